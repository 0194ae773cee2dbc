"""The PostgreSQL store: its three facets over one driver and writer, opened from a URL; and
the bridge bench (the Trio ↔ asyncio crossing's cost).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from .. import _bases
from .._contracts import (
    Store,
)
from .._types import (
    DEFAULT_MAX_VALUE_BYTES,
    SYSTEM_CLOCK,
    Clock,
    OwnershipScope,
    SaveCheckpoint,
    SchemaStatus,
)
from . import _schema
from ._checkpoints import PostgresCheckpointStore
from ._driver import Driver, Session, open_driver, plain_asyncio_timings
from ._inbox import PostgresInboxStore
from ._leases import PostgresLeaseStore
from ._polls import PostgresPollStore
from ._url import PostgresOptions, PostgresURL, parse_postgres_url
from ._writer import _Job, _pack, _Writer

CLOSE_BUDGET_S = 5.0


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
    polls: PostgresPollStore
    """Due polls shared by the instances (:class:`~stores.PollStore`)."""
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
    long. Entering checks the schema and applies missing migrations (see
    :mod:`stores.postgres._schema`).

    Raises :class:`~stores.InvalidStoreURLError` for a malformed URL,
    :class:`~stores.StoreUnreachableError` when the server cannot be reached (refused, timed
    out, starting up) and :class:`~stores.StoreUnavailableError` for everything else that
    stops the open (login refused, no such database, a newer schema).
    """
    parsed = parse_postgres_url(url)
    _bases.check_max_value_bytes(max_value_bytes)
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
            checkpoints=PostgresCheckpointStore(driver, writer, clock, max_value_bytes, table),
            leases=PostgresLeaseStore(driver, clock, table),
            inbox=PostgresInboxStore(driver, clock, max_value_bytes, f"{table}.prism_inbox"),
            polls=PostgresPollStore(driver, clock, f"{table}.prism_polls"),
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
        save = SaveCheckpoint(
            "bench.bridge", f"{prefix}-{leg}-{i}", scope, 1, {"i": i}, expected_version=0
        )
        request = _bases.check_save(save, DEFAULT_MAX_VALUE_BYTES)
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
                namespace="bench.bridge",
                key=f"{prefix}-store-{i}",
                scope=scope,
                version=1,
                value={"i": i},
                expected_version=0,
            )
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
