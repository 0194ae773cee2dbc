"""Due polls on PostgreSQL (:class:`~stores.PollStore` on ``prism_polls``, migration 3): each
call one statement; a reservation locks the row ``FOR UPDATE SKIP LOCKED``, so two instances
asking at once never wait on each other and never both win.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from .._polling import PollLease, PollWait
from .._types import Clock
from ._driver import Driver, Session

BUSY_MS = 50
"""How soon to ask again for a row another reservation was locking."""


@attrs.define(eq=False)
class PostgresPollStore:
    _driver: Driver
    _clock: Clock
    _table: str
    """The schema-qualified, quoted table name."""

    async def _row(self, sql: str, *args: object) -> Sequence[Any] | None:
        async def run(session: Session) -> Sequence[Any] | None:
            return await session.fetchrow(sql, *args)

        return await self._driver.call(run)

    async def track(self, key: str) -> None:
        await self._row(
            f"INSERT INTO {self._table} (key, due_at, owner_id, fence, expires_at)"
            " VALUES ($1, $2, NULL, 0, 0) ON CONFLICT (key) DO NOTHING",
            key,
            self._clock.now_ms(),
        )

    async def reserve(
        self, key: str, *, owner_id: str, ttl_ms: int, hurry: bool = False
    ) -> PollLease | PollWait | None:
        t = self._table
        now = self._clock.now_ms()
        row = await self._row(
            f"WITH cur AS (SELECT key, due_at, expires_at FROM {t} WHERE key = $1"
            "   FOR UPDATE SKIP LOCKED),"
            f" won AS (UPDATE {t} AS p SET owner_id = $2, fence = p.fence + 1, expires_at = $4"
            "   FROM cur WHERE p.key = cur.key AND cur.expires_at <= $3"
            "   AND (cur.due_at <= $3 OR $5::boolean) RETURNING p.fence)"
            " SELECT (SELECT fence FROM won), (SELECT due_at FROM cur),"
            f" (SELECT expires_at FROM cur), EXISTS (SELECT 1 FROM {t} WHERE key = $1)",
            key,
            owner_id,
            now,
            now + ttl_ms,
            hurry,
        )
        assert row is not None
        fence, due_at, expires_at, exists = row
        if fence is not None:
            return PollLease(key, owner_id, int(fence), now + ttl_ms)
        if due_at is None:
            return PollWait(BUSY_MS) if exists else None  # locked by a reservation: soon
        until = int(expires_at) if hurry else max(int(due_at), int(expires_at))
        return PollWait(max(1, until - now))

    async def renew(self, lease: PollLease, *, ttl_ms: int) -> PollLease | None:
        expires = self._clock.now_ms() + ttl_ms
        row = await self._row(
            f"UPDATE {self._table} SET expires_at = $4"
            " WHERE key = $1 AND owner_id = $2 AND fence = $3 RETURNING fence",
            lease.key,
            lease.owner_id,
            lease.fence,
            expires,
        )
        return None if row is None else attrs.evolve(lease, expires_at_ms=expires)

    async def settle(self, lease: PollLease, *, delay_ms: int) -> bool:
        row = await self._row(
            f"UPDATE {self._table} SET due_at = $4, expires_at = 0"
            " WHERE key = $1 AND owner_id = $2 AND fence = $3 RETURNING fence",
            lease.key,
            lease.owner_id,
            lease.fence,
            self._clock.now_ms() + max(0, delay_ms),
        )
        return row is not None

    async def finish(self, lease: PollLease) -> bool:
        row = await self._row(
            f"DELETE FROM {self._table} WHERE key = $1 AND owner_id = $2 AND fence = $3"
            " RETURNING fence",
            lease.key,
            lease.owner_id,
            lease.fence,
        )
        return row is not None

    async def forget(self, key: str) -> None:
        await self._row(f"DELETE FROM {self._table} WHERE key = $1", key)
