"""The SQLite file: its URL, its schema and forward migrations, the connections' settings
(WAL, ``synchronous=FULL`` read back). Used when the store opens; the statements a facet
runs per request use the engine's helpers (:mod:`._engine`).
"""

from __future__ import annotations

import os
from pathlib import Path

import apsw

from .. import _types
from .._types import InvalidStoreURLError, StoreUnavailableError
from ._engine import _scalar

SCHEMA_VERSION = 3
"""1: checkpoints, leases, events; 2: the inbox (``prism_inbox``); 3: no
``prism_checkpoints_recent`` index (see ``_SCHEMA_3``)."""

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
    if not _types._is_text(path):
        # apsw takes UTF-8 names; a non-UTF-8 file name (surrogate-escaped) cannot be opened.
        raise InvalidStoreURLError("sqlite URL path must be valid UTF-8")
    return Path(path)


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
            reader.execute(_READER_CACHE)
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


_TEMP_IN_MEMORY = "PRAGMA temp_store=MEMORY"
"""Temporary storage in memory: a savepoint's statement journal (an atomic batch of several
writes, such as a turn's terminal) and a sort's temporary B-tree, bounded by one
transaction's pages or one listing page. SQLite's default keeps a statement journal in a
buffer that spills to a temporary file past 64 KiB; a turn's journal never got that far
(strace: no temporary file was opened), yet with it the first write inside a savepoint,
the terminal's reply insert, took 36-43 us in the pipeline, and 17 us in memory."""


_READER_CACHE = "PRAGMA cache_size=-256"
"""A reader's page cache: 256 KiB, the writer's SQLite's default 2 MiB. In WAL mode a
connection discards its whole page cache when it begins a read after another connection
committed, and the writer commits all the time: a reader's cache serves one statement,
never the next (the a2a bench, 10,000 tasks: the worker thread's reader 1,069 hits and
2.4 million misses, the loop's 91,000 and 1.3 million; the writer 2.08 million hits and
17,000 misses). What it kept was the last long read's pages, up to 2 MiB each: 210 bytes
per followed task at 10,000. 256 KiB (64 pages) still holds one statement's B-tree
interior pages; a miss is a read of the OS's page cache."""


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
