"""The durable inbox on ``prism_inbox``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import apsw
import attrs

from .. import _common, _inbox_checks
from .._types import (
    LIST_LIMIT_DEFAULT,
    LIST_LIMIT_MAX,
    InboxClaim,
    InboxDepth,
    InboxItem,
    InboxPage,
    InboxState,
    InvalidInboxError,
    JSONValue,
)
from ._engine import _Database
from ._schema import _one

# --------------------------------------------------------------------------- inbox

_INBOX_COLUMNS = (
    "source, key, partition, ord, payload, state, attempts, available_at, owner_id, token,"
    " claim_expires_at, error, created_at, updated_at"
)
# Contract (a)-(c) of InboxStore.claim, as one query (the writer's BEGIN IMMEDIATE makes it
# and the updates that follow one step for every other connection and process).
_INBOX_READY = """
SELECT r.source, r.key, r.attempts FROM prism_inbox AS r
 WHERE ((r.state = 'pending' AND r.available_at <= :now)
        OR (r.state = 'claimed' AND r.claim_expires_at <= :now))
   {sources}
   AND NOT EXISTS (SELECT 1 FROM prism_inbox AS e
        WHERE e.source = r.source AND e.partition = r.partition
          AND e.state IN ('pending', 'claimed')
          AND (e.ord < r.ord OR (e.ord = r.ord AND e.key < r.key)))
   AND NOT EXISTS (SELECT 1 FROM prism_inbox AS h
        WHERE h.source = r.source AND h.partition = r.partition
          AND h.claim_expires_at > :now AND h.state IN ('claimed', 'done')
          AND h.owner_id IS NOT :owner)
 ORDER BY r.available_at, r.ord, r.source, r.key
 LIMIT :limit
"""


def _inbox_item(row: Sequence[Any], *, with_payload: bool = True) -> tuple[InboxItem, str | None]:
    (source, key, partition, order, payload, state, attempts, available, owner, token,
     expires, error, created, updated) = row  # fmt: skip
    item = InboxItem(
        source=source, key=key, partition=partition, order=order, state=state,
        attempts=attempts, available_at_ms=available, created_at_ms=created,
        updated_at_ms=updated, error=error, owner_id=owner, claim_expires_at_ms=expires,
        payload=_common.decode_json(payload) if with_payload and payload is not None else None,
    )  # fmt: skip
    return item, token


@attrs.define(eq=False)
class SQLiteInboxStore:
    """:class:`~stores.InboxStore` on ``prism_inbox``: every change is a job of the
    group-committed writer (``BEGIN IMMEDIATE``), so a claim is atomic across processes."""

    _db: _Database
    _max_value_bytes: int

    async def put(
        self, *, source: str, key: str, partition: str, order: int, payload: JSONValue
    ) -> bool:
        """A new ``pending`` item, or ``False`` when ``(source, key)`` is known."""
        put = _inbox_checks.check_inbox_put(
            source=source, key=key, partition=partition, order=order, payload=payload,
            max_value_bytes=self._max_value_bytes,
        )  # fmt: skip
        now = self._db.clock.now_ms()

        def txn(conn: apsw.Connection) -> bool:
            row = _one(
                conn,
                f"INSERT INTO prism_inbox ({_INBOX_COLUMNS})"
                " VALUES (?, ?, ?, ?, ?, 'pending', 0, ?, NULL, NULL, 0, NULL, ?, ?)"
                " ON CONFLICT (source, key) DO NOTHING RETURNING 1",
                (put.source, put.key, put.partition, put.order, put.payload_json, now, now, now),
            )
            return row is not None

        return await self._db.write(txn)

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
            return ()
        now = self._db.clock.now_ms()
        args: dict[str, Any] = {"now": now, "owner": owner, "limit": n}
        where = ""
        if wanted is not None:
            names = [f":s{i}" for i in range(len(wanted))]
            where = f"AND r.source IN ({', '.join(names)})"
            args.update({name[1:]: value for name, value in zip(names, wanted)})
        sql = _INBOX_READY.format(sources=where)

        def txn(conn: apsw.Connection) -> tuple[InboxClaim, ...]:
            ready: list[Any] = conn.execute(sql, args).fetchall()
            claims: list[InboxClaim] = []
            for source, key, attempts in ready:
                if attempts >= most:
                    conn.execute(
                        "UPDATE prism_inbox SET state = 'dead', updated_at = ?"
                        " WHERE source = ? AND key = ?",
                        (now, source, key),
                    )
                    continue
                token = _inbox_checks.new_claim_token()
                row = _one(
                    conn,
                    "UPDATE prism_inbox SET state = 'claimed', attempts = attempts + 1,"
                    " owner_id = ?, token = ?, claim_expires_at = ?, updated_at = ?"
                    f" WHERE source = ? AND key = ? RETURNING {_INBOX_COLUMNS}",
                    (owner, token, now + ttl, now, source, key),
                )
                item, _ = _inbox_item(row)
                claims.append(InboxClaim(item, token, now + ttl))
            return tuple(claims)

        return await self._db.write(txn)

    async def _update(
        self, claim: InboxClaim, states: tuple[str, ...], assignments: str, args: Sequence[Any]
    ) -> InboxItem | None:
        """``UPDATE … SET assignments`` the claim's item when its token and state still
        match; the item as stored, or ``None``."""
        _inbox_checks.check_inbox_claim(claim)
        sql = (
            f"UPDATE prism_inbox SET {assignments}"
            f" WHERE source = ? AND key = ? AND token = ?"
            f" AND state IN ({', '.join('?' for _ in states)}) RETURNING {_INBOX_COLUMNS}"
        )
        values = (*args, claim.source, claim.key, claim.token, *states)

        def txn(conn: apsw.Connection) -> InboxItem | None:
            row = _one(conn, sql, values)
            return None if row is None else _inbox_item(row)[0]

        return await self._db.write(txn)

    async def extend(self, claim: InboxClaim, *, ttl_ms: int) -> InboxClaim | None:
        ttl = _inbox_checks.check_inbox_ms(ttl_ms, "ttl_ms", minimum=1)
        now = self._db.clock.now_ms()
        item = await self._update(
            claim,
            ("claimed", "done"),
            "claim_expires_at = ?, updated_at = ?",
            (now + ttl, now),
        )
        return None if item is None else attrs.evolve(claim, item=item, expires_at_ms=now + ttl)

    async def complete(self, claim: InboxClaim, *, hold_ms: int = 0) -> bool:
        hold = _inbox_checks.check_inbox_ms(hold_ms, "hold_ms", minimum=0)
        now = self._db.clock.now_ms()
        done = await self._update(
            claim,
            ("claimed",),
            "state = 'done', payload = NULL, claim_expires_at = ?, updated_at = ?",
            (now + hold, now),
        )
        return done is not None

    async def expire_own_claims(
        self, *, owner_id: str, sources: Sequence[str] | None = None
    ) -> int:
        owner = _common.check_name(owner_id, "owner_id", InvalidInboxError)
        wanted = _inbox_checks.check_inbox_sources(sources)
        if wanted == ():
            return 0
        now = self._db.clock.now_ms()
        sql = (
            "UPDATE prism_inbox SET claim_expires_at = ?, updated_at = ?"
            " WHERE state = 'claimed' AND owner_id = ? AND claim_expires_at > ?"
        )
        if wanted is not None:
            sql += f" AND source IN ({', '.join('?' for _ in wanted)})"
        sql += " RETURNING 1"

        def txn(conn: apsw.Connection) -> int:
            return len(conn.execute(sql, (now, now, owner, now, *(wanted or ()))).fetchall())

        return await self._db.write(txn)

    async def release(self, claim: InboxClaim) -> bool:
        now = self._db.clock.now_ms()
        released = await self._update(
            claim,
            ("done",),
            "claim_expires_at = min(claim_expires_at, ?), updated_at = ?",
            (now, now),
        )
        return released is not None

    async def retry(
        self, claim: InboxClaim, *, delay_ms: int, error: str, max_attempts: int
    ) -> InboxItem | None:
        delay = _inbox_checks.check_inbox_ms(delay_ms, "delay_ms", minimum=0)
        code = _inbox_checks.bound_inbox_error(error)
        most = _inbox_checks.check_inbox_ms(max_attempts, "max_attempts", minimum=1)
        now = self._db.clock.now_ms()
        return await self._update(
            claim,
            ("claimed",),
            "state = CASE WHEN attempts >= ? THEN 'dead' ELSE 'pending' END, error = ?,"
            " available_at = ?, token = NULL, claim_expires_at = ?, updated_at = ?",
            (most, code, now + delay, now, now),
        )

    async def get(self, *, source: str, key: str) -> InboxItem | None:
        _common.check_name(source, "source", InvalidInboxError)
        _common.check_name(key, "key", InvalidInboxError)

        def read(conn: apsw.Connection) -> InboxItem | None:
            row = _one(
                conn,
                f"SELECT {_INBOX_COLUMNS} FROM prism_inbox WHERE source = ? AND key = ?",
                (source, key),
            )
            return None if row is None else _inbox_item(row)[0]

        return await self._db.run(read)

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
            where.append("source = ?")
            args.append(source)
        if wanted is not None:
            where.append("state = ?")
            args.append(wanted)
        if position is not None:
            where.append("(source, ord, key) > (?, ?, ?)")
            args += list(position)
        sql = f"SELECT {_INBOX_COLUMNS} FROM prism_inbox"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY source, ord, key LIMIT ?"
        args.append(n + 1)

        def read(conn: apsw.Connection) -> list[InboxItem]:
            rows = conn.execute(sql, args).fetchall()
            return [_inbox_item(row, with_payload=False)[0] for row in rows]

        rows = await self._db.run(read)
        items = tuple(rows[:n])
        more = len(rows) > n
        return InboxPage(items, _inbox_checks.encode_inbox_cursor(items[-1]) if more else None)

    async def settle(
        self, *, source: str, key: str, action: Literal["retry", "discard"]
    ) -> InboxItem | None:
        _common.check_name(source, "source", InvalidInboxError)
        _common.check_name(key, "key", InvalidInboxError)
        if action == "retry":
            assignments = "state = 'pending', attempts = 0, available_at = ?, updated_at = ?"
        elif action == "discard":
            assignments = "state = 'discarded', payload = NULL, updated_at = max(?, ?)"
        else:
            raise InvalidInboxError("action must be 'retry' or 'discard'")
        now = self._db.clock.now_ms()

        def txn(conn: apsw.Connection) -> InboxItem | None:
            row = _one(
                conn,
                f"UPDATE prism_inbox SET {assignments}"
                f" WHERE source = ? AND key = ? AND state = 'dead' RETURNING {_INBOX_COLUMNS}",
                (now, now, source, key),
            )
            return None if row is None else _inbox_item(row)[0]

        return await self._db.write(txn)

    async def prune(self, *, before_ms: int, limit: int = LIST_LIMIT_MAX) -> int:
        before = _inbox_checks.check_inbox_ms(before_ms, "before_ms", minimum=0)
        n = _inbox_checks.check_inbox_claim_args("-", 1, limit, 1, None)[2]
        now = self._db.clock.now_ms()

        def txn(conn: apsw.Connection) -> int:
            rows = conn.execute(
                "DELETE FROM prism_inbox WHERE rowid IN (SELECT rowid FROM prism_inbox"
                " WHERE state IN ('done', 'discarded') AND updated_at < ?"
                " AND claim_expires_at <= ? LIMIT ?) RETURNING 1",
                (before, now, n),
            ).fetchall()
            return len(rows)

        # Up to ``n`` deletes: beyond the Trio thread's share of one transaction.
        return await self._db.write(txn, weight=n)

    async def depth(self, *, sources: Sequence[str] | None = None) -> InboxDepth:
        wanted = _inbox_checks.check_inbox_sources(sources)
        if wanted == ():
            return InboxDepth()
        sql = (
            "SELECT state, count(*) FROM prism_inbox WHERE state IN ('pending', 'claimed', 'dead')"
        )
        if wanted is not None:
            sql += f" AND source IN ({', '.join('?' for _ in wanted)})"
        sql += " GROUP BY state"

        def read(conn: apsw.Connection) -> InboxDepth:
            counts: dict[str, int] = dict(conn.execute(sql, wanted or ()).fetchall())  # type: ignore[arg-type]
            return InboxDepth(
                pending=counts.get("pending", 0),
                claimed=counts.get("claimed", 0),
                dead=counts.get("dead", 0),
            )

        return await self._db.run(read)
