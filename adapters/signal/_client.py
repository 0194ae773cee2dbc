"""The transport to signal-cli: its Unix socket or loopback TCP, newline-delimited JSON-RPC.

signal-cli's ``daemon --socket`` / ``--tcp`` speaks JSON-RPC 2.0, one object per line
(``protocols-telegram-signal.md`` §2). :func:`open_signal_client` connects and wraps the
stream in the toolkit's client (:func:`~adapters.toolkit.open_jsonrpc_client`) with the
bounds this adapter needs: a per-request deadline, at most ``max_pending`` requests in
flight, frames of at most ``max_frame_bytes`` (an oversized or malformed frame, or one that
is not ``"jsonrpc": "2.0"``, ends the connection: the stream cannot be trusted after it),
and a small notification queue so reading stops — backpressure on signal-cli — while the
receiver admits what it already has.

Nothing here knows the account number; errors carry fixed text and exception type names.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio

from ..toolkit import JsonRpcClient, open_jsonrpc_client, parse_host_port

__all__ = ["Endpoint", "SignalUnreachableError", "open_request_client", "open_signal_client"]

MAX_UNIX_PATH_BYTES = 107
"""``sun_path`` holds 108 bytes including the terminating NUL."""


class SignalUnreachableError(Exception):
    """No connection to signal-cli could be opened (nothing was sent)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"signal-cli is unreachable ({type(cause).__name__})")
        self.cause_name = type(cause).__name__


@attrs.frozen
class Endpoint:
    """Where signal-cli listens: exactly one of a Unix socket path and a ``host:port``."""

    socket: str | None = None
    tcp: str | None = None

    def __attrs_post_init__(self) -> None:
        if (self.socket is None) == (self.tcp is None):
            raise ValueError("set exactly one of socket and tcp")
        if self.socket is not None:
            raw = self.socket.encode("utf-8", "surrogatepass")
            if not raw or b"\0" in raw or len(raw) > MAX_UNIX_PATH_BYTES:
                raise ValueError("socket must be a path of 1-107 bytes without NUL")
        if self.tcp is not None:
            parse_host_port(self.tcp)

    @property
    def kind(self) -> str:
        """``unix`` or ``tcp``, for log lines."""
        return "unix" if self.socket is not None else "tcp"

    def describe(self) -> str:
        """Where, for the startup line (a path or an address: no secret)."""
        return f"unix:{self.socket}" if self.socket is not None else f"tcp:{self.tcp}"

    async def connect(self, timeout_s: float) -> trio.abc.Stream:
        """A connected stream; :class:`SignalUnreachableError` when none could be opened."""
        try:
            with trio.fail_after(timeout_s):
                if self.socket is not None:
                    return await trio.open_unix_socket(self.socket)
                assert self.tcp is not None
                host, port = parse_host_port(self.tcp)
                return await trio.open_tcp_stream(host, port)
        except (OSError, trio.TooSlowError) as exc:
            raise SignalUnreachableError(exc) from None


@asynccontextmanager
async def open_signal_client(
    endpoint: Endpoint,
    *,
    timeout_s: float,
    max_pending: int,
    max_frame_bytes: int,
    max_notifications: int,
) -> AsyncIterator[JsonRpcClient]:
    """A JSON-RPC client on a new connection to signal-cli (closed when the context exits).

    Raises :class:`SignalUnreachableError` before yielding when it cannot connect.
    """
    stream = await endpoint.connect(timeout_s)
    async with open_jsonrpc_client(
        stream,
        timeout_s=timeout_s,
        max_pending=max_pending,
        max_frame_bytes=max_frame_bytes,
        max_notifications=max_notifications,
        close_on_bad_frame=True,
    ) as client:
        yield client


async def _discard_notifications(client: JsonRpcClient) -> None:
    """A request connection subscribes to nothing; a signal-cli not in manual mode still
    sends it messages, which must not fill the queue and stall the answer to a request."""
    async for _note in client.notifications:
        pass


@asynccontextmanager
async def open_request_client(
    endpoint: Endpoint, *, timeout_s: float, max_frame_bytes: int
) -> AsyncIterator[JsonRpcClient]:
    """A connection for one request at a time (a send, a typing indicator): one request in
    flight, the notifications signal-cli pushes anyway read and dropped meanwhile.

    Raises :class:`SignalUnreachableError` before yielding when it cannot connect.
    """
    async with (
        open_signal_client(
            endpoint,
            timeout_s=timeout_s,
            max_pending=1,
            max_frame_bytes=max_frame_bytes,
            max_notifications=16,
        ) as client,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(_discard_notifications, client)
        yield client
        nursery.cancel_scope.cancel()
