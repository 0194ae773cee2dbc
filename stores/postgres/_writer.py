"""The one write path: jobs group-committed by one writer task, each transaction one call of
``prism_write_checkpoints`` (see the package's guarantees).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import attrs
import trio

from .. import _bases, _types
from .._types import (
    DeleteCheckpoint,
    SaveCheckpoint,
    StoreUnavailableError,
    WriteResult,
    WriteStatus,
)
from ._driver import Driver, RetryTransaction, Session, WriteRefused

log = logging.getLogger("stores.postgres")

MAX_JOBS = 64
"""Jobs per transaction: bounds the subtransactions of one transaction (atomic jobs) below
PostgreSQL's per-backend cache of 64, past which every snapshot in the cluster slows down."""
MAX_WRITES = _bases.MAX_BATCH_WRITES
"""Writes per transaction (one job may bring this many on its own)."""
RETRIES = 4
"""A transaction aborted by a deadlock or serialization failure is run again this often."""
_STATUSES: frozenset[str] = frozenset({"ok", "conflict", "missing", "aborted"})


@attrs.define(eq=False)
class _Job:
    """One caller's ``write_checkpoints`` (its writes checked): waiting for, or inside, a
    transaction."""

    requests: Sequence[SaveCheckpoint | DeleteCheckpoint]
    atomic: bool
    now_ms: int
    done: trio.Event = attrs.Factory(trio.Event)
    taken: bool = False
    results: tuple[WriteResult, ...] = ()
    error: BaseException | None = None

    def finish(
        self, results: tuple[WriteResult, ...] = (), error: BaseException | None = None
    ) -> None:
        if not self.done.is_set():
            self.results, self.error = results, error
            self.done.set()


def _pack(jobs: Sequence[_Job]) -> list[list[Any]]:
    """The arguments of ``prism_write_checkpoints``: one array per column, one element per
    write, jobs numbered in order."""
    columns: list[list[Any]] = [[] for _ in range(15)]
    for number, job in enumerate(jobs):
        for req in job.requests:
            if isinstance(req, DeleteCheckpoint):
                row: tuple[Any, ...] = (
                    number,
                    job.atomic,
                    job.now_ms,
                    True,
                    req.namespace,
                    req.key,
                    *_types.scope_args(req.scope),
                    None,
                    None,
                    None,
                    None,
                    None,
                    None,
                )
            else:
                row = (
                    number,
                    job.atomic,
                    job.now_ms,
                    False,
                    req.namespace,
                    req.key,
                    *_types.scope_args(req.scope),
                    req.version,
                    req.expected_version,
                    req.fencing_token,
                    req.category,
                    req.value_json,
                    req.metadata_json,
                )
            for column, value in zip(columns, row):
                column.append(value)
    return columns


def _unpack(jobs: Sequence[_Job], rows: Sequence[Sequence[Any]]) -> list[tuple[WriteResult, ...]]:
    """Each job's answer from the rows the write returned (one per write, in order)."""
    total = sum(len(job.requests) for job in jobs)
    if len(rows) != total:
        raise StoreUnavailableError("PostgreSQL store: the write answered an unexpected shape")
    out: list[tuple[WriteResult, ...]] = []
    it = iter(rows)
    for job in jobs:
        answered = [next(it) for _ in job.requests]
        if any(status not in _STATUSES for status, _created, _updated in answered):
            raise StoreUnavailableError("PostgreSQL store: unknown write status")
        out.append(_answer(job, answered))
    return out


def _answer(job: _Job, answered: list[Sequence[Any]]) -> tuple[WriteResult, ...]:
    """``write_checkpoints``' results, a written save's with its row's times (an ``atomic``
    job with a lost check: the others ``aborted``)."""
    results: list[WriteResult] = []
    for req, (status, created, updated) in zip(job.requests, answered, strict=True):
        status_: WriteStatus = status
        if status_ == "ok" and isinstance(req, SaveCheckpoint):
            results.append(WriteResult(status_, req, created, updated))
        else:
            results.append(WriteResult(status_))
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

    async def submit(self, job: _Job) -> tuple[WriteResult, ...]:
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
