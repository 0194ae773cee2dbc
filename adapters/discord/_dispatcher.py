"""One connection's dispatches, in the order the gateway sent them, and the watermark's saves.

* **Handled in the reader's task when nothing waits.** A dispatch that needs no wait — a
  message with room in the lanes, our own message echoed back, a dispatch the connection
  does not read, RESUMED — is handled by the socket's reader as it reads it, when no
  dispatch is queued or being handled: no hand-over to another task. One that may wait
  (READY: its save and backfill; a message with all lanes full), and every dispatch behind
  it, goes through the queue to the dispatcher task, in order: the reader reads on meanwhile
  (heartbeat ACKs are never stuck behind an admission).
* **Messages admitted in lanes** (:mod:`._lanes`): across channels at once, in order within
  each. The watermark (``session.seq``) passes each dispatch once it and all before it are
  handled; a saver task writes it at most every :data:`SAVE_EVERY_S` after it moved (and
  the connection saves it when it ends): a watermark saved late only means a longer
  replay, which the journal deduplicates by message id.
"""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from ..toolkit import ReceiverLease
from . import _protocol as proto
from ._cursor import ShardCursor
from ._lanes import Lanes
from ._status import ShardStatus

QUEUE_SIZE = 256
SAVE_EVERY_S = 1.0


@attrs.define(eq=False, kw_only=True)
class Dispatcher:
    """Built per connection; :meth:`run` in the connection's nursery, :meth:`put` from its
    reader, :meth:`close` when the reader ends."""

    cursor: ShardCursor
    lease: ReceiverLease
    status: ShardStatus
    handle_message: Callable[[Mapping[str, Any]], Awaitable[object]]
    """Admit one message; returns once the admission is final."""
    ready: Callable[[proto.Frame], Awaitable[None]]
    """READY: store the new session (and backfill); RESUMED while a backfill is due."""
    _lanes: Lanes = attrs.field(init=False)
    _send: trio.MemorySendChannel[proto.Frame] = attrs.field(init=False)
    _receive: trio.MemoryReceiveChannel[proto.Frame] = attrs.field(init=False)
    _nursery: trio.Nursery | None = attrs.field(default=None, init=False)
    """The lanes' nursery while the dispatcher runs."""
    _idle: bool = attrs.field(default=False, init=False)
    """Nothing queued, nothing being handled: the reader may handle a dispatch itself."""
    _moved: trio.Event = attrs.field(factory=trio.Event, init=False)
    """The watermark moved since it was last saved."""

    def __attrs_post_init__(self) -> None:
        self._lanes = Lanes(self._advance)
        self._send, self._receive = trio.open_memory_channel[proto.Frame](QUEUE_SIZE)

    async def run(self) -> None:
        """Handle queued dispatches until :meth:`close` (then wait for the admissions in
        flight)."""
        async with trio.open_nursery() as saver:
            saver.start_soon(self._save_moved)
            try:
                async with trio.open_nursery() as nursery:
                    self._nursery = nursery
                    await self._handle_queued()
            finally:
                self._nursery = None
                self._idle = False
            saver.cancel_scope.cancel()

    async def put(self, frame: proto.Frame) -> None:
        """The reader's hand-over of one dispatch: handled at once when nothing waits and
        it needs no wait; else queued (waits while the queue is full)."""
        if self._idle and self._handle_now(frame):
            return
        self._idle = False
        try:
            self._send.send_nowait(frame)  # no trip through the scheduler while there is room
        except trio.WouldBlock:
            await self._send.send(frame)

    def close(self) -> None:
        self._send.close()

    # ------------------------------------------------------------------ handling

    async def _handle_queued(self) -> None:
        while True:
            try:
                frame = self._receive.receive_nowait()
            except trio.WouldBlock:
                self._idle = True
                try:
                    frame = await self._receive.receive()
                except trio.EndOfChannel:
                    return
            except trio.EndOfChannel:
                return
            self._idle = False
            if not self._handle_now(frame):
                await self._handle_waiting(frame)

    def _handle_now(self, frame: proto.Frame) -> bool:
        """Handle ``frame`` if that needs no wait (see the module docstring); ``False``:
        it was not touched."""
        assert frame.s is not None
        nursery = self._nursery
        if nursery is None:
            return False
        state = self.cursor.state
        if frame.t == "READY" or (frame.t == "RESUMED" and state.backfill_due):
            return False  # a new session to store, a backfill to run
        if state.session is not None and frame.s <= state.session.seq:
            return True  # a duplicate (or the replay of what we handled)
        if frame.t == "RESUMED":
            self.status.state = "connected"
            self.status.resumes += 1
        elif frame.t == "MESSAGE_CREATE" and isinstance(frame.d, Mapping):
            author = frame.d.get("author")
            if not (isinstance(author, Mapping) and author.get("id") == state.bot_user_id):
                # (our own replies come back too: nothing to admit)
                return self._lanes.try_admit(
                    nursery, frame.s, str(frame.d.get("channel_id")), self._admission(frame.d)
                )
        self._lanes.passed(frame.s)
        return True

    async def _handle_waiting(self, frame: proto.Frame) -> None:
        assert frame.s is not None and self._nursery is not None
        if frame.t in ("READY", "RESUMED"):
            await self.ready(frame)
            if frame.t == "RESUMED":
                self._handle_now(frame)  # the backfill done: counted as any RESUMED
            return
        assert isinstance(frame.d, Mapping)  # a message waiting for room in the lanes
        channel = str(frame.d.get("channel_id"))
        await self._lanes.admit(self._nursery, frame.s, channel, self._admission(frame.d))

    def _admission(self, message: Mapping[str, Any]) -> Callable[[], Awaitable[object]]:
        return functools.partial(self.handle_message, message)

    # ------------------------------------------------------------------ the watermark

    def _advance(self, seq: int) -> None:
        """The watermark passes ``seq`` (:class:`Lanes`: it and all before it are handled)."""
        session = self.cursor.state.session
        if session is not None and seq > session.seq:
            session.seq = seq
            self._moved.set()

    async def _save_moved(self) -> None:
        """Save the watermark :data:`SAVE_EVERY_S` after it moved, at most that often."""
        while True:
            await self._moved.wait()
            await trio.sleep(SAVE_EVERY_S)
            self._moved = trio.Event()
            self.lease.check()
            await self.cursor.save(self.lease.fencing_token)
