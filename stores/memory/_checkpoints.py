""":class:`~stores.CheckpointStore` over a dict."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import trio

from .. import _bases, _types
from .._bases import CheckpointQuery, CheckpointStoreBase
from .._types import (
    CheckpointRecord,
    DeleteCheckpoint,
    EventAction,
    JournalEvent,
    OwnershipScope,
    SaveCheckpoint,
    WriteResult,
)
from ._state import _Row, _saved, _State


def _sort_key(row: _Row) -> tuple[int, str, str]:
    """Python twin of the SQL backends' ``ORDER BY``: ascending order of this tuple is
    listing order (see :func:`stores._bases.encode_cursor`)."""
    return (-row.updated_at_ms, row.key, row.namespace)


@attrs.define(eq=False)
class MemoryCheckpointStore(CheckpointStoreBase):
    """:class:`~stores.CheckpointStore` over a dict; see the module docstring."""

    _state: _State

    async def write_checkpoints(
        self,
        writes: Sequence[SaveCheckpoint | DeleteCheckpoint],
        *,
        atomic: bool = False,
        linger_s: float = 0.0,
    ) -> tuple[WriteResult, ...]:
        """Apply the batch against an overlay of the rows it touches, then publish the
        overlay and its events at once (see :meth:`~stores.CheckpointStore.write_checkpoints`);
        an ``atomic`` batch with a lost check publishes nothing. Nothing is group-committed
        here: ``linger_s`` is ignored."""
        await trio.lowlevel.checkpoint()
        state = self._state
        state.check_open()
        checked = _bases.check_writes(writes, atomic, state.max_value_bytes)
        now = state.clock.now_ms()
        overlay: dict[tuple[str, str], _Row | None] = {}
        events: list[tuple[EventAction, SaveCheckpoint, str | None]] = []
        results: list[WriteResult] = []
        for write in checked:
            address = (write.namespace, write.key)
            current = overlay[address] if address in overlay else state.checkpoints.get(address)
            if isinstance(write, DeleteCheckpoint):
                if current is None or current.save.scope != write.scope:
                    results.append(_MISSING)
                    continue
                overlay[address] = None
                events.append(("delete", current.save, None))
                results.append(_OK)
                continue
            row = _saved(write, current, now)
            if row is None:
                results.append(_CONFLICT)
                continue
            overlay[address] = row
            events.append(("save", write, write.metadata_json))
            results.append(WriteResult("ok", *row))
        if atomic and not all(r.ok for r in results):
            return tuple(r if not r.ok else _ABORTED for r in results)
        for address, stored in overlay.items():
            if stored is None:
                del state.checkpoints[address]
            else:
                state.checkpoints[address] = stored
        for action, saved, metadata_json in events:
            state.append_event(action, saved, now, metadata_json)
        return tuple(results)

    async def _enter(self) -> None:
        await self._state.step()

    async def _load(
        self, namespace: str, key: str, scope: OwnershipScope
    ) -> CheckpointRecord | None:
        row = self._state.checkpoints.get((namespace, key))
        if row is None or row.save.scope != scope:
            return None
        return row.record()

    async def _list(self, query: CheckpointQuery) -> Sequence[CheckpointRecord]:
        # Sort and page the stored rows; only the rows of this page are decoded.
        matching = sorted(
            (
                row
                for row in self._state.checkpoints.values()
                if (query.namespace is None or row.namespace == query.namespace)
                and (query.key_prefix is None or row.key.startswith(query.key_prefix))
                and (query.categories is None or row.save.category in query.categories)
                and query.scope.matches_filter(row.save.scope)
            ),
            key=_sort_key,
        )
        if query.after is not None:
            updated_at_ms, key, namespace = query.after
            position = (-updated_at_ms, key, namespace)
            matching = [r for r in matching if _sort_key(r) > position]
        return [row.record() for row in matching[: query.limit]]

    async def _count(self, query: CheckpointQuery) -> int:
        counted = 0
        for row in self._state.checkpoints.values():
            if (
                (query.namespace is None or row.namespace == query.namespace)
                and (query.categories is None or row.save.category in query.categories)
                and query.scope.matches_filter(row.save.scope)
            ):
                counted += 1
                if counted >= query.limit:
                    break
        return counted

    async def _events(
        self, after: int, limit: int, scope: OwnershipScope
    ) -> Sequence[JournalEvent]:
        items: list[JournalEvent] = []
        for event, metadata_json in self._state.events:
            if event.seq <= after or not scope.matches_filter(event.scope):
                continue
            metadata = None if metadata_json is None else _types.decode_json(metadata_json)
            items.append(attrs.evolve(event, metadata=metadata))
            if len(items) >= limit:
                break
        return items

    async def last_event_seq(self) -> int:
        """The highest event sequence number (0: none yet)."""
        await self._state.step()
        return self._state.next_seq - 1


_OK = WriteResult("ok")
_CONFLICT = WriteResult("conflict")
_MISSING = WriteResult("missing")
_ABORTED = WriteResult("aborted")
