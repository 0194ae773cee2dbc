"""The durable inbox on PostgreSQL (``prism_inbox``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from .. import _inbox_checks
from .._inboxing import ReserveAsk, SQLInboxStore, inbox_item
from .._sql import numbered
from .._types import Clock, InboxReservation
from ._driver import Driver, Session


@attrs.define(eq=False)
class PostgresInboxStore(SQLInboxStore):
    """:class:`~stores.InboxStore` on ``prism_inbox``: one statement per call, outside the
    checkpoint writer (an inbox write has no journal event). A claim selects the ready items
    ``FOR UPDATE SKIP LOCKED`` and claims them in the same statement, so workers on every
    instance take disjoint items without waiting for each other; the readiness rules are in
    that selection's ``WHERE`` (READ COMMITTED: a row another claim took meanwhile is
    re-checked against its committed state, and skipped)."""

    _COLUMNS = (
        "source, key, partition, ord, payload::text, state, attempts, available_at, owner_id,"
        " token, claim_expires_at, error, created_at, updated_at"
    )
    _JSON_PARAM = "?::json"
    _LEAST = "least"

    _driver: Driver
    _clock: Clock
    _max_value_bytes: int
    _t: str
    """``prism_inbox`` in the quoted schema."""

    def _now(self) -> int:
        return self._clock.now_ms()

    def _payload_limit(self) -> int:
        return self._max_value_bytes

    async def _rows(self, sql: str, *args: Any) -> Sequence[Sequence[Any]]:
        async def run(session: Session) -> Sequence[Sequence[Any]]:
            return await session.fetch(sql, *args)

        return await self._driver.call(run)

    async def _read(self, sql: str, args: Sequence[Any]) -> Sequence[Sequence[Any]]:
        return await self._rows(numbered(sql), *args)

    async def _write(self, sql: str, args: Sequence[Any]) -> Sequence[Sequence[Any]]:
        return await self._rows(numbered(sql), *args)

    async def _reserve(self, ask: ReserveAsk) -> tuple[InboxReservation, ...]:
        t = self._t
        rows = await self._rows(
            f"WITH ready AS (SELECT r.source, r.key FROM {t} AS r"
            " WHERE ((r.state = 'pending' AND r.available_at <= $1)"
            "        OR (r.state = 'claimed' AND r.claim_expires_at <= $1))"
            "   AND ($5::text[] IS NULL OR r.source = ANY($5::text[]))"
            f"  AND NOT EXISTS (SELECT 1 FROM {t} AS e"
            "        WHERE e.source = r.source AND e.partition = r.partition"
            "          AND e.state IN ('pending', 'claimed') AND (e.ord, e.key) < (r.ord, r.key))"
            f"  AND NOT EXISTS (SELECT 1 FROM {t} AS h"
            "        WHERE h.source = r.source AND h.partition = r.partition"
            "          AND h.claim_expires_at > $1 AND h.state IN ('claimed', 'done')"
            "          AND h.owner_id IS DISTINCT FROM $2)"
            " ORDER BY r.available_at, r.ord, r.source, r.key LIMIT $3"
            " FOR UPDATE OF r SKIP LOCKED)"
            f" UPDATE {t} AS x SET"
            "   state = CASE WHEN x.attempts >= $4 THEN 'dead' ELSE 'claimed' END,"
            "   attempts = CASE WHEN x.attempts >= $4 THEN x.attempts ELSE x.attempts + 1 END,"
            "   owner_id = CASE WHEN x.attempts >= $4 THEN x.owner_id ELSE $2 END,"
            "   token = CASE WHEN x.attempts >= $4 THEN NULL ELSE $6 || ':' || x.key END,"
            "   claim_expires_at = CASE WHEN x.attempts >= $4 THEN x.claim_expires_at"
            "     ELSE $7 END,"
            "   updated_at = $1"
            " FROM ready WHERE x.source = ready.source AND x.key = ready.key"
            f" RETURNING {', '.join('x.' + c.strip() for c in self._COLUMNS.split(','))}",
            ask.now,
            ask.owner_id,
            ask.limit,
            ask.max_attempts,
            None if ask.sources is None else list(ask.sources),
            _inbox_checks.new_reservation_token(),
            ask.now + ask.ttl_ms,
        )
        expires_at = ask.now + ask.ttl_ms
        reservations = [
            InboxReservation(inbox_item(row), str(row[9]), expires_at)
            for row in rows
            if row[5] == "claimed"
        ]
        reservations.sort(key=lambda c: (c.item.available_at_ms, c.item.order, c.source, c.key))
        return tuple(reservations)

    async def _prune(self, before: int, limit: int, now: int) -> int:
        rows = await self._rows(
            f"DELETE FROM {self._t} WHERE (source, key) IN (SELECT source, key FROM {self._t}"
            " WHERE state IN ('done', 'discarded') AND updated_at < $1"
            " AND claim_expires_at <= $2 LIMIT $3 FOR UPDATE SKIP LOCKED) RETURNING 1",
            before,
            now,
            limit,
        )
        return len(rows)
