"""Checkpoints on ``prism_checkpoints``, each save or delete with its ``prism_events`` row."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import apsw
import attrs

from .. import _bases, _types
from .._bases import CheckpointQuery, CheckpointStoreBase
from .._sql import event_from_row, events_query
from .._types import (
    CheckpointRecord,
    Condition,
    DeleteCheckpoint,
    EventAction,
    JournalEvent,
    OwnershipScope,
    SaveCheckpoint,
    WriteResult,
)
from ._engine import _SCOPE_IS, _Database, _one, _RolledBack, _scalar

_CHECKPOINT_COLUMNS = (
    "namespace, key, version, fencing_token, category, tenant_id, account_id, user_id,"
    " value, metadata, created_at, updated_at"
)
_EVENT_COLUMNS = (
    "seq, at, action, namespace, key, tenant_id, account_id, user_id, version, category, metadata"
)


_EVENT = (
    "INSERT INTO prism_events (at, action, namespace, key, tenant_id, account_id,"
    " user_id, version, category, metadata) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def _insert_event(
    conn: apsw.Connection,
    at_ms: int,
    action: EventAction,
    namespace: str,
    key: str,
    scope: OwnershipScope,
    version: int | None,
    category: str | None,
    metadata_json: str | None,
) -> None:
    """Journal a save or delete inside the transaction that made it."""
    conn.execute(
        _EVENT,
        (
            at_ms,
            action,
            namespace,
            key,
            *_types.scope_args(scope),
            version,
            category,
            metadata_json,
        ),
    )


_INSERT = (
    f"INSERT INTO prism_checkpoints AS c ({_CHECKPOINT_COLUMNS})"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def _overwrite(new: Callable[[str], str], expected: str) -> tuple[str, str]:
    """The ``SET`` and the ``WHERE`` of a write over the stored row ``c``: ``new(column)``
    is the SQL of the value written to ``column``, ``expected`` that of the expected
    version (``NULL``: any). The ``WHERE`` holds the checks of contract §1.2 steps 2-5, the
    same for the upsert and for the ``UPDATE`` of a positive expected version."""
    fence = new("fencing_token")
    assignments = ", ".join(
        f"{column} = {new(column)}"
        for column in ("version", "fencing_token", "category", "value", "metadata")
    )
    checks = (
        f"c.tenant_id IS {new('tenant_id')} AND c.account_id IS {new('account_id')}"
        f" AND c.user_id IS {new('user_id')}"
        f" AND ({expected} IS NULL OR c.version = {expected})"
        f" AND {new('version')} > c.version"
        f" AND (c.fencing_token IS NULL OR ({fence} IS NOT NULL AND {fence} >= c.fencing_token))"
    )
    return f"{assignments}, updated_at = max({new('updated_at')}, c.updated_at)", checks


# What a successful write hands back: everything else it wrote is the request's own.
_WRITTEN = "created_at, updated_at"
_CREATE_ONLY = f"{_INSERT} ON CONFLICT (namespace, key) DO NOTHING RETURNING {_WRITTEN}"
_UPSERT_SET, _UPSERT_WHERE = _overwrite(lambda column: f"excluded.{column}", "?")
_UPSERT_ANY = (
    f"{_INSERT} ON CONFLICT (namespace, key) DO UPDATE SET {_UPSERT_SET}"
    f" WHERE {_UPSERT_WHERE} RETURNING {_WRITTEN}"
)
# A positive expected version needs an existing row: a plain UPDATE of it (one index seek;
# an upsert would look the row up twice and draw a new rowid before it met the conflict),
# bound like the insert (each column's value at its place in the column list) and then the
# expected version.
_PARAMETER = {
    column.strip(): f"?{n}" for n, column in enumerate(_CHECKPOINT_COLUMNS.split(","), start=1)
}
_UPDATE_SET, _UPDATE_WHERE = _overwrite(_PARAMETER.__getitem__, f"?{len(_PARAMETER) + 1}")
_UPDATE_AT = (
    f"UPDATE prism_checkpoints AS c SET {_UPDATE_SET}"
    f" WHERE namespace = {_PARAMETER['namespace']} AND key = {_PARAMETER['key']}"
    f" AND {_UPDATE_WHERE} RETURNING {_WRITTEN}"
)
_DELETE = (
    f"DELETE FROM prism_checkpoints WHERE namespace = ? AND key = ? AND {_SCOPE_IS}"
    " RETURNING version, category"
)


def _apply_save(conn: apsw.Connection, save: SaveCheckpoint, now: int) -> WriteResult:
    """One save: one statement whose ``WHERE`` holds every check, then its event; answered
    with the stored row's times, or ``conflict`` when a check failed (nothing written)."""
    scope = save.scope
    tenant, account, user = scope.tenant_id, scope.account_id, scope.user_id
    values = (
        save.namespace,
        save.key,
        save.version,
        save.fencing_token,
        save.category,
        tenant,
        account,
        user,
        save.value_json,
        save.metadata_json,
        now,
        now,
    )
    expected = save.expected_version
    if expected == 0:
        rows = conn.execute(_CREATE_ONLY, values).fetchall()
    elif expected is None:
        rows = conn.execute(_UPSERT_ANY, (*values, None, None)).fetchall()
    else:
        rows = conn.execute(_UPDATE_AT, (*values, expected)).fetchall()
    if not rows:
        return _CONFLICT
    _insert_event(
        conn,
        now,
        "save",
        save.namespace,
        save.key,
        scope,
        save.version,
        save.category,
        save.metadata_json,
    )
    created, updated = rows[0]
    return WriteResult("ok", save, created, updated)  # type: ignore[arg-type]


def _apply(
    conn: apsw.Connection, write: SaveCheckpoint | DeleteCheckpoint, now: int
) -> WriteResult:
    """One write of a ``write_checkpoints`` batch."""
    if isinstance(write, SaveCheckpoint):
        return _apply_save(conn, write, now)
    gone = _one(conn, _DELETE, (write.namespace, write.key, *_types.scope_args(write.scope)))
    if gone is None:
        return _MISSING
    version, category = gone
    _insert_event(
        conn, now, "delete", write.namespace, write.key, write.scope, version, category, None
    )
    return _OK


_OK = WriteResult("ok")
_CONFLICT = WriteResult("conflict")
_MISSING = WriteResult("missing")
_ABORTED = WriteResult("aborted")


def _starts_with(prefix: str) -> Condition:
    return "substr(key, 1, ?) = ?", (len(prefix), prefix)


def _one_of(categories: tuple[str, ...]) -> Condition:
    return f"category IN ({', '.join('?' for _ in categories)})", categories


@attrs.define(eq=False)
class SQLiteCheckpointStore(CheckpointStoreBase):
    """:class:`~stores.CheckpointStore` on ``prism_checkpoints`` + ``prism_events``."""

    _db: _Database
    _max_value_bytes: int

    async def write_checkpoints(
        self,
        writes: Sequence[SaveCheckpoint | DeleteCheckpoint],
        *,
        atomic: bool = False,
        linger_s: float = 0.0,
    ) -> tuple[WriteResult, ...]:
        """The batch in one job of the next group-committed transaction (see
        :meth:`~stores.CheckpointStore.write_checkpoints`); an ``atomic`` batch with a lost
        check is rolled back and answered ``aborted`` for each write that did apply."""
        checked = _bases.check_writes(writes, atomic, self._max_value_bytes)
        now = self._db.clock.now_ms()
        # Each write is one statement whose WHERE holds its checks, plus its event: only an
        # atomic batch of several needs a savepoint, to undo the ones already applied.
        undo = atomic and len(checked) > 1

        def txn(conn: apsw.Connection) -> tuple[WriteResult, ...]:
            results = tuple(_apply(conn, write, now) for write in checked)
            if undo and not all(r.status == "ok" for r in results):
                raise _RolledBack(tuple(r if r.status != "ok" else _ABORTED for r in results))
            return results

        return await self._db.write(txn, savepoint=undo, weight=len(checked), linger_s=linger_s)

    async def _load(
        self, namespace: str, key: str, scope: OwnershipScope
    ) -> CheckpointRecord | None:
        def read(conn: apsw.Connection) -> CheckpointRecord | None:
            row = _one(
                conn,
                f"SELECT {_CHECKPOINT_COLUMNS} FROM prism_checkpoints"
                f" WHERE namespace = ? AND key = ? AND {_SCOPE_IS}",
                (namespace, key, *_types.scope_args(scope)),
            )
            return None if row is None else _types.checkpoint_from_row(row)

        return await self._db.run(read)

    async def _list(self, query: CheckpointQuery) -> Sequence[CheckpointRecord]:
        sql, args = _bases.listing_query(
            "prism_checkpoints",
            _CHECKPOINT_COLUMNS,
            query,
            starts_with=_starts_with,
            one_of=_one_of,
        )

        def read(conn: apsw.Connection) -> list[CheckpointRecord]:
            return [_types.checkpoint_from_row(row) for row in conn.execute(sql, args).fetchall()]

        return await self._db.run(read)

    async def _count(self, query: CheckpointQuery) -> int:
        sql, args = _bases.listing_query(
            "prism_checkpoints", "1", query, starts_with=_starts_with, one_of=_one_of
        )

        def read(conn: apsw.Connection) -> int:
            return int(_one(conn, f"SELECT count(*) FROM ({sql})", args)[0])

        return await self._db.run(read)

    async def _events(
        self, after: int, limit: int, scope: OwnershipScope
    ) -> Sequence[JournalEvent]:
        sql, args = events_query("prism_events", _EVENT_COLUMNS, after, limit, scope)

        def read(conn: apsw.Connection) -> list[JournalEvent]:
            rows: list[Any] = conn.execute(sql, args).fetchall()
            return [event_from_row(row) for row in rows]

        return await self._db.run(read)

    async def last_event_seq(self) -> int:
        """The highest committed event sequence number (0: none yet)."""

        def read(conn: apsw.Connection) -> int:
            return int(_scalar(conn, "SELECT coalesce(max(seq), 0) FROM prism_events"))

        return await self._db.run(read)
