"""Which gateway URLs a shard may connect to."""

from __future__ import annotations

from ..toolkit import is_loopback_host


def checked_gateway_url(url: object) -> str | None:
    """A gateway URL we may connect to: ``wss://``, or ``ws://`` on loopback."""
    if not isinstance(url, str):
        return None
    scheme, sep, rest = url.partition("://")
    host = rest.split("/", 1)[0].split("?", 1)[0]
    if host.startswith("["):
        host = host.split("]", 1)[0] + "]"
    elif ":" in host:
        host = host.rsplit(":", 1)[0]
    if not sep or not host:
        return None
    if scheme == "wss" or (scheme == "ws" and is_loopback_host(host)):
        return url
    return None
