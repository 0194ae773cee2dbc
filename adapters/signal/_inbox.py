"""The durable inbox: every received message, from the moment it is read until ``admit``
gave it a final answer.

signal-cli hands a message over once and forgets it (``protocols-telegram-signal.md`` §2:
no application acknowledgement, no replay), so the Signal adapter writes what it reads here
first, in the journal's store, before anything else happens to it: a crash, a stop or a
retryable admission (``capacity``, ``unavailable``, ``stopped``) while it waits then loses
nothing — the next receiver to hold the lease (this daemon after a restart, or a standby)
admits it before subscribing. (The Telegram adapter needs no such thing: Telegram keeps an
update until the offset moves past it.)

It is the store's inbox (:class:`stores.InboxStore`, the one the Telegram webhook uses):
one item per event, source = the connection id, key = the event id, a partition of its own
(the receiver admits in order itself), ``order`` the order it was read in. The events read
together are put at once (one transaction on SQLite: its writes are group-committed). An
item is claimed by the connection's receiver (owner ``signal-receiver:<connection>``, the
same for every daemon: the receiver lease makes one of them the holder) and completed
(``done``, its text dropped) once the event got a final admission, in batches; ``prune``
deletes it later. A receiver that takes the lease first lets its owner's claims go
(:meth:`~stores.InboxStore.expire_own_reservations`) and claims every waiting item again: an item
whose claim a former holder still has is fenced from it. An admission answered as a
duplicate is final, so an event written twice, or replayed by two daemons, is still
admitted once. The claims never make a dead letter (:data:`MAX_ATTEMPTS`): an event waits
until it is admitted, as before.

Before the store had an inbox, these were checkpoints (namespace
:data:`INBOX_NAMESPACE`, key ``i1:<connection>:<event id>``, the service scope): a
receiver moves any it finds into the inbox (and deletes them) before it claims, so a
journal written then keeps its waiting messages, each admitted once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import trio

from prismd.channel import InboundEvent
from stores import (
    CheckpointRecord,
    CheckpointStore,
    DeleteCheckpoint,
    InboxReservation,
    InboxStore,
    OwnershipScope,
)

from ._status import log

__all__ = ["INBOX_NAMESPACE", "Inbox"]

INBOX_NAMESPACE = "prism.channels.v1.signal.inbox"
"""Where the records were kept before the store's inbox (read only to move them)."""
MAX_REPLAY = 10_000
"""At most this many items are taken back at one start (the rest at the next)."""
MAX_ATTEMPTS = 2**31
"""Claims before the store would call an item dead: never reached (an event is retried
until its admission is final, however many times the receiver restarts)."""
RESERVATION_TTL_MS = 24 * 3600 * 1000
"""A claim's time: while the receiver holds the lease its claims are its own anyway (a
new holder lets them go at once); an expired one is claimed again when needed."""
_PAGE = 500


@attrs.define(eq=False, kw_only=True)
class Inbox:
    connection_id: str
    store: InboxStore
    checkpoints: CheckpointStore
    """Where the records written before the store's inbox may wait (moved at :meth:`load`)."""
    scope: OwnershipScope
    """Their scope (the adapter's service scope)."""
    _seq: int = attrs.field(default=0, init=False)
    """Orders events received in the same millisecond (as they were read)."""
    _last_order: int = attrs.field(default=0, init=False)
    _orders: dict[str, int] = attrs.field(factory=dict, init=False)
    """The order given to each event put and not yet removed: a put tried again (the store
    failed the first) keeps its place among the events read after it."""
    _reservations: dict[str, InboxReservation] = attrs.field(factory=dict, init=False)
    """This receiver's claims, by event id."""

    @property
    def owner(self) -> str:
        return f"signal-receiver:{self.connection_id}"

    def _order(self, received_at_ms: int | None) -> int:
        """Increasing in the order events are read, by receipt time first."""
        self._last_order = max(self._last_order + 1, (received_at_ms or 0) * 1000)
        return self._last_order

    def _order_of(self, event: InboundEvent) -> int:
        order = self._orders.get(event.event_id)
        if order is None:
            order = self._orders[event.event_id] = self._order(event.received_at_ms)
        return order

    async def put(self, events: Sequence[InboundEvent]) -> list[bool]:
        """Write each event (once), together; per event whether it is now durable (False
        for an event the store did not take: logged)."""
        if not events:
            return []
        items = [(event.event_id, self._order_of(event), self._value(event)) for event in events]
        durable = [False] * len(items)
        failed: list[str] = []

        async def put_one(index: int, key: str, order: int, payload: dict[str, Any]) -> None:
            try:
                # False: the item is there already (written before): durable too.
                await self.store.put(
                    source=self.connection_id,
                    key=key,
                    partition=f"event:{key}",
                    order=order,
                    payload=payload,
                )
            except Exception as exc:
                failed.append(type(exc).__name__)
                return
            durable[index] = True

        async with trio.open_nursery() as nursery:
            for index, (key, order, payload) in enumerate(items):
                nursery.start_soon(put_one, index, key, order, payload)
        if failed:
            log.warning(
                "signal %s: keeping %d received message(s) in the inbox failed (%s); they "
                "wait in memory only",
                self.connection_id,
                len(failed),
                failed[0],
            )
        return durable

    def _value(self, event: InboundEvent) -> dict[str, Any]:
        self._seq += 1
        return {
            "schema": 1,
            "eventId": event.event_id,
            "conversationId": event.external_conversation_id,
            "actorId": event.external_actor_id,
            "text": event.text,
            "receivedAt": event.received_at_ms,
            "seq": self._seq,
            "claims": dict(event.claims),
        }

    async def remove(self, events: Sequence[InboundEvent]) -> None:
        """Complete the items of events that got their final admission, together
        (failures logged: an item left behind is admitted again as a duplicate and
        completed then)."""
        if not events:
            return
        keys = {event.event_id for event in events}
        for key in keys:
            self._orders.pop(key, None)
        try:
            await self._reserve(keys - self._reservations.keys())
            done = [self._reservations.pop(key) for key in keys if key in self._reservations]
            async with trio.open_nursery() as nursery:
                for reservation in done:
                    nursery.start_soon(self._complete, reservation)
        except Exception as exc:
            log.warning(
                "signal %s: removing %d admitted message(s) from the inbox failed (%s)",
                self.connection_id,
                len(events),
                type(exc).__name__,
            )

    async def _complete(self, reservation: InboxReservation) -> None:
        await self.store.complete(reservation)

    async def _reserve(self, wanted: set[str]) -> None:
        """Claim ready items (oldest first) until ``wanted`` are among this receiver's
        claims or none is ready; what else it claims is kept for later."""
        missing = set(wanted)
        while missing:
            reservations = await self.store.reserve(
                owner_id=self.owner,
                ttl_ms=RESERVATION_TTL_MS,
                limit=min(_PAGE, max(len(missing), 1)),
                max_attempts=MAX_ATTEMPTS,
                sources=(self.connection_id,),
            )
            if not reservations:
                break
            for reservation in reservations:
                self._reservations[reservation.key] = reservation
                missing.discard(reservation.key)

    async def load(self) -> list[InboundEvent]:
        """Every waiting event, oldest first, now claimed by this receiver (store errors
        propagate). Moves the records written before the store's inbox into it first."""
        await self._move_checkpoint_records()
        await self.store.expire_own_reservations(owner_id=self.owner, sources=(self.connection_id,))
        self._reservations.clear()
        self._orders.clear()
        reserved: list[InboxReservation] = []
        while len(reserved) < MAX_REPLAY:
            reservations = await self.store.reserve(
                owner_id=self.owner,
                ttl_ms=RESERVATION_TTL_MS,
                limit=min(_PAGE, MAX_REPLAY - len(reserved)),
                max_attempts=MAX_ATTEMPTS,
                sources=(self.connection_id,),
            )
            if not reservations:
                break
            reserved.extend(reservations)
        events: list[InboundEvent] = []
        for reservation in sorted(reserved, key=lambda c: (c.item.order, c.key)):
            self._reservations[reservation.key] = reservation
            self._last_order = max(self._last_order, reservation.item.order)
            event = self._event(reservation.item.payload)
            if event is not None:
                events.append(event)
        return events

    async def _move_checkpoint_records(self) -> None:
        """The records of the checkpoint inbox, into the store's inbox in their order, then
        deleted (a record that does not read as one stays where it is, as it did)."""
        rows: list[tuple[int, int, str, CheckpointRecord]] = []
        cursor: str | None = None
        while len(rows) < MAX_REPLAY:
            page = await self.checkpoints.list_checkpoints(
                namespace=INBOX_NAMESPACE,
                key_prefix=f"i1:{self.connection_id}:",
                scope=self.scope,
                cursor=cursor,
                limit=_PAGE,
            )
            for row in page.items:
                event = self._event(row.value)
                if event is not None:
                    seq = row.value.get("seq")
                    order = seq if isinstance(seq, int) and not isinstance(seq, bool) else 0
                    rows.append((event.received_at_ms or 0, order, row.key, row))
            cursor = page.next_cursor
            if cursor is None:
                break
        if not rows:
            return
        rows.sort(key=lambda item: item[:3])
        for received_at, _seq, _key, row in rows:
            await self.store.put(
                source=self.connection_id,
                key=row.value["eventId"],
                partition=f"event:{row.value['eventId']}",
                order=self._order(received_at),
                payload=row.value,
            )
        await self.checkpoints.write_checkpoints(
            [
                DeleteCheckpoint(namespace=INBOX_NAMESPACE, key=row.key, scope=self.scope)
                for *_order, row in rows
            ]
        )
        log.info(
            "signal %s: %d received message(s) moved into the store's inbox",
            self.connection_id,
            len(rows),
        )

    def _event(self, value: Any) -> InboundEvent | None:
        if not isinstance(value, Mapping) or value.get("schema") != 1:
            return None
        parts = [value.get(k) for k in ("eventId", "conversationId", "actorId", "text")]
        if not all(isinstance(part, str) for part in parts):
            return None
        received = value.get("receivedAt")
        raw_claims = value.get("claims")
        return InboundEvent(
            connection_id=self.connection_id,
            external_conversation_id=value["conversationId"],
            external_actor_id=value["actorId"],
            event_id=value["eventId"],
            text=value["text"],
            received_at_ms=received if isinstance(received, int) else None,
            claims=dict(raw_claims) if isinstance(raw_claims, Mapping) else {},
        )
