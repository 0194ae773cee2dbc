"""The PostgreSQL store: the CheckpointStore/LeaseStore contract on a real server.

Guarantees:

* A call that returned has committed (the server's ``synchronous_commit`` decides what that
  means on disk; PostgreSQL's default waits for the WAL flush).
* **Isolation: READ COMMITTED, with every check inside the statement that writes.** Each
  save is one ``INSERT … ON CONFLICT DO UPDATE … WHERE <checks>`` (or ``UPDATE … WHERE
  <checks>`` for a positive expected version, ``INSERT … ON CONFLICT DO NOTHING`` for
  create-only); each delete one ``DELETE … WHERE <scope>``. The row is locked by that
  statement and, if another transaction changed it meanwhile, the server re-evaluates the
  ``WHERE`` against the newest committed row before writing. So the version, create-only,
  fence and scope checks and the write are one atomic step on one row — what SERIALIZABLE
  would give for this access pattern, without its retries: no check reads a row it does not
  write or lock, and nothing reads a range to decide a write. Leases are the same (one
  statement, the conflicting row locked; see :mod:`stores._pg_schema`). The conformance
  suite's races (many writers, one winner) and the PostgreSQL tests with two independent
  pools prove it.
* **One write path, group committed.** Every write call is a job for one writer task: jobs
  that arrive while a transaction is in flight wait, and the next transaction carries all of
  them (up to :data:`MAX_JOBS`) as one call of ``prism_write_checkpoints`` — one statement,
  one round trip, one commit. Each write keeps its own result; an ``atomic`` job of several
  writes runs in a subtransaction rolled back when one of them loses. Nobody is answered
  before the commit; a failed transaction fails every job in it, except that a statement the
  server refuses for its data (an oversized key, say) is retried job by job, so one bad job
  does not fail the others. A deadlock or serialization abort (another instance's
  transaction) is retried, bounded.
* **Events:** written by the same statement as their checkpoints; sequence numbers come from
  one counter row locked until commit, so commits are visible in ``seq`` order and
  :meth:`PostgresCheckpointStore.list_events` never shows N+1 before a committed N.
* **Time** comes from the store's ``clock`` (passed in, like SQLite), never the server's:
  instances sharing a database need synchronized clocks (NTP), and tests can drive it.
* **Cancellation:** a cancelled read returns at once (the statement is cancelled on the
  server in the background). A cancelled write still queued is dropped (nothing written);
  once its transaction is in flight the caller waits for the outcome, bounded by the
  statement timeout, so a returned write is never in doubt.
* **Failures:** a lost connection, a server restart or a timeout fails the calls in flight
  with :class:`~stores.StoreUnavailableError`; the pool reconnects on the next call. A
  connection lost during COMMIT leaves that transaction's outcome unknown to the caller (it
  may have committed): every write is a compare-and-swap, so a retry cannot apply it twice.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Literal

import attrs
import trio

from .. import _common
from .._types import (
    ANY_SCOPE,
    DEFAULT_MAX_VALUE_BYTES,
    LIST_LIMIT_DEFAULT,
    LIST_LIMIT_MAX,
    SYSTEM_CLOCK,
    CheckpointPage,
    CheckpointRecord,
    CheckpointWrite,
    Clock,
    DeleteCheckpoint,
    EncodedSave,
    EventPage,
    InboxClaim,
    InboxDepth,
    InboxItem,
    InboxPage,
    InboxState,
    InvalidInboxError,
    InvalidLeaseError,
    JSONValue,
    LeaseConflictError,
    LeaseRecord,
    OwnershipScope,
    SchemaStatus,
    Store,
    StoreUnavailableError,
    WriteResult,
    WriteStatus,
)
from . import _schema
from ._driver import (
    Driver,
    RetryTransaction,
    Session,
    WriteRefused,
    open_driver,
    plain_asyncio_timings,
)
from ._url import PostgresOptions, PostgresURL, parse_postgres_url

log = logging.getLogger("stores.postgres")

MAX_JOBS = 64
"""Jobs per transaction: bounds the subtransactions of one transaction (atomic jobs) below
PostgreSQL's per-backend cache of 64, past which every snapshot in the cluster slows down."""
MAX_WRITES = _common.MAX_BATCH_WRITES
"""Writes per transaction (one job may bring this many on its own)."""
RETRIES = 4
"""A transaction aborted by a deadlock or serialization failure is run again this often."""
CLOSE_BUDGET_S = 5.0
_STATUSES: frozenset[str] = frozenset({"ok", "conflict", "missing", "aborted"})

_CHECKPOINT_COLUMNS = (
    "namespace, key, version, fencing_token, category, tenant_id, account_id, user_id,"
    " value::text, metadata::text, created_at, updated_at"
)
_LEASE_COLUMNS = (
    "namespace, key, tenant_id, account_id, user_id, owner_id, token, fencing_token,"
    " acquired_at, expires_at, updated_at"
)
_EVENT_COLUMNS = (
    "seq, at, action, namespace, key, tenant_id, account_id, user_id, version, category,"
    " metadata::text"
)
_SCOPE_FIELDS = ("tenant_id", "account_id", "user_id")


def _scope_filter(scope: OwnershipScope, where: list[str], args: list[Any]) -> None:
    """The partial-scope filter: each field that is set must match exactly."""
    for column, value in zip(_SCOPE_FIELDS, _common.scope_args(scope)):
        if value is not None:
            args.append(value)
            where.append(f"{column} = ${len(args)}")


# --------------------------------------------------------------------------- group commit


Request = _common.SaveRequest | _common.DeleteRequest | EncodedSave


@attrs.define(eq=False)
class _Job:
    """One caller's ``write_checkpoints`` or ``save_encoded``: waiting for, or inside, a
    transaction."""

    requests: Sequence[Request]
    atomic: bool
    now_ms: int
    encoded: bool = False
    """A ``save_encoded`` job: answered with times, not write results."""
    done: trio.Event = attrs.Factory(trio.Event)
    taken: bool = False
    results: tuple[Any, ...] = ()
    error: BaseException | None = None

    def finish(self, results: tuple[Any, ...] = (), error: BaseException | None = None) -> None:
        if not self.done.is_set():
            self.results, self.error = results, error
            self.done.set()


def _pack(jobs: Sequence[_Job]) -> list[list[Any]]:
    """The arguments of ``prism_write_checkpoints``: one array per column, one element per
    write, jobs numbered in order."""
    columns: list[list[Any]] = [[] for _ in range(15)]
    for number, job in enumerate(jobs):
        for req in job.requests:
            if isinstance(req, _common.DeleteRequest):
                row: tuple[Any, ...] = (
                    number, job.atomic, job.now_ms, True, req.namespace, req.key,
                    *_common.scope_args(req.scope), None, None, None, None, None, None,
                )  # fmt: skip
            else:
                row = (
                    number, job.atomic, job.now_ms, False, req.namespace, req.key,
                    *_common.scope_args(req.scope), req.version, req.expected_version,
                    req.fencing_token, req.category, req.value_json, req.metadata_json,
                )  # fmt: skip
            for column, value in zip(columns, row):
                column.append(value)
    return columns


def _unpack(jobs: Sequence[_Job], rows: Sequence[Sequence[Any]]) -> list[tuple[Any, ...]]:
    """Each job's answer from the rows the write returned (one per write, in order)."""
    total = sum(len(job.requests) for job in jobs)
    if len(rows) != total:
        raise StoreUnavailableError("PostgreSQL store: the write answered an unexpected shape")
    out: list[tuple[Any, ...]] = []
    it = iter(rows)
    for job in jobs:
        answered = [next(it) for _ in job.requests]
        if any(status not in _STATUSES for status, _created, _updated in answered):
            raise StoreUnavailableError("PostgreSQL store: unknown write status")
        out.append(_answer(job, answered))
    return out


def _answer(job: _Job, answered: list[Sequence[Any]]) -> tuple[Any, ...]:
    """``save_encoded``'s times, or ``write_checkpoints``' results with their records (an
    ``atomic`` job with a lost check: the others ``aborted``)."""
    if job.encoded:
        return tuple(
            updated if status == "ok" else 0 if status == "aborted" else None
            for status, _, updated in answered
        )
    results: list[WriteResult] = []
    for req, (status, created, updated) in zip(job.requests, answered, strict=True):
        record = None
        if status == "ok" and isinstance(req, _common.SaveRequest):
            record = req.stored(created, updated)
        status_: WriteStatus = status
        results.append(WriteResult(status_, record))
    if job.atomic and not all(r.ok for r in results):
        return tuple(r if not r.ok else WriteResult("aborted") for r in results)
    return tuple(results)


@attrs.define(eq=False)
class _Writer:
    """The one task that writes: drains the queue into group-committed transactions."""

    driver: Driver
    write_sql: str
    outcome_wait_s: float
    queue: list[_Job] = attrs.Factory(list)
    wake: trio.Event = attrs.Factory(trio.Event)
    idle: trio.Event = attrs.Factory(trio.Event)
    closed: bool = False
    commits: int = 0
    writes: int = 0

    async def submit(self, job: _Job) -> tuple[Any, ...]:
        if self.closed:
            raise StoreUnavailableError(f"PostgreSQL store {self.driver.where}: store is closed")
        # An already cancelled caller writes nothing: once queued, the writer may take the
        # job before the cancellation is delivered, and a taken job is answered.
        await trio.lowlevel.checkpoint_if_cancelled()
        self.queue.append(job)
        self.wake.set()
        try:
            await job.done.wait()
        except trio.Cancelled:
            if not job.taken:
                self.queue.remove(job)
                raise
            # Inside a transaction: wait for its outcome (bounded: the server ends any
            # statement at statement_timeout) so the caller's write is never in doubt.
            with trio.move_on_after(self.outcome_wait_s, shield=True):
                await job.done.wait()
            if not job.done.is_set():
                raise
        if job.error is not None:
            raise job.error
        return job.results

    def _take(self) -> list[_Job]:
        batch: list[_Job] = []
        writes = 0
        while self.queue and len(batch) < MAX_JOBS:
            size = len(self.queue[0].requests)
            if batch and writes + size > MAX_WRITES:
                break
            job = self.queue.pop(0)
            job.taken = True
            batch.append(job)
            writes += size
        return batch

    async def run(self) -> None:
        try:
            while True:
                if not self.queue:
                    self.idle.set()
                    self.wake = trio.Event()
                    await self.wake.wait()
                    self.idle = trio.Event()
                    continue
                batch = self._take()
                try:
                    await self._commit(batch)
                except Exception as exc:
                    # Nothing may stop the one writer: a surprise fails this batch only.
                    log.error("PostgreSQL store: write failed (%s)", type(exc).__name__)
                    failed = StoreUnavailableError(
                        f"PostgreSQL store {self.driver.where}: write failed ({type(exc).__name__})"
                    )
                    for job in batch:
                        job.finish(error=failed)
                finally:
                    # Only when the writer itself is cancelled (the store closing).
                    unfinished = [job for job in batch if not job.done.is_set()]
                    if unfinished:
                        cut = StoreUnavailableError(
                            f"PostgreSQL store {self.driver.where}: store closed while the"
                            " write was in flight (outcome unknown)"
                        )
                        for job in unfinished:
                            job.finish(error=cut)
        finally:
            self.idle.set()

    async def _commit(self, batch: list[_Job]) -> None:
        """One transaction for ``batch``; every job is finished when this returns."""
        jobs = [job for job in batch if job.requests]
        for job in batch:
            if not job.requests:
                job.finish(())
        if not jobs:
            return
        for attempt in range(RETRIES + 1):
            try:
                rows = await self.driver.call(self._statement(_pack(jobs)))
            except RetryTransaction as exc:
                if attempt == RETRIES:
                    for job in jobs:
                        job.finish(error=exc)
                    return
                continue
            except WriteRefused as exc:
                if len(jobs) == 1:
                    jobs[0].finish(error=exc)
                    return
                # Which job did the server refuse? Each alone: only that one fails.
                for job in jobs:
                    await self._commit([job])
                return
            except StoreUnavailableError as exc:
                for job in jobs:
                    job.finish(error=exc)
                return
            try:
                answers = _unpack(jobs, rows)
            except StoreUnavailableError as exc:
                for job in jobs:
                    job.finish(error=exc)
                return
            self.commits += 1
            self.writes += len(jobs)
            for job, results in zip(jobs, answers, strict=True):
                job.finish(results)
            return

    def _statement(self, columns: list[list[Any]]) -> Any:
        sql = self.write_sql

        async def write(session: Session) -> Sequence[Sequence[Any]]:
            return await session.fetch(sql, *columns)

        return write

    def close(self) -> None:
        self.closed = True
        queued, self.queue = self.queue, []
        for job in queued:
            job.finish(
                error=StoreUnavailableError(
                    f"PostgreSQL store {self.driver.where}: store is closed"
                )
            )


# --------------------------------------------------------------------------- checkpoints


@attrs.define(eq=False)
class PostgresCheckpointStore(_common.SavesAsABatchOfOne):
    """:class:`~stores.CheckpointStore` on ``prism_checkpoints`` + ``prism_events``."""

    _driver: Driver
    _writer: _Writer
    _clock: Clock
    _max_value_bytes: int
    _schema_name: str

    @property
    def _t(self) -> str:
        return _schema.quote_ident(self._schema_name)

    async def write_checkpoints(
        self, writes: Sequence[CheckpointWrite], *, atomic: bool = False
    ) -> tuple[WriteResult, ...]:
        """The batch as one job of a group-committed transaction (see
        :meth:`~stores.CheckpointStore.write_checkpoints`)."""
        requests = _common.check_writes(writes, atomic, self._max_value_bytes)
        return await self._submit(_Job(requests, atomic, self._clock.now_ms()))

    async def save_encoded(
        self, saves: Sequence[EncodedSave], *, atomic: bool = False
    ) -> tuple[int | None, ...]:
        """The saves as one job of a group-committed transaction, as
        :meth:`write_checkpoints` (see :meth:`~stores.CheckpointStore.save_encoded`)."""
        checked = _common.check_encoded(saves, atomic, self._max_value_bytes)
        return await self._submit(_Job(checked, atomic, self._clock.now_ms(), encoded=True))

    async def _submit(self, job: _Job) -> tuple[Any, ...]:
        if not job.requests:
            if self._writer.closed:
                raise StoreUnavailableError(
                    f"PostgreSQL store {self._driver.where}: store is closed"
                )
            await trio.lowlevel.checkpoint()
            return ()
        return await self._writer.submit(job)

    async def delete_checkpoint(self, *, namespace: str, key: str, scope: OwnershipScope) -> bool:
        """True when a row was removed (with its delete event); a foreign scope is a miss."""
        (result,) = await self.write_checkpoints((DeleteCheckpoint(namespace, key, scope),))
        return result.ok

    async def load_checkpoint(
        self, *, namespace: str, key: str, scope: OwnershipScope
    ) -> CheckpointRecord | None:
        """The row, or ``None`` when absent or stored under another exact scope."""
        _common.check_checkpoint_address(namespace, key, scope)
        sql = (
            f"SELECT {_CHECKPOINT_COLUMNS} FROM {self._t}.prism_checkpoints"
            " WHERE namespace = $1 AND key = $2 AND tenant_id IS NOT DISTINCT FROM $3"
            " AND account_id IS NOT DISTINCT FROM $4 AND user_id IS NOT DISTINCT FROM $5"
        )

        async def read(session: Session) -> Sequence[Any] | None:
            return await session.fetchrow(sql, namespace, key, *_common.scope_args(scope))

        row = await self._driver.call(read)
        return None if row is None else _common.checkpoint_from_row(row)

    async def list_checkpoints(
        self,
        *,
        namespace: str | None = None,
        key_prefix: str | None = None,
        category: str | Sequence[str] | None = None,
        scope: OwnershipScope = ANY_SCOPE,
        cursor: str | None = None,
        limit: int = LIST_LIMIT_DEFAULT,
    ) -> CheckpointPage:
        """Newest first, then key; keyset-paged (see :meth:`CheckpointStore.list_checkpoints`)."""
        _common.check_list_filters(namespace, key_prefix, scope)
        categories = _common.check_category_filter(category)
        position = _common.decode_cursor(cursor)
        n = _common.clamp_limit(limit)
        if categories == ():
            await trio.lowlevel.checkpoint()
            return CheckpointPage(items=())
        where: list[str] = []
        args: list[Any] = []
        if namespace is not None:
            args.append(namespace)
            where.append(f"namespace = ${len(args)}")
        if key_prefix:
            # The planner derives the range from starts_with only for a constant: a prepared
            # statement's generic plan read the whole table (10,000 rows: 1.9 ms, 0.03 ms
            # with the range).
            low, high = _common.prefix_bounds(key_prefix)
            args.append(low)
            where.append(f"key >= ${len(args)}")
            if high is not None:
                args.append(high)
                where.append(f"key < ${len(args)}")
            args.append(key_prefix)
            where.append(f"starts_with(key, ${len(args)})")
        if categories is not None:
            args.append(list(categories))
            where.append(f"category = ANY(${len(args)}::text[])")
        _scope_filter(scope, where, args)
        if position is not None:
            at, last_key, last_ns = position
            args += [at, last_key, last_ns]
            a, k, s = (f"${len(args) - 2}", f"${len(args) - 1}", f"${len(args)}")
            where.append(
                f"(updated_at < {a} OR (updated_at = {a} AND (key > {k}"
                f" OR (key = {k} AND namespace > {s}))))"
            )
        sql = f"SELECT {_CHECKPOINT_COLUMNS} FROM {self._t}.prism_checkpoints"
        if where:
            sql += " WHERE " + " AND ".join(where)
        args.append(n + 1)
        sql += f" ORDER BY updated_at DESC, key ASC, namespace ASC LIMIT ${len(args)}"

        async def read(session: Session) -> Sequence[Sequence[Any]]:
            return await session.fetch(sql, *args)

        rows = [_common.checkpoint_from_row(row) for row in await self._driver.call(read)]
        items = tuple(rows[:n])
        next_cursor = _common.encode_cursor(items[-1]) if len(rows) > n else None
        return CheckpointPage(items=items, next_cursor=next_cursor)

    async def list_events(
        self, *, after: int = 0, limit: int = LIST_LIMIT_DEFAULT, scope: OwnershipScope = ANY_SCOPE
    ) -> EventPage:
        """Committed events with ``seq > after`` in ``seq`` order (which is commit order: see
        the module docstring), filtered by partial scope."""
        after, n = _common.check_event_args(after, limit, scope)
        where = ["seq > $1"]
        args: list[Any] = [after]
        _scope_filter(scope, where, args)
        args.append(n)
        sql = (
            f"SELECT {_EVENT_COLUMNS} FROM {self._t}.prism_events WHERE {' AND '.join(where)}"
            f" ORDER BY seq LIMIT ${len(args)}"
        )

        async def read(session: Session) -> Sequence[Sequence[Any]]:
            return await session.fetch(sql, *args)

        items = tuple(_common.event_from_row(row) for row in await self._driver.call(read))
        return EventPage(items=items, last_seq=items[-1].seq if items else after)

    async def last_event_seq(self) -> int:
        """The counter row as committed: commits are visible in ``seq`` order, so it is the
        highest committed event sequence number (0: none yet)."""
        sql = f"SELECT last_seq FROM {self._t}.prism_event_seq WHERE id = 1"

        async def read(session: Session) -> Sequence[Any] | None:
            return await session.fetchrow(sql)

        row = await self._driver.call(read)
        return 0 if row is None else int(row[0])


# --------------------------------------------------------------------------- leases


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


# --------------------------------------------------------------------------- inbox

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
        put = _common.check_inbox_put(
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
        owner, ttl, n, most, wanted = _common.check_inbox_claim_args(
            owner_id, ttl_ms, limit, max_attempts, sources
        )
        if wanted == ():
            await trio.lowlevel.checkpoint()
            return ()
        now = self._clock.now_ms()
        token = _common.new_claim_token()
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
        _common.check_inbox_claim(claim)
        rows = await self._rows(
            f"UPDATE {self._t} SET {assignments}"
            f" WHERE source = $1 AND key = $2 AND token = $3"
            f" AND state = ANY(${len(args) + 4}::text[]) RETURNING {_INBOX_COLUMNS}",
            claim.source, claim.key, claim.token, *args, list(states),
        )  # fmt: skip
        return _inbox_item(rows[0]) if rows else None

    async def extend(self, claim: InboxClaim, *, ttl_ms: int) -> InboxClaim | None:
        ttl = _common.check_inbox_ms(ttl_ms, "ttl_ms", minimum=1)
        now = self._clock.now_ms()
        item = await self._update(
            claim, ("claimed", "done"), "claim_expires_at = $4, updated_at = $5", now + ttl, now
        )
        return None if item is None else attrs.evolve(claim, item=item, expires_at_ms=now + ttl)

    async def complete(self, claim: InboxClaim, *, hold_ms: int = 0) -> bool:
        hold = _common.check_inbox_ms(hold_ms, "hold_ms", minimum=0)
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
        wanted = _common.check_inbox_sources(sources)
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
        delay = _common.check_inbox_ms(delay_ms, "delay_ms", minimum=0)
        code = _common.bound_inbox_error(error)
        most = _common.check_inbox_ms(max_attempts, "max_attempts", minimum=1)
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
        wanted = _common.check_inbox_state(state)
        position = _common.decode_inbox_cursor(cursor)
        n = _common.check_inbox_claim_args("-", 1, limit, 1, None)[2]
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
        return InboxPage(items, _common.encode_inbox_cursor(items[-1]) if more else None)

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
        before = _common.check_inbox_ms(before_ms, "before_ms", minimum=0)
        n = _common.check_inbox_claim_args("-", 1, limit, 1, None)[2]
        rows = await self._rows(
            f"DELETE FROM {self._t} WHERE (source, key) IN (SELECT source, key FROM {self._t}"
            " WHERE state IN ('done', 'discarded') AND updated_at < $1"
            " AND claim_expires_at <= $2 LIMIT $3 FOR UPDATE SKIP LOCKED) RETURNING 1",
            before, self._clock.now_ms(), n,
        )  # fmt: skip
        return len(rows)

    async def depth(self, *, sources: Sequence[str] | None = None) -> InboxDepth:
        wanted = _common.check_inbox_sources(sources)
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


# --------------------------------------------------------------------------- the store


@attrs.frozen
class PostgresStatistics:
    commits: int
    """Write transactions committed: fewer than ``writes`` under load (group commit)."""
    writes: int
    """Write jobs (one per store call) in those transactions."""


@attrs.define(eq=False)
class PostgresStore:
    """An open PostgreSQL :class:`~stores.Store`; made by :func:`open_postgres_store`."""

    _url: PostgresURL
    _driver: Driver
    _writer: _Writer
    checkpoints: PostgresCheckpointStore
    leases: PostgresLeaseStore
    inbox: PostgresInboxStore
    schema_status: SchemaStatus
    _writer_scope: trio.CancelScope = attrs.Factory(trio.CancelScope)
    _closed: bool = False

    @property
    def url(self) -> str:
        """The URL without its password."""
        return self._url.display

    def statistics(self) -> PostgresStatistics:
        """Counters of the write path since open (for the bench and the tests)."""
        return PostgresStatistics(commits=self._writer.commits, writes=self._writer.writes)

    async def aclose(self) -> None:
        """Finish the transaction in flight (bounded), fail what is queued, close the pool;
        idempotent. Every later call raises :class:`~stores.StoreUnavailableError`."""
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        with trio.move_on_after(CLOSE_BUDGET_S, shield=True):
            await self._writer.idle.wait()
        self._writer_scope.cancel()
        with trio.CancelScope(shield=True):
            await self._driver.aclose()


def _leaves(group: BaseExceptionGroup[BaseException]) -> list[BaseException]:
    out: list[BaseException] = []
    for exc in group.exceptions:
        out += _leaves(exc) if isinstance(exc, BaseExceptionGroup) else [exc]
    return out


@asynccontextmanager
async def _unwrapped() -> AsyncIterator[None]:
    """The loop's and the writer's nurseries wrap whatever crosses them in exception groups;
    one exception comes out as itself, so this store raises what SQLite's would (a
    :class:`~stores.StoreUnreachableError` on entering, the block's own error on leaving)."""
    try:
        yield
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        if len(leaves) != 1:
            raise
        raise leaves[0] from leaves[0].__cause__


@asynccontextmanager
async def open_postgres_store(
    url: str,
    *,
    clock: Clock = SYSTEM_CLOCK,
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
    options: PostgresOptions | None = None,
) -> AsyncIterator[PostgresStore]:
    """The store at ``url`` for the block: the loop, the pool and the writer live exactly as
    long. Entering checks the schema and applies missing migrations (see :mod:`stores._pg_schema`).

    Raises :class:`~stores.InvalidStoreURLError` for a malformed URL,
    :class:`~stores.StoreUnreachableError` when the server cannot be reached (refused, timed
    out, starting up) and :class:`~stores.StoreUnavailableError` for everything else that
    stops the open (login refused, no such database, a newer schema).
    """
    parsed = parse_postgres_url(url)
    _common.check_max_value_bytes(max_value_bytes)
    options = options or PostgresOptions()
    async with _unwrapped(), open_driver(parsed, options) as driver:
        where = driver.where

        async def migrate(session: Session) -> SchemaStatus:
            return await _schema.migrate(session, parsed.schema, where)

        status = await driver.call(migrate)
        table = _schema.quote_ident(parsed.schema)
        writer = _Writer(
            driver=driver,
            write_sql=f"SELECT * FROM {table}.prism_write_checkpoints("
            + ", ".join(f"${i}" for i in range(1, 16))
            + ")",
            outcome_wait_s=(options.statement_timeout_ms + options.connect_timeout_ms) / 1000 + 1,
        )
        store = PostgresStore(
            url=parsed,
            driver=driver,
            writer=writer,
            checkpoints=PostgresCheckpointStore(
                driver, writer, clock, max_value_bytes, parsed.schema
            ),
            leases=PostgresLeaseStore(driver, clock, parsed.schema),
            inbox=PostgresInboxStore(driver, clock, max_value_bytes, parsed.schema),
            schema_status=status,
        )
        async with trio.open_nursery() as nursery:

            async def write_loop() -> None:
                with store._writer_scope:
                    await writer.run()

            nursery.start_soon(write_loop)
            try:
                yield store
            finally:
                await store.aclose()


async def schema_status(
    url: str, *, options: PostgresOptions | None = None, apply: bool = False
) -> SchemaStatus:
    """Where the schema at ``url`` stands; with ``apply=True`` apply what is missing first
    (``prismd migrate``). Raises as :func:`open_postgres_store` does."""
    parsed = parse_postgres_url(url)
    async with _unwrapped(), open_driver(parsed, options or PostgresOptions()) as driver:
        where = driver.where

        async def run(session: Session) -> SchemaStatus:
            if apply:
                return await _schema.migrate(session, parsed.schema, where)
            return await _schema.status(session, parsed.schema, where)

        return await driver.call(run)


# --------------------------------------------------------------------------- the bridge bench


@attrs.frozen
class BridgeSamples:
    """Seconds per single-row write, three ways, in one run (``prismd bench``'s
    ``postgres-bridge``): the same ``prism_write_checkpoints`` call of one create-only save."""

    store: tuple[float, ...]
    """Through ``save_checkpoint``: validation, the writer task, the bridge, the statement."""
    bridge: tuple[float, ...]
    """The bare statement through the trio-asyncio bridge (one crossing, no writer)."""
    asyncio: tuple[float, ...]
    """The bare statement from plain asyncio (its own loop and connection, in a thread)."""


async def measure_bridge(store: Store, samples: int) -> BridgeSamples:
    """Time ``samples`` create-only saves each way, alternating so that load hits all three
    alike (``prismd bench``'s ``postgres-bridge``). ``TypeError`` for another store."""
    if not isinstance(store, PostgresStore):
        raise TypeError("the postgres-bridge measure needs a postgresql:// store")
    scope = OwnershipScope("bench-bridge")
    prefix = os.urandom(6).hex()
    writer = store._writer
    now = store.checkpoints._clock.now_ms

    def args(leg: str, i: int) -> list[list[Any]]:
        request = _common.check_save(
            namespace="bench.bridge", key=f"{prefix}-{leg}-{i}", scope=scope, version=1,
            value={"i": i}, expected_version=0, fencing_token=None, category=None,
            metadata=None, max_value_bytes=DEFAULT_MAX_VALUE_BYTES,
        )  # fmt: skip
        return _pack([_Job(requests=[request], atomic=False, now_ms=now())])

    through_store: list[float] = []
    through_bridge: list[float] = []
    chunk = max(1, min(samples, 50))
    asyncio_times: list[float] = []
    done = 0
    while done < samples:
        n = min(chunk, samples - done)
        for i in range(done, done + n):
            start = time.perf_counter()
            await store.checkpoints.save_checkpoint(
                namespace="bench.bridge", key=f"{prefix}-store-{i}", scope=scope, version=1,
                value={"i": i}, expected_version=0,
            )  # fmt: skip
            through_store.append(time.perf_counter() - start)
            statement = writer._statement(args("bridge", i))
            start = time.perf_counter()
            await store._driver.call(statement)
            through_bridge.append(time.perf_counter() - start)
        batch = [args("asyncio", i) for i in range(done, done + n)]
        asyncio_times += await trio.to_thread.run_sync(
            plain_asyncio_timings, store._driver, writer.write_sql, batch
        )
        done += n
    return BridgeSamples(tuple(through_store), tuple(through_bridge), tuple(asyncio_times))
