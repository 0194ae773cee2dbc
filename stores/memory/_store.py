"""``MemoryStore``: the store contract in process memory, for unit tests.

It follows every rule of :mod:`stores._types` exactly like the durable backends (the
conformance suite runs against all of them), but nothing survives the process. Values are
deep-copied through JSON on save and on load, so a caller mutating a value it saved or loaded
never changes what is stored.

Every method runs synchronously between two Trio checkpoints, so each call is atomic with
respect to other tasks: that is the memory store's "transaction".
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import TracebackType
from typing import Any, Literal

import attrs
import trio

from .. import _common
from .._types import (
    ANY_SCOPE,
    DEFAULT_MAX_VALUE_BYTES,
    LIST_LIMIT_DEFAULT,
    LIST_LIMIT_MAX,
    SYSTEM_CLOCK,
    CheckpointPage,
    CheckpointRecord,
    CheckpointWrite,
    Clock,
    DeleteCheckpoint,
    EncodedSave,
    EventAction,
    EventPage,
    InboxClaim,
    InboxDepth,
    InboxItem,
    InboxPage,
    InboxState,
    InvalidInboxError,
    InvalidLeaseError,
    JournalEvent,
    JSONValue,
    LeaseConflictError,
    LeaseRecord,
    OwnershipScope,
    StoreUnavailableError,
    WriteResult,
    WriteStatus,
)

_DECODE: Any = object()


@attrs.frozen
class _Row:
    """A stored checkpoint with its value kept as JSON text (the copy boundary)."""

    namespace: str
    key: str
    version: int
    value_json: str
    scope: OwnershipScope
    created_at_ms: int
    updated_at_ms: int
    fencing_token: int | None
    category: str | None
    metadata_json: str | None

    def record(self, value: JSONValue = _DECODE) -> CheckpointRecord:
        """The row as a record; ``value`` given: the caller's own object, not a decode of
        the stored copy (a save answering with what it was asked to store)."""
        return CheckpointRecord(
            namespace=self.namespace,
            key=self.key,
            version=self.version,
            value=_common.decode_json(self.value_json) if value is _DECODE else value,
            scope=self.scope,
            created_at_ms=self.created_at_ms,
            updated_at_ms=self.updated_at_ms,
            fencing_token=self.fencing_token,
            category=self.category,
            metadata=None
            if self.metadata_json is None
            else _common.decode_json(self.metadata_json),
        )


_Request = _common.SaveRequest | _common.DeleteRequest | EncodedSave


def _saved(req: _common.SaveRequest | EncodedSave, current: _Row | None, now: int) -> _Row | None:
    """The row ``req`` writes over ``current``, or ``None`` when its checks fail (§1.2)."""
    if current is None:
        if req.expected_version not in (None, 0):
            return None
        created_at = updated_at = now
    else:
        if (
            current.scope != req.scope
            or (req.expected_version is not None and req.expected_version != current.version)
            or req.version <= current.version
            or (
                current.fencing_token is not None
                and (req.fencing_token is None or req.fencing_token < current.fencing_token)
            )
        ):
            return None
        created_at = current.created_at_ms
        # Never let updated_at go backwards (a clock step): listing order and keyset
        # cursors rely on a rewritten row moving to the front.
        updated_at = max(now, current.updated_at_ms)
    return _Row(
        namespace=req.namespace,
        key=req.key,
        version=req.version,
        value_json=req.value_json,
        scope=req.scope,
        created_at_ms=created_at,
        updated_at_ms=updated_at,
        fencing_token=req.fencing_token,
        category=req.category,
        metadata_json=req.metadata_json,
    )


@attrs.frozen
class _InboxRow:
    """A stored inbox item: the payload kept as JSON text, and the current claim's token."""

    item: InboxItem
    payload_json: str | None
    token: str | None = None

    def public(self, *, with_payload: bool) -> InboxItem:
        if not with_payload or self.payload_json is None:
            return self.item
        return attrs.evolve(self.item, payload=_common.decode_json(self.payload_json))


@attrs.define(eq=False)
class _State:
    """Everything one :class:`MemoryStore` holds; shared by its two facets."""

    clock: Clock
    max_value_bytes: int
    checkpoints: dict[tuple[str, str], _Row] = attrs.Factory(dict)
    leases: dict[tuple[str, str], LeaseRecord] = attrs.Factory(dict)
    inbox: dict[tuple[str, str], _InboxRow] = attrs.Factory(dict)
    events: list[tuple[JournalEvent, str | None]] = attrs.Factory(list)
    next_seq: int = 1
    closed: bool = False

    def check_open(self) -> None:
        if self.closed:
            raise StoreUnavailableError("store is closed")

    async def step(self) -> None:
        """The checkpoint before every call, then the open check."""
        await trio.lowlevel.checkpoint()
        self.check_open()

    def append_event(
        self,
        action: EventAction,
        row: _Row,
        at_ms: int,
        metadata_json: str | None,
    ) -> None:
        event = JournalEvent(
            seq=self.next_seq,
            at_ms=at_ms,
            action=action,
            namespace=row.namespace,
            key=row.key,
            scope=row.scope,
            version=row.version,
            category=row.category,
            metadata=None,
        )
        self.next_seq += 1
        self.events.append((event, metadata_json))


@attrs.define(eq=False)
class MemoryCheckpointStore(_common.SavesAsABatchOfOne):
    """:class:`~stores.CheckpointStore` over a dict; see the module docstring."""

    _state: _State

    async def write_checkpoints(
        self, writes: Sequence[CheckpointWrite], *, atomic: bool = False
    ) -> tuple[WriteResult, ...]:
        """See :meth:`~stores.CheckpointStore.write_checkpoints` and :meth:`_apply`."""
        await trio.lowlevel.checkpoint()
        state = self._state
        state.check_open()
        requests = _common.check_writes(writes, atomic, state.max_value_bytes)
        results: list[WriteResult] = []
        for req, (status, row) in zip(requests, self._apply(requests, atomic), strict=True):
            if status != "ok" or row is None or isinstance(req, _common.DeleteRequest):
                results.append(WriteResult(status))
            else:
                record = row.record(req.value) if req.encoded_by_caller else row.record()
                results.append(WriteResult(status, record))
        return tuple(results)

    async def save_encoded(
        self, saves: Sequence[EncodedSave], *, atomic: bool = False
    ) -> tuple[int | None, ...]:
        """See :meth:`~stores.CheckpointStore.save_encoded` and :meth:`_apply`."""
        await trio.lowlevel.checkpoint()
        state = self._state
        state.check_open()
        checked = _common.check_encoded(saves, atomic, state.max_value_bytes)
        return tuple(
            None if row is None else 0 if status == "aborted" else row.updated_at_ms
            for status, row in self._apply(checked, atomic)
        )

    def _apply(
        self, requests: Sequence[_Request], atomic: bool
    ) -> list[tuple[WriteStatus, _Row | None]]:
        """Apply the batch against an overlay of the rows it touches, then publish the
        overlay and its events at once; per request its status and the row it wrote (or
        would have written, when an ``atomic`` batch is ``aborted``)."""
        state = self._state
        now = state.clock.now_ms()
        overlay: dict[tuple[str, str], _Row | None] = {}
        events: list[tuple[EventAction, _Row, str | None]] = []
        results: list[tuple[WriteStatus, _Row | None]] = []
        for req in requests:
            address = (req.namespace, req.key)
            current = overlay[address] if address in overlay else state.checkpoints.get(address)
            if isinstance(req, _common.DeleteRequest):
                if current is None or current.scope != req.scope:
                    results.append(("missing", None))
                    continue
                overlay[address] = None
                events.append(("delete", current, None))
                results.append(("ok", None))
                continue
            row = _saved(req, current, now)
            if row is None:
                results.append(("conflict", None))
                continue
            overlay[address] = row
            events.append(("save", row, req.metadata_json))
            results.append(("ok", row))
        if atomic and any(status != "ok" for status, _ in results):
            return [(status if status != "ok" else "aborted", row) for status, row in results]
        for address, stored in overlay.items():
            if stored is None:
                del state.checkpoints[address]
            else:
                state.checkpoints[address] = stored
        for action, stored, metadata_json in events:
            state.append_event(action, stored, now, metadata_json)
        return results

    async def load_checkpoint(
        self, *, namespace: str, key: str, scope: OwnershipScope
    ) -> CheckpointRecord | None:
        """The row, or ``None`` when absent or stored under another exact scope."""
        await trio.lowlevel.checkpoint()
        self._state.check_open()
        _common.check_checkpoint_address(namespace, key, scope)
        row = self._state.checkpoints.get((namespace, key))
        if row is None or row.scope != scope:
            return None
        return row.record()

    async def list_checkpoints(
        self,
        *,
        namespace: str | None = None,
        key_prefix: str | None = None,
        category: str | Sequence[str] | None = None,
        scope: OwnershipScope = ANY_SCOPE,
        cursor: str | None = None,
        limit: int = LIST_LIMIT_DEFAULT,
    ) -> CheckpointPage:
        """Newest first, then key; keyset-paged (see :meth:`CheckpointStore.list_checkpoints`)."""
        await trio.lowlevel.checkpoint()
        self._state.check_open()
        _common.check_list_filters(namespace, key_prefix, scope)
        categories = _common.check_category_filter(category)
        position = _common.decode_cursor(cursor)
        n = _common.clamp_limit(limit)
        # Sort and page the stored rows; only the rows of this page are decoded.
        matching = sorted(
            (
                row
                for row in self._state.checkpoints.values()
                if (namespace is None or row.namespace == namespace)
                and (key_prefix is None or row.key.startswith(key_prefix))
                and (categories is None or row.category in categories)
                and scope.matches_filter(row.scope)
            ),
            key=_common.sort_key,
        )
        if position is not None:
            matching = [r for r in matching if _common.after_cursor(r, position)]
        items = tuple(row.record() for row in matching[:n])
        next_cursor = _common.encode_cursor(items[-1]) if len(matching) > n else None
        return CheckpointPage(items=items, next_cursor=next_cursor)

    async def delete_checkpoint(self, *, namespace: str, key: str, scope: OwnershipScope) -> bool:
        """True when a row was removed; a foreign scope is a miss (``False``)."""
        (result,) = await self.write_checkpoints((DeleteCheckpoint(namespace, key, scope),))
        return result.ok

    async def list_events(
        self, *, after: int = 0, limit: int = LIST_LIMIT_DEFAULT, scope: OwnershipScope = ANY_SCOPE
    ) -> EventPage:
        """Events with ``seq > after`` in commit order, filtered by partial ``scope``."""
        await trio.lowlevel.checkpoint()
        self._state.check_open()
        after, n = _common.check_event_args(after, limit, scope)
        items: list[JournalEvent] = []
        for event, metadata_json in self._state.events:
            if event.seq <= after or not scope.matches_filter(event.scope):
                continue
            metadata = None if metadata_json is None else _common.decode_json(metadata_json)
            items.append(attrs.evolve(event, metadata=metadata))
            if len(items) >= n:
                break
        return EventPage(items=tuple(items), last_seq=items[-1].seq if items else after)

    async def last_event_seq(self) -> int:
        """The highest event sequence number (0: none yet)."""
        await self._state.step()
        return self._state.next_seq - 1


@attrs.define(eq=False)
class MemoryLeaseStore:
    """:class:`~stores.LeaseStore` over a dict. Released and expired rows are kept, so
    fencing counters survive them (unlike the reference's sweep)."""

    _state: _State

    def _row(self, namespace: str, key: str, scope: OwnershipScope) -> LeaseRecord | None:
        self._state.check_open()
        _common.check_lease_address(namespace, key, scope)
        row = self._state.leases.get((namespace, key))
        if row is not None and row.scope != scope:
            raise LeaseConflictError("lease ownership mismatch")
        return row

    async def try_acquire_lease(
        self,
        *,
        namespace: str,
        key: str,
        scope: OwnershipScope,
        owner_id: str,
        ttl_ms: int,
        reclaim: bool = False,
    ) -> LeaseRecord | None:
        """A fresh lease (new token, fencing token + 1), or ``None`` while someone else holds it.

        With ``reclaim=True`` an unexpired lease held by the same ``owner_id`` is taken over.
        Raises :class:`~stores.LeaseConflictError` for a foreign scope or bad input.
        """
        await trio.lowlevel.checkpoint()
        row = self._row(namespace, key, scope)
        _common.check_name(owner_id, "owner_id", InvalidLeaseError)
        ttl = _common.check_ttl(ttl_ms)
        if not isinstance(reclaim, bool):
            raise InvalidLeaseError("reclaim must be a bool")
        now = self._state.clock.now_ms()
        if (
            row is not None
            and row.expires_at_ms > now
            and not (reclaim and row.owner_id == owner_id)
        ):
            return None
        lease = LeaseRecord(
            namespace=namespace,
            key=key,
            scope=scope,
            owner_id=owner_id,
            token=os.urandom(16).hex(),
            fencing_token=1 if row is None else row.fencing_token + 1,
            acquired_at_ms=now,
            expires_at_ms=now + ttl,
            updated_at_ms=now,
        )
        self._state.leases[(namespace, key)] = lease
        return lease

    async def renew_lease(
        self,
        *,
        namespace: str,
        key: str,
        scope: OwnershipScope,
        owner_id: str,
        token: str,
        ttl_ms: int,
    ) -> LeaseRecord | None:
        """Move the expiry of an unexpired lease held by (owner_id, token); else ``None``."""
        await trio.lowlevel.checkpoint()
        row = self._row(namespace, key, scope)
        _common.check_name(owner_id, "owner_id", InvalidLeaseError)
        _common.check_name(token, "token", InvalidLeaseError)
        ttl = _common.check_ttl(ttl_ms)
        now = self._state.clock.now_ms()
        if row is None or row.owner_id != owner_id or row.token != token:
            return None
        if row.expires_at_ms <= now:
            return None
        lease = attrs.evolve(row, expires_at_ms=now + ttl, updated_at_ms=now)
        self._state.leases[(namespace, key)] = lease
        return lease

    async def release_lease(
        self, *, namespace: str, key: str, scope: OwnershipScope, owner_id: str, token: str
    ) -> bool:
        """Expire the lease now when (owner_id, token) holds it; ``False`` otherwise."""
        await trio.lowlevel.checkpoint()
        row = self._row(namespace, key, scope)
        _common.check_name(owner_id, "owner_id", InvalidLeaseError)
        _common.check_name(token, "token", InvalidLeaseError)
        now = self._state.clock.now_ms()
        if row is None or row.owner_id != owner_id or row.token != token:
            return False
        if row.expires_at_ms <= now:
            return False
        self._state.leases[(namespace, key)] = attrs.evolve(
            row, expires_at_ms=now, updated_at_ms=now
        )
        return True

    async def get_lease(
        self, *, namespace: str, key: str, scope: OwnershipScope
    ) -> LeaseRecord | None:
        """The unexpired lease, or ``None``; a foreign scope raises LeaseConflictError."""
        await trio.lowlevel.checkpoint()
        row = self._row(namespace, key, scope)
        if row is None or row.expires_at_ms <= self._state.clock.now_ms():
            return None
        return row


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
        put = _common.check_inbox_put(
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
        owner, ttl, n, most, wanted = _common.check_inbox_claim_args(
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
            token = _common.new_claim_token()
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
        wanted = _common.check_inbox_sources(sources)
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
        _common.check_inbox_claim(claim)
        ttl = _common.check_inbox_ms(ttl_ms, "ttl_ms", minimum=1)
        row = self._current(claim)
        if row is None or row.item.state not in ("claimed", "done"):
            return None
        now = self._state.clock.now_ms()
        item = attrs.evolve(row.item, claim_expires_at_ms=now + ttl, updated_at_ms=now)
        self._store(attrs.evolve(row, item=item))
        return attrs.evolve(claim, item=item, expires_at_ms=now + ttl)

    async def complete(self, claim: InboxClaim, *, hold_ms: int = 0) -> bool:
        await self._state.step()
        _common.check_inbox_claim(claim)
        hold = _common.check_inbox_ms(hold_ms, "hold_ms", minimum=0)
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
        _common.check_inbox_claim(claim)
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
        _common.check_inbox_claim(claim)
        delay = _common.check_inbox_ms(delay_ms, "delay_ms", minimum=0)
        code = _common.bound_inbox_error(error)
        most = _common.check_inbox_ms(max_attempts, "max_attempts", minimum=1)
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
        wanted = _common.check_inbox_state(state)
        position = _common.decode_inbox_cursor(cursor)
        n = _common.check_inbox_claim_args("-", 1, limit, 1, None)[2]
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
        return InboxPage(items, _common.encode_inbox_cursor(items[-1]) if more else None)

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
        before = _common.check_inbox_ms(before_ms, "before_ms", minimum=0)
        n = _common.check_inbox_claim_args("-", 1, limit, 1, None)[2]
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
        wanted = _common.check_inbox_sources(sources)
        counts = {"pending": 0, "claimed": 0, "dead": 0}
        for row in self._state.inbox.values():
            if (wanted is None or row.item.source in wanted) and row.item.state in counts:
                counts[row.item.state] += 1
        return InboxDepth(**counts)


@attrs.define(eq=False)
class MemoryStore:
    """A process-local :class:`~stores.Store`: ``.checkpoints``, ``.leases``, ``aclose()``.

    Usable as ``async with MemoryStore() as store:``. After ``aclose()`` every call raises
    :class:`~stores.StoreUnavailableError`. ``max_value_bytes`` bounds the JSON encoding of
    a value (default 1 MiB).
    """

    clock: Clock = SYSTEM_CLOCK
    max_value_bytes: int = attrs.field(
        default=DEFAULT_MAX_VALUE_BYTES,
        validator=lambda _i, _a, v: _common.check_max_value_bytes(v),
    )
    _state: _State = attrs.field(init=False)
    _checkpoints: MemoryCheckpointStore = attrs.field(init=False)
    _leases: MemoryLeaseStore = attrs.field(init=False)
    _inbox: MemoryInboxStore = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._state = _State(clock=self.clock, max_value_bytes=self.max_value_bytes)
        self._checkpoints = MemoryCheckpointStore(self._state)
        self._leases = MemoryLeaseStore(self._state)
        self._inbox = MemoryInboxStore(self._state)

    @property
    def url(self) -> str:
        return "memory://"

    @property
    def checkpoints(self) -> MemoryCheckpointStore:
        return self._checkpoints

    @property
    def leases(self) -> MemoryLeaseStore:
        return self._leases

    @property
    def inbox(self) -> MemoryInboxStore:
        return self._inbox

    async def aclose(self) -> None:
        """Close the store; idempotent."""
        self._state.closed = True
        await trio.lowlevel.checkpoint()

    async def __aenter__(self) -> MemoryStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
