""":class:`~stores.InboxStore` over a dict."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs

from .. import _common, _inbox_checks
from .._types import (
    LIST_LIMIT_DEFAULT,
    LIST_LIMIT_MAX,
    InboxClaim,
    InboxDepth,
    InboxItem,
    InboxPage,
    InboxState,
    InvalidInboxError,
    JSONValue,
)
from ._state import _InboxRow, _State


def _held_by_other(row: _InboxRow, owner_id: str, now: int) -> bool:
    item = row.item
    return (
        item.state in ("claimed", "done")
        and item.claim_expires_at_ms > now
        and item.owner_id != owner_id
    )


@attrs.define(eq=False)
class MemoryInboxStore:
    """:class:`~stores.InboxStore` over a dict; every call is one synchronous step (no two
    claimers can interleave), with the rules of the contract checked in Python."""

    _state: _State

    def _row(self, source: str, key: str) -> _InboxRow | None:
        return self._state.inbox.get((source, key))

    def _store(self, row: _InboxRow) -> None:
        self._state.inbox[(row.item.source, row.item.key)] = row

    def _current(self, claim: InboxClaim) -> _InboxRow | None:
        row = self._row(claim.source, claim.key)
        if row is None or row.token != claim.token:
            return None
        return row

    async def put(
        self, *, source: str, key: str, partition: str, order: int, payload: JSONValue
    ) -> bool:
        """A new ``pending`` item, or ``False`` when ``(source, key)`` is known."""
        await self._state.step()
        put = _inbox_checks.check_inbox_put(
            source=source, key=key, partition=partition, order=order, payload=payload,
            max_value_bytes=self._state.max_value_bytes,
        )  # fmt: skip
        if self._row(put.source, put.key) is not None:
            return False
        now = self._state.clock.now_ms()
        item = InboxItem(
            source=put.source, key=put.key, partition=put.partition, order=put.order,
            state="pending", attempts=0, available_at_ms=now, created_at_ms=now,
            updated_at_ms=now,
        )  # fmt: skip
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

    async def claim(
        self,
        *,
        owner_id: str,
        ttl_ms: int,
        limit: int = 1,
        max_attempts: int,
        sources: Sequence[str] | None = None,
    ) -> tuple[InboxClaim, ...]:
        """Ready items, oldest first (see :class:`~stores.InboxStore`)."""
        await self._state.step()
        owner, ttl, n, most, wanted = _inbox_checks.check_inbox_claim_args(
            owner_id, ttl_ms, limit, max_attempts, sources
        )
        now = self._state.clock.now_ms()
        candidates = sorted(
            (
                row
                for row in self._state.inbox.values()
                if (wanted is None or row.item.source in wanted) and self._ready(row, owner, now)
            ),
            key=lambda r: (r.item.available_at_ms, r.item.order, r.item.source, r.item.key),
        )
        claims: list[InboxClaim] = []
        taken: set[tuple[str, str]] = set()
        for row in candidates:
            if len(claims) >= n:
                break
            partition = (row.item.source, row.item.partition)
            if partition in taken:  # one item per partition (its head) per claim
                continue
            if row.item.attempts >= most:
                dead = attrs.evolve(row.item, state="dead", updated_at_ms=now)
                self._store(_InboxRow(dead, row.payload_json))
                continue
            taken.add(partition)
            token = _inbox_checks.new_claim_token()
            item = attrs.evolve(
                row.item, state="claimed", attempts=row.item.attempts + 1, owner_id=owner,
                claim_expires_at_ms=now + ttl, updated_at_ms=now,
            )  # fmt: skip
            stored = _InboxRow(item, row.payload_json, token)
            self._store(stored)
            claims.append(InboxClaim(stored.public(with_payload=True), token, now + ttl))
        return tuple(claims)

    async def expire_own_claims(
        self, *, owner_id: str, sources: Sequence[str] | None = None
    ) -> int:
        await self._state.step()
        owner = _common.check_name(owner_id, "owner_id", InvalidInboxError)
        wanted = _inbox_checks.check_inbox_sources(sources)
        now = self._state.clock.now_ms()
        mine = [
            row
            for row in self._state.inbox.values()
            if row.item.state == "claimed"
            and row.item.owner_id == owner
            and row.item.claim_expires_at_ms > now
            and (wanted is None or row.item.source in wanted)
        ]
        for row in mine:
            item = attrs.evolve(row.item, claim_expires_at_ms=now, updated_at_ms=now)
            self._store(attrs.evolve(row, item=item))
        return len(mine)

    async def extend(self, claim: InboxClaim, *, ttl_ms: int) -> InboxClaim | None:
        await self._state.step()
        _inbox_checks.check_inbox_claim(claim)
        ttl = _inbox_checks.check_inbox_ms(ttl_ms, "ttl_ms", minimum=1)
        row = self._current(claim)
        if row is None or row.item.state not in ("claimed", "done"):
            return None
        now = self._state.clock.now_ms()
        item = attrs.evolve(row.item, claim_expires_at_ms=now + ttl, updated_at_ms=now)
        self._store(attrs.evolve(row, item=item))
        return attrs.evolve(claim, item=item, expires_at_ms=now + ttl)

    async def complete(self, claim: InboxClaim, *, hold_ms: int = 0) -> bool:
        await self._state.step()
        _inbox_checks.check_inbox_claim(claim)
        hold = _inbox_checks.check_inbox_ms(hold_ms, "hold_ms", minimum=0)
        row = self._current(claim)
        if row is None or row.item.state != "claimed":
            return False
        now = self._state.clock.now_ms()
        item = attrs.evolve(
            row.item, state="done", claim_expires_at_ms=now + hold, updated_at_ms=now
        )
        self._store(_InboxRow(item, None, row.token))
        return True

    async def release(self, claim: InboxClaim) -> bool:
        await self._state.step()
        _inbox_checks.check_inbox_claim(claim)
        row = self._current(claim)
        if row is None or row.item.state != "done":
            return False
        now = self._state.clock.now_ms()
        if row.item.claim_expires_at_ms > now:
            item = attrs.evolve(row.item, claim_expires_at_ms=now, updated_at_ms=now)
            self._store(attrs.evolve(row, item=item))
        return True

    async def retry(
        self, claim: InboxClaim, *, delay_ms: int, error: str, max_attempts: int
    ) -> InboxItem | None:
        await self._state.step()
        _inbox_checks.check_inbox_claim(claim)
        delay = _inbox_checks.check_inbox_ms(delay_ms, "delay_ms", minimum=0)
        code = _inbox_checks.bound_inbox_error(error)
        most = _inbox_checks.check_inbox_ms(max_attempts, "max_attempts", minimum=1)
        row = self._current(claim)
        if row is None or row.item.state != "claimed":
            return None
        now = self._state.clock.now_ms()
        state: InboxState = "dead" if row.item.attempts >= most else "pending"
        item = attrs.evolve(
            row.item, state=state, error=code, available_at_ms=now + delay,
            claim_expires_at_ms=now, updated_at_ms=now,
        )  # fmt: skip
        self._store(_InboxRow(item, row.payload_json, None))
        return item

    async def get(self, *, source: str, key: str) -> InboxItem | None:
        await self._state.step()
        _common.check_name(source, "source", InvalidInboxError)
        _common.check_name(key, "key", InvalidInboxError)
        row = self._row(source, key)
        return None if row is None else row.public(with_payload=True)

    async def list_items(
        self,
        *,
        source: str | None = None,
        state: InboxState | None = None,
        cursor: str | None = None,
        limit: int = LIST_LIMIT_DEFAULT,
    ) -> InboxPage:
        await self._state.step()
        if source is not None:
            _common.check_name(source, "source", InvalidInboxError)
        wanted = _inbox_checks.check_inbox_state(state)
        position = _inbox_checks.decode_inbox_cursor(cursor)
        n = _inbox_checks.check_inbox_claim_args("-", 1, limit, 1, None)[2]
        rows = sorted(
            (
                r.item
                for r in self._state.inbox.values()
                if (source is None or r.item.source == source)
                and (wanted is None or r.item.state == wanted)
                and (position is None or (r.item.source, r.item.order, r.item.key) > position)
            ),
            key=lambda i: (i.source, i.order, i.key),
        )
        items = tuple(rows[:n])
        more = len(rows) > n
        return InboxPage(items, _inbox_checks.encode_inbox_cursor(items[-1]) if more else None)

    async def settle(
        self, *, source: str, key: str, action: Literal["retry", "discard"]
    ) -> InboxItem | None:
        await self._state.step()
        _common.check_name(source, "source", InvalidInboxError)
        _common.check_name(key, "key", InvalidInboxError)
        if action not in ("retry", "discard"):
            raise InvalidInboxError("action must be 'retry' or 'discard'")
        row = self._row(source, key)
        if row is None or row.item.state != "dead":
            return None
        now = self._state.clock.now_ms()
        if action == "retry":
            item = attrs.evolve(
                row.item, state="pending", attempts=0, available_at_ms=now, updated_at_ms=now
            )
            self._store(_InboxRow(item, row.payload_json))
        else:
            item = attrs.evolve(row.item, state="discarded", updated_at_ms=now)
            self._store(_InboxRow(item, None))
        return item

    async def prune(self, *, before_ms: int, limit: int = LIST_LIMIT_MAX) -> int:
        await self._state.step()
        before = _inbox_checks.check_inbox_ms(before_ms, "before_ms", minimum=0)
        n = _inbox_checks.check_inbox_claim_args("-", 1, limit, 1, None)[2]
        now = self._state.clock.now_ms()
        doomed = [
            address
            for address, row in self._state.inbox.items()
            if row.item.state in ("done", "discarded")
            and row.item.updated_at_ms < before
            and row.item.claim_expires_at_ms <= now
        ][:n]
        for address in doomed:
            del self._state.inbox[address]
        return len(doomed)

    async def depth(self, *, sources: Sequence[str] | None = None) -> InboxDepth:
        await self._state.step()
        wanted = _inbox_checks.check_inbox_sources(sources)
        counts = {"pending": 0, "claimed": 0, "dead": 0}
        for row in self._state.inbox.values():
            if (wanted is None or row.item.source in wanted) and row.item.state in counts:
                counts[row.item.state] += 1
        return InboxDepth(**counts)
