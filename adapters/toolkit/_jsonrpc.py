"""A Trio JSON-RPC 2.0 client over one stream (newline-delimited framing of
:mod:`prismd.jsonrpc`), for daemons such as signal-cli that answer requests and also send
notifications of their own.

Guarantees of :func:`open_jsonrpc_client`:

* **Bounded.** Every call has a deadline (``timeout_s``, per call overridable); at most
  ``max_pending`` calls are in flight, later ones wait for a slot (inside their deadline);
  a frame from the server larger than ``max_frame_bytes`` breaks the connection instead of
  being buffered; notifications queue in a channel of ``max_notifications`` and, when the
  consumer falls behind, reading pauses (backpressure on the socket, nothing dropped).
* **Outcome known or said unknown.** :class:`JsonRpcTimeoutError` and
  :class:`JsonRpcConnectionError` carry ``sent``: ``False`` means the request never left
  (safe to retry), ``True`` that the server may have acted on it (a send is ambiguous).
  An error response raises :class:`~prismd.jsonrpc.RpcError` with the server's code.
* **One reader.** Responses are matched by id; a late answer to a call that timed out is
  dropped. A request from the server is answered ``-32601``. When the stream ends or
  breaks, every pending call fails with :class:`JsonRpcConnectionError` and the
  notification channel closes (after every notification read before); leaving the context
  closes the stream. :attr:`JsonRpcClient.closed_reason` says why it ended.
* **Bad frames.** An unreadable frame (not JSON, not an object) is dropped with a warning;
  with ``close_on_bad_frame=True`` it ends the connection instead, as does a message
  without ``"jsonrpc": "2.0"`` (for a peer whose stream must be trusted whole, such as
  signal-cli handing out messages once: the caller reconnects rather than guessing).

Example::

    async with open_jsonrpc_client(stream, timeout_s=10) as client:
        version = await client.call("version")
        async for note in client.notifications:
            ...
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal, TypeAlias

import attrs
import trio

from prismd.jsonrpc import (
    MAX_FRAME_BYTES,
    METHOD_NOT_FOUND,
    FrameBuffer,
    FrameError,
    FrameTooLargeError,
    Incoming,
    Response,
    encode_error,
    encode_notification,
    encode_request,
    parse_message,
)

__all__ = [
    "JsonRpcClient",
    "JsonRpcConnectionError",
    "JsonRpcTimeoutError",
    "open_jsonrpc_client",
]

log = logging.getLogger("prismd.jsonrpc")

_CHUNK = 65536
CLOSE_BUDGET_S = 1.0

CloseReason: TypeAlias = Literal["open", "eof", "broken", "oversized", "malformed", "closed"]
"""Why a connection ended: ``eof`` (the server closed it), ``broken`` (a read or write
failed), ``oversized`` (a frame over ``max_frame_bytes``), ``malformed`` (a bad frame with
``close_on_bad_frame``), ``closed`` (the context was left); ``open`` while it lasts."""


class JsonRpcConnectionError(Exception):
    """The connection ended or broke before the answer came (fixed text)."""

    def __init__(self, *, sent: bool) -> None:
        super().__init__("JSON-RPC connection lost")
        self.sent = sent


class JsonRpcTimeoutError(Exception):
    """No answer within the call's deadline (fixed text)."""

    def __init__(self, *, sent: bool) -> None:
        super().__init__("JSON-RPC call timed out")
        self.sent = sent


@attrs.define(eq=False)
class _Pending:
    done: trio.Event = attrs.field(factory=trio.Event)
    response: Response | None = None


@attrs.define(eq=False)
class JsonRpcClient:
    """Made by :func:`open_jsonrpc_client`; :meth:`call` may be used from many tasks."""

    _stream: trio.abc.Stream
    timeout_s: float
    max_pending: int
    max_frame_bytes: int
    notifications: trio.MemoryReceiveChannel[Incoming]
    """Notifications from the server, in arrival order (closed when the connection ends)."""
    _notify_send: trio.MemorySendChannel[Incoming]
    close_on_bad_frame: bool = False
    _slots: trio.Semaphore = attrs.field(init=False)
    _send_lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)
    _pending: dict[int, _Pending] = attrs.field(factory=dict, init=False)
    _ids: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1), init=False)
    _closed: bool = attrs.field(default=False, init=False)
    closed_reason: CloseReason = attrs.field(default="open", init=False)
    late_answers: int = attrs.field(default=0, init=False)
    """Responses that matched no pending call (answers after their call's deadline)."""

    def __attrs_post_init__(self) -> None:
        self._slots = trio.Semaphore(self.max_pending)

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def closed(self) -> bool:
        """The connection ended (no call can succeed any more)."""
        return self._closed

    async def call(self, method: str, params: Any = None, *, timeout_s: float | None = None) -> Any:
        """The ``result`` of one request. Raises :class:`~prismd.jsonrpc.RpcError` (error
        response), :class:`JsonRpcTimeoutError` or :class:`JsonRpcConnectionError`."""
        sent = False
        with trio.move_on_after(self.timeout_s if timeout_s is None else timeout_s):
            async with self._slots:
                if self._closed:
                    raise JsonRpcConnectionError(sent=False)
                request_id = next(self._ids)
                frame = encode_request(request_id, method, params)
                waiter = self._pending[request_id] = _Pending()
                try:
                    await self._send(frame)
                    sent = True
                    await waiter.done.wait()
                finally:
                    self._pending.pop(request_id, None)
                response = waiter.response
                if response is None:
                    raise JsonRpcConnectionError(sent=True)
                if response.error is not None:
                    raise response.error
                return response.result
        raise JsonRpcTimeoutError(sent=sent)

    async def notify(self, method: str, params: Any = None) -> None:
        """Send a notification (no answer). :class:`JsonRpcConnectionError` if closed."""
        await self._send(encode_notification(method, params))

    async def _send(self, frame: bytes) -> None:
        async with self._send_lock:
            if self._closed:
                raise JsonRpcConnectionError(sent=False)
            try:
                await self._stream.send_all(frame)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                # Part of the frame may have gone out: the caller cannot know.
                self._fail_all("broken")
                raise JsonRpcConnectionError(sent=True) from None

    async def _read(self) -> None:
        frames = FrameBuffer(self.max_frame_bytes)
        reason: CloseReason = "closed"  # cancelled: the context is being left
        try:
            while True:
                frame = frames.next_frame()
                if frame is None:
                    data = await self._stream.receive_some(_CHUNK)
                    if not data:
                        reason = "eof"
                        return
                    frames.feed(data)
                    continue
                if not frame.strip():
                    continue
                try:
                    message = parse_message(frame, strict=self.close_on_bad_frame)
                except FrameError:
                    if self.close_on_bad_frame:
                        log.warning("JSON-RPC: the server sent an unreadable frame; closing")
                        reason = "malformed"
                        return
                    log.warning("JSON-RPC: an unreadable frame was dropped")
                    continue
                if isinstance(message, Incoming):
                    await self._incoming(message)
                    continue
                waiter = self._pending.get(message.id) if isinstance(message.id, int) else None
                if waiter is None or waiter.done.is_set():
                    self.late_answers += 1
                    continue
                waiter.response = message
                waiter.done.set()
        except FrameTooLargeError:
            log.warning("JSON-RPC: the server sent a frame over %d bytes", self.max_frame_bytes)
            reason = "oversized"
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            reason = "broken"
        finally:
            self._fail_all(reason)

    async def _incoming(self, message: Incoming) -> None:
        if message.id is None:
            await self._notify_send.send(message)
            return
        answer = encode_error(message.id, METHOD_NOT_FOUND, "method not found")
        try:
            await self._send(answer)
        except JsonRpcConnectionError:
            pass

    def _fail_all(self, reason: CloseReason) -> None:
        if self.closed_reason == "open":
            self.closed_reason = reason
        self._closed = True
        for waiter in self._pending.values():
            waiter.done.set()  # response stays None: connection lost
        self._notify_send.close()


@asynccontextmanager
async def open_jsonrpc_client(
    stream: trio.abc.Stream,
    *,
    timeout_s: float = 30.0,
    max_pending: int = 64,
    max_frame_bytes: int = MAX_FRAME_BYTES,
    max_notifications: int = 256,
    close_on_bad_frame: bool = False,
) -> AsyncIterator[JsonRpcClient]:
    """A client reading ``stream`` in the background until the context exits (see the
    module docstring); the stream is closed on exit."""
    if timeout_s <= 0 or max_pending < 1 or max_notifications < 0:
        raise ValueError("timeout_s, max_pending and max_notifications must be positive")
    send, receive = trio.open_memory_channel[Incoming](max_notifications)
    client = JsonRpcClient(
        stream, timeout_s, max_pending, max_frame_bytes, receive, send, close_on_bad_frame
    )
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(client._read)
            try:
                yield client
            finally:
                nursery.cancel_scope.cancel()
    finally:
        client._fail_all("closed")
        with trio.move_on_after(CLOSE_BUDGET_S, shield=True):
            await stream.aclose()
