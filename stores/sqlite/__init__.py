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

The package: ``_schema`` (the file, its schema and migrations), ``_engine`` (the connections,
group commit, the writer thread, the statement helpers), ``_checkpoints``, ``_leases``,
``_inbox`` (the three facets) and ``_store`` (the store that holds them, and its opening).
"""

from __future__ import annotations

from ._checkpoints import SQLiteCheckpointStore as SQLiteCheckpointStore
from ._engine import BUSY_TIMEOUT_MS as BUSY_TIMEOUT_MS
from ._engine import COMMIT_ON_LOOP_BELOW_S as COMMIT_ON_LOOP_BELOW_S
from ._engine import COMMIT_TIME_DECAY as COMMIT_TIME_DECAY
from ._engine import INLINE_WRITES as INLINE_WRITES
from ._engine import MAX_JOBS_PER_TRANSACTION as MAX_JOBS_PER_TRANSACTION
from ._engine import READ_HERE_STEPS as READ_HERE_STEPS
from ._engine import SLOW_COMMIT_S as SLOW_COMMIT_S
from ._engine import WAL_CHECKPOINT_PAGES as WAL_CHECKPOINT_PAGES
from ._inbox import SQLiteInboxStore as SQLiteInboxStore
from ._leases import SQLiteLeaseStore as SQLiteLeaseStore
from ._schema import SCHEMA_VERSION as SCHEMA_VERSION
from ._schema import sqlite_path_from_url as sqlite_path_from_url
from ._store import SQLiteStatistics as SQLiteStatistics
from ._store import SQLiteStore as SQLiteStore
from ._store import open_sqlite_store as open_sqlite_store
from ._store import sqlite_schema_status as sqlite_schema_status
