"""What one :class:`MemoryStore` holds (rows kept as JSON text: the copy boundary), shared by
its three facets.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs
import trio

from .. import _types
from .._types import (
    CheckpointRecord,
    Clock,
    EventAction,
    InboxItem,
    JournalEvent,
    LeaseRecord,
    SaveCheckpoint,
    StoreUnavailableError,
    stored_record,
)


class _Row(NamedTuple):
    """A stored checkpoint: the checked save that wrote it (its value and metadata kept as
    JSON text: the copy boundary) and the row's times."""

    save: SaveCheckpoint
    created_at_ms: int
    updated_at_ms: int

    @property
    def namespace(self) -> str:
        return self.save.namespace

    @property
    def key(self) -> str:
        return self.save.key

    def record(self) -> CheckpointRecord:
        return stored_record(*self)


def _saved(req: SaveCheckpoint, current: _Row | None, now: int) -> _Row | None:
    """The row ``req`` writes over ``current``, or ``None`` when its checks fail (§1.2)."""
    if current is None:
        if req.expected_version not in (None, 0):
            return None
        return _Row(req, now, now)
    stored = current.save
    if (
        stored.scope != req.scope
        or (req.expected_version is not None and req.expected_version != stored.version)
        or req.version <= stored.version
        or (
            stored.fencing_token is not None
            and (req.fencing_token is None or req.fencing_token < stored.fencing_token)
        )
    ):
        return None
    # Never let updated_at go backwards (a clock step): listing order and keyset cursors
    # rely on a rewritten row moving to the front.
    return _Row(req, current.created_at_ms, max(now, current.updated_at_ms))


@attrs.frozen
class _InboxRow:
    """A stored inbox item: the payload kept as JSON text, and the current claim's token."""

    item: InboxItem
    payload_json: str | None
    token: str | None = None

    def public(self, *, with_payload: bool) -> InboxItem:
        if not with_payload or self.payload_json is None:
            return self.item
        return attrs.evolve(self.item, payload=_types.decode_json(self.payload_json))


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
        self, action: EventAction, row: SaveCheckpoint, at_ms: int, metadata_json: str | None
    ) -> None:
        """The event of a save, or of the delete of the row ``row`` saved."""
        event = JournalEvent(
            self.next_seq,
            at_ms,
            action,
            row.namespace,
            row.key,
            row.scope,
            row.version,
            row.category,
        )
        self.next_seq += 1
        self.events.append((event, metadata_json))
