"""The SQLite engine: the writer and reader connections, group commit and the writer thread
(see :class:`_Database`), and the helpers every facet runs its statements with (``_one``,
``_scalar``, the scope filters).
"""

from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import apsw
import attrs
import trio

from .._types import Clock, StoreUnavailableError

T = TypeVar("T")


class _RolledBack(Exception):
    """Raised by a job to roll back its own savepoint and still answer ``value``."""

    def __init__(self, value: object) -> None:
        super().__init__()
        self.value = value


INLINE_WRITES = 256
"""A transaction of more writes than this (the sum of its jobs' ``weight``) runs its
statements in the writer thread: a bound on how long they hold the Trio loop."""
COMMIT_ON_LOOP_BELOW_S = 0.001
"""A ``COMMIT`` runs on the Trio thread only while the store's recent commits there each took
less than this (the slowest, decaying by :data:`COMMIT_TIME_DECAY` per commit since)."""
COMMIT_TIME_DECAY = 0.9
SLOW_COMMIT_S = 0.01
"""A ``COMMIT`` this long or longer is counted in :attr:`SQLiteStatistics.slow_commits`."""
WAL_CHECKPOINT_PAGES = 1000
"""Checkpoint (``PASSIVE``, in the writer thread) once the WAL holds this many pages:
SQLite's own automatic checkpoint, moved off whichever thread committed."""
MAX_JOBS_PER_TRANSACTION = 256
"""At most this many jobs share one transaction (later ones take the next)."""
READ_HERE_STEPS = 20_000
"""A read's statement on the Trio thread stops after this many steps of SQLite's virtual
machine, and the read is made in the worker thread instead (:meth:`_Database.run`). On
the bench's VM a statement stopped there had run 0.3 ms (p50); a read of one checkpoint by
its key makes 133 steps, of a lease 12, a page of 500 checkpoints through the listing
index 10,600, a route's bindings by key prefix 428."""


BUSY_TIMEOUT_MS = 5000
"""How long the writer thread waits for another process's lock on the file."""


def _one(conn: apsw.Connection, sql: str, args: Sequence[Any] = ()) -> Any:
    """The first row or ``None``. Always drains the statement: an unfinished statement with
    ``RETURNING`` would keep the transaction from committing."""
    rows = conn.execute(sql, args).fetchall()
    return rows[0] if rows else None


def _scalar(conn: apsw.Connection, sql: str) -> Any:
    row = _one(conn, sql)
    return None if row is None else row[0]


# Exact scope equality with NULL = NULL (``IS``): None differs from every string.
_SCOPE_IS = "tenant_id IS ? AND account_id IS ? AND user_id IS ?"


def _stop() -> bool:
    return True


@attrs.define(eq=False)
class _Job:
    """One caller's write, waiting for (or inside) a group-committed transaction."""

    fn: Callable[[apsw.Connection], Any]
    savepoint: bool
    """Run inside a savepoint of its own (see :meth:`_Database.write`)."""
    weight: int
    """How many writes it makes, at most (see :meth:`_Database.write`)."""
    waiting: trio.lowlevel.Task | None = None
    """The caller's task while it is parked for its answer or for the lead (see
    :meth:`_Database._park`); ``None`` once woken, and while it leads."""
    taken: bool = False
    """In a transaction: its outcome is that transaction's."""
    lead: bool = False
    """Woken to run the next transaction (handed over by the one that ran the last)."""
    result: Any = None
    error: BaseException | None = None


@attrs.define(eq=False)
class _ThreadCall:
    """A call for the writer thread; the caller's Trio run is woken through ``token``."""

    fn: Callable[[], Any]
    token: trio.lowlevel.TrioToken
    done: trio.Event = attrs.Factory(trio.Event)
    result: Any = None
    error: BaseException | None = None


@attrs.define(eq=False)
class _Database:
    """The writer and reader connections and the one path each statement takes to reach them.

    Writes are group-committed. A caller whose write finds no transaction in flight leads
    one: it lets the tasks runnable with it run first (one pass of the scheduler, no
    timer), everything queued by then shares the transaction, and when it ends, the
    oldest write queued meanwhile leads the next. A lone write is not held for company
    beyond that one pass.

    Where the statements run: on the Trio thread itself, unless the transaction makes
    more than :data:`INLINE_WRITES` writes in all (then the whole transaction runs in the
    writer thread). They touch memory, not the disk (WAL: pages are written at
    ``COMMIT``), and a thread running them would have to take the interpreter lock back
    from a busy loop after every statement; the web chat daemon measured 15–20% more
    messages per second this way.

    Where the ``COMMIT`` runs: on the Trio thread while every recent commit was fast
    (under :data:`COMMIT_ON_LOOP_BELOW_S`), else in the store's writer thread while the
    loop goes on. Handing a commit to the thread costs two thread wake-ups (0.16 ms on
    the 2-core VM of the bench, more than the fsync itself) and, on a busy loop, the wait
    for the loop to take the answer back: every durable step of a message paid it, and
    a message makes four in a row before its reply. Committing on the loop instead
    holds the loop for the fsync, once per transaction (which carries every write of
    its scheduler pass). A commit that turns out slow (a disk stall) blocks the loop
    that once, and sends the following ones to the thread until its time, decayed by
    :data:`COMMIT_TIME_DECAY` with each commit since, is below the bound again; then the
    loop commits, and measures, again. Only commits on the loop are timed: one in the
    thread ends when the thread has the interpreter lock back, and timed with that wait
    (the web chat daemon's: p50 1 ms, p95 4.5 ms) a busy loop kept 11-25% of the commits
    in the thread with a fast disk. On a disk that stays slow, one commit in every
    ``log(bound / commit time) / log(decay)`` or so holds the loop. What can wait
    on another process, or on more than a commit, always runs in the thread: a ``BEGIN``
    that finds the file locked by another connection, and the WAL checkpoint
    (:data:`WAL_CHECKPOINT_PAGES`).
    """

    conn: apsw.Connection
    reader: apsw.Connection
    """The worker thread's (:meth:`run`)."""
    loop_reader: apsw.Connection
    """The Trio thread's (:meth:`run`): its busy timeout is 0."""
    clock: Clock
    label: str
    busy_timeout_ms: int = BUSY_TIMEOUT_MS
    """How long a ``BEGIN`` waits (in the writer thread) for another connection's lock."""
    closed: bool = False
    _read_limiter: trio.CapacityLimiter = attrs.Factory(lambda: trio.CapacityLimiter(1))
    _pending: list[_Job] = attrs.Factory(list)
    """Writes queued for the next transaction (touched on the Trio thread only)."""
    _leading: bool = False
    """A transaction is being run, or its successor handed over: new writes queue."""
    _idle: trio.Event | None = None
    """Set when the last transaction ends (``aclose`` waits for it)."""
    _calls: queue.SimpleQueue[_ThreadCall | None] = attrs.Factory(queue.SimpleQueue)
    """The writer thread's calls (``None``: stop): a C queue, one call to hand a commit over
    (a ``threading.Condition`` took a lock, a notify and a list on the loop's side)."""
    _writer: threading.Thread | None = None
    commit_on_loop_below_s: float = COMMIT_ON_LOOP_BELOW_S
    """See :data:`COMMIT_ON_LOOP_BELOW_S` (tests set 0: every ``COMMIT`` in the thread)."""
    _commit_s: float = 0.0
    """The slowest recent ``COMMIT``, in seconds, decayed by each commit since."""
    _wal_pages: int = 0
    """Pages in the WAL after the last commit (from the WAL hook)."""
    commits: int = 0
    writes: int = 0
    slow_commits: int = 0
    """Commits that took :data:`SLOW_COMMIT_S` or longer (see :class:`SQLiteStatistics`)."""
    slow_commit_s: float = 0.0
    reads_in_thread: int = 0
    """Reads made again in the worker thread (see :meth:`run`)."""

    def __attrs_post_init__(self) -> None:
        # Replaces SQLite's automatic checkpoint (itself a WAL hook), which would run in
        # whichever thread commits: the loop's, for a commit made there.
        self.conn.set_wal_hook(self._wal_hook)
        # Called once a statement has made READ_HERE_STEPS steps: stops it (InterruptError).
        self.loop_reader.set_progress_handler(_stop, READ_HERE_STEPS)

    def _wal_hook(self, _conn: apsw.Connection, _name: str, pages: int) -> int:
        self._wal_pages = pages
        return apsw.SQLITE_OK

    def _unavailable(self, exc: apsw.Error) -> StoreUnavailableError:
        # Class name only: apsw messages can quote SQL.
        return StoreUnavailableError(f"SQLite store {self.label}: {type(exc).__name__}")

    async def run(self, fn: Callable[[apsw.Connection], T]) -> T:
        """Run the read ``fn(conn)``: on the Trio thread while it is short, else on a
        worker thread (one read at a time).

        First on the Trio thread's reader, which never waits for a lock and stops any
        statement past :data:`READ_HERE_STEPS` steps of SQLite's virtual machine; a read
        that finds the file locked or runs past that is made again, from the start, on
        the worker thread's reader, which waits up to the busy timeout. A read has no
        side effect, so the second run answers as the first would have. A reader in WAL
        mode waits for nobody but a connection that holds the file exclusively (a
        recovery, ``locking_mode=EXCLUSIVE``).

        Why not every read in the thread: most are short (one row by its key, a route's
        bindings), and one at a time behind the limiter, each paying two thread wake-ups
        and then the wait for a busy loop to take the interpreter lock back, they queued:
        the first admission on each of 64 new routes reads 5 checkpoints and a listing,
        and the last of those 384 reads answered some 140 ms after the first (admission
        at 64 routes: p99 140 ms, 25.8 on the loop).

        apsw errors become :class:`StoreUnavailableError`; our own errors pass through.
        """
        if self.closed:
            raise StoreUnavailableError("store is closed")
        await trio.lowlevel.checkpoint()
        if self.closed:
            raise StoreUnavailableError("store is closed")
        try:
            return fn(self.loop_reader)
        except (apsw.BusyError, apsw.InterruptError):
            self.reads_in_thread += 1
        except apsw.Error as exc:
            raise self._unavailable(exc) from None
        try:
            return await trio.to_thread.run_sync(
                self._read, fn, limiter=self._read_limiter, abandon_on_cancel=False
            )
        except apsw.Error as exc:
            raise self._unavailable(exc) from None

    def _read(self, fn: Callable[[apsw.Connection], T]) -> T:
        if self.closed:
            # Checked again in the thread: a close may have won the limiter first.
            raise StoreUnavailableError("store is closed")
        return fn(self.reader)

    async def write(
        self,
        fn: Callable[[apsw.Connection], T],
        *,
        savepoint: bool = True,
        weight: int = 1,
        linger_s: float = 0.0,
    ) -> T:
        """Run ``fn(conn)`` inside a savepoint of the next group-committed transaction.

        Returns what ``fn`` returned once the transaction is durable. An exception from
        ``fn`` rolls back its savepoint only and is raised here (:class:`_RolledBack`
        answers its value instead); a failed transaction raises
        :class:`StoreUnavailableError` for every job in it.

        ``savepoint=False`` spares the two statements of the savepoint for a job whose
        statements each either apply in full or change nothing, whatever the others do
        (a single-statement write, or independent ones: a lost check writes nothing). Such
        a job cannot be rolled back alone: if ``fn`` raises, the whole transaction is
        rolled back and fails. ``weight`` is how many writes ``fn`` makes at most: a
        transaction of more than :data:`INLINE_WRITES` in all runs in the writer thread.

        ``linger_s``: when no transaction is in flight, the write waits up to this long
        for another write to lead one, and shares it, before it leads one itself (see
        :meth:`_linger`). What waits for it waits that much longer, at most; a write that
        nothing waits on but its own caller (a reply's delivery mark) spares a commit
        this way when the next write comes within the time.

        Cancelled while queued, the write is withdrawn (nothing of it runs). Once its
        transaction has begun, its outcome is the transaction's: the call waits for it
        (bounded by one transaction) and answers it; the cancellation lands at the caller's
        next checkpoint.
        """
        if self.closed:
            raise StoreUnavailableError("store is closed")
        # Already cancelled: nothing is queued (a running transaction could take it).
        await trio.lowlevel.checkpoint_if_cancelled()
        job = _Job(fn, savepoint, weight)
        self._pending.append(job)
        if self._leading:
            await self._park(job)
        elif linger_s > 0:
            await self._linger(job, linger_s)
        else:
            self._leading = job.lead = True
        if job.lead:
            # Shielded: the writes queued behind this one wait for the transaction it runs.
            with trio.CancelScope(shield=True):
                await self._lead()
        if job.error is not None:
            raise job.error
        return job.result  # type: ignore[no-any-return]

    async def _park(self, job: _Job) -> None:
        """Wait until the job is answered or handed the next transaction (:meth:`_wake`).

        A cancellation while the job is still queued withdraws it (nothing of it runs) and
        raises here; once the job is in a transaction it cannot be aborted: the caller
        waits for that transaction's outcome (bounded by one transaction) and the
        cancellation lands at its next checkpoint. Parking the task itself (no
        :class:`trio.Event` per write) decides both in the same step as the cancellation:
        a withdrawn job is gone from the queue before anyone could hand it the lead."""
        job.waiting = trio.lowlevel.current_task()

        def abort(_: object) -> trio.lowlevel.Abort:
            if job.taken:
                return trio.lowlevel.Abort.FAILED
            self._pending.remove(job)
            job.waiting = None
            return trio.lowlevel.Abort.SUCCEEDED

        await trio.lowlevel.wait_task_rescheduled(abort)

    async def _linger(self, job: _Job, linger_s: float) -> None:
        """Wait up to ``linger_s`` for a transaction to take ``job`` (the next write that
        leads one takes everything queued); then lead one, unless one has begun meanwhile.
        A cancellation withdraws the job as :meth:`_park` does."""
        with trio.move_on_after(linger_s) as waited:
            await self._park(job)
        if not waited.cancelled_caught:
            return
        # Timed out while still queued: the park withdrew the job. Queue it again, as the
        # oldest (it was), unless the caller itself was cancelled meanwhile.
        await trio.lowlevel.checkpoint_if_cancelled()
        self._pending.insert(0, job)
        if self._leading:
            await self._park(job)
        else:
            self._leading = job.lead = True

    @staticmethod
    def _wake(job: _Job) -> None:
        task, job.waiting = job.waiting, None
        if task is not None:
            trio.lowlevel.reschedule(task)

    async def _lead(self) -> None:
        """Run one transaction of everything queued (this caller's write is the oldest),
        answer it, and hand the next to the oldest write queued meanwhile."""
        # One pass of the scheduler first: every task runnable in it queues its write into
        # this transaction (a COMMIT on the loop lets no task run until it returns).
        await trio.lowlevel.cancel_shielded_checkpoint()
        batch = self._pending[:MAX_JOBS_PER_TRANSACTION]
        del self._pending[:MAX_JOBS_PER_TRANSACTION]
        for job in batch:
            job.taken = True
        try:
            try:
                if sum(job.weight for job in batch) <= INLINE_WRITES:
                    await self._transaction_here(batch)
                else:
                    await self._in_thread(functools.partial(self._transaction, batch))
            except Exception:
                # Not a statement's error (those fail the transaction where they happen):
                # a job without a savepoint raised.
                self._abandon(batch)
            except BaseException:
                self._abandon(batch)
                raise
            finally:
                self._answer(batch)
            if self._wal_pages >= WAL_CHECKPOINT_PAGES and not self.closed:
                # The batch is answered already; the next transaction waits for this.
                with contextlib.suppress(StoreUnavailableError):
                    await self._in_thread(self._checkpoint)
        finally:
            self._hand_over()

    def _answer(self, batch: list[_Job]) -> None:
        for job in batch:
            self._wake(job)

    def _hand_over(self) -> None:
        """The next transaction to the oldest write queued, or the store is idle."""
        if self._pending:
            following = self._pending[0]
            following.lead = True
            self._wake(following)
        else:
            self._leading = False
            if self._idle is not None:
                self._idle.set()

    async def _transaction_here(self, batch: list[_Job]) -> None:
        """The statements on this (the Trio) thread; the ``COMMIT`` here too if the loop
        is idle and the disk has been fast, else in the writer thread."""
        conn = self.conn
        try:
            try:
                conn.execute("BEGIN IMMEDIATE")
            except apsw.BusyError:
                # Another connection holds the file: wait for it off the loop.
                await self._in_thread(self._begin_waiting)
            self._run_jobs(batch)
            if self._commit_s < self.commit_on_loop_below_s:
                self._commit()
            else:
                await self._in_thread(functools.partial(self._commit, here=False))
        except apsw.Error as exc:
            self._failed(batch, exc)
            return
        self._committed(batch)

    def _transaction(self, batch: list[_Job]) -> None:
        """The whole transaction, in the writer thread."""
        try:
            self._begin_waiting()
            self._run_jobs(batch)
            self._commit(here=False)
        except apsw.Error as exc:
            self._failed(batch, exc)
            return
        self._committed(batch)

    def _begin_waiting(self) -> None:
        """``BEGIN IMMEDIATE`` that waits up to the busy timeout for another connection's
        lock (off the loop: in the writer thread)."""
        conn = self.conn
        try:
            conn.execute("BEGIN IMMEDIATE")
            return
        except apsw.BusyError:
            pass
        conn.set_busy_timeout(self.busy_timeout_ms)
        try:
            conn.execute("BEGIN IMMEDIATE")
        finally:
            conn.set_busy_timeout(0)

    def _commit(self, *, here: bool = True) -> None:
        """``COMMIT``; only one on the Trio thread is timed for where the next ones run
        (``here=False``, in the writer thread: the slowest time only decays; see
        :class:`_Database`). Either counts in :attr:`slow_commits` when it took
        :data:`SLOW_COMMIT_S` or longer."""
        start = time.perf_counter()
        self.conn.execute("COMMIT")
        took = time.perf_counter() - start
        if took >= SLOW_COMMIT_S:
            self.slow_commits += 1
            self.slow_commit_s += took
        if here:
            self._commit_s = max(took, self._commit_s * COMMIT_TIME_DECAY)
        else:
            self._commit_s *= COMMIT_TIME_DECAY

    def _checkpoint(self) -> None:
        """A ``PASSIVE`` checkpoint (it never waits for readers), in the writer thread. The
        writes are durable in the WAL already: a failed checkpoint is retried after the
        next commit, as SQLite's own would be."""
        with contextlib.suppress(apsw.Error):
            self.conn.wal_checkpoint(mode=apsw.SQLITE_CHECKPOINT_PASSIVE)
        self._wal_pages = 0

    def _run_jobs(self, batch: list[_Job]) -> None:
        """Each job in its own savepoint, if it needs one; a statement's error
        (``apsw.Error``) propagates and fails the transaction, and so does any error of a
        job without a savepoint."""
        conn = self.conn
        for job in batch:
            if not job.savepoint:
                job.result = job.fn(conn)
                continue
            conn.execute("SAVEPOINT job")
            try:
                job.result = job.fn(conn)
            except apsw.Error:
                raise
            except _RolledBack as rolled:
                conn.execute("ROLLBACK TO job")
                job.result = rolled.value
            except Exception as exc:
                conn.execute("ROLLBACK TO job")
                job.error = exc
            conn.execute("RELEASE job")

    def _rollback(self) -> None:
        if self.conn.in_transaction:
            with contextlib.suppress(apsw.Error):
                self.conn.execute("ROLLBACK")

    @staticmethod
    def _fail(batch: list[_Job], error: StoreUnavailableError) -> None:
        for job in batch:
            job.result = None
            job.error = error

    def _failed(self, batch: list[_Job], exc: apsw.Error) -> None:
        """A statement, ``BEGIN`` or ``COMMIT`` failed: every job fails. Rolled back, since
        a transaction left open would wedge every later ``BEGIN`` on this connection."""
        self._rollback()
        self._fail(batch, self._unavailable(exc))

    def _abandon(self, batch: list[_Job]) -> None:
        """Nothing of the transaction stays and every job in it fails; the connection is
        not left inside a transaction that every later BEGIN would trip over."""
        self._rollback()
        self._fail(batch, StoreUnavailableError(f"SQLite store {self.label}: write failed"))

    def _committed(self, batch: list[_Job]) -> None:
        self.commits += 1
        self.writes += len(batch)

    async def _in_thread(self, fn: Callable[[], T]) -> T:
        """``fn()`` in the writer thread (started on first use); its exception is raised
        here. Only a transaction's leader calls this, so calls never overlap."""
        call = _ThreadCall(fn, trio.lowlevel.current_trio_token())
        if self._writer is None:
            writer = threading.Thread(
                target=self._write_loop, name=f"prismd-sqlite-writer {self.label}", daemon=True
            )
            try:
                writer.start()
            except RuntimeError:
                message = f"SQLite store {self.label}: no writer thread"
                raise StoreUnavailableError(message) from None
            self._writer = writer
        self._calls.put(call)
        await call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[no-any-return]

    def _write_loop(self) -> None:
        """The writer thread: the calls handed to it, one at a time, until stopped."""
        while True:
            call = self._calls.get()
            if call is None:
                return
            try:
                call.result = call.fn()
            except BaseException as exc:
                call.error = exc
            # A run that has ended has nobody left waiting.
            with contextlib.suppress(trio.RunFinishedError):
                call.token.run_sync_soon(call.done.set)

    async def aclose(self) -> None:
        if self.closed:
            return
        self.closed = True  # new calls are refused from here on
        if self._pending and not self._leading:
            # Writes lingering for company, with no transaction in flight: the oldest
            # leads one now.
            first = self._pending[0]
            self._leading = first.lead = True
            self._wake(first)
        # Every write queued is written; the connections are closed after the last
        # transaction has ended.
        with trio.CancelScope(shield=True):
            while self._leading:
                self._idle = trio.Event()
                await self._idle.wait()

        def close_writer() -> None:
            self.conn.close()

        # First: the writer, closed last, checkpoints the WAL into the file (in a thread).
        self.loop_reader.close()

        def close_reader() -> None:
            self.reader.close()

        writer = self._writer
        if writer is not None:
            self._calls.put(None)
            await trio.to_thread.run_sync(writer.join, abandon_on_cancel=False)
        await trio.to_thread.run_sync(close_writer, abandon_on_cancel=False)
        await trio.to_thread.run_sync(
            close_reader, limiter=self._read_limiter, abandon_on_cancel=False
        )
