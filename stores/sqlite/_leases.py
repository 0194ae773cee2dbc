"""Leases on ``prism_leases``: one ``INSERT … ON CONFLICT DO UPDATE … WHERE … RETURNING``
per acquisition.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import apsw
import attrs

from .. import _common
from .._types import InvalidLeaseError, LeaseConflictError, LeaseRecord, OwnershipScope
from ._engine import _Database
from ._schema import _SCOPE_IS, _one

_LEASE_COLUMNS = (
    "namespace, key, tenant_id, account_id, user_id, owner_id, token, fencing_token,"
    " acquired_at, expires_at, updated_at"
)


def _lease(row: Sequence[Any]) -> LeaseRecord:
    (ns, key, tenant, account, user, owner, token, fence, acquired, expires, updated) = row
    return LeaseRecord(
        namespace=ns,
        key=key,
        scope=OwnershipScope(tenant, account, user),
        owner_id=owner,
        token=token,
        fencing_token=fence,
        acquired_at_ms=acquired,
        expires_at_ms=expires,
        updated_at_ms=updated,
    )


@attrs.define(eq=False)
class SQLiteLeaseStore:
    """:class:`~stores.LeaseStore` on ``prism_leases``; rows are never deleted, so fencing
    counters survive release and expiry."""

    _db: _Database

    @staticmethod
    def _check_scope(
        conn: apsw.Connection, namespace: str, key: str, scope: OwnershipScope
    ) -> None:
        row = _one(
            conn,
            "SELECT tenant_id, account_id, user_id FROM prism_leases"
            " WHERE namespace = ? AND key = ?",
            (namespace, key),
        )
        if row is not None and tuple(row) != _common.scope_args(scope):
            raise LeaseConflictError("lease ownership mismatch")

    async def _move_expiry(
        self,
        namespace: str,
        key: str,
        scope: OwnershipScope,
        owner_id: str,
        token: str,
        now: int,
        expires_at: int,
    ) -> LeaseRecord | None:
        """Set the expiry of the unexpired lease (owner_id, token) holds; ``None`` when it
        does not hold one. The scope is checked only when the update misses, so the common
        case is one statement."""

        def txn(conn: apsw.Connection) -> LeaseRecord | None:
            row = _one(
                conn,
                "UPDATE prism_leases SET expires_at = ?, updated_at = ?"
                f" WHERE namespace = ? AND key = ? AND {_SCOPE_IS}"
                " AND owner_id = ? AND token = ? AND expires_at > ?"
                f" RETURNING {_LEASE_COLUMNS}",
                (expires_at, now, namespace, key, *_common.scope_args(scope), owner_id, token, now),
            )
            if row is not None:
                return _lease(row)
            self._check_scope(conn, namespace, key, scope)
            return None

        return await self._db.write(txn)

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

        One statement decides: insert, or take over a row that is expired (or, with
        ``reclaim=True``, held by the same ``owner_id``) in the same scope.
        Raises :class:`~stores.LeaseConflictError` for a foreign scope or bad input.
        """
        _common.check_lease_address(namespace, key, scope)
        _common.check_name(owner_id, "owner_id", InvalidLeaseError)
        ttl = _common.check_ttl(ttl_ms)
        if not isinstance(reclaim, bool):
            raise InvalidLeaseError("reclaim must be a bool")
        now = self._db.clock.now_ms()
        token = os.urandom(16).hex()
        sql = (
            f"INSERT INTO prism_leases AS l ({_LEASE_COLUMNS})"
            " VALUES (?, ?, ?, ?, ?, ?, ?, 1, ?, ?, ?)"
            " ON CONFLICT (namespace, key) DO UPDATE SET"
            " owner_id = excluded.owner_id, token = excluded.token,"
            " fencing_token = l.fencing_token + 1, acquired_at = excluded.acquired_at,"
            " expires_at = excluded.expires_at, updated_at = excluded.updated_at"
            " WHERE l.tenant_id IS excluded.tenant_id AND l.account_id IS excluded.account_id"
            " AND l.user_id IS excluded.user_id"
            " AND (l.expires_at <= excluded.acquired_at OR (? AND l.owner_id = excluded.owner_id))"
            f" RETURNING {_LEASE_COLUMNS}"
        )
        args = (
            namespace,
            key,
            *_common.scope_args(scope),
            owner_id,
            token,
            now,
            now + ttl,
            now,
            1 if reclaim else 0,
        )

        def txn(conn: apsw.Connection) -> LeaseRecord | None:
            row = _one(conn, sql, args)
            if row is not None:
                return _lease(row)
            self._check_scope(conn, namespace, key, scope)
            return None

        return await self._db.write(txn)

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
        _common.check_lease_address(namespace, key, scope)
        _common.check_name(owner_id, "owner_id", InvalidLeaseError)
        _common.check_name(token, "token", InvalidLeaseError)
        ttl = _common.check_ttl(ttl_ms)
        now = self._db.clock.now_ms()
        return await self._move_expiry(namespace, key, scope, owner_id, token, now, now + ttl)

    async def release_lease(
        self, *, namespace: str, key: str, scope: OwnershipScope, owner_id: str, token: str
    ) -> bool:
        """Expire the lease now when (owner_id, token) holds it; ``False`` otherwise."""
        _common.check_lease_address(namespace, key, scope)
        _common.check_name(owner_id, "owner_id", InvalidLeaseError)
        _common.check_name(token, "token", InvalidLeaseError)
        now = self._db.clock.now_ms()
        return await self._move_expiry(namespace, key, scope, owner_id, token, now, now) is not None

    async def get_lease(
        self, *, namespace: str, key: str, scope: OwnershipScope
    ) -> LeaseRecord | None:
        """The unexpired lease, or ``None``; a foreign scope raises LeaseConflictError."""
        _common.check_lease_address(namespace, key, scope)
        now = self._db.clock.now_ms()

        def read(conn: apsw.Connection) -> LeaseRecord | None:
            row = _one(
                conn,
                f"SELECT {_LEASE_COLUMNS} FROM prism_leases WHERE namespace = ? AND key = ?",
                (namespace, key),
            )
            if row is None:
                return None
            lease = _lease(row)
            if lease.scope != scope:
                raise LeaseConflictError("lease ownership mismatch")
            return lease if lease.expires_at_ms > now else None

        return await self._db.run(read)
