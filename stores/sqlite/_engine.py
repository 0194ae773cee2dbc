"""The SQLite store (the default backend): apsw, WAL, ``synchronous=FULL``.

Guarantees:

* A call that returned has committed durably: WAL with ``synchronous=FULL`` (read back at
  open; anything else is refused with :class:`StoreUnavailableError`).
* Every write is one ``BEGIN IMMEDIATE`` transaction that holds the database write lock from
  its first statement, so the compare-and-swap checks and the write cannot interleave with
  another connection or process. A save or delete and its :class:`JournalEvent` commit together.
* The Trio loop never waits for another process, and waits for the disk only for the
  pages of a short read and while its commits there have been fast (after a slow one, once
  the slowest has decayed, to measure again): a read runs on the Trio thread's own reader
  connection, which never waits for a lock, until its statement has made
  :data:`READ_HERE_STEPS` steps, and is made again, if it finds the file locked or runs
  longer, on a reader connection in a worker thread (one at a time, via a
  ``CapacityLimiter(1)``); a ``BEGIN`` that finds the file locked, every checkpoint, and
  every ``COMMIT`` (the fsync) after a recent commit took :data:`COMMIT_ON_LOOP_BELOW_S` or
  longer, run on the writer connection in the store's own writer thread; WAL lets a read
  proceed while a write waits for its fsync. A write
  transaction's statements (memory work: WAL writes pages at ``COMMIT``) run on the Trio
  thread unless they are many (see :class:`_Database`).
* Group commit: every write is a job for :meth:`_Database.write`. Jobs that arrive while a
  transaction is in flight wait, and *all* of them share one ``BEGIN IMMEDIATE … COMMIT``
  (one fsync) as soon as that transaction ends, each inside its own ``SAVEPOINT`` so a job
  that fails or loses an atomic batch rolls back alone (a job whose statements each apply
  in full or not at all needs none). A writer on an idle store is committed after one pass
  of the scheduler (no timer, no linger). Nobody is answered before the shared ``COMMIT``
  returned; a failed transaction fails every job in it. A caller cancelled while its job is
  still queued leaves nothing behind; once its job is in a transaction it waits for the
  outcome, so a write is never left half-known. The thread ends when the store is closed.
* Two processes on one file coordinate through the ``prism_leases`` table: acquisition is one
  ``INSERT … ON CONFLICT DO UPDATE … WHERE … RETURNING`` statement.
* A corrupt, unreadable or newer-schema file raises :class:`StoreUnavailableError` at open;
  errors name the file but never include its contents.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, TypeVar

import apsw
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
    EventAction,
    EventPage,
    InboxClaim,
    InboxDepth,
    InboxItem,
    InboxPage,
    InboxState,
    InvalidInboxError,
    InvalidLeaseError,
    InvalidStoreURLError,
    JournalEvent,
    JSONValue,
    LeaseConflictError,
    LeaseRecord,
    OwnershipScope,
    SchemaStatus,
    StoreUnavailableError,
    WriteResult,
)

T = TypeVar("T")
W = TypeVar("W")
A = TypeVar("A")

SCHEMA_VERSION = 3
"""1: checkpoints, leases, events; 2: the inbox (``prism_inbox``); 3: no
``prism_checkpoints_recent`` index (see ``_SCHEMA_3``)."""
BUSY_TIMEOUT_MS = 5000

_SCHEMA = """
CREATE TABLE IF NOT EXISTS prism_checkpoints (
    namespace     TEXT    NOT NULL,
    key           TEXT    NOT NULL,
    version       INTEGER NOT NULL,
    fencing_token INTEGER,
    category      TEXT,
    tenant_id     TEXT,
    account_id    TEXT,
    user_id       TEXT,
    value         TEXT    NOT NULL,
    metadata      TEXT,
    created_at    INTEGER NOT NULL,
    updated_at    INTEGER NOT NULL,
    PRIMARY KEY (namespace, key)
);
CREATE INDEX IF NOT EXISTS prism_checkpoints_list
    ON prism_checkpoints (namespace, category, tenant_id, updated_at DESC, key);
CREATE TABLE IF NOT EXISTS prism_leases (
    namespace     TEXT    NOT NULL,
    key           TEXT    NOT NULL,
    tenant_id     TEXT,
    account_id    TEXT,
    user_id       TEXT,
    owner_id      TEXT    NOT NULL,
    token         TEXT    NOT NULL,
    fencing_token INTEGER NOT NULL,
    acquired_at   INTEGER NOT NULL,
    expires_at    INTEGER NOT NULL,
    updated_at    INTEGER NOT NULL,
    PRIMARY KEY (namespace, key)
);
CREATE TABLE IF NOT EXISTS prism_events (
    seq        INTEGER PRIMARY KEY AUTOINCREMENT,
    at         INTEGER NOT NULL,
    action     TEXT    NOT NULL,
    namespace  TEXT    NOT NULL,
    key        TEXT    NOT NULL,
    tenant_id  TEXT,
    account_id TEXT,
    user_id    TEXT,
    version    INTEGER,
    category   TEXT,
    metadata   TEXT
);
"""

_SCHEMA_2 = """
CREATE TABLE IF NOT EXISTS prism_inbox (
    source           TEXT    NOT NULL,
    key              TEXT    NOT NULL,
    partition        TEXT    NOT NULL,
    ord              INTEGER NOT NULL,
    payload          TEXT,
    state            TEXT    NOT NULL,
    attempts         INTEGER NOT NULL,
    available_at     INTEGER NOT NULL,
    owner_id         TEXT,
    token            TEXT,
    claim_expires_at INTEGER NOT NULL,
    error            TEXT,
    created_at       INTEGER NOT NULL,
    updated_at       INTEGER NOT NULL,
    PRIMARY KEY (source, key)
);
CREATE INDEX IF NOT EXISTS prism_inbox_ready ON prism_inbox (state, available_at);
CREATE INDEX IF NOT EXISTS prism_inbox_head ON prism_inbox (source, partition, state, ord, key);
CREATE INDEX IF NOT EXISTS prism_inbox_hold ON prism_inbox (source, partition, claim_expires_at);
CREATE INDEX IF NOT EXISTS prism_inbox_prune ON prism_inbox (state, updated_at);
"""
_SCHEMA_3 = """
DROP INDEX IF EXISTS prism_checkpoints_recent;
"""
"""Schema 1 had an index on ``(updated_at DESC, key, namespace)`` for a listing of every
namespace at once, which prismd never makes (its listings name a namespace and use
``prism_checkpoints_list`` or the primary key). Each save paid for it: a third B-tree
updated (delete and insert, since ``updated_at`` changes), a quarter of the statements'
time and a page of the WAL per commit. A listing without a namespace now reads the table
and sorts (still correct, slower on a large journal)."""
_MIGRATIONS = {1: _SCHEMA, 2: _SCHEMA_2, 3: _SCHEMA_3}
"""Forward-only: version N's DDL, applied in order from the file's version + 1."""

_CHECKPOINT_COLUMNS = (
    "namespace, key, version, fencing_token, category, tenant_id, account_id, user_id,"
    " value, metadata, created_at, updated_at"
)
_LEASE_COLUMNS = (
    "namespace, key, tenant_id, account_id, user_id, owner_id, token, fencing_token,"
    " acquired_at, expires_at, updated_at"
)
# Exact scope equality with NULL = NULL (``IS``): None differs from every string.
_SCOPE_IS = "tenant_id IS ? AND account_id IS ? AND user_id IS ?"


def _add_scope_filter(scope: OwnershipScope, where: list[str], args: list[Any]) -> None:
    """Append the partial-scope filter: each field that is set must match exactly."""
    for column, field in zip(("tenant_id", "account_id", "user_id"), _common.scope_args(scope)):
        if field is not None:
            where.append(f"{column} = ?")
            args.append(field)


_EVENT = (
    "INSERT INTO prism_events (at, action, namespace, key, tenant_id, account_id,"
    " user_id, version, category, metadata) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def _insert_event(
    conn: apsw.Connection,
    at_ms: int,
    action: EventAction,
    namespace: str,
    key: str,
    scope: OwnershipScope,
    version: int | None,
    category: str | None,
    metadata_json: str | None,
) -> None:
    """Journal a save or delete inside the transaction that made it."""
    conn.execute(
        _EVENT,
        (
            at_ms,
            action,
            namespace,
            key,
            *_common.scope_args(scope),
            version,
            category,
            metadata_json,
        ),
    )


def _lease(row: Sequence[Any]) -> LeaseRecord:
    (ns, key, tenant, account, user, owner, token, fence, acquired, expires, updated) = row
    return LeaseRecord(
        namespace=ns,
        key=key,
        scope=OwnershipScope(tenant, account, user),
        owner_id=owner,
        token=token,
        fencing_token=fence,
        acquired_at_ms=acquired,
        expires_at_ms=expires,
        updated_at_ms=updated,
    )


# --------------------------------------------------------------------------- URL + open


def sqlite_path_from_url(url: str) -> Path:
    """``sqlite:///rel/path`` → ``rel/path``; ``sqlite:////abs/path`` → ``/abs/path``.

    Raises :class:`InvalidStoreURLError` for anything else (no host, no query, no empty path).
    """
    if not isinstance(url, str) or not url.startswith("sqlite://"):
        raise InvalidStoreURLError("expected a sqlite:///PATH URL")
    rest = url[len("sqlite://") :]
    if not rest.startswith("/"):
        raise InvalidStoreURLError("sqlite URL must be sqlite:///relative or sqlite:////absolute")
    path = rest[1:]
    if not path or path.endswith("/") or "?" in path or "#" in path or "\x00" in path:
        raise InvalidStoreURLError("sqlite URL must name a database file: sqlite:///PATH")
    if not _common._is_text(path):
        # apsw takes UTF-8 names; a non-UTF-8 file name (surrogate-escaped) cannot be opened.
        raise InvalidStoreURLError("sqlite URL path must be valid UTF-8")
    return Path(path)


async def open_sqlite_store(
    url: str,
    *,
    clock: Clock = SYSTEM_CLOCK,
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
    busy_timeout_ms: int = BUSY_TIMEOUT_MS,
) -> SQLiteStore:
    """Open (creating it and its parent directories when missing) the database at ``url``.

    Raises :class:`InvalidStoreURLError` for a malformed URL and
    :class:`StoreUnavailableError` when the file cannot be opened, is not a healthy SQLite
    database, has a newer schema, or refuses WAL / ``synchronous=FULL``.
    """
    path = sqlite_path_from_url(url)
    _common.check_max_value_bytes(max_value_bytes)
    conn, reader, loop_reader = await trio.to_thread.run_sync(
        _open_connections, path, busy_timeout_ms, abandon_on_cancel=False
    )
    db = _Database(
        conn=conn,
        reader=reader,
        loop_reader=loop_reader,
        clock=clock,
        label=str(path),
        busy_timeout_ms=busy_timeout_ms,
    )
    return SQLiteStore(url=url, db=db, max_value_bytes=max_value_bytes)


async def sqlite_schema_status(url: str, *, apply: bool) -> SchemaStatus:
    """The schema version of the file at ``url``: with ``apply``, open it as the store does
    (creating and preparing it); without, read it and change nothing (a missing file is
    version 0). Raises as :func:`open_sqlite_store` does."""
    path = sqlite_path_from_url(url)
    if apply:
        before = await trio.to_thread.run_sync(_read_user_version, path)
        store = await open_sqlite_store(url)
        await store.aclose()
        applied = tuple(range(before + 1, SCHEMA_VERSION + 1))
        return SchemaStatus(str(path), SCHEMA_VERSION, SCHEMA_VERSION, applied)
    current = await trio.to_thread.run_sync(_read_user_version, path)
    if current > SCHEMA_VERSION:
        raise StoreUnavailableError(
            f"SQLite store {path}: schema version {current} is newer than this"
            f" prismd knows ({SCHEMA_VERSION})"
        )
    return SchemaStatus(str(path), current, SCHEMA_VERSION)


def _read_user_version(path: Path) -> int:
    if not path.is_file():
        return 0
    try:
        conn = apsw.Connection(os.fspath(path), flags=apsw.SQLITE_OPEN_READONLY)
        try:
            return int(_scalar(conn, "PRAGMA user_version"))
        finally:
            conn.close()
    except apsw.Error as exc:
        raise StoreUnavailableError(
            f"SQLite store {path}: not a usable SQLite database ({type(exc).__name__})"
        ) from None


def _open_connections(
    path: Path, busy_timeout_ms: int
) -> tuple[apsw.Connection, apsw.Connection, apsw.Connection]:
    """The writer (which checks and prepares the file), then the two readers on the same
    file: the worker thread's, which waits up to ``busy_timeout_ms`` for a lock, and the
    Trio thread's, which never waits (see :meth:`_Database.run`)."""
    conn = _open_connection(path, busy_timeout_ms)
    readers: list[apsw.Connection] = []
    try:
        for timeout_ms in (busy_timeout_ms, 0):
            reader = apsw.Connection(os.fspath(path), flags=apsw.SQLITE_OPEN_READWRITE)
            readers.append(reader)
            reader.set_busy_timeout(timeout_ms)
            reader.execute("PRAGMA query_only=ON")
            reader.execute(_TEMP_IN_MEMORY)
    except apsw.Error as exc:
        for reader in readers:
            reader.close()
        conn.close()
        raise StoreUnavailableError(
            f"SQLite store {path}: cannot open a reader ({type(exc).__name__})"
        ) from None
    # From now on the writer's BEGIN never waits on the Trio thread: a locked file is
    # waited for in the writer thread (``_Database._begin_waiting``).
    conn.set_busy_timeout(0)
    return conn, readers[0], readers[1]


def _open_connection(path: Path, busy_timeout_ms: int) -> apsw.Connection:
    label = str(path)
    if path.is_dir():
        raise StoreUnavailableError(f"SQLite store {label}: path is a directory")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StoreUnavailableError(
            f"SQLite store {label}: cannot create its directory ({type(exc).__name__})"
        ) from None
    try:
        conn = apsw.Connection(
            os.fspath(path), flags=apsw.SQLITE_OPEN_READWRITE | apsw.SQLITE_OPEN_CREATE
        )
    except apsw.Error as exc:
        raise StoreUnavailableError(
            f"SQLite store {label}: cannot open ({type(exc).__name__})"
        ) from None
    try:
        conn.set_busy_timeout(busy_timeout_ms)
        _prepare(conn, label)
    except StoreUnavailableError:
        conn.close()
        raise
    except apsw.Error as exc:
        conn.close()
        raise StoreUnavailableError(
            f"SQLite store {label}: not a usable SQLite database ({type(exc).__name__})"
        ) from None
    return conn


def _one(conn: apsw.Connection, sql: str, args: Sequence[Any] = ()) -> Any:
    """The first row or ``None``. Always drains the statement: an unfinished statement with
    ``RETURNING`` would keep the transaction from committing."""
    rows = conn.execute(sql, args).fetchall()
    return rows[0] if rows else None


def _scalar(conn: apsw.Connection, sql: str) -> Any:
    row = _one(conn, sql)
    return None if row is None else row[0]


_TEMP_IN_MEMORY = "PRAGMA temp_store=MEMORY"
"""Temporary storage in memory: a savepoint's statement journal (an atomic batch of several
writes, such as a turn's terminal) and a sort's temporary B-tree, bounded by one
transaction's pages or one listing page. SQLite's default keeps a statement journal in a
buffer that spills to a temporary file past 64 KiB; a turn's journal never got that far
(strace: no temporary file was opened), yet with it the first write inside a savepoint,
the terminal's reply insert, took 36-43 us in the pipeline, and 17 us in memory."""


def _prepare(conn: apsw.Connection, label: str) -> None:
    # quick_check first: on a damaged file it fails (or reports) before we write anything.
    check = conn.execute("PRAGMA quick_check").fetchall()
    if [tuple(r) for r in check] != [("ok",)]:
        raise StoreUnavailableError(f"SQLite store {label}: integrity check failed")
    mode = _scalar(conn, "PRAGMA journal_mode=WAL")
    if str(mode).lower() != "wal":
        raise StoreUnavailableError(f"SQLite store {label}: WAL journal mode refused")
    conn.execute("PRAGMA synchronous=FULL")
    # Read it back: a build or VFS that silently ignores the pragma would make every "committed"
    # answer a lie after a power cut.
    if _scalar(conn, "PRAGMA synchronous") != 2:
        raise StoreUnavailableError(f"SQLite store {label}: synchronous=FULL refused")
    conn.execute("PRAGMA foreign_keys=ON")
    conn.execute(_TEMP_IN_MEMORY)
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = _scalar(conn, "PRAGMA user_version")
        if not 0 <= version <= SCHEMA_VERSION:
            raise StoreUnavailableError(
                f"SQLite store {label}: schema version {version} is newer than this"
                f" prismd knows ({SCHEMA_VERSION})"
            )
        for step in range(version + 1, SCHEMA_VERSION + 1):
            conn.execute(_MIGRATIONS[step])
        if version != SCHEMA_VERSION:
            conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise


# --------------------------------------------------------------------------- the DB seam


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
    _calls: list[_ThreadCall] = attrs.Factory(list)
    _cond: threading.Condition = attrs.Factory(threading.Condition)
    """Guards ``_calls`` and ``_stopping``."""
    _writer: threading.Thread | None = None
    _stopping: bool = False
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
        self, fn: Callable[[apsw.Connection], T], *, savepoint: bool = True, weight: int = 1
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
                if self.closed:
                    self._fail(batch, StoreUnavailableError("store is closed"))
                elif sum(job.weight for job in batch) <= INLINE_WRITES:
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
        with self._cond:
            if self._writer is None:
                writer = threading.Thread(
                    target=self._write_loop, name=f"prismd-sqlite-writer {self.label}", daemon=True
                )
                try:
                    writer.start()
                except RuntimeError:
                    raise StoreUnavailableError(
                        f"SQLite store {self.label}: no writer thread"
                    ) from None
                self._writer = writer
            self._calls.append(call)
            self._cond.notify()
        await call.done.wait()
        if call.error is not None:
            raise call.error
        return call.result  # type: ignore[no-any-return]

    def _write_loop(self) -> None:
        """The writer thread: the calls handed to it, one at a time, until stopped."""
        while True:
            with self._cond:
                while not self._calls and not self._stopping:
                    self._cond.wait()
                if not self._calls:
                    return
                call = self._calls.pop(0)
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
        self.closed = True

        def close_writer() -> None:
            self.conn.close()

        # First: the writer, closed last, checkpoints the WAL into the file (in a thread).
        self.loop_reader.close()

        def close_reader() -> None:
            self.reader.close()

        # Each connection is closed after any call in flight: the writer's once the last
        # transaction has ended (writes still queued are answered "store is closed").
        with trio.CancelScope(shield=True):
            while self._leading:
                self._idle = trio.Event()
                await self._idle.wait()
        with self._cond:
            self._stopping = True
            self._cond.notify()
            writer = self._writer
        if writer is not None:
            await trio.to_thread.run_sync(writer.join, abandon_on_cancel=False)
        await trio.to_thread.run_sync(close_writer, abandon_on_cancel=False)
        await trio.to_thread.run_sync(
            close_reader, limiter=self._read_limiter, abandon_on_cancel=False
        )


# --------------------------------------------------------------------------- checkpoints

_INSERT = (
    f"INSERT INTO prism_checkpoints AS c ({_CHECKPOINT_COLUMNS})"
    " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)


def _overwrite(new: Callable[[str], str], expected: str) -> tuple[str, str]:
    """The ``SET`` and the ``WHERE`` of a write over the stored row ``c``: ``new(column)``
    is the SQL of the value written to ``column``, ``expected`` that of the expected
    version (``NULL``: any). The ``WHERE`` holds the checks of contract §1.2 steps 2-5, the
    same for the upsert and for the ``UPDATE`` of a positive expected version."""
    fence = new("fencing_token")
    assignments = ", ".join(
        f"{column} = {new(column)}"
        for column in ("version", "fencing_token", "category", "value", "metadata")
    )
    checks = (
        f"c.tenant_id IS {new('tenant_id')} AND c.account_id IS {new('account_id')}"
        f" AND c.user_id IS {new('user_id')}"
        f" AND ({expected} IS NULL OR c.version = {expected})"
        f" AND {new('version')} > c.version"
        f" AND (c.fencing_token IS NULL OR ({fence} IS NOT NULL AND {fence} >= c.fencing_token))"
    )
    return f"{assignments}, updated_at = max({new('updated_at')}, c.updated_at)", checks


# What a successful write hands back: everything else it wrote is the request's own.
_WRITTEN = "created_at, updated_at"
_CREATE_ONLY = f"{_INSERT} ON CONFLICT (namespace, key) DO NOTHING RETURNING {_WRITTEN}"
_UPSERT_SET, _UPSERT_WHERE = _overwrite(lambda column: f"excluded.{column}", "?")
_UPSERT_ANY = (
    f"{_INSERT} ON CONFLICT (namespace, key) DO UPDATE SET {_UPSERT_SET}"
    f" WHERE {_UPSERT_WHERE} RETURNING {_WRITTEN}"
)
# A positive expected version needs an existing row: a plain UPDATE of it (one index seek;
# an upsert would look the row up twice and draw a new rowid before it met the conflict),
# bound like the insert (each column's value at its place in the column list) and then the
# expected version.
_PARAMETER = {
    column.strip(): f"?{n}" for n, column in enumerate(_CHECKPOINT_COLUMNS.split(","), start=1)
}
_UPDATE_SET, _UPDATE_WHERE = _overwrite(_PARAMETER.__getitem__, f"?{len(_PARAMETER) + 1}")
_UPDATE_AT = (
    f"UPDATE prism_checkpoints AS c SET {_UPDATE_SET}"
    f" WHERE namespace = {_PARAMETER['namespace']} AND key = {_PARAMETER['key']}"
    f" AND {_UPDATE_WHERE} RETURNING {_WRITTEN}"
)
_DELETE = (
    f"DELETE FROM prism_checkpoints WHERE namespace = ? AND key = ? AND {_SCOPE_IS}"
    " RETURNING version, category"
)


def _apply_save(
    conn: apsw.Connection, req: _common.SaveRequest | EncodedSave, now: int
) -> tuple[int, int] | None:
    """One save: one statement whose ``WHERE`` holds every check, then its event. The
    stored row's ``(created_at, updated_at)``, or ``None`` when a check failed (nothing
    written). Every save of either write method takes this path."""
    scope = req.scope
    tenant, account, user = scope.tenant_id, scope.account_id, scope.user_id
    values = (
        req.namespace,
        req.key,
        req.version,
        req.fencing_token,
        req.category,
        tenant,
        account,
        user,
        req.value_json,
        req.metadata_json,
        now,
        now,
    )
    expected = req.expected_version
    if expected == 0:
        rows = conn.execute(_CREATE_ONLY, values).fetchall()
    elif expected is None:
        rows = conn.execute(_UPSERT_ANY, (*values, None, None)).fetchall()
    else:
        rows = conn.execute(_UPDATE_AT, (*values, expected)).fetchall()
    if not rows:
        return None
    _insert_event(
        conn, now, "save", req.namespace, req.key, scope, req.version, req.category,
        req.metadata_json,
    )  # fmt: skip
    created, updated = rows[0]
    return created, updated  # type: ignore[return-value]


def _apply(
    conn: apsw.Connection, req: _common.SaveRequest | _common.DeleteRequest, now: int
) -> WriteResult:
    """One write of a ``write_checkpoints`` batch, answered with the stored record."""
    if isinstance(req, _common.DeleteRequest):
        gone = _one(conn, _DELETE, (req.namespace, req.key, *_common.scope_args(req.scope)))
        if gone is None:
            return WriteResult("missing")
        version, category = gone
        _insert_event(
            conn, now, "delete", req.namespace, req.key, req.scope, version, category, None
        )
        return WriteResult("ok")
    stored = _apply_save(conn, req, now)
    if stored is None:
        return WriteResult("conflict")
    return WriteResult("ok", req.stored(*stored))


def _saved_at(conn: apsw.Connection, save: EncodedSave, now: int) -> int | None:
    """``save_encoded``'s answer for one save: the row's ``updated_at``, or ``None``."""
    stored = _apply_save(conn, save, now)
    return None if stored is None else stored[1]


def _result_lost(result: WriteResult) -> bool:
    return not result.ok


def _result_aborted(result: WriteResult) -> WriteResult:
    return result if not result.ok else _ABORTED


_ABORTED = WriteResult("aborted")


def _time_lost(updated_at: int | None) -> bool:
    return updated_at is None


def _time_aborted(updated_at: int | None) -> int | None:
    return None if updated_at is None else 0


@attrs.define(eq=False)
class SQLiteCheckpointStore(_common.SavesAsABatchOfOne):
    """:class:`~stores.CheckpointStore` on ``prism_checkpoints`` + ``prism_events``."""

    _db: _Database
    _max_value_bytes: int

    async def write_checkpoints(
        self, writes: Sequence[CheckpointWrite], *, atomic: bool = False
    ) -> tuple[WriteResult, ...]:
        """The batch in one savepoint of a group-committed transaction (see
        :meth:`~stores.CheckpointStore.write_checkpoints`); an ``atomic`` batch with a lost
        check rolls its savepoint back."""
        requests = _common.check_writes(writes, atomic, self._max_value_bytes)
        return await self._batch(requests, atomic, _apply, _result_lost, _result_aborted)

    async def save_encoded(
        self, saves: Sequence[EncodedSave], *, atomic: bool = False
    ) -> tuple[int | None, ...]:
        """The saves in one savepoint of a group-committed transaction, as
        :meth:`write_checkpoints` (see :meth:`~stores.CheckpointStore.save_encoded`)."""
        checked = _common.check_encoded(saves, atomic, self._max_value_bytes)
        return await self._batch(checked, atomic, _saved_at, _time_lost, _time_aborted)

    async def _batch(
        self,
        writes: Sequence[W],
        atomic: bool,
        apply: Callable[[apsw.Connection, W, int], A],
        lost: Callable[[A], bool],
        aborted: Callable[[A], A],
    ) -> tuple[A, ...]:
        """``apply`` each write in one job of the next group-committed transaction; an
        ``atomic`` batch in which one was ``lost`` is rolled back and answered
        ``aborted`` for each (what a lost one answers stays)."""
        now = self._db.clock.now_ms()
        # Each write is one statement whose WHERE holds its checks, plus its event: only an
        # atomic batch of several needs a savepoint, to undo the ones already applied.
        undo = atomic and len(writes) > 1

        def txn(conn: apsw.Connection) -> tuple[A, ...]:
            results = tuple(apply(conn, write, now) for write in writes)
            if undo and any(lost(r) for r in results):
                raise _RolledBack(tuple(aborted(r) for r in results))
            return results

        return await self._db.write(txn, savepoint=undo, weight=len(writes))

    async def load_checkpoint(
        self, *, namespace: str, key: str, scope: OwnershipScope
    ) -> CheckpointRecord | None:
        """The row, or ``None`` when absent or stored under another exact scope."""
        _common.check_checkpoint_address(namespace, key, scope)

        def read(conn: apsw.Connection) -> CheckpointRecord | None:
            row = _one(
                conn,
                f"SELECT {_CHECKPOINT_COLUMNS} FROM prism_checkpoints"
                f" WHERE namespace = ? AND key = ? AND {_SCOPE_IS}",
                (namespace, key, *_common.scope_args(scope)),
            )
            return None if row is None else _common.checkpoint_from_row(row)

        return await self._db.run(read)

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
            return CheckpointPage(items=())
        where: list[str] = []
        args: list[Any] = []
        if namespace is not None:
            where.append("namespace = ?")
            args.append(namespace)
        if key_prefix:
            low, high = _common.prefix_bounds(key_prefix)
            where.append("key >= ?")
            args.append(low)
            if high is not None:
                where.append("key < ?")
                args.append(high)
            where.append("substr(key, 1, ?) = ?")
            args += [len(key_prefix), key_prefix]
        if categories is not None:
            where.append(f"category IN ({', '.join('?' for _ in categories)})")
            args += categories
        _add_scope_filter(scope, where, args)
        if position is not None:
            at, last_key, last_ns = position
            where.append(
                "(updated_at < ? OR (updated_at = ? AND (key > ? OR (key = ? AND namespace > ?))))"
            )
            args += [at, at, last_key, last_key, last_ns]
        sql = f"SELECT {_CHECKPOINT_COLUMNS} FROM prism_checkpoints"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += " ORDER BY updated_at DESC, key ASC, namespace ASC LIMIT ?"
        args.append(n + 1)

        def read(conn: apsw.Connection) -> list[CheckpointRecord]:
            return [_common.checkpoint_from_row(row) for row in conn.execute(sql, args).fetchall()]

        rows = await self._db.run(read)
        items = tuple(rows[:n])
        next_cursor = _common.encode_cursor(items[-1]) if len(rows) > n else None
        return CheckpointPage(items=items, next_cursor=next_cursor)

    async def delete_checkpoint(self, *, namespace: str, key: str, scope: OwnershipScope) -> bool:
        """True when a row was removed (its delete event committed with it); a foreign
        scope is a miss."""
        (result,) = await self.write_checkpoints((DeleteCheckpoint(namespace, key, scope),))
        return result.ok

    async def list_events(
        self, *, after: int = 0, limit: int = LIST_LIMIT_DEFAULT, scope: OwnershipScope = ANY_SCOPE
    ) -> EventPage:
        """Committed events with ``seq > after`` in commit order, filtered by partial scope."""
        after, n = _common.check_event_args(after, limit, scope)
        where = ["seq > ?"]
        args: list[Any] = [after]
        _add_scope_filter(scope, where, args)
        sql = (
            "SELECT seq, at, action, namespace, key, tenant_id, account_id, user_id, version,"
            f" category, metadata FROM prism_events WHERE {' AND '.join(where)}"
            " ORDER BY seq LIMIT ?"
        )
        args.append(n)

        def read(conn: apsw.Connection) -> list[JournalEvent]:
            rows: list[Any] = conn.execute(sql, args).fetchall()
            return [_common.event_from_row(row) for row in rows]

        items = tuple(await self._db.run(read))
        return EventPage(items=items, last_seq=items[-1].seq if items else after)

    async def last_event_seq(self) -> int:
        """The highest committed event sequence number (0: none yet)."""

        def read(conn: apsw.Connection) -> int:
            return int(_scalar(conn, "SELECT coalesce(max(seq), 0) FROM prism_events"))

        return await self._db.run(read)


# --------------------------------------------------------------------------- leases


@attrs.define(eq=False)
class SQLiteLeaseStore:
    """:class:`~stores.LeaseStore` on ``prism_leases``; rows are never deleted, so fencing
    counters survive release and expiry."""

    _db: _Database

    @staticmethod
    def _check_scope(
        conn: apsw.Connection, namespace: str, key: str, scope: OwnershipScope
    ) -> None:
        row = _one(
            conn,
            "SELECT tenant_id, account_id, user_id FROM prism_leases"
            " WHERE namespace = ? AND key = ?",
            (namespace, key),
        )
        if row is not None and tuple(row) != _common.scope_args(scope):
            raise LeaseConflictError("lease ownership mismatch")

    async def _move_expiry(
        self,
        namespace: str,
        key: str,
        scope: OwnershipScope,
        owner_id: str,
        token: str,
        now: int,
        expires_at: int,
    ) -> LeaseRecord | None:
        """Set the expiry of the unexpired lease (owner_id, token) holds; ``None`` when it
        does not hold one. The scope is checked only when the update misses, so the common
        case is one statement."""

        def txn(conn: apsw.Connection) -> LeaseRecord | None:
            row = _one(
                conn,
                "UPDATE prism_leases SET expires_at = ?, updated_at = ?"
                f" WHERE namespace = ? AND key = ? AND {_SCOPE_IS}"
                " AND owner_id = ? AND token = ? AND expires_at > ?"
                f" RETURNING {_LEASE_COLUMNS}",
                (expires_at, now, namespace, key, *_common.scope_args(scope), owner_id, token, now),
            )
            if row is not None:
                return _lease(row)
            self._check_scope(conn, namespace, key, scope)
            return None

        return await self._db.write(txn)

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
        """A fresh lease (new token, fencing token + 1), or ``None`` while someone else holds it.

        One statement decides: insert, or take over a row that is expired (or, with
        ``reclaim=True``, held by the same ``owner_id``) in the same scope.
        Raises :class:`~stores.LeaseConflictError` for a foreign scope or bad input.
        """
        _common.check_lease_address(namespace, key, scope)
        _common.check_name(owner_id, "owner_id", InvalidLeaseError)
        ttl = _common.check_ttl(ttl_ms)
        if not isinstance(reclaim, bool):
            raise InvalidLeaseError("reclaim must be a bool")
        now = self._db.clock.now_ms()
        token = os.urandom(16).hex()
        sql = (
            f"INSERT INTO prism_leases AS l ({_LEASE_COLUMNS})"
            " VALUES (?, ?, ?, ?, ?, ?, ?, 1, ?, ?, ?)"
            " ON CONFLICT (namespace, key) DO UPDATE SET"
            " owner_id = excluded.owner_id, token = excluded.token,"
            " fencing_token = l.fencing_token + 1, acquired_at = excluded.acquired_at,"
            " expires_at = excluded.expires_at, updated_at = excluded.updated_at"
            " WHERE l.tenant_id IS excluded.tenant_id AND l.account_id IS excluded.account_id"
            " AND l.user_id IS excluded.user_id"
            " AND (l.expires_at <= excluded.acquired_at OR (? AND l.owner_id = excluded.owner_id))"
            f" RETURNING {_LEASE_COLUMNS}"
        )
        args = (
            namespace,
            key,
            *_common.scope_args(scope),
            owner_id,
            token,
            now,
            now + ttl,
            now,
            1 if reclaim else 0,
        )

        def txn(conn: apsw.Connection) -> LeaseRecord | None:
            row = _one(conn, sql, args)
            if row is not None:
                return _lease(row)
            self._check_scope(conn, namespace, key, scope)
            return None

        return await self._db.write(txn)

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
        now = self._db.clock.now_ms()
        return await self._move_expiry(namespace, key, scope, owner_id, token, now, now + ttl)

    async def release_lease(
        self, *, namespace: str, key: str, scope: OwnershipScope, owner_id: str, token: str
    ) -> bool:
        """Expire the lease now when (owner_id, token) holds it; ``False`` otherwise."""
        _common.check_lease_address(namespace, key, scope)
        _common.check_name(owner_id, "owner_id", InvalidLeaseError)
        _common.check_name(token, "token", InvalidLeaseError)
        now = self._db.clock.now_ms()
        return await self._move_expiry(namespace, key, scope, owner_id, token, now, now) is not None

    async def get_lease(
        self, *, namespace: str, key: str, scope: OwnershipScope
    ) -> LeaseRecord | None:
        """The unexpired lease, or ``None``; a foreign scope raises LeaseConflictError."""
        _common.check_lease_address(namespace, key, scope)
        now = self._db.clock.now_ms()

        def read(conn: apsw.Connection) -> LeaseRecord | None:
            row = _one(
                conn,
                f"SELECT {_LEASE_COLUMNS} FROM prism_leases WHERE namespace = ? AND key = ?",
                (namespace, key),
            )
            if row is None:
                return None
            lease = _lease(row)
            if lease.scope != scope:
                raise LeaseConflictError("lease ownership mismatch")
            return lease if lease.expires_at_ms > now else None

        return await self._db.run(read)


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
        put = _common.check_inbox_put(
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
        owner, ttl, n, most, wanted = _common.check_inbox_claim_args(
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
                token = _common.new_claim_token()
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
        _common.check_inbox_claim(claim)
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
        ttl = _common.check_inbox_ms(ttl_ms, "ttl_ms", minimum=1)
        now = self._db.clock.now_ms()
        item = await self._update(
            claim,
            ("claimed", "done"),
            "claim_expires_at = ?, updated_at = ?",
            (now + ttl, now),
        )
        return None if item is None else attrs.evolve(claim, item=item, expires_at_ms=now + ttl)

    async def complete(self, claim: InboxClaim, *, hold_ms: int = 0) -> bool:
        hold = _common.check_inbox_ms(hold_ms, "hold_ms", minimum=0)
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
        wanted = _common.check_inbox_sources(sources)
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
        delay = _common.check_inbox_ms(delay_ms, "delay_ms", minimum=0)
        code = _common.bound_inbox_error(error)
        most = _common.check_inbox_ms(max_attempts, "max_attempts", minimum=1)
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
        wanted = _common.check_inbox_state(state)
        position = _common.decode_inbox_cursor(cursor)
        n = _common.check_inbox_claim_args("-", 1, limit, 1, None)[2]
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
        return InboxPage(items, _common.encode_inbox_cursor(items[-1]) if more else None)

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
        before = _common.check_inbox_ms(before_ms, "before_ms", minimum=0)
        n = _common.check_inbox_claim_args("-", 1, limit, 1, None)[2]
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
        wanted = _common.check_inbox_sources(sources)
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


# --------------------------------------------------------------------------- the store


@attrs.frozen
class SQLiteStatistics:
    commits: int
    """Transactions committed: one fsync each; fewer than ``writes`` under load."""
    writes: int
    """Write jobs (one per store call) in those transactions."""
    slow_commits: int = 0
    """Of ``commits``, those whose ``COMMIT`` took :data:`SLOW_COMMIT_S` (10 ms) or longer:
    the disk's stalls, which every write waiting for them shares (one in the writer thread
    is timed with its wait for the interpreter lock too)."""
    slow_commit_s: float = 0.0
    """The time those took, in all."""


@attrs.define(eq=False)
class SQLiteStore:
    """An open SQLite :class:`~stores.Store`; use :func:`open_sqlite_store` to make one.

    Usable as ``async with``; after :meth:`aclose` every call raises
    :class:`StoreUnavailableError`.
    """

    _url: str = attrs.field(alias="url")
    _db: _Database = attrs.field(alias="db")
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    _checkpoints: SQLiteCheckpointStore = attrs.field(init=False)
    _leases: SQLiteLeaseStore = attrs.field(init=False)
    _inbox: SQLiteInboxStore = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._checkpoints = SQLiteCheckpointStore(self._db, self.max_value_bytes)
        self._leases = SQLiteLeaseStore(self._db)
        self._inbox = SQLiteInboxStore(self._db, self.max_value_bytes)

    @property
    def url(self) -> str:
        return self._url

    @property
    def checkpoints(self) -> SQLiteCheckpointStore:
        return self._checkpoints

    @property
    def leases(self) -> SQLiteLeaseStore:
        return self._leases

    @property
    def inbox(self) -> SQLiteInboxStore:
        return self._inbox

    def statistics(self) -> SQLiteStatistics:
        """Counters of the write path since open (for the bench and the tests)."""
        db = self._db
        return SQLiteStatistics(
            commits=db.commits,
            writes=db.writes,
            slow_commits=db.slow_commits,
            slow_commit_s=db.slow_commit_s,
        )

    async def aclose(self) -> None:
        """Close the connections (after any call in flight); idempotent."""
        await self._db.aclose()

    async def __aenter__(self) -> SQLiteStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
