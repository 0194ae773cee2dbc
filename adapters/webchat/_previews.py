"""Live previews for the web chat: a streaming answer's text as ``preview`` frames.

The runtime calls ``send_draft`` for every delta (cumulative, redacted text; never
journaled). The web chat sends an actor at most one preview per :data:`PREVIEW_INTERVAL_S`,
the first that long after the run's first delta, with the newest text (coalesced: a slow
tab gets the latest state, never a backlog). Previews are ordered against replies: sending
a reply takes the actor's lock and drops the pending preview, so no preview of a run ever
arrives after the reply that ends it, and an answer that is complete within the interval
is shown by its reply alone.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import attrs
import trio

PREVIEW_INTERVAL_S = 0.05
"""At most one preview per actor per this interval, the first this long after the run's
first delta. A model streaming tokens shows its text 20 times a second; an answer that
ends sooner is not previewed at all: a preview its reply replaces within a frame's time is
flicker to the reader, and a frame, a task and a socket write to the daemon."""


def preview_frame(text: str) -> str:
    # ASCII escapes, as for replies: a lone surrogate must not make the UTF-8 encoding raise.
    return json.dumps({"type": "preview", "text": text}, ensure_ascii=True)


@attrs.define(eq=False)
class LivePreviews:
    send: Callable[[str, str], Awaitable[None]]
    """``send(actor, frame)``: the frame to every open socket of the actor."""
    interval_s: float = PREVIEW_INTERVAL_S
    _latest: dict[str, str] = attrs.field(factory=dict)
    """The newest text not yet sent, per actor."""
    _due: dict[str, float] = attrs.field(factory=dict)
    """When an actor's first preview may go (Trio time), for actors with no sender yet;
    oldest first (the interval is fixed, so insertion order is due order)."""
    _streaming: set[str] = attrs.field(factory=set)
    """Actors with a sender task (it sends, then waits out the interval, until idle)."""
    _locks: dict[str, trio.Lock] = attrs.field(factory=dict)
    _wake: trio.Event | None = None
    """Set to wake the scheduler when a first preview is due and it sleeps with none."""
    _scheduling_in: trio.Nursery | None = None
    """The nursery the scheduler task runs in (``None``: not running)."""
    sent: int = 0

    def offer(self, nursery: trio.Nursery, actor: str, text: str) -> None:
        """Make ``text`` the actor's newest preview (never blocks)."""
        self._latest[actor] = text
        if actor in self._streaming or actor in self._due:
            return  # a sender, or the scheduler, sends it in its turn
        self._due[actor] = trio.current_time() + self.interval_s
        if self._scheduling_in is not nursery:
            self._scheduling_in = nursery
            nursery.start_soon(self._schedule, nursery)
        elif self._wake is not None:
            self._wake.set()

    async def _schedule(self, nursery: trio.Nursery) -> None:
        """Start the sender of each actor whose first preview is due and still pending."""
        try:
            while True:
                if not self._due:
                    self._wake = trio.Event()
                    await self._wake.wait()
                    self._wake = None
                    continue
                actor, due = next(iter(self._due.items()))
                # Up to a fifth of the interval early: the first previews of many actors
                # go out at one wake-up of this task, not one each.
                if due > trio.current_time() + self.interval_s / 5:
                    await trio.sleep_until(due)
                    continue
                del self._due[actor]
                if actor in self._latest:
                    self._streaming.add(actor)
                    nursery.start_soon(self._stream, actor)
        finally:
            if self._scheduling_in is nursery:
                self._scheduling_in = None
                self._wake = None
                self._due.clear()

    def _lock(self, actor: str) -> trio.Lock:
        lock = self._locks.get(actor)
        if lock is None:
            lock = self._locks[actor] = trio.Lock()
        return lock

    def _forget(self, actor: str, lock: trio.Lock) -> None:
        if (
            self._locks.get(actor) is lock
            and not lock.locked()
            and actor not in self._latest
            and lock.statistics().tasks_waiting == 0
        ):
            del self._locks[actor]

    async def _stream(self, actor: str) -> None:
        lock = self._lock(actor)
        try:
            while True:
                async with lock:
                    text = self._latest.pop(actor, None)
                    if text is None:
                        return  # a reply ended the run meanwhile, or nothing new came
                    await self.send(actor, preview_frame(text))
                    self.sent += 1
                await trio.sleep(self.interval_s)
        finally:
            self._streaming.discard(actor)
            self._forget(actor, lock)

    def busy(self, actor: str) -> bool:
        """A reply or a preview is being written to ``actor`` now."""
        lock = self._locks.get(actor)
        return lock is not None and lock.locked()

    @asynccontextmanager
    async def replying(self, actor: str) -> AsyncIterator[None]:
        """Hold while a reply goes to ``actor``: its pending preview is dropped and no
        preview is sent until the reply went out."""
        lock = self._lock(actor)
        try:
            async with lock:
                self._latest.pop(actor, None)
                self._due.pop(actor, None)
                yield
        finally:
            self._forget(actor, lock)
