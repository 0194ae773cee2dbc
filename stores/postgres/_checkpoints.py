"""Checkpoints and their events on PostgreSQL, written through the group-commit writer."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import trio

from .. import _bases, _types
from .._bases import CheckpointQuery, CheckpointStoreBase
from .._sql import event_from_row, events_query, numbered
from .._types import (
    CheckpointRecord,
    Clock,
    Condition,
    DeleteCheckpoint,
    JournalEvent,
    OwnershipScope,
    SaveCheckpoint,
    StoreUnavailableError,
    WriteResult,
)
from ._driver import Driver, Session
from ._writer import _Job, _Writer

_CHECKPOINT_COLUMNS = (
    "namespace, key, version, fencing_token, category, tenant_id, account_id, user_id,"
    " value::text, metadata::text, created_at, updated_at"
)
_EVENT_COLUMNS = (
    "seq, at, action, namespace, key, tenant_id, account_id, user_id, version, category,"
    " metadata::text"
)


def _starts_with(prefix: str) -> Condition:
    # Beside the key range: the planner derives the range from starts_with only for a
    # constant, and a prepared statement's generic plan read the whole table (10,000 rows:
    # 1.9 ms, 0.03 ms with the range).
    return "starts_with(key, ?)", (prefix,)


def _one_of(categories: tuple[str, ...]) -> Condition:
    return "category = ANY(?::text[])", (list(categories),)


@attrs.define(eq=False)
class PostgresCheckpointStore(CheckpointStoreBase):
    """:class:`~stores.CheckpointStore` on ``prism_checkpoints`` + ``prism_events``."""

    _driver: Driver
    _writer: _Writer
    _clock: Clock
    _max_value_bytes: int
    _t: str
    """The quoted schema name (``quote_ident``, once for the store)."""

    async def write_checkpoints(
        self,
        writes: Sequence[SaveCheckpoint | DeleteCheckpoint],
        *,
        atomic: bool = False,
        linger_s: float = 0.0,
    ) -> tuple[WriteResult, ...]:
        """The batch as one job of a group-committed transaction (see
        :meth:`~stores.CheckpointStore.write_checkpoints`). ``linger_s`` is not used: the
        writer's transactions are shared by the writes queued while one is in flight."""
        checked = _bases.check_writes(writes, atomic, self._max_value_bytes)
        if not checked:
            if self._writer.closed:
                raise StoreUnavailableError(
                    f"PostgreSQL store {self._driver.where}: store is closed"
                )
            await trio.lowlevel.checkpoint()
            return ()
        return await self._writer.submit(_Job(checked, atomic, self._clock.now_ms()))

    async def _load(
        self, namespace: str, key: str, scope: OwnershipScope
    ) -> CheckpointRecord | None:
        sql = (
            f"SELECT {_CHECKPOINT_COLUMNS} FROM {self._t}.prism_checkpoints"
            " WHERE namespace = $1 AND key = $2 AND tenant_id IS NOT DISTINCT FROM $3"
            " AND account_id IS NOT DISTINCT FROM $4 AND user_id IS NOT DISTINCT FROM $5"
        )

        async def read(session: Session) -> Sequence[Any] | None:
            return await session.fetchrow(sql, namespace, key, *_types.scope_args(scope))

        row = await self._driver.call(read)
        return None if row is None else _types.checkpoint_from_row(row)

    async def _fetch(self, sql: str, args: Sequence[Any]) -> Sequence[Sequence[Any]]:
        async def read(session: Session) -> Sequence[Sequence[Any]]:
            return await session.fetch(sql, *args)

        return await self._driver.call(read)

    async def _list(self, query: CheckpointQuery) -> Sequence[CheckpointRecord]:
        sql, args = _bases.listing_query(
            f"{self._t}.prism_checkpoints",
            _CHECKPOINT_COLUMNS,
            query,
            starts_with=_starts_with,
            one_of=_one_of,
        )
        return [_types.checkpoint_from_row(row) for row in await self._fetch(numbered(sql), args)]

    async def _count(self, query: CheckpointQuery) -> int:
        sql, args = _bases.listing_query(
            f"{self._t}.prism_checkpoints", "1", query, starts_with=_starts_with, one_of=_one_of
        )
        (row,) = await self._fetch(numbered(f"SELECT count(*) FROM ({sql}) AS counted"), args)
        return int(row[0])

    async def _events(
        self, after: int, limit: int, scope: OwnershipScope
    ) -> Sequence[JournalEvent]:
        """In ``seq`` order, which is commit order (see the module docstring)."""
        sql, args = events_query(f"{self._t}.prism_events", _EVENT_COLUMNS, after, limit, scope)
        return [event_from_row(row) for row in await self._fetch(numbered(sql), args)]

    async def last_event_seq(self) -> int:
        """The counter row as committed: commits are visible in ``seq`` order, so it is the
        highest committed event sequence number (0: none yet)."""
        sql = f"SELECT last_seq FROM {self._t}.prism_event_seq WHERE id = 1"

        async def read(session: Session) -> Sequence[Any] | None:
            return await session.fetchrow(sql)

        row = await self._driver.call(read)
        return 0 if row is None else int(row[0])
