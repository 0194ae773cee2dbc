"""Live previews for the web chat: a streaming answer's text as ``preview`` frames.

The runtime calls ``send_draft`` for every delta (cumulative, redacted text; never
journaled). Each actor's previews are coalesced — one sender task per actor sends the
newest text, so a slow tab gets the latest state, never a backlog — and ordered against
replies: sending a reply takes the actor's lock and drops the pending preview, so no preview
of a run ever arrives after the reply that ends it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import attrs
import trio


def preview_frame(text: str) -> str:
    # ASCII escapes, as for replies: a lone surrogate must not make the UTF-8 encoding raise.
    return json.dumps({"type": "preview", "text": text}, ensure_ascii=True)


@attrs.define(eq=False)
class LivePreviews:
    send: Callable[[str, str], Awaitable[None]]
    """``send(actor, frame)``: the frame to every open socket of the actor."""
    _latest: dict[str, str] = attrs.field(factory=dict)
    _locks: dict[str, trio.Lock] = attrs.field(factory=dict)
    sent: int = 0

    def offer(self, nursery: trio.Nursery, actor: str, text: str) -> None:
        """Make ``text`` the actor's newest preview (never blocks)."""
        idle = actor not in self._latest
        self._latest[actor] = text
        if idle:
            nursery.start_soon(self._stream, actor)

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
                    text = self._latest.get(actor)
                    if text is None:
                        return  # a reply ended the run meanwhile
                    await self.send(actor, preview_frame(text))
                    self.sent += 1
                    if self._latest.get(actor) == text:
                        del self._latest[actor]
                        return
        finally:
            self._forget(actor, lock)

    @asynccontextmanager
    async def replying(self, actor: str) -> AsyncIterator[None]:
        """Hold while a reply goes to ``actor``: its pending preview is dropped and no
        preview is sent until the reply went out."""
        lock = self._lock(actor)
        try:
            async with lock:
                self._latest.pop(actor, None)
                yield
        finally:
            self._forget(actor, lock)
