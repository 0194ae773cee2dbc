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
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import attrs
import trio

from . import _common
from ._types import (
    ANY_SCOPE,
    DEFAULT_MAX_VALUE_BYTES,
    LIST_LIMIT_DEFAULT,
    SYSTEM_CLOCK,
    CheckpointConflictError,
    CheckpointPage,
    CheckpointRecord,
    CheckpointWrite,
    Clock,
    DeleteCheckpoint,
    EventAction,
    EventPage,
    InvalidLeaseError,
    JournalEvent,
    JSONValue,
    LeaseConflictError,
    LeaseRecord,
    OwnershipScope,
    SaveCheckpoint,
    StoreUnavailableError,
    WriteResult,
)

_CONFLICT = "checkpoint version conflict"


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


def _saved(req: _common.SaveRequest, current: _Row | None, now: int) -> _Row | None:
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


@attrs.define(eq=False)
class _State:
    """Everything one :class:`MemoryStore` holds; shared by its two facets."""

    clock: Clock
    max_value_bytes: int
    checkpoints: dict[tuple[str, str], _Row] = attrs.Factory(dict)
    leases: dict[tuple[str, str], LeaseRecord] = attrs.Factory(dict)
    events: list[tuple[JournalEvent, str | None]] = attrs.Factory(list)
    next_seq: int = 1
    closed: bool = False

    def check_open(self) -> None:
        if self.closed:
            raise StoreUnavailableError("store is closed")

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
class MemoryCheckpointStore:
    """:class:`~stores.CheckpointStore` over a dict; see the module docstring."""

    _state: _State

    async def save_checkpoint(
        self,
        *,
        namespace: str,
        key: str,
        scope: OwnershipScope,
        version: int,
        value: JSONValue,
        expected_version: int | None = None,
        fencing_token: int | None = None,
        category: str | None = None,
        metadata: Mapping[str, JSONValue] | None = None,
    ) -> CheckpointRecord:
        """Store ``value`` under the CAS and fencing rules; nothing is written when it raises.

        Raises :class:`~stores.CheckpointConflictError` (its subclasses for bad input or an
        oversize value) and :class:`~stores.StoreUnavailableError` once closed.
        """
        write = SaveCheckpoint(
            namespace=namespace,
            key=key,
            scope=scope,
            version=version,
            value=value,
            expected_version=expected_version,
            fencing_token=fencing_token,
            category=category,
            metadata=metadata,
        )
        (result,) = await self.write_checkpoints((write,))
        if result.record is None:
            raise CheckpointConflictError(_CONFLICT)
        return result.record

    async def write_checkpoints(
        self, writes: Sequence[CheckpointWrite], *, atomic: bool = False
    ) -> tuple[WriteResult, ...]:
        """Apply the batch against an overlay of the rows it touches, then publish the
        overlay and its events at once (see :meth:`~stores.CheckpointStore.write_checkpoints`)."""
        await trio.lowlevel.checkpoint()
        state = self._state
        state.check_open()
        requests = _common.check_writes(writes, atomic, state.max_value_bytes)
        now = state.clock.now_ms()
        overlay: dict[tuple[str, str], _Row | None] = {}
        events: list[tuple[EventAction, _Row, str | None]] = []
        results: list[WriteResult] = []
        for req in requests:
            address = (req.namespace, req.key)
            current = overlay[address] if address in overlay else state.checkpoints.get(address)
            if isinstance(req, _common.DeleteRequest):
                if current is None or current.scope != req.scope:
                    results.append(WriteResult("missing"))
                    continue
                overlay[address] = None
                events.append(("delete", current, None))
                results.append(WriteResult("ok"))
                continue
            row = _saved(req, current, now)
            if row is None:
                results.append(WriteResult("conflict"))
                continue
            overlay[address] = row
            events.append(("save", row, req.metadata_json))
            results.append(
                WriteResult("ok", row.record(req.value) if req.encoded_by_caller else row.record())
            )
        if atomic and not all(r.ok for r in results):
            return tuple(r if not r.ok else WriteResult("aborted") for r in results)
        for address, row in overlay.items():
            if row is None:
                del state.checkpoints[address]
            else:
                state.checkpoints[address] = row
        for action, row, metadata_json in events:
            state.append_event(action, row, now, metadata_json)
        return tuple(results)

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

    def __attrs_post_init__(self) -> None:
        self._state = _State(clock=self.clock, max_value_bytes=self.max_value_bytes)
        self._checkpoints = MemoryCheckpointStore(self._state)
        self._leases = MemoryLeaseStore(self._state)

    @property
    def url(self) -> str:
        return "memory://"

    @property
    def checkpoints(self) -> MemoryCheckpointStore:
        return self._checkpoints

    @property
    def leases(self) -> MemoryLeaseStore:
        return self._leases

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
