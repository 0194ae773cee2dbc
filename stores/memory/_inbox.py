""":class:`~stores.InboxStore` over a dict."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from .. import _inbox_checks
from .._inbox_checks import InboxPut
from .._inboxing import InboxStoreBase, ListAsk, ReserveAsk, RetryAsk, Settle
from .._types import InboxDepth, InboxItem, InboxReservation, InboxState
from ._state import _InboxRow, _State


def _held_by_other(row: _InboxRow, owner_id: str, now: int) -> bool:
    item = row.item
    return (
        item.state in ("claimed", "done")
        and item.claim_expires_at_ms > now
        and item.owner_id != owner_id
    )


@attrs.define(eq=False)
class MemoryInboxStore(InboxStoreBase):
    """:class:`~stores.InboxStore` over a dict; every call is one synchronous step (no two
    reservers can interleave), with the rules of the contract checked in Python."""

    _state: _State

    async def _enter(self) -> None:
        await self._state.step()

    def _now(self) -> int:
        return self._state.clock.now_ms()

    def _payload_limit(self) -> int:
        return self._state.max_value_bytes

    def _row(self, source: str, key: str) -> _InboxRow | None:
        return self._state.inbox.get((source, key))

    def _store(self, row: _InboxRow) -> None:
        self._state.inbox[(row.item.source, row.item.key)] = row

    def _current(self, reservation: InboxReservation, *states: InboxState) -> _InboxRow | None:
        """The claim's item while its token holds it in one of ``states``."""
        row = self._row(reservation.source, reservation.key)
        if row is None or row.token != reservation.token or row.item.state not in states:
            return None
        return row

    async def _insert(self, put: InboxPut, now: int) -> bool:
        if self._row(put.source, put.key) is not None:
            return False
        item = InboxItem(
            source=put.source,
            key=put.key,
            partition=put.partition,
            order=put.order,
            state="pending",
            attempts=0,
            available_at_ms=now,
            created_at_ms=now,
            updated_at_ms=now,
        )
        self._store(_InboxRow(item, put.payload_json))
        return True

    def _ready(self, row: _InboxRow, owner_id: str, now: int) -> bool:
        item = row.item
        if not (
            (item.state == "pending" and item.available_at_ms <= now)
            or (item.state == "claimed" and item.claim_expires_at_ms <= now)
        ):
            return False
        for other in self._state.inbox.values():
            o = other.item
            if o.source != item.source or o.partition != item.partition or other is row:
                continue
            if o.state in ("pending", "claimed") and (o.order, o.key) < (item.order, item.key):
                return False
            if _held_by_other(other, owner_id, now):
                return False
        return True

    async def _reserve(self, ask: ReserveAsk) -> tuple[InboxReservation, ...]:
        now, owner, expires_at = ask.now, ask.owner_id, ask.now + ask.ttl_ms
        candidates = sorted(
            (
                row
                for row in self._state.inbox.values()
                if (ask.sources is None or row.item.source in ask.sources)
                and self._ready(row, owner, now)
            ),
            key=lambda r: (r.item.available_at_ms, r.item.order, r.item.source, r.item.key),
        )
        reservations: list[InboxReservation] = []
        taken: set[tuple[str, str]] = set()
        for row in candidates:
            if len(reservations) >= ask.limit:
                break
            partition = (row.item.source, row.item.partition)
            if partition in taken:  # one item per partition (its head) per reserve
                continue
            if row.item.attempts >= ask.max_attempts:
                dead = attrs.evolve(row.item, state="dead", updated_at_ms=now)
                self._store(_InboxRow(dead, row.payload_json))
                continue
            taken.add(partition)
            token = _inbox_checks.new_reservation_token()
            item = attrs.evolve(
                row.item,
                state="claimed",
                attempts=row.item.attempts + 1,
                owner_id=owner,
                claim_expires_at_ms=expires_at,
                updated_at_ms=now,
            )
            stored = _InboxRow(item, row.payload_json, token)
            self._store(stored)
            reservations.append(
                InboxReservation(stored.public(with_payload=True), token, expires_at)
            )
        return tuple(reservations)

    async def _expire_own(self, owner_id: str, sources: tuple[str, ...] | None, now: int) -> int:
        mine = [
            row
            for row in self._state.inbox.values()
            if row.item.state == "claimed"
            and row.item.owner_id == owner_id
            and row.item.claim_expires_at_ms > now
            and (sources is None or row.item.source in sources)
        ]
        for row in mine:
            item = attrs.evolve(row.item, claim_expires_at_ms=now, updated_at_ms=now)
            self._store(attrs.evolve(row, item=item))
        return len(mine)

    async def _extend(
        self, reservation: InboxReservation, expires_at: int, now: int
    ) -> InboxItem | None:
        row = self._current(reservation, "claimed", "done")
        if row is None:
            return None
        item = attrs.evolve(row.item, claim_expires_at_ms=expires_at, updated_at_ms=now)
        self._store(attrs.evolve(row, item=item))
        return item

    async def _complete(self, reservation: InboxReservation, expires_at: int, now: int) -> bool:
        row = self._current(reservation, "claimed")
        if row is None:
            return False
        item = attrs.evolve(
            row.item, state="done", claim_expires_at_ms=expires_at, updated_at_ms=now
        )
        self._store(_InboxRow(item, None, row.token))
        return True

    async def _release(self, reservation: InboxReservation, now: int) -> bool:
        row = self._current(reservation, "done")
        if row is None:
            return False
        if row.item.claim_expires_at_ms > now:
            item = attrs.evolve(row.item, claim_expires_at_ms=now, updated_at_ms=now)
            self._store(attrs.evolve(row, item=item))
        return True

    async def _retry(self, ask: RetryAsk) -> InboxItem | None:
        row = self._current(ask.reservation, "claimed")
        if row is None:
            return None
        state: InboxState = "dead" if row.item.attempts >= ask.max_attempts else "pending"
        item = attrs.evolve(
            row.item,
            state=state,
            error=ask.error,
            available_at_ms=ask.available_at,
            claim_expires_at_ms=ask.now,
            updated_at_ms=ask.now,
        )
        self._store(_InboxRow(item, row.payload_json, None))
        return item

    async def _get(self, source: str, key: str) -> InboxItem | None:
        row = self._row(source, key)
        return None if row is None else row.public(with_payload=True)

    async def _list(self, ask: ListAsk) -> Sequence[InboxItem]:
        return sorted(
            (
                r.item
                for r in self._state.inbox.values()
                if (ask.source is None or r.item.source == ask.source)
                and (ask.state is None or r.item.state == ask.state)
                and (ask.after is None or (r.item.source, r.item.order, r.item.key) > ask.after)
            ),
            key=lambda i: (i.source, i.order, i.key),
        )[: ask.limit]

    async def _settle(self, source: str, key: str, action: Settle, now: int) -> InboxItem | None:
        row = self._row(source, key)
        if row is None or row.item.state != "dead":
            return None
        if action == "retry":
            item = attrs.evolve(
                row.item, state="pending", attempts=0, available_at_ms=now, updated_at_ms=now
            )
            self._store(_InboxRow(item, row.payload_json))
        else:
            item = attrs.evolve(row.item, state="discarded", updated_at_ms=now)
            self._store(_InboxRow(item, None))
        return item

    async def _prune(self, before: int, limit: int, now: int) -> int:
        doomed = [
            address
            for address, row in self._state.inbox.items()
            if row.item.state in ("done", "discarded")
            and row.item.updated_at_ms < before
            and row.item.claim_expires_at_ms <= now
        ][:limit]
        for address in doomed:
            del self._state.inbox[address]
        return len(doomed)

    async def _depth(self, sources: tuple[str, ...] | None) -> InboxDepth:
        counts = {"pending": 0, "claimed": 0, "dead": 0}
        for row in self._state.inbox.values():
            if (sources is None or row.item.source in sources) and row.item.state in counts:
                counts[row.item.state] += 1
        return InboxDepth(**counts)
