"""Leases on PostgreSQL: each call one statement (a function of the schema), the conflicting
row locked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from .. import _types
from .._bases import LeaseAsk, LeaseStoreBase
from .._types import (
    LEASE_COLUMNS,
    Clock,
    LeaseConflictError,
    LeaseRecord,
    OwnershipScope,
    lease_from_row,
)
from ._driver import Driver, Session


@attrs.define(eq=False)
class PostgresLeaseStore(LeaseStoreBase):
    """:class:`~stores.LeaseStore` on ``prism_leases``: one round trip per call, every check
    in the statement that writes (see ``prism_acquire_lease``/``prism_move_lease``)."""

    _driver: Driver
    _clock: Clock
    _t: str
    """The quoted schema name (``quote_ident``, once for the store)."""

    def _now(self) -> int:
        return self._clock.now_ms()

    async def _call(self, ask: LeaseAsk, function: str, *args: Any) -> LeaseRecord | None:
        """``SELECT * FROM function(namespace, key, scope…, owner, token, now, expires_at,
        *args)``: its status, and the lease when it is ``ok``."""
        params = ", ".join(f"${i}" for i in range(1, 10 + len(args)))
        sql = f"SELECT * FROM {self._t}.{function}({params})"
        values = (
            ask.namespace,
            ask.key,
            *_types.scope_args(ask.scope),
            ask.owner_id,
            ask.token,
            ask.now,
            ask.expires_at,
            *args,
        )

        async def run(session: Session) -> Sequence[Any]:
            row = await session.fetchrow(sql, *values)
            assert row is not None  # the functions always answer one row
            return row

        status, fence, acquired, _expires = await self._driver.call(run)
        if status == "scope":
            raise LeaseConflictError("lease ownership mismatch")
        return ask.record(fence, acquired) if status == "ok" else None

    async def _acquire(self, ask: LeaseAsk, adopt: bool) -> LeaseRecord | None:
        return await self._call(ask, "prism_acquire_lease", adopt)

    async def _move(self, ask: LeaseAsk) -> LeaseRecord | None:
        return await self._call(ask, "prism_move_lease")

    async def _get(self, namespace: str, key: str, scope: OwnershipScope) -> LeaseRecord | None:
        sql = (
            f"SELECT {LEASE_COLUMNS} FROM {self._t}.prism_leases WHERE namespace = $1 AND key = $2"
        )

        async def read(session: Session) -> Sequence[Any] | None:
            return await session.fetchrow(sql, namespace, key)

        row = await self._driver.call(read)
        return None if row is None else lease_from_row(row)
