"""Checkpoints on ``prism_checkpoints``, each save or delete with its ``prism_events`` row."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import apsw
import attrs

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
)
from ._engine import _Database, _RolledBack
from ._schema import _SCOPE_IS, _add_scope_filter, _one, _scalar

W = TypeVar("W")
A = TypeVar("A")


_CHECKPOINT_COLUMNS = (
    "namespace, key, version, fencing_token, category, tenant_id, account_id, user_id,"
    " value, metadata, created_at, updated_at"
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
            *_common.scope_args(scope),
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


def _apply_save(
    conn: apsw.Connection, req: _common.SaveRequest | EncodedSave, now: int
) -> tuple[int, int] | None:
    """One save: one statement whose ``WHERE`` holds every check, then its event. The
    stored row's ``(created_at, updated_at)``, or ``None`` when a check failed (nothing
    written). Every save of either write method takes this path."""
    scope = req.scope
    tenant, account, user = scope.tenant_id, scope.account_id, scope.user_id
    values = (
        req.namespace,
        req.key,
        req.version,
        req.fencing_token,
        req.category,
        tenant,
        account,
        user,
        req.value_json,
        req.metadata_json,
        now,
        now,
    )
    expected = req.expected_version
    if expected == 0:
        rows = conn.execute(_CREATE_ONLY, values).fetchall()
    elif expected is None:
        rows = conn.execute(_UPSERT_ANY, (*values, None, None)).fetchall()
    else:
        rows = conn.execute(_UPDATE_AT, (*values, expected)).fetchall()
    if not rows:
        return None
    _insert_event(
        conn, now, "save", req.namespace, req.key, scope, req.version, req.category,
        req.metadata_json,
    )  # fmt: skip
    created, updated = rows[0]
    return created, updated  # type: ignore[return-value]


def _apply(
    conn: apsw.Connection, req: _common.SaveRequest | _common.DeleteRequest, now: int
) -> WriteResult:
    """One write of a ``write_checkpoints`` batch, answered with the stored record."""
    if isinstance(req, _common.DeleteRequest):
        gone = _one(conn, _DELETE, (req.namespace, req.key, *_common.scope_args(req.scope)))
        if gone is None:
            return WriteResult("missing")
        version, category = gone
        _insert_event(
            conn, now, "delete", req.namespace, req.key, req.scope, version, category, None
        )
        return WriteResult("ok")
    stored = _apply_save(conn, req, now)
    if stored is None:
        return WriteResult("conflict")
    return WriteResult("ok", req.stored(*stored))


def _saved_at(conn: apsw.Connection, save: EncodedSave, now: int) -> int | None:
    """``save_encoded``'s answer for one save: the row's ``updated_at``, or ``None``."""
    stored = _apply_save(conn, save, now)
    return None if stored is None else stored[1]


def _result_lost(result: WriteResult) -> bool:
    return not result.ok


def _result_aborted(result: WriteResult) -> WriteResult:
    return result if not result.ok else _ABORTED


_ABORTED = WriteResult("aborted")


def _time_lost(updated_at: int | None) -> bool:
    return updated_at is None


def _time_aborted(updated_at: int | None) -> int | None:
    return None if updated_at is None else 0


@attrs.define(eq=False)
class SQLiteCheckpointStore(CheckpointStoreBase):
    """:class:`~stores.CheckpointStore` on ``prism_checkpoints`` + ``prism_events``."""

    _db: _Database
    _max_value_bytes: int

    async def write_checkpoints(
        self, writes: Sequence[CheckpointWrite], *, atomic: bool = False
    ) -> tuple[WriteResult, ...]:
        """The batch in one savepoint of a group-committed transaction (see
        :meth:`~stores.CheckpointStore.write_checkpoints`); an ``atomic`` batch with a lost
        check rolls its savepoint back."""
        requests = _common.check_writes(writes, atomic, self._max_value_bytes)
        return await self._batch(requests, atomic, _apply, _result_lost, _result_aborted)

    async def save_encoded(
        self, saves: Sequence[EncodedSave], *, atomic: bool = False
    ) -> tuple[int | None, ...]:
        """The saves in one savepoint of a group-committed transaction, as
        :meth:`write_checkpoints` (see :meth:`~stores.CheckpointStore.save_encoded`)."""
        checked = _common.check_encoded(saves, atomic, self._max_value_bytes)
        return await self._batch(checked, atomic, _saved_at, _time_lost, _time_aborted)

    async def _batch(
        self,
        writes: Sequence[W],
        atomic: bool,
        apply: Callable[[apsw.Connection, W, int], A],
        lost: Callable[[A], bool],
        aborted: Callable[[A], A],
    ) -> tuple[A, ...]:
        """``apply`` each write in one job of the next group-committed transaction; an
        ``atomic`` batch in which one was ``lost`` is rolled back and answered
        ``aborted`` for each (what a lost one answers stays)."""
        now = self._db.clock.now_ms()
        # Each write is one statement whose WHERE holds its checks, plus its event: only an
        # atomic batch of several needs a savepoint, to undo the ones already applied.
        undo = atomic and len(writes) > 1

        def txn(conn: apsw.Connection) -> tuple[A, ...]:
            results = tuple(apply(conn, write, now) for write in writes)
            if undo and any(lost(r) for r in results):
                raise _RolledBack(tuple(aborted(r) for r in results))
            return results

        return await self._db.write(txn, savepoint=undo, weight=len(writes))

    async def _load(
        self, namespace: str, key: str, scope: OwnershipScope
    ) -> CheckpointRecord | None:
        def read(conn: apsw.Connection) -> CheckpointRecord | None:
            row = _one(
                conn,
                f"SELECT {_CHECKPOINT_COLUMNS} FROM prism_checkpoints"
                f" WHERE namespace = ? AND key = ? AND {_SCOPE_IS}",
                (namespace, key, *_common.scope_args(scope)),
            )
            return None if row is None else _common.checkpoint_from_row(row)

        return await self._db.run(read)

    async def _list(self, query: CheckpointQuery) -> Sequence[CheckpointRecord]:
        where: list[str] = []
        args: list[Any] = []
        if query.namespace is not None:
            where.append("namespace = ?")
            args.append(query.namespace)
        if query.key_prefix:
            low, high = _common.prefix_bounds(query.key_prefix)
            where.append("key >= ?")
            args.append(low)
            if high is not None:
                where.append("key < ?")
                args.append(high)
            where.append("substr(key, 1, ?) = ?")
            args += [len(query.key_prefix), query.key_prefix]
        if query.categories is not None:
            where.append(f"category IN ({', '.join('?' for _ in query.categories)})")
            args += query.categories
        _add_scope_filter(query.scope, where, args)
        if query.after is not None:
            at, last_key, last_ns = query.after
            where.append(
                "(updated_at < ? OR (updated_at = ? AND (key > ? OR (key = ? AND namespace > ?))))"
            )
            args += [at, at, last_key, last_key, last_ns]
        sql = f"SELECT {_CHECKPOINT_COLUMNS} FROM prism_checkpoints"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY updated_at DESC, key ASC, namespace ASC LIMIT ?"
        args.append(query.limit)

        def read(conn: apsw.Connection) -> list[CheckpointRecord]:
            return [_common.checkpoint_from_row(row) for row in conn.execute(sql, args).fetchall()]

        return await self._db.run(read)

    async def _events(
        self, after: int, limit: int, scope: OwnershipScope
    ) -> Sequence[JournalEvent]:
        where = ["seq > ?"]
        args: list[Any] = [after]
        _add_scope_filter(scope, where, args)
        sql = (
            "SELECT seq, at, action, namespace, key, tenant_id, account_id, user_id, version,"
            f" category, metadata FROM prism_events WHERE {' AND '.join(where)}"
            " ORDER BY seq LIMIT ?"
        )
        args.append(limit)

        def read(conn: apsw.Connection) -> list[JournalEvent]:
            rows: list[Any] = conn.execute(sql, args).fetchall()
            return [_common.event_from_row(row) for row in rows]

        return await self._db.run(read)

    async def last_event_seq(self) -> int:
        """The highest committed event sequence number (0: none yet)."""

        def read(conn: apsw.Connection) -> int:
            return int(_scalar(conn, "SELECT coalesce(max(seq), 0) FROM prism_events"))

        return await self._db.run(read)


# --------------------------------------------------------------------------- leases
