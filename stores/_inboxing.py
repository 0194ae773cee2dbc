"""The calls of :class:`~stores.InboxStore` written once: :class:`InboxStoreBase` checks every
call's input and reads the clock, a backend gives the steps that touch its items;
:class:`SQLInboxStore` writes those steps once in the SQL both SQL backends speak (``?``
parameters; PostgreSQL numbers them), leaving each its reserve and its prune."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import attrs
import trio

from . import _bases, _inbox_checks, _types
from ._inbox_checks import InboxPut
from ._types import (
    LIST_LIMIT_DEFAULT,
    LIST_LIMIT_MAX,
    InboxDepth,
    InboxItem,
    InboxPage,
    InboxReservation,
    InboxState,
    InvalidInboxError,
    JSONValue,
    Where,
)

Settle = Literal["retry", "discard"]


@attrs.frozen
class ReserveAsk:
    """A checked :meth:`~stores.InboxStore.reserve` at ``now``: at most ``limit`` items of
    ``sources`` (``None``: any; never empty here) for ``owner_id`` until ``now + ttl_ms``."""

    owner_id: str
    ttl_ms: int
    limit: int
    max_attempts: int
    sources: tuple[str, ...] | None
    now: int


@attrs.frozen
class RetryAsk:
    """A checked :meth:`~stores.InboxStore.retry` at ``now``: the reserved item back to
    ``pending`` at ``available_at`` (``dead`` once it has had ``max_attempts``)."""

    reservation: InboxReservation
    max_attempts: int
    error: str
    available_at: int
    now: int


@attrs.frozen
class ListAsk:
    """A checked :meth:`~stores.InboxStore.list_items`: up to ``limit`` items (payloads left
    out) of ``source`` in ``state`` (``None``: any) after ``(source, order, key)``, in that
    order."""

    source: str | None
    state: InboxState | None
    after: tuple[str, int, str] | None
    limit: int


class InboxStoreBase(abc.ABC):
    """:class:`~stores.InboxStore` over the steps below: each gets checked input and the
    store clock's ``now``; ``_enter`` runs before anything else of every call."""

    async def _enter(self) -> None:
        """Before every call's checks (the memory store's checkpoint and open check);
        nothing by default."""
        return None

    @abc.abstractmethod
    def _now(self) -> int:
        """The backend's own step (see the class)."""

    @abc.abstractmethod
    def _payload_limit(self) -> int:
        """The largest payload, in bytes of its JSON."""

    @abc.abstractmethod
    async def _insert(self, put: InboxPut, now: int) -> bool:
        """The backend's own step (see the class)."""

    @abc.abstractmethod
    async def _reserve(self, ask: ReserveAsk) -> tuple[InboxReservation, ...]:
        """The backend's own step (see the class)."""

    @abc.abstractmethod
    async def _expire_own(self, owner_id: str, sources: tuple[str, ...] | None, now: int) -> int:
        """The backend's own step (see the class)."""

    @abc.abstractmethod
    async def _extend(
        self, reservation: InboxReservation, expires_at: int, now: int
    ) -> InboxItem | None:
        """The backend's own step (see the class)."""

    @abc.abstractmethod
    async def _complete(self, reservation: InboxReservation, expires_at: int, now: int) -> bool:
        """The backend's own step (see the class)."""

    @abc.abstractmethod
    async def _release(self, reservation: InboxReservation, now: int) -> bool:
        """The backend's own step (see the class)."""

    @abc.abstractmethod
    async def _retry(self, ask: RetryAsk) -> InboxItem | None:
        """The backend's own step (see the class)."""

    @abc.abstractmethod
    async def _get(self, source: str, key: str) -> InboxItem | None:
        """The backend's own step (see the class)."""

    @abc.abstractmethod
    async def _list(self, ask: ListAsk) -> Sequence[InboxItem]:
        """The backend's own step (see the class)."""

    @abc.abstractmethod
    async def _settle(self, source: str, key: str, action: Settle, now: int) -> InboxItem | None:
        """The backend's own step (see the class)."""

    @abc.abstractmethod
    async def _prune(self, before: int, limit: int, now: int) -> int:
        """The backend's own step (see the class)."""

    @abc.abstractmethod
    async def _depth(self, sources: tuple[str, ...] | None) -> InboxDepth:
        """The backend's own step (see the class)."""

    async def put(
        self, *, source: str, key: str, partition: str, order: int, payload: JSONValue
    ) -> bool:
        """A new ``pending`` item, or ``False`` when ``(source, key)`` is known."""
        await self._enter()
        put = _inbox_checks.check_inbox_put(
            source=source,
            key=key,
            partition=partition,
            order=order,
            payload=payload,
            max_value_bytes=self._payload_limit(),
        )
        return await self._insert(put, self._now())

    async def reserve(
        self,
        *,
        owner_id: str,
        ttl_ms: int,
        limit: int = 1,
        max_attempts: int,
        sources: Sequence[str] | None = None,
    ) -> tuple[InboxReservation, ...]:
        """Ready items, oldest first (see :class:`~stores.InboxStore`)."""
        await self._enter()
        owner, ttl, n, most, wanted = _inbox_checks.check_inbox_reserve_args(
            owner_id, ttl_ms, limit, max_attempts, sources
        )
        if wanted == ():
            await trio.lowlevel.checkpoint()
            return ()
        return await self._reserve(ReserveAsk(owner, ttl, n, most, wanted, self._now()))

    async def expire_own_reservations(
        self, *, owner_id: str, sources: Sequence[str] | None = None
    ) -> int:
        await self._enter()
        owner = _bases.check_name(owner_id, "owner_id", InvalidInboxError)
        wanted = _inbox_checks.check_inbox_sources(sources)
        if wanted == ():
            await trio.lowlevel.checkpoint()
            return 0
        return await self._expire_own(owner, wanted, self._now())

    async def extend(
        self, reservation: InboxReservation, *, ttl_ms: int
    ) -> InboxReservation | None:
        await self._enter()
        _inbox_checks.check_inbox_reservation(reservation)
        ttl = _inbox_checks.check_inbox_ms(ttl_ms, "ttl_ms", minimum=1)
        now = self._now()
        item = await self._extend(reservation, now + ttl, now)
        return (
            None if item is None else attrs.evolve(reservation, item=item, expires_at_ms=now + ttl)
        )

    async def complete(self, reservation: InboxReservation, *, keep_partition_ms: int = 0) -> bool:
        await self._enter()
        _inbox_checks.check_inbox_reservation(reservation)
        hold = _inbox_checks.check_inbox_ms(keep_partition_ms, "keep_partition_ms", minimum=0)
        now = self._now()
        return await self._complete(reservation, now + hold, now)

    async def release(self, reservation: InboxReservation) -> bool:
        await self._enter()
        _inbox_checks.check_inbox_reservation(reservation)
        return await self._release(reservation, self._now())

    async def retry(
        self, reservation: InboxReservation, *, delay_ms: int, error: str, max_attempts: int
    ) -> InboxItem | None:
        await self._enter()
        _inbox_checks.check_inbox_reservation(reservation)
        delay = _inbox_checks.check_inbox_ms(delay_ms, "delay_ms", minimum=0)
        code = _inbox_checks.bound_inbox_error(error)
        most = _inbox_checks.check_inbox_ms(max_attempts, "max_attempts", minimum=1)
        now = self._now()
        return await self._retry(RetryAsk(reservation, most, code, now + delay, now))

    async def get(self, *, source: str, key: str) -> InboxItem | None:
        await self._enter()
        _bases.check_name(source, "source", InvalidInboxError)
        _bases.check_name(key, "key", InvalidInboxError)
        return await self._get(source, key)

    async def list_items(
        self,
        *,
        source: str | None = None,
        state: InboxState | None = None,
        cursor: str | None = None,
        limit: int = LIST_LIMIT_DEFAULT,
    ) -> InboxPage:
        await self._enter()
        if source is not None:
            _bases.check_name(source, "source", InvalidInboxError)
        wanted = _inbox_checks.check_inbox_state(state)
        position = _inbox_checks.decode_inbox_cursor(cursor)
        n = _inbox_checks.check_inbox_reserve_args("-", 1, limit, 1, None)[2]
        rows = await self._list(ListAsk(source, wanted, position, n + 1))
        items = tuple(rows[:n])
        more = len(rows) > n
        return InboxPage(items, _inbox_checks.encode_inbox_cursor(items[-1]) if more else None)

    async def settle(
        self, *, source: str, key: str, action: Literal["retry", "discard"]
    ) -> InboxItem | None:
        await self._enter()
        _bases.check_name(source, "source", InvalidInboxError)
        _bases.check_name(key, "key", InvalidInboxError)
        if action not in ("retry", "discard"):
            raise InvalidInboxError("action must be 'retry' or 'discard'")
        return await self._settle(source, key, action, self._now())

    async def prune(self, *, before_ms: int, limit: int = LIST_LIMIT_MAX) -> int:
        await self._enter()
        before = _inbox_checks.check_inbox_ms(before_ms, "before_ms", minimum=0)
        n = _inbox_checks.check_inbox_reserve_args("-", 1, limit, 1, None)[2]
        return await self._prune(before, n, self._now())

    async def depth(self, *, sources: Sequence[str] | None = None) -> InboxDepth:
        await self._enter()
        wanted = _inbox_checks.check_inbox_sources(sources)
        if wanted == ():
            await trio.lowlevel.checkpoint()
            return InboxDepth()
        return await self._depth(wanted)


def inbox_item(row: Sequence[Any], *, with_payload: bool = True) -> InboxItem:
    """A ``prism_inbox`` row (:attr:`SQLInboxStore._COLUMNS`) as an item."""
    (
        source,
        key,
        partition,
        order,
        payload,
        state,
        attempts,
        available,
        owner,
        _token,
        expires,
        error,
        created,
        updated,
    ) = row
    return InboxItem(
        source=source,
        key=key,
        partition=partition,
        order=order,
        state=state,
        attempts=attempts,
        available_at_ms=available,
        created_at_ms=created,
        updated_at_ms=updated,
        error=error,
        owner_id=owner,
        claim_expires_at_ms=expires,
        payload=_types.decode_json(payload) if with_payload and payload is not None else None,
    )


def _marks(values: Sequence[object]) -> str:
    return ", ".join("?" for _ in values)


class SQLInboxStore(InboxStoreBase):
    """The steps of :class:`InboxStoreBase` on ``prism_inbox`` in SQL with ``?`` parameters,
    over a backend's ``_read``/``_write`` (one statement, its rows), its table name, and its
    spelling of the payload column and of the smaller of two values. The reserve and the
    prune stay the backend's own."""

    _COLUMNS: ClassVar[str]
    """``source, key, partition, ord, payload, state, attempts, available_at, owner_id, token,
    claim_expires_at, error, created_at, updated_at`` (the payload as JSON text)."""
    _JSON_PARAM: ClassVar[str] = "?"
    _LEAST: ClassVar[str]

    @property
    @abc.abstractmethod
    def _t(self) -> str:
        """The backend's own step (see the class)."""

    @abc.abstractmethod
    async def _read(self, sql: str, args: Sequence[Any]) -> Sequence[Sequence[Any]]:
        """The backend's own step (see the class)."""

    @abc.abstractmethod
    async def _write(self, sql: str, args: Sequence[Any]) -> Sequence[Sequence[Any]]:
        """The backend's own step (see the class)."""

    async def _insert(self, put: InboxPut, now: int) -> bool:
        rows = await self._write(
            f"INSERT INTO {self._t} (source, key, partition, ord, payload, state, attempts,"
            " available_at, claim_expires_at, created_at, updated_at)"
            f" VALUES (?, ?, ?, ?, {self._JSON_PARAM}, 'pending', 0, ?, 0, ?, ?)"
            " ON CONFLICT (source, key) DO NOTHING RETURNING 1",
            (put.source, put.key, put.partition, put.order, put.payload_json, now, now, now),
        )
        return bool(rows)

    async def _expire_own(self, owner_id: str, sources: tuple[str, ...] | None, now: int) -> int:
        sql = (
            f"UPDATE {self._t} SET claim_expires_at = ?, updated_at = ?"
            " WHERE state = 'claimed' AND owner_id = ? AND claim_expires_at > ?"
        )
        if sources is not None:
            sql += f" AND source IN ({_marks(sources)})"
        rows = await self._write(sql + " RETURNING 1", (now, now, owner_id, now, *(sources or ())))
        return len(rows)

    async def _update(
        self,
        reservation: InboxReservation,
        states: tuple[str, ...],
        assignments: str,
        args: Sequence[Any],
    ) -> InboxItem | None:
        """``UPDATE … SET assignments`` the reservation's item when its token and state still
        match; the item as stored, or ``None``."""
        rows = await self._write(
            f"UPDATE {self._t} SET {assignments}"
            f" WHERE source = ? AND key = ? AND token = ? AND state IN ({_marks(states)})"
            f" RETURNING {self._COLUMNS}",
            (*args, reservation.source, reservation.key, reservation.token, *states),
        )
        return inbox_item(rows[0]) if rows else None

    async def _extend(
        self, reservation: InboxReservation, expires_at: int, now: int
    ) -> InboxItem | None:
        return await self._update(
            reservation,
            ("claimed", "done"),
            "claim_expires_at = ?, updated_at = ?",
            (expires_at, now),
        )

    async def _complete(self, reservation: InboxReservation, expires_at: int, now: int) -> bool:
        done = await self._update(
            reservation,
            ("claimed",),
            "state = 'done', payload = NULL, claim_expires_at = ?, updated_at = ?",
            (expires_at, now),
        )
        return done is not None

    async def _release(self, reservation: InboxReservation, now: int) -> bool:
        released = await self._update(
            reservation,
            ("done",),
            f"claim_expires_at = {self._LEAST}(claim_expires_at, ?), updated_at = ?",
            (now, now),
        )
        return released is not None

    async def _retry(self, ask: RetryAsk) -> InboxItem | None:
        return await self._update(
            ask.reservation,
            ("claimed",),
            "state = CASE WHEN attempts >= ? THEN 'dead' ELSE 'pending' END, error = ?,"
            " available_at = ?, token = NULL, claim_expires_at = ?, updated_at = ?",
            (ask.max_attempts, ask.error, ask.available_at, ask.now, ask.now),
        )

    async def _get(self, source: str, key: str) -> InboxItem | None:
        rows = await self._read(
            f"SELECT {self._COLUMNS} FROM {self._t} WHERE source = ? AND key = ?", (source, key)
        )
        return inbox_item(rows[0]) if rows else None

    async def _list(self, ask: ListAsk) -> Sequence[InboxItem]:
        where = Where()
        where.equals("source", ask.source)
        where.equals("state", ask.state)
        if ask.after is not None:
            where.add("(source, ord, key) > (?, ?, ?)", *ask.after)
        rows = await self._read(
            f"SELECT {self._COLUMNS} FROM {self._t}{where.sql()} ORDER BY source, ord, key LIMIT ?",
            (*where.args, ask.limit),
        )
        return [inbox_item(row, with_payload=False) for row in rows]

    async def _settle(self, source: str, key: str, action: Settle, now: int) -> InboxItem | None:
        if action == "retry":
            assignments = "state = 'pending', attempts = 0, available_at = ?, updated_at = ?"
            args: tuple[int, ...] = (now, now)
        else:
            assignments, args = "state = 'discarded', payload = NULL, updated_at = ?", (now,)
        rows = await self._write(
            f"UPDATE {self._t} SET {assignments}"
            f" WHERE source = ? AND key = ? AND state = 'dead' RETURNING {self._COLUMNS}",
            (*args, source, key),
        )
        return inbox_item(rows[0]) if rows else None

    async def _depth(self, sources: tuple[str, ...] | None) -> InboxDepth:
        sql = f"SELECT state, count(*) FROM {self._t} WHERE state IN ('pending', 'claimed', 'dead')"
        if sources is not None:
            sql += f" AND source IN ({_marks(sources)})"
        counts = {
            str(state): int(n)
            for state, n in await self._read(sql + " GROUP BY state", sources or ())
        }
        return InboxDepth(
            pending=counts.get("pending", 0),
            claimed=counts.get("claimed", 0),
            dead=counts.get("dead", 0),
        )
