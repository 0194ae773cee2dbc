"""The events the receiver has read and not yet admitted, in the order read: each written to
the inbox first (:mod:`._inbox`), admitted one at a time, and taken off the inbox in
batches once its admission is final. Also the receiver's stop, which every wait here obeys.
"""

from __future__ import annotations

import collections
import random as _random
from collections.abc import Sequence

import attrs
import trio

from prismd.channel import Admit, InboundEvent

from ..toolkit import Backoff, Interrupts
from ._inbox import Inbox
from ._status import SignalStatus, log

__all__ = ["PERSIST_S", "UnadmittedEvents"]

PERSIST_S = 2.0
"""Bound on writing held events to the inbox during a stop."""


@attrs.define(eq=False)
class Unadmitted:
    event: InboundEvent
    durable: bool = False


@attrs.define(eq=False, kw_only=True)
class UnadmittedEvents:
    connection_id: str
    admit: Admit
    inbox: Inbox
    status: SignalStatus
    stop: Interrupts
    random: _random.Random
    reconnect_delay_s: float
    max_reconnect_delay_s: float
    _items: collections.deque[Unadmitted] = attrs.field(factory=collections.deque, init=False)
    _to_remove: list[InboundEvent] = attrs.field(factory=list, init=False)
    """Admitted events whose inbox items are still to be completed (in one batch)."""

    def __len__(self) -> int:
        return len(self._items)

    @property
    def head(self) -> Unadmitted:
        return self._items[0]

    @property
    def removals(self) -> int:
        return len(self._to_remove)

    async def keep(self, events: Sequence[InboundEvent]) -> bool:
        """Write ``events`` to the inbox and hold them; False when the store did not take
        them all (those are held in memory, and written again before they are admitted)."""
        durable = await self.inbox.put(events)
        for event, ok in zip(events, durable, strict=True):
            self._items.append(Unadmitted(event, durable=ok))
        self.status.held = len(self._items)
        return all(durable)

    async def admit_once(self, event: InboundEvent) -> bool:
        """True when ``admit`` gave a final answer (accepted, duplicate, a final refusal)."""
        try:
            admission = await self.admit(event)
        except Exception as exc:
            self.status.retried += 1
            log.warning(
                "signal %s: admitting a message failed (%s); it is kept and retried",
                self.connection_id,
                type(exc).__name__,
            )
            return False
        if admission.retryable:
            self.status.retried += 1
            log.debug(
                "signal %s: admission answered %s; the message is kept and retried",
                self.connection_id,
                admission.reason,
            )
            return False
        self.status.admitted += 1
        return True

    def admitted(self, item: Unadmitted) -> None:
        self._items.popleft()
        self.status.held = len(self._items)
        if item.durable:
            self._to_remove.append(item.event)

    async def flush_removals(self) -> None:
        done, self._to_remove = self._to_remove, []
        await self.inbox.remove(done)

    async def settle(self) -> None:
        """Admit the held events in order, with backoff; returns when none is left (or on a
        stop, after making them durable)."""
        backoff = Backoff(
            self.random, base_s=self.reconnect_delay_s, cap_s=self.max_reconnect_delay_s
        )
        while self._items:
            if self.stop.stopped:
                await self.persist()
                return
            await self.persist()
            item = self._items[0]
            if await self.admit_once(item.event):
                self.admitted(item)
                backoff.reset()
                continue
            self.status.state = "paused"
            self.status.subscription = "paused"
            delay = backoff.next_delay()
            log.info(
                "signal %s: %d received message(s) wait for admission; next try in %.1f s",
                self.connection_id,
                len(self._items),
                delay,
            )
            with self.stop.interruptible():
                await trio.sleep(delay)
        await self.flush_removals()

    async def persist(self) -> None:
        """Write the held events not yet in the inbox (bounded, also during a stop)."""
        missing = [item for item in self._items if not item.durable]
        if not missing:
            return
        with trio.move_on_after(PERSIST_S, shield=True):
            durable = await self.inbox.put([item.event for item in missing])
            for item, ok in zip(missing, durable, strict=True):
                item.durable = ok

    async def replay(self) -> None:
        """Take back what waits in the inbox (a start, a lease taken over)."""
        try:
            events = await self.inbox.load()
        except Exception as exc:
            log.warning(
                "signal %s: reading the inbox failed (%s); retried at the next start",
                self.connection_id,
                type(exc).__name__,
            )
            return
        known = {item.event.event_id for item in self._items}
        for event in events:
            if event.event_id not in known:
                self._items.append(Unadmitted(event, durable=True))
                self.status.replayed += 1
        self.status.held = len(self._items)
        if events:
            log.info(
                "signal %s: %d received message(s) taken back from the inbox",
                self.connection_id,
                len(events),
            )
