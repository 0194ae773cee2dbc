"""Leases on ``prism_leases``: one ``INSERT … ON CONFLICT DO UPDATE … WHERE … RETURNING``
per acquisition.
"""

from __future__ import annotations

import apsw
import attrs

from .. import _types
from .._bases import LeaseAsk, LeaseStoreBase
from .._types import LEASE_COLUMNS, LeaseConflictError, LeaseRecord, OwnershipScope, lease_from_row
from ._engine import _SCOPE_IS, _Database, _one

_ACQUIRE = (
    f"INSERT INTO prism_leases AS l ({LEASE_COLUMNS})"
    " VALUES (?, ?, ?, ?, ?, ?, ?, 1, ?, ?, ?)"
    " ON CONFLICT (namespace, key) DO UPDATE SET"
    " owner_id = excluded.owner_id, token = excluded.token,"
    " fencing_token = l.fencing_token + 1, acquired_at = excluded.acquired_at,"
    " expires_at = excluded.expires_at, updated_at = excluded.updated_at"
    " WHERE l.tenant_id IS excluded.tenant_id AND l.account_id IS excluded.account_id"
    " AND l.user_id IS excluded.user_id"
    " AND (l.expires_at <= excluded.acquired_at OR (? AND l.owner_id = excluded.owner_id))"
    f" RETURNING {LEASE_COLUMNS}"
)
"""One statement decides: insert, or take over a row that is expired (or, with ``adopt``,
held by the same ``owner_id``) in the same scope."""

_MOVE = (
    "UPDATE prism_leases SET expires_at = ?, updated_at = ?"
    f" WHERE namespace = ? AND key = ? AND {_SCOPE_IS}"
    " AND owner_id = ? AND token = ? AND expires_at > ?"
    f" RETURNING {LEASE_COLUMNS}"
)


@attrs.define(eq=False)
class SQLiteLeaseStore(LeaseStoreBase):
    """:class:`~stores.LeaseStore` on ``prism_leases``; rows are never deleted, so fencing
    counters survive release and expiry. A write is one statement; the scope is checked
    only when it misses, so the common case is one statement."""

    _db: _Database

    def _now(self) -> int:
        return self._db.clock.now_ms()

    async def _write(self, ask: LeaseAsk, sql: str, args: tuple[object, ...]) -> LeaseRecord | None:
        def txn(conn: apsw.Connection) -> LeaseRecord | None:
            row = _one(conn, sql, args)
            if row is not None:
                return lease_from_row(row)
            held = _one(
                conn,
                "SELECT tenant_id, account_id, user_id FROM prism_leases"
                " WHERE namespace = ? AND key = ?",
                (ask.namespace, ask.key),
            )
            if held is not None and tuple(held) != _types.scope_args(ask.scope):
                raise LeaseConflictError("lease ownership mismatch")
            return None

        return await self._db.write(txn)

    async def _acquire(self, ask: LeaseAsk, adopt: bool) -> LeaseRecord | None:
        scope = _types.scope_args(ask.scope)
        args = (ask.namespace, ask.key, *scope, ask.owner_id, ask.token, ask.now, ask.expires_at)
        return await self._write(ask, _ACQUIRE, (*args, ask.now, 1 if adopt else 0))

    async def _move(self, ask: LeaseAsk) -> LeaseRecord | None:
        scope = _types.scope_args(ask.scope)
        args = (ask.expires_at, ask.now, ask.namespace, ask.key, *scope, ask.owner_id, ask.token)
        return await self._write(ask, _MOVE, (*args, ask.now))

    async def _get(self, namespace: str, key: str, scope: OwnershipScope) -> LeaseRecord | None:
        def read(conn: apsw.Connection) -> LeaseRecord | None:
            row = _one(
                conn,
                f"SELECT {LEASE_COLUMNS} FROM prism_leases WHERE namespace = ? AND key = ?",
                (namespace, key),
            )
            return None if row is None else lease_from_row(row)

        return await self._db.run(read)
