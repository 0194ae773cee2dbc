"""The durable inbox on PostgreSQL (``prism_inbox``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs
import trio

from .. import _common, _inbox_checks
from .._types import (
    LIST_LIMIT_DEFAULT,
    LIST_LIMIT_MAX,
    Clock,
    InboxClaim,
    InboxDepth,
    InboxItem,
    InboxPage,
    InboxState,
    InvalidInboxError,
    JSONValue,
)
from . import _schema
from ._driver import Driver, Session

_INBOX_COLUMNS = (
    "source, key, partition, ord, payload::text, state, attempts, available_at, owner_id,"
    " token, claim_expires_at, error, created_at, updated_at"
)


def _inbox_item(row: Sequence[Any], *, with_payload: bool = True) -> InboxItem:
    (source, key, partition, order, payload, state, attempts, available, owner, _token,
     expires, error, created, updated) = row  # fmt: skip
    return InboxItem(
        source=source, key=key, partition=partition, order=order, state=state,
        attempts=attempts, available_at_ms=available, created_at_ms=created,
        updated_at_ms=updated, error=error, owner_id=owner, claim_expires_at_ms=expires,
        payload=_common.decode_json(payload) if with_payload and payload is not None else None,
    )  # fmt: skip


@attrs.define(eq=False)
class PostgresInboxStore:
    """:class:`~stores.InboxStore` on ``prism_inbox``: one statement per call, outside the
    checkpoint writer (an inbox write has no journal event). A claim selects the ready items
    ``FOR UPDATE SKIP LOCKED`` and claims them in the same statement, so workers on every
    instance take disjoint items without waiting for each other; the readiness rules are in
    that selection's ``WHERE`` (READ COMMITTED: a row another claim took meanwhile is
    re-checked against its committed state, and skipped)."""

    _driver: Driver
    _clock: Clock
    _max_value_bytes: int
    _schema_name: str

    @property
    def _t(self) -> str:
        return f"{_schema.quote_ident(self._schema_name)}.prism_inbox"

    async def _rows(self, sql: str, *args: Any) -> Sequence[Sequence[Any]]:
        async def run(session: Session) -> Sequence[Sequence[Any]]:
            return await session.fetch(sql, *args)

        return await self._driver.call(run)

    async def put(
        self, *, source: str, key: str, partition: str, order: int, payload: JSONValue
    ) -> bool:
        """A new ``pending`` item, or ``False`` when ``(source, key)`` is known."""
        put = _inbox_checks.check_inbox_put(
            source=source, key=key, partition=partition, order=order, payload=payload,
            max_value_bytes=self._max_value_bytes,
        )  # fmt: skip
        now = self._clock.now_ms()
        rows = await self._rows(
            f"INSERT INTO {self._t} (source, key, partition, ord, payload, state, attempts,"
            " available_at, claim_expires_at, created_at, updated_at)"
            " VALUES ($1, $2, $3, $4, $5::json, 'pending', 0, $6, 0, $6, $6)"
            " ON CONFLICT (source, key) DO NOTHING RETURNING 1",
            put.source, put.key, put.partition, put.order, put.payload_json, now,
        )  # fmt: skip
        return bool(rows)

    async def claim(
        self,
        *,
        owner_id: str,
        ttl_ms: int,
        limit: int = 1,
        max_attempts: int,
        sources: Sequence[str] | None = None,
    ) -> tuple[InboxClaim, ...]:
        """Ready items, oldest first (see :class:`~stores.InboxStore`)."""
        owner, ttl, n, most, wanted = _inbox_checks.check_inbox_claim_args(
            owner_id, ttl_ms, limit, max_attempts, sources
        )
        if wanted == ():
            await trio.lowlevel.checkpoint()
            return ()
        now = self._clock.now_ms()
        token = _inbox_checks.new_claim_token()
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
            f" RETURNING {', '.join('x.' + c.strip() for c in _INBOX_COLUMNS.split(','))}",
            now, owner, n, most, None if wanted is None else list(wanted), token, now + ttl,
        )  # fmt: skip
        claims = [
            InboxClaim(_inbox_item(row), str(row[9]), now + ttl)
            for row in rows
            if row[5] == "claimed"
        ]
        claims.sort(key=lambda c: (c.item.available_at_ms, c.item.order, c.source, c.key))
        return tuple(claims)

    async def _update(
        self, claim: InboxClaim, states: tuple[str, ...], assignments: str, *args: Any
    ) -> InboxItem | None:
        """``UPDATE … SET assignments`` (parameters from ``$4``) the claim's item when its
        token and state still match; the item as stored, or ``None``."""
        _inbox_checks.check_inbox_claim(claim)
        rows = await self._rows(
            f"UPDATE {self._t} SET {assignments}"
            f" WHERE source = $1 AND key = $2 AND token = $3"
            f" AND state = ANY(${len(args) + 4}::text[]) RETURNING {_INBOX_COLUMNS}",
            claim.source, claim.key, claim.token, *args, list(states),
        )  # fmt: skip
        return _inbox_item(rows[0]) if rows else None

    async def extend(self, claim: InboxClaim, *, ttl_ms: int) -> InboxClaim | None:
        ttl = _inbox_checks.check_inbox_ms(ttl_ms, "ttl_ms", minimum=1)
        now = self._clock.now_ms()
        item = await self._update(
            claim, ("claimed", "done"), "claim_expires_at = $4, updated_at = $5", now + ttl, now
        )
        return None if item is None else attrs.evolve(claim, item=item, expires_at_ms=now + ttl)

    async def complete(self, claim: InboxClaim, *, hold_ms: int = 0) -> bool:
        hold = _inbox_checks.check_inbox_ms(hold_ms, "hold_ms", minimum=0)
        now = self._clock.now_ms()
        done = await self._update(
            claim,
            ("claimed",),
            "state = 'done', payload = NULL, claim_expires_at = $4, updated_at = $5",
            now + hold,
            now,
        )
        return done is not None

    async def expire_own_claims(
        self, *, owner_id: str, sources: Sequence[str] | None = None
    ) -> int:
        owner = _common.check_name(owner_id, "owner_id", InvalidInboxError)
        wanted = _inbox_checks.check_inbox_sources(sources)
        if wanted == ():
            await trio.lowlevel.checkpoint()
            return 0
        now = self._clock.now_ms()
        rows = await self._rows(
            f"UPDATE {self._t} SET claim_expires_at = $1, updated_at = $1"
            " WHERE state = 'claimed' AND owner_id = $2 AND claim_expires_at > $1"
            " AND ($3::text[] IS NULL OR source = ANY($3::text[])) RETURNING 1",
            now, owner, None if wanted is None else list(wanted),
        )  # fmt: skip
        return len(rows)

    async def release(self, claim: InboxClaim) -> bool:
        now = self._clock.now_ms()
        released = await self._update(
            claim,
            ("done",),
            "claim_expires_at = least(claim_expires_at, $4), updated_at = $4",
            now,
        )
        return released is not None

    async def retry(
        self, claim: InboxClaim, *, delay_ms: int, error: str, max_attempts: int
    ) -> InboxItem | None:
        delay = _inbox_checks.check_inbox_ms(delay_ms, "delay_ms", minimum=0)
        code = _inbox_checks.bound_inbox_error(error)
        most = _inbox_checks.check_inbox_ms(max_attempts, "max_attempts", minimum=1)
        now = self._clock.now_ms()
        return await self._update(
            claim,
            ("claimed",),
            "state = CASE WHEN attempts >= $4 THEN 'dead' ELSE 'pending' END, error = $5,"
            " available_at = $6, token = NULL, claim_expires_at = $7, updated_at = $7",
            most,
            code,
            now + delay,
            now,
        )

    async def get(self, *, source: str, key: str) -> InboxItem | None:
        _common.check_name(source, "source", InvalidInboxError)
        _common.check_name(key, "key", InvalidInboxError)
        rows = await self._rows(
            f"SELECT {_INBOX_COLUMNS} FROM {self._t} WHERE source = $1 AND key = $2", source, key
        )
        return _inbox_item(rows[0]) if rows else None

    async def list_items(
        self,
        *,
        source: str | None = None,
        state: InboxState | None = None,
        cursor: str | None = None,
        limit: int = LIST_LIMIT_DEFAULT,
    ) -> InboxPage:
        if source is not None:
            _common.check_name(source, "source", InvalidInboxError)
        wanted = _inbox_checks.check_inbox_state(state)
        position = _inbox_checks.decode_inbox_cursor(cursor)
        n = _inbox_checks.check_inbox_claim_args("-", 1, limit, 1, None)[2]
        where: list[str] = []
        args: list[Any] = []
        if source is not None:
            args.append(source)
            where.append(f"source = ${len(args)}")
        if wanted is not None:
            args.append(wanted)
            where.append(f"state = ${len(args)}")
        if position is not None:
            args += list(position)
            where.append(f"(source, ord, key) > (${len(args) - 2}, ${len(args) - 1}, ${len(args)})")
        sql = f"SELECT {_INBOX_COLUMNS} FROM {self._t}"
        if where:
            sql += " WHERE " + " AND ".join(where)
        args.append(n + 1)
        sql += f" ORDER BY source, ord, key LIMIT ${len(args)}"
        rows = [_inbox_item(row, with_payload=False) for row in await self._rows(sql, *args)]
        items = tuple(rows[:n])
        more = len(rows) > n
        return InboxPage(items, _inbox_checks.encode_inbox_cursor(items[-1]) if more else None)

    async def settle(
        self, *, source: str, key: str, action: Literal["retry", "discard"]
    ) -> InboxItem | None:
        _common.check_name(source, "source", InvalidInboxError)
        _common.check_name(key, "key", InvalidInboxError)
        if action == "retry":
            assignments = "state = 'pending', attempts = 0, available_at = $3, updated_at = $3"
        elif action == "discard":
            assignments = "state = 'discarded', payload = NULL, updated_at = $3"
        else:
            raise InvalidInboxError("action must be 'retry' or 'discard'")
        rows = await self._rows(
            f"UPDATE {self._t} SET {assignments}"
            f" WHERE source = $1 AND key = $2 AND state = 'dead' RETURNING {_INBOX_COLUMNS}",
            source, key, self._clock.now_ms(),
        )  # fmt: skip
        return _inbox_item(rows[0]) if rows else None

    async def prune(self, *, before_ms: int, limit: int = LIST_LIMIT_MAX) -> int:
        before = _inbox_checks.check_inbox_ms(before_ms, "before_ms", minimum=0)
        n = _inbox_checks.check_inbox_claim_args("-", 1, limit, 1, None)[2]
        rows = await self._rows(
            f"DELETE FROM {self._t} WHERE (source, key) IN (SELECT source, key FROM {self._t}"
            " WHERE state IN ('done', 'discarded') AND updated_at < $1"
            " AND claim_expires_at <= $2 LIMIT $3 FOR UPDATE SKIP LOCKED) RETURNING 1",
            before, self._clock.now_ms(), n,
        )  # fmt: skip
        return len(rows)

    async def depth(self, *, sources: Sequence[str] | None = None) -> InboxDepth:
        wanted = _inbox_checks.check_inbox_sources(sources)
        if wanted == ():
            await trio.lowlevel.checkpoint()
            return InboxDepth()
        rows = await self._rows(
            f"SELECT state, count(*) FROM {self._t}"
            " WHERE state IN ('pending', 'claimed', 'dead')"
            " AND ($1::text[] IS NULL OR source = ANY($1::text[])) GROUP BY state",
            None if wanted is None else list(wanted),
        )
        counts = {str(state): int(count) for state, count in rows}
        return InboxDepth(
            pending=counts.get("pending", 0),
            claimed=counts.get("claimed", 0),
            dead=counts.get("dead", 0),
        )
