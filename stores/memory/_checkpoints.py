""":class:`~stores.CheckpointStore` over a dict."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import trio

from .. import _common
from .._checkpointing import CheckpointQuery, CheckpointStoreBase
from .._types import (
    CheckpointRecord,
    CheckpointWrite,
    EncodedSave,
    EventAction,
    JournalEvent,
    OwnershipScope,
    WriteResult,
    WriteStatus,
)
from ._state import _Request, _Row, _saved, _State


@attrs.define(eq=False)
class MemoryCheckpointStore(CheckpointStoreBase):
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

    async def _enter(self) -> None:
        await self._state.step()

    async def _load(
        self, namespace: str, key: str, scope: OwnershipScope
    ) -> CheckpointRecord | None:
        row = self._state.checkpoints.get((namespace, key))
        if row is None or row.scope != scope:
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
                and (query.categories is None or row.category in query.categories)
                and query.scope.matches_filter(row.scope)
            ),
            key=_common.sort_key,
        )
        if query.after is not None:
            after = query.after
            matching = [r for r in matching if _common.after_cursor(r, after)]
        return [row.record() for row in matching[: query.limit]]

    async def _events(
        self, after: int, limit: int, scope: OwnershipScope
    ) -> Sequence[JournalEvent]:
        items: list[JournalEvent] = []
        for event, metadata_json in self._state.events:
            if event.seq <= after or not scope.matches_filter(event.scope):
                continue
            metadata = None if metadata_json is None else _common.decode_json(metadata_json)
            items.append(attrs.evolve(event, metadata=metadata))
            if len(items) >= limit:
                break
        return items

    async def last_event_seq(self) -> int:
        """The highest event sequence number (0: none yet)."""
        await self._state.step()
        return self._state.next_seq - 1
