"""Leases on PostgreSQL: each call one statement (a function of the schema), the conflicting
row locked.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import attrs

from .. import _common
from .._types import Clock, InvalidLeaseError, LeaseConflictError, LeaseRecord, OwnershipScope
from . import _schema
from ._driver import Driver, Session

_LEASE_COLUMNS = (
    "namespace, key, tenant_id, account_id, user_id, owner_id, token, fencing_token,"
    " acquired_at, expires_at, updated_at"
)


@attrs.define(eq=False)
class PostgresLeaseStore:
    """:class:`~stores.LeaseStore` on ``prism_leases``: one round trip per call, every check
    in the statement that writes (see ``prism_acquire_lease``/``prism_move_lease``)."""

    _driver: Driver
    _clock: Clock
    _schema_name: str

    @property
    def _t(self) -> str:
        return _schema.quote_ident(self._schema_name)

    async def _call(self, sql: str, *args: Any) -> Sequence[Any]:
        async def run(session: Session) -> Sequence[Any]:
            row = await session.fetchrow(sql, *args)
            assert row is not None  # the functions always answer one row
            return row

        return await self._driver.call(run)

    def _record(
        self,
        namespace: str,
        key: str,
        scope: OwnershipScope,
        owner_id: str,
        token: str,
        now: int,
        row: Sequence[Any],
    ) -> LeaseRecord | None:
        status, fence, acquired, expires = row
        if status == "scope":
            raise LeaseConflictError("lease ownership mismatch")
        if status != "ok":
            return None
        return LeaseRecord(
            namespace=namespace,
            key=key,
            scope=scope,
            owner_id=owner_id,
            token=token,
            fencing_token=fence,
            acquired_at_ms=acquired,
            expires_at_ms=expires,
            updated_at_ms=now,
        )

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
        """A fresh lease (new token, fencing token + 1), or ``None`` while someone else holds
        it; :class:`~stores.LeaseConflictError` for a foreign scope or bad input."""
        _common.check_lease_address(namespace, key, scope)
        _common.check_name(owner_id, "owner_id", InvalidLeaseError)
        ttl = _common.check_ttl(ttl_ms)
        if not isinstance(reclaim, bool):
            raise InvalidLeaseError("reclaim must be a bool")
        now = self._clock.now_ms()
        token = os.urandom(16).hex()
        row = await self._call(
            f"SELECT * FROM {self._t}.prism_acquire_lease($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
            namespace, key, *_common.scope_args(scope), owner_id, token, now, now + ttl, reclaim,
        )  # fmt: skip
        return self._record(namespace, key, scope, owner_id, token, now, row)

    async def _move(
        self,
        namespace: str,
        key: str,
        scope: OwnershipScope,
        owner_id: str,
        token: str,
        now: int,
        expires_at: int,
    ) -> LeaseRecord | None:
        row = await self._call(
            f"SELECT * FROM {self._t}.prism_move_lease($1, $2, $3, $4, $5, $6, $7, $8, $9)",
            namespace, key, *_common.scope_args(scope), owner_id, token, now, expires_at,
        )  # fmt: skip
        return self._record(namespace, key, scope, owner_id, token, now, row)

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
        now = self._clock.now_ms()
        return await self._move(namespace, key, scope, owner_id, token, now, now + ttl)

    async def release_lease(
        self, *, namespace: str, key: str, scope: OwnershipScope, owner_id: str, token: str
    ) -> bool:
        """Expire the lease now when (owner_id, token) holds it; ``False`` otherwise."""
        _common.check_lease_address(namespace, key, scope)
        _common.check_name(owner_id, "owner_id", InvalidLeaseError)
        _common.check_name(token, "token", InvalidLeaseError)
        now = self._clock.now_ms()
        return await self._move(namespace, key, scope, owner_id, token, now, now) is not None

    async def get_lease(
        self, *, namespace: str, key: str, scope: OwnershipScope
    ) -> LeaseRecord | None:
        """The unexpired lease, or ``None``; a foreign scope raises LeaseConflictError."""
        _common.check_lease_address(namespace, key, scope)
        now = self._clock.now_ms()
        sql = (
            f"SELECT {_LEASE_COLUMNS} FROM {self._t}.prism_leases WHERE namespace = $1 AND key = $2"
        )

        async def read(session: Session) -> Sequence[Any] | None:
            return await session.fetchrow(sql, namespace, key)

        row = await self._driver.call(read)
        if row is None:
            return None
        (ns, k, tenant, account, user, owner, token, fence, acquired, expires, updated) = row
        if OwnershipScope(tenant, account, user) != scope:
            raise LeaseConflictError("lease ownership mismatch")
        if expires <= now:
            return None
        return LeaseRecord(
            namespace=ns,
            key=k,
            scope=scope,
            owner_id=owner,
            token=token,
            fencing_token=fence,
            acquired_at_ms=acquired,
            expires_at_ms=expires,
            updated_at_ms=updated,
        )
