"""What one :class:`MemoryStore` holds (rows kept as JSON text: the copy boundary), shared by
its three facets.
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from .. import _common
from .._types import (
    CheckpointRecord,
    Clock,
    EncodedSave,
    EventAction,
    InboxItem,
    JournalEvent,
    JSONValue,
    LeaseRecord,
    OwnershipScope,
    StoreUnavailableError,
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
