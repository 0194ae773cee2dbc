"""Where ``prismctl`` looks for the control socket, and what it says when none is there.

In order: ``--socket PATH``; ``$PRISMD_CONTROL_SOCKET``; with ``--config FILE``, that
file's ``[control].socket`` (relative to the working directory, as the daemon reads it);
then the first that exists of ``./var/run/control.sock`` (``make run``'s) and
``/run/prismd/control.sock`` (the systemd unit's). A path given one of the first three
ways is used alone: a daemon named on purpose is never swapped for another one found.
A failed search lists each path tried and how to name the right one. Standard library
only.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass

LOCAL_SOCKET = "var/run/control.sock"
SYSTEM_SOCKET = "/run/prismd/control.sock"
SOCKET_ENV = "PRISMD_CONTROL_SOCKET"


class SocketSearchError(Exception):
    """No socket to try; ``str(e)`` is the whole explanation (several lines)."""


@dataclass(frozen=True)
class Candidate:
    path: str
    source: str
    """Where the path came from, as the failure message says it."""


def _config_socket(config: str) -> str:
    data = _read_toml(config, "--config")
    control = data.get("control", {})
    socket = control.get("socket", LOCAL_SOCKET) if isinstance(control, dict) else None
    if not isinstance(socket, str) or not socket:
        raise SocketSearchError(f"--config {config}: [control].socket is not a path")
    return socket


def candidates(
    socket: str | None, config: str | None, env: Mapping[str, str] = os.environ
) -> list[Candidate]:
    """The paths to try, in order: one when it was named, else the two defaults."""
    if socket:
        return [Candidate(socket, "--socket")]
    named = env.get(SOCKET_ENV)
    if named:
        return [Candidate(named, f"${SOCKET_ENV}")]
    if config:
        return [Candidate(_config_socket(config), f"[control].socket of {config}")]
    where = os.getcwd()
    return [
        Candidate(LOCAL_SOCKET, f"make run's, relative to {where}"),
        Candidate(SYSTEM_SOCKET, "the systemd unit's"),
    ]


def find_socket(socket: str | None, config: str | None, env: Mapping[str, str] = os.environ) -> str:
    """The socket path to connect to; :class:`SocketSearchError` when the search found none."""
    found = candidates(socket, config, env)
    if len(found) == 1:
        return found[0].path
    for candidate in found:
        try:
            os.stat(candidate.path)
        except PermissionError:
            # It may be there behind a directory this user cannot enter: connecting says so
            # ("permission denied"), where "no control socket found" would mislead.
            return candidate.path
        except OSError:
            continue
        return candidate.path
    tried = "\n".join(f"  {c.path}  ({c.source})" for c in found)
    raise SocketSearchError(
        f"no control socket found: is prismd running? Tried:\n{tried}\n"
        f"Name it with --socket PATH or {SOCKET_ENV}=PATH"
        " (or --config FILE for that config's [control].socket)."
    )


DEFAULT_CONFIG_FILE = "prismd.toml"
WEB_LISTEN = "127.0.0.1:8787"
"""The web chat's address in ``make run``'s and ``prismd init``'s configs."""


@dataclass(frozen=True)
class ChatTarget:
    url: str
    token_env: str | None
    """The config's ``access_token_env`` for that web chat, if any."""
    source: str
    """Where the address came from, as ``prismctl chat`` says it."""


def chat_target(url: str | None, config: str | None) -> ChatTarget:
    """The web chat ``prismctl chat`` talks to: ``--url``; else the first ``webchat``
    connection of ``--config FILE``, else of ``./prismd.toml`` (the file ``prismd run``
    reads by default there); else ``make run``'s default address. A daemon whose config
    moved the web chat is reached, not another one still on the default port."""
    if url:
        return ChatTarget(url, None, "--url")
    path = config or (DEFAULT_CONFIG_FILE if os.path.isfile(DEFAULT_CONFIG_FILE) else None)
    if path is None:
        return ChatTarget(_listen_url(WEB_LISTEN), None, "the default")
    root = _read_toml(path, "--config" if config else "./prismd.toml")
    entries = root.get("connections", [])
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and entry.get("kind") == "webchat":
            listen = entry.get("listen", WEB_LISTEN)
            token_env = entry.get("access_token_env")
            if not isinstance(listen, str) or not listen:
                break
            return ChatTarget(
                _listen_url(listen),
                token_env if isinstance(token_env, str) and token_env else None,
                f"the web chat {entry.get('id', '?')!r} in {path}",
            )
    raise SocketSearchError(
        f"{path} has no webchat connection with a listen address; name the web chat with --url URL"
    )


def _read_toml(path: str, how: str) -> Mapping[str, object]:
    try:
        with open(path, "rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        raise SocketSearchError(f"{how} {path}: file not found") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SocketSearchError(f"{how} {path}: cannot read it ({type(exc).__name__})") from None


def _listen_url(listen: str) -> str:
    """``http://host:port/`` for a ``listen`` address; a wildcard host is reached on
    loopback."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}/"
