"""The ``admit`` an adapter test hands its adapter instead of a runtime."""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

from prismd.channel import Admission, InboundEvent


@attrs.define(eq=False)
class Recorder:
    """An ``admit`` that records events and answers ``answer(event)`` (accepted by default)."""

    answer: Callable[[InboundEvent], Admission] = lambda _e: Admission(status="accepted")
    events: list[InboundEvent] = attrs.field(factory=list)
    changed: trio.Event = attrs.field(factory=trio.Event)

    async def __call__(self, event: InboundEvent) -> Admission:
        self.events.append(event)
        self.changed.set()
        self.changed = trio.Event()
        return self.answer(event)

    @property
    def texts(self) -> list[str]:
        return [e.text for e in self.events]

    async def wait_for(self, count: int) -> None:
        """Until ``count`` events were admitted (the caller bounds it with a deadline)."""
        while len(self.events) < count:
            await self.changed.wait()
