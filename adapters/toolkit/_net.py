"""Addresses as the config writes them: ``host:port`` and the loopback test.

Standard library only: :mod:`prismd.daemon`'s config reads addresses with these too, so a
listen address means the same thing to the config check and to the adapter that binds it.
"""

from __future__ import annotations

import ipaddress

__all__ = ["is_loopback_host", "origin_problem", "parse_host_port"]


def is_loopback_host(host: str) -> bool:
    """True for ``localhost``, 127.0.0.0/8 and ::1 (brackets allowed)."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_host_port(value: str) -> tuple[str, int]:
    """Split ``"host:port"`` or ``"[v6]:port"``; raises ``ValueError`` when malformed."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError("must be 'host:port'")
    if host.startswith("["):
        if not host.endswith("]"):
            raise ValueError("must be 'host:port'")
        host = host[1:-1]
    elif ":" in host:
        raise ValueError("an IPv6 host must be written in brackets: '[::1]:port'")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ValueError("port must be between 0 and 65535")
    return host, port


def origin_problem(origin: str, example: str) -> str | None:
    """What is wrong with ``origin`` as a bare origin (``https://host[:port]``, or
    ``http://`` for a loopback host: tests and local servers), else ``None``. ``example``
    is the platform's own origin, named in the message."""
    scheme, sep, rest = origin.partition("://")
    hostport = rest.rstrip("/")
    if not sep or not hostport or any(c in hostport for c in "@/?#"):
        return f"must be an origin like {example} (no path)"
    host = hostport
    if hostport.startswith("["):
        host = hostport.split("]", 1)[0] + "]"
    elif ":" in hostport:
        host = hostport.rsplit(":", 1)[0]
    if scheme == "https":
        return None
    if scheme == "http":
        if is_loopback_host(host):
            return None
        return "http:// is accepted only for loopback hosts; use https://"
    return "must start with https://"
