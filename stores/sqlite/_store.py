"""The SQLite store: its three facets over one engine, opened from a ``sqlite:///`` URL."""

from __future__ import annotations

import attrs
import trio

from .. import _bases
from .._bases import ClosesOnExit
from .._types import (
    DEFAULT_MAX_VALUE_BYTES,
    SYSTEM_CLOCK,
    Clock,
    SchemaStatus,
    StoreUnavailableError,
)
from ._checkpoints import SQLiteCheckpointStore
from ._engine import BUSY_TIMEOUT_MS, _Database
from ._inbox import SQLiteInboxStore
from ._leases import SQLiteLeaseStore
from ._schema import (
    SCHEMA_VERSION,
    _open_connections,
    _read_user_version,
    sqlite_path_from_url,
)


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
    _bases.check_max_value_bytes(max_value_bytes)
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
class SQLiteStore(ClosesOnExit):
    """An open SQLite :class:`~stores.Store`; use :func:`open_sqlite_store` to make one.

    Usable as ``async with``; after :meth:`aclose` every call raises
    :class:`StoreUnavailableError`.
    """

    _url: str = attrs.field(alias="url")
    _db: _Database = attrs.field(alias="db")
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    checkpoints: SQLiteCheckpointStore = attrs.field(init=False)
    leases: SQLiteLeaseStore = attrs.field(init=False)
    inbox: SQLiteInboxStore = attrs.field(init=False)
    polls: None = attrs.field(default=None, init=False)
    """No shared due polls: one instance polls alone (:mod:`stores._polling`)."""

    def __attrs_post_init__(self) -> None:
        self.checkpoints = SQLiteCheckpointStore(self._db, self.max_value_bytes)
        self.leases = SQLiteLeaseStore(self._db)
        self.inbox = SQLiteInboxStore(self._db, self.max_value_bytes)

    @property
    def url(self) -> str:
        return self._url

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
