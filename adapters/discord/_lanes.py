"""A session's messages admitted across channels at once, in order within each, behind one
contiguous watermark.

A burst of ``MESSAGE_CREATE`` dispatches is admitted concurrently — one lane per channel,
in dispatch order within it, as the Telegram poller's lanes per chat — so the journal's
group commit shares one transaction among their admissions instead of committing each in
turn. The sequence the shard stores (``session.seq``) stays the contiguous watermark: it
passes a dispatch only once that dispatch and every one before it are handled (admitted
with a final answer, or nothing to admit), never past one still being admitted. At most
:data:`MAX_IN_FLIGHT` admissions run at once; the dispatcher waits for room beyond that.
"""

from __future__ import annotations

import collections
from collections.abc import Awaitable, Callable

import attrs
import trio

MAX_IN_FLIGHT = 64


@attrs.define(eq=False)
class _Entry:
    seq: int
    done: bool = False


@attrs.define(eq=False)
class Lanes:
    advance: Callable[[int], None]
    """Called with the watermark each time the handled prefix grows."""
    limit: int = MAX_IN_FLIGHT
    _order: collections.deque[_Entry] = attrs.field(factory=collections.deque, init=False)
    _tails: dict[str, trio.Event] = attrs.field(factory=dict, init=False)
    """Each channel's last admission started: the next one in the channel waits for it."""
    _room: trio.Semaphore = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._room = trio.Semaphore(self.limit)

    @property
    def busy(self) -> bool:
        """Some dispatch is still being admitted."""
        return bool(self._order)

    def passed(self, seq: int) -> None:
        """A dispatch with nothing to admit: handled once those before it are."""
        self._order.append(_Entry(seq, done=True))
        self._pop()

    def try_admit(
        self, nursery: trio.Nursery, seq: int, channel: str, handle: Callable[[], Awaitable[object]]
    ) -> bool:
        """Start ``handle`` (one admission) in ``channel``'s lane if there is room now;
        ``False``: there is none (nothing was started)."""
        try:
            self._room.acquire_nowait()
        except trio.WouldBlock:
            return False
        self._start(nursery, seq, channel, handle)
        return True

    async def admit(
        self, nursery: trio.Nursery, seq: int, channel: str, handle: Callable[[], Awaitable[object]]
    ) -> None:
        """Start ``handle`` (one admission) in ``channel``'s lane; returns once it started."""
        try:
            self._room.acquire_nowait()
        except trio.WouldBlock:
            await self._room.acquire()
        self._start(nursery, seq, channel, handle)

    def _start(
        self, nursery: trio.Nursery, seq: int, channel: str, handle: Callable[[], Awaitable[object]]
    ) -> None:
        entry = _Entry(seq)
        self._order.append(entry)
        previous = self._tails.get(channel)
        done = self._tails[channel] = trio.Event()
        nursery.start_soon(self._lane, entry, channel, previous, done, handle)

    async def _lane(
        self,
        entry: _Entry,
        channel: str,
        previous: trio.Event | None,
        done: trio.Event,
        handle: Callable[[], Awaitable[object]],
    ) -> None:
        try:
            if previous is not None:
                await previous.wait()
            await handle()
        finally:
            self._room.release()
        # Only a finished admission lets the channel's next one start: a failed one raises
        # into the dispatcher's nursery, which cancels the lanes waiting behind it.
        entry.done = True
        done.set()
        if self._tails.get(channel) is done:
            del self._tails[channel]
        self._pop()

    def _pop(self) -> None:
        watermark: int | None = None
        while self._order and self._order[0].done:
            seq = self._order.popleft().seq
            watermark = seq if watermark is None else max(watermark, seq)
        if watermark is not None:
            self.advance(watermark)
