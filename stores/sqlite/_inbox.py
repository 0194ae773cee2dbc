"""The durable inbox on ``prism_inbox``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import apsw
import attrs

from .. import _inbox_checks
from .._inboxing import ReserveAsk, SQLInboxStore, inbox_item
from .._types import InboxReservation
from ._engine import _Database, _one

# Contract (a)-(c) of InboxStore.reserve, as one query (the writer's BEGIN IMMEDIATE makes it
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


@attrs.define(eq=False)
class SQLiteInboxStore(SQLInboxStore):
    """:class:`~stores.InboxStore` on ``prism_inbox``: every change is a job of the
    group-committed writer (``BEGIN IMMEDIATE``), so a claim is atomic across processes."""

    _COLUMNS = (
        "source, key, partition, ord, payload, state, attempts, available_at, owner_id, token,"
        " claim_expires_at, error, created_at, updated_at"
    )
    _LEAST = "min"

    _db: _Database
    _max_value_bytes: int

    @property
    def _t(self) -> str:
        return "prism_inbox"

    def _now(self) -> int:
        return self._db.clock.now_ms()

    def _payload_limit(self) -> int:
        return self._max_value_bytes

    async def _read(self, sql: str, args: Sequence[Any]) -> Sequence[Sequence[Any]]:
        def read(conn: apsw.Connection) -> list[Any]:
            return conn.execute(sql, tuple(args)).fetchall()

        return await self._db.run(read)

    async def _write(self, sql: str, args: Sequence[Any]) -> Sequence[Sequence[Any]]:
        def txn(conn: apsw.Connection) -> list[Any]:
            return conn.execute(sql, tuple(args)).fetchall()

        # One statement: it applies in full or not at all, so it needs no savepoint of its
        # own (two statements fewer per put, complete, retry…; concurrent pushes' puts share
        # one transaction and one commit through the group commit as before).
        return await self._db.write(txn, savepoint=False)

    async def _reserve(self, ask: ReserveAsk) -> tuple[InboxReservation, ...]:
        now, ttl = ask.now, ask.ttl_ms
        args: dict[str, Any] = {"now": now, "owner": ask.owner_id, "limit": ask.limit}
        where = ""
        if ask.sources is not None:
            names = [f":s{i}" for i in range(len(ask.sources))]
            where = f"AND r.source IN ({', '.join(names)})"
            args.update({name[1:]: value for name, value in zip(names, ask.sources)})
        sql = _INBOX_READY.format(sources=where)

        def txn(conn: apsw.Connection) -> tuple[InboxReservation, ...]:
            ready: list[Any] = conn.execute(sql, args).fetchall()
            reservations: list[InboxReservation] = []
            for source, key, attempts in ready:
                if attempts >= ask.max_attempts:
                    conn.execute(
                        "UPDATE prism_inbox SET state = 'dead', updated_at = ?"
                        " WHERE source = ? AND key = ?",
                        (now, source, key),
                    )
                    continue
                token = _inbox_checks.new_reservation_token()
                row = _one(
                    conn,
                    "UPDATE prism_inbox SET state = 'claimed', attempts = attempts + 1,"
                    " owner_id = ?, token = ?, claim_expires_at = ?, updated_at = ?"
                    f" WHERE source = ? AND key = ? RETURNING {self._COLUMNS}",
                    (ask.owner_id, token, now + ttl, now, source, key),
                )
                reservations.append(InboxReservation(inbox_item(row), token, now + ttl))
            return tuple(reservations)

        return await self._db.write(txn)

    async def _prune(self, before: int, limit: int, now: int) -> int:
        def txn(conn: apsw.Connection) -> int:
            rows = conn.execute(
                "DELETE FROM prism_inbox WHERE rowid IN (SELECT rowid FROM prism_inbox"
                " WHERE state IN ('done', 'discarded') AND updated_at < ?"
                " AND claim_expires_at <= ? LIMIT ?) RETURNING 1",
                (before, now, limit),
            ).fetchall()
            return len(rows)

        # Up to ``limit`` deletes: beyond the Trio thread's share of one transaction.
        return await self._db.write(txn, weight=limit)
