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
  statement, the conflicting row locked; see :mod:`stores.postgres._schema`). The conformance
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

The package: ``_url`` (the URL and the pool settings, no driver: :mod:`stores` re-exports
them for ``check-config``), ``_driver`` (the one module importing asyncpg and trio-asyncio),
``_schema`` (the tables, functions and migrations), ``_writer`` (group commit),
``_checkpoints``, ``_leases``, ``_inbox`` (the three facets) and ``_store`` (the store, its
opening, the bridge bench). The store's names below are loaded on first use, so importing
the URL parser does not import the driver.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._checkpoints import PostgresCheckpointStore as PostgresCheckpointStore
    from ._inbox import PostgresInboxStore as PostgresInboxStore
    from ._leases import PostgresLeaseStore as PostgresLeaseStore
    from ._store import CLOSE_BUDGET_S as CLOSE_BUDGET_S
    from ._store import BridgeSamples as BridgeSamples
    from ._store import PostgresStatistics as PostgresStatistics
    from ._store import PostgresStore as PostgresStore
    from ._store import measure_bridge as measure_bridge
    from ._store import open_postgres_store as open_postgres_store
    from ._store import schema_status as schema_status
    from ._writer import MAX_JOBS as MAX_JOBS
    from ._writer import MAX_WRITES as MAX_WRITES
    from ._writer import RETRIES as RETRIES

_LAZY = {
    "PostgresCheckpointStore": "_checkpoints",
    "PostgresInboxStore": "_inbox",
    "PostgresLeaseStore": "_leases",
    "CLOSE_BUDGET_S": "_store",
    "BridgeSamples": "_store",
    "PostgresStatistics": "_store",
    "PostgresStore": "_store",
    "measure_bridge": "_store",
    "open_postgres_store": "_store",
    "schema_status": "_store",
    "MAX_JOBS": "_writer",
    "MAX_WRITES": "_writer",
    "RETRIES": "_writer",
}


def __getattr__(name: str) -> Any:
    """The store's names, imported (with the driver) when first asked for."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
