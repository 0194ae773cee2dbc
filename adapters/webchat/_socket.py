"""One web chat WebSocket over the connection its HTTP request came on: the handshake over
the bytes already read, frames written with a deadline, and the close that says why.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import attrs
import trio
import trio_websocket

from ..toolkit import Slot

__all__ = ["Socket", "get_message", "send_frame", "serve_websocket", "to_each"]

HANDSHAKE_TIMEOUT_S = 10.0
SEND_TIMEOUT_S = 10.0
"""A frame that cannot be written to a socket in this time counts as not taken; the socket
is closed, since a peer that stops reading would otherwise hold replies forever."""
CLOSE_BUDGET_S = 2.0
STOP_CLOSE_BUDGET_S = 0.25

_FAIL_REASONS = {1002: "protocol error", 1007: "invalid UTF-8", 1009: "message too big"}
"""Close codes wsproto reports for a frame it could not accept (its ``ParseFailed``)."""
CLOSE_FRAME_BUDGET_S = 0.25


def _close_frame(code: int, reason: str) -> bytes:
    """A server's (unmasked) close frame; ``reason`` is fixed ASCII text, short."""
    payload = code.to_bytes(2, "big") + reason.encode("ascii")
    return bytes([0x88, len(payload)]) + payload


class ReplayStream(trio.abc.Stream):
    """A stream that yields ``prefix`` before reading from ``inner``.

    The request head was consumed to route the request; wsproto must see it again.

    It also completes a failure trio-websocket leaves half done: for a frame wsproto refuses
    (a text frame that is not UTF-8 …) the library records close code 1007 locally and closes
    the transport without telling the peer, who would see an abnormal closure (1006).
    :meth:`tell_failure` sends that close frame; it runs when the library closes the stream
    and when the session ends, whichever comes first.
    """

    def __init__(self, inner: trio.abc.Stream, prefix: bytes) -> None:
        self._inner = inner
        self._prefix = prefix
        self.ws: Any = None
        """The WebSocket over this stream, once accepted."""
        self._close_sent = False

    async def send_close_frame(self, code: int, reason: str) -> None:
        """Write a close frame directly, once (bounded; never raises for a gone peer)."""
        if self._close_sent:
            return
        self._close_sent = True
        with trio.move_on_after(CLOSE_FRAME_BUDGET_S):
            try:
                await self._inner.send_all(_close_frame(code, reason))
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                pass

    async def tell_failure(self) -> None:
        """Send the close frame of a failure the library did not send (see the class)."""
        code = self._failed_without_telling()
        if code is not None:
            # Shielded so a cancelled handler still tells the peer, bounded so a peer that
            # reads nothing cannot hold the handler (and a stop) forever.
            with trio.move_on_after(CLOSE_BUDGET_S, shield=True):
                await self.send_close_frame(code, _FAIL_REASONS[code])

    def _failed_without_telling(self) -> int | None:
        ws = self.ws
        closed = getattr(ws, "closed", None)
        if closed is None or closed.code not in _FAIL_REASONS:
            return None
        # Still OPEN for wsproto: no close frame went out (a peer's own close is answered,
        # which leaves it CLOSED). Private, hence looked up defensively; the tests pin it.
        state = getattr(getattr(ws, "_wsproto", None), "state", None)
        return int(closed.code) if getattr(state, "name", None) == "OPEN" else None

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self._prefix:
            n = len(self._prefix) if max_bytes is None else max_bytes
            chunk, self._prefix = self._prefix[:n], self._prefix[n:]
            await trio.lowlevel.checkpoint()
            return chunk
        return await self._inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.tell_failure()
        await self._inner.aclose()

    def __repr__(self) -> str:
        return "<webchat stream>"


@attrs.define(eq=False)
class Socket:
    ws: Any  # trio_websocket.WebSocketConnection (untyped library)
    stream: trio.abc.Stream
    """The transport under ``ws``, closed directly when the peer stops reading."""
    slot: Slot
    """Its place among the listener's connections (touched by messages and replies)."""


async def serve_websocket(
    stream: trio.SocketStream,
    raw: bytes,
    slot: Slot,
    session: Callable[[Socket], Awaitable[None]],
    *,
    max_message_bytes: int,
) -> None:
    """Accept the WebSocket whose request head ``raw`` was already read from ``stream``, run
    ``session`` on it, and close it: 1013 when ``slot`` was evicted for a newcomer, 1001
    when stopping, else 1000. A handshake that does not finish in time ends quietly."""
    replay = ReplayStream(stream, raw)
    async with trio.open_nursery() as nursery:
        ws: Any = None
        with trio.move_on_after(HANDSHAKE_TIMEOUT_S):
            request = await trio_websocket.wrap_server_stream(
                nursery,
                replay,
                # the library closes (1009) only far above our own limit, so a merely
                # oversized frame gets an error frame and the socket stays usable
                max_message_size=4 * max_message_bytes,
                message_queue_size=16,
            )
            ws = await request.accept()
            replay.ws = ws
        if ws is None:
            nursery.cancel_scope.cancel()
            return
        try:
            await session(Socket(ws=ws, stream=replay, slot=slot))
        finally:
            await replay.tell_failure()
            if slot.evicted:
                # Pushed out for a newcomer: say so without waiting for an answer (the
                # library's reader is cancelled with us); the transport closes next.
                with trio.move_on_after(STOP_CLOSE_BUDGET_S, shield=True):
                    await replay.send_close_frame(1013, "try again later")
            else:
                # Stopping (we are cancelled): say 1001 "going away" and do not wait long
                # for the peer's answer, since the library's reader is cancelled with us.
                stopping = trio.current_effective_deadline() == float("-inf")
                budget = STOP_CLOSE_BUDGET_S if stopping else CLOSE_BUDGET_S
                with trio.move_on_after(budget, shield=True):
                    await ws.aclose(1001 if stopping else 1000)
            nursery.cancel_scope.cancel()


async def send_frame(sock: Socket, frame: str) -> bool:
    """Write one frame; ``False`` (and the socket closed if stuck) when it did not go out."""
    with trio.move_on_after(SEND_TIMEOUT_S) as scope:
        try:
            await sock.ws.send_message(frame)
            return True
        except (
            trio_websocket.ConnectionClosed,
            trio.BrokenResourceError,
            trio.ClosedResourceError,
        ):
            return False
    if scope.cancelled_caught:
        # A close frame would queue behind the unsent bytes, and the library's own reader
        # may be stuck writing to this peer too: drop the transport, which ends both.
        await trio.aclose_forcefully(sock.stream)
    return False


async def to_each(sockets: Sequence[Socket], send: Callable[[Socket], Awaitable[object]]) -> None:
    """``send`` to every socket: concurrently, so one stalled tab cannot hold up the others
    for ``SEND_TIMEOUT_S``; to a lone one (the usual case) directly, with no nursery and
    task to spend per frame."""
    if len(sockets) == 1:
        await send(sockets[0])
        return
    async with trio.open_nursery() as nursery:
        for sock in sockets:
            nursery.start_soon(send, sock)


async def get_message(ws: Any) -> str | bytes | None:
    try:
        message: str | bytes = await ws.get_message()
    except trio_websocket.ConnectionClosed:
        return None
    return message
