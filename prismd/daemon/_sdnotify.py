"""systemd's ``sd_notify`` protocol over an AF_UNIX datagram socket, without a dependency.

Follows systemd's self-contained example (``man sd_notify``): the message goes to
``$NOTIFY_SOCKET`` (a path, or an abstract name when it starts with ``@``). Guarantees:
:func:`notify` never raises, never blocks (a full queue drops the notification) and returns
whether the datagram was sent; with no ``$NOTIFY_SOCKET`` it does nothing.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


def notify(state: str, *, env: Mapping[str, str] | None = None) -> bool:
    """Send ``state`` (e.g. ``"READY=1"``); False when not under systemd or on any error."""
    address = (os.environ if env is None else env).get("NOTIFY_SOCKET", "")
    if not address or address[0] not in "/@":
        return False
    # An abstract socket name starts with a NUL byte on the wire; systemd writes it as "@".
    target = "\0" + address[1:] if address[0] == "@" else address
    try:
        # Non-blocking: it is called on the Trio loop, and a stalled systemd with a full
        # datagram queue must cost a dropped notification, never a wedged daemon.
        kind = socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
        with socket.socket(socket.AF_UNIX, kind) as sock:
            sock.connect(target)
            sock.sendall(state.encode("utf-8"))
    except (OSError, UnicodeError, ValueError):
        # The daemon must keep serving when the notify socket is gone or full.
        return False
    return True


def status(text: str) -> str:
    """The ``STATUS=`` line for ``text`` (what ``systemctl status`` shows), on one line: a
    newline inside would start another assignment."""
    return "STATUS=" + " ".join(text.split())


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between ``WATCHDOG=1`` pings (half of ``$WATCHDOG_USEC``), or None when off.

    ``$WATCHDOG_PID``, when set, must name this process (systemd's own check), so a child
    process that inherited the environment does not ping on the parent's behalf.
    """
    values = os.environ if env is None else env
    try:
        usec = int(values.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = values.get("WATCHDOG_PID")
    if pid:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 2_000_000
