"""The PostgreSQL server of the suite (started by ``tests/with-services.sh``), one schema per use.

``make test`` runs the suite through ``tests/with-services.sh``, which starts a throwaway
server and exports:

* ``PRISMD_TEST_POSTGRES_URL`` — ``postgresql://postgres@127.0.0.1:PORT/postgres``;
* ``PRISMD_TEST_POSTGRES_DATA``, ``PRISMD_TEST_POSTGRES_BIN`` and ``PRISMD_TEST_POSTGRES_LOG``
  — its data directory, the directory of ``pg_ctl`` and its log file, for the tests that
  restart it;
* ``PRISMD_TEST_POSTGRES_AS`` — the user the server runs as (``postgres`` when the suite runs
  as root), for ``runuser``.

Without them a PostgreSQL test is skipped with that reason (and a root run, which is what CI
is, fails on any skip: see ``tests/conftest.py``). Every test gets a schema of its own
(``?schema=t_…``): tests are isolated, and dropping the schema removes everything.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import shlex
import subprocess
import urllib.parse
import uuid
from collections.abc import AsyncIterator

import pytest
import trio

URL_ENV = "PRISMD_TEST_POSTGRES_URL"
MISSING = f"{URL_ENV} is not set: run the suite through tests/with-services.sh (make test does)"


def server_url() -> str:
    """The server's URL (without a schema); a test without one fails saying how to get it."""
    url = os.environ.get(URL_ENV, "")
    if not url:
        pytest.fail(MISSING)
    return url


def fresh_url(tag: str = "t") -> str:
    """A URL for a schema nobody else uses (it is created by the store's first migration)."""
    base = server_url()
    schema = f"{tag}_{uuid.uuid4().hex[:16]}"
    separator = "&" if urllib.parse.urlsplit(base).query else "?"
    return f"{base}{separator}schema={schema}"


def schema_of(url: str) -> str:
    return dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(url).query))["schema"]


def admin_url(url: str) -> str:
    """``url`` without its query, as asyncpg takes it."""
    return urllib.parse.urlunsplit(urllib.parse.urlsplit(url)._replace(query=""))


def run_sql(url: str, sql: str, *args: object) -> list[tuple[object, ...]]:
    """Run one statement on the server with plain asyncio, blocking (inside a Trio run it
    runs on another thread: trio-asyncio's event loop policy refuses a plain asyncio loop in
    a Trio thread; :func:`query` is the non-blocking form there)."""
    import asyncpg

    async def main() -> list[tuple[object, ...]]:
        conn = await asyncpg.connect(admin_url(url))
        try:
            return [tuple(row) for row in await conn.fetch(sql, *args)]
        finally:
            await conn.close()

    def work() -> list[tuple[object, ...]]:
        with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
            return runner.run(main())

    try:
        trio.lowlevel.current_trio_token()
    except RuntimeError:
        return work()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(work).result()


async def query(url: str, sql: str, *args: object) -> list[tuple[object, ...]]:
    """:func:`run_sql` without blocking the Trio run."""
    return await trio.to_thread.run_sync(lambda: run_sql(url, sql, *args))


def drop_schema(url: str) -> None:
    run_sql(url, f'DROP SCHEMA IF EXISTS "{schema_of(url)}" CASCADE')


def empty_schema(url: str) -> None:
    """Remove every row the store wrote (a migrated schema as good as new, minus the DDL)."""
    schema = f'"{schema_of(url)}"'
    run_sql(
        url,
        f"TRUNCATE {schema}.prism_checkpoints, {schema}.prism_leases, {schema}.prism_events",
    )
    run_sql(url, f"UPDATE {schema}.prism_event_seq SET last_seq = 0")


def pg_ctl(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``pg_ctl -D <data dir> ARGS…`` as the server's user (for restart tests).

    Refused in a parallel worker: every other test uses this server, so a test that stops
    or restarts it is marked ``serial`` and runs alone (tests/run-suite.sh).
    """
    if os.environ.get("PYTEST_XDIST_WORKER"):
        pytest.fail("this test stops or restarts the shared server: mark it serial")
    data = os.environ.get("PRISMD_TEST_POSTGRES_DATA", "")
    bindir = os.environ.get("PRISMD_TEST_POSTGRES_BIN", "")
    if not data or not bindir:
        pytest.fail("PRISMD_TEST_POSTGRES_DATA/_BIN are not set: run tests/with-services.sh")
    log = os.environ.get("PRISMD_TEST_POSTGRES_LOG", "/dev/null")
    # -l: the restarted server must not inherit our pipes (run() would wait for it forever).
    command = [os.path.join(bindir, "pg_ctl"), "-D", data, "-l", log, *args]
    user = os.environ.get("PRISMD_TEST_POSTGRES_AS", "")
    if user and os.geteuid() == 0:
        command = ["runuser", "-u", user, "--", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)


def pg_ctl_start_again() -> subprocess.CompletedProcess[str]:
    """Start the server stopped by ``pg_ctl stop`` with the options it last ran with (from
    ``postmaster.opts``): a bare ``pg_ctl start`` would take the defaults — another port."""
    data = os.environ.get("PRISMD_TEST_POSTGRES_DATA", "")
    if not data:
        pytest.fail("PRISMD_TEST_POSTGRES_DATA is not set: run tests/with-services.sh")
    with open(os.path.join(data, "postmaster.opts")) as file:
        words = shlex.split(file.read())[1:]  # without the postgres binary
    options: list[str] = []
    while words:
        word = words.pop(0)
        if word == "-D":
            words.pop(0)  # pg_ctl passes its own -D
        else:
            options.append(word)
    return pg_ctl("start", "-w", "-t", "60", "-o", shlex.join(options))


class Admin:
    """A connection of the test's own beside the store's (to hold locks, kill backends,
    look at what the server sees), on a trio-asyncio loop of its own."""

    def __init__(self, loop: object, conn: object) -> None:
        self._loop = loop
        self._conn = conn

    async def fetch(self, sql: str, *args: object) -> list[tuple[object, ...]]:
        rows = await self._loop.run_aio_coroutine(self._conn.fetch(sql, *args))  # type: ignore[attr-defined]
        return [tuple(row) for row in rows]

    async def execute(self, sql: str, *args: object) -> None:
        await self._loop.run_aio_coroutine(self._conn.execute(sql, *args))  # type: ignore[attr-defined]


@contextlib.asynccontextmanager
async def admin(url: str) -> AsyncIterator[Admin]:
    import asyncpg
    import trio_asyncio

    async with trio_asyncio.open_loop() as loop:
        conn = await loop.run_aio_coroutine(asyncpg.connect(admin_url(url)))
        try:
            yield Admin(loop, conn)
        finally:
            with trio.CancelScope(shield=True):
                await loop.run_aio_coroutine(conn.close())


def port_of(url: str) -> int:
    port = urllib.parse.urlsplit(url).port
    assert port is not None
    return port


async def forward(
    listen_port: int,
    target_port: int,
    *,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Forward TCP from 127.0.0.1:``listen_port`` to 127.0.0.1:``target_port`` until
    cancelled: the server "appearing" on a port where nothing listened before."""

    async def pump(
        source: trio.SocketStream, sink: trio.SocketStream, done: trio.CancelScope
    ) -> None:
        try:
            while data := await source.receive_some(65536):
                await sink.send_all(data)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        done.cancel()

    async def handle(client: trio.SocketStream) -> None:
        server = await trio.open_tcp_stream("127.0.0.1", target_port)
        async with client, server, trio.open_nursery() as nursery:
            nursery.start_soon(pump, client, server, nursery.cancel_scope)
            nursery.start_soon(pump, server, client, nursery.cancel_scope)

    listeners = await trio.open_tcp_listeners(listen_port, host="127.0.0.1")
    await trio.serve_listeners(handle, listeners, task_status=task_status)
