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
import os
import subprocess
import urllib.parse
import uuid

import pytest

URL_ENV = "PRISMD_TEST_POSTGRES_URL"
MISSING = f"{URL_ENV} is not set: run the suite through tests/with-services.sh (make test does)"


def server_url() -> str:
    """The server's URL (without a schema), or skip the test saying how to get one."""
    url = os.environ.get(URL_ENV, "")
    if not url:
        pytest.skip(MISSING)
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
    """Run one statement on the server with plain asyncio (outside any Trio run)."""
    import asyncpg

    async def main() -> list[tuple[object, ...]]:
        conn = await asyncpg.connect(admin_url(url))
        try:
            return [tuple(row) for row in await conn.fetch(sql, *args)]
        finally:
            await conn.close()

    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        return runner.run(main())


def drop_schema(url: str) -> None:
    run_sql(url, f'DROP SCHEMA IF EXISTS "{schema_of(url)}" CASCADE')


def pg_ctl(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``pg_ctl -D <data dir> ARGS…`` as the server's user (for restart tests)."""
    data = os.environ.get("PRISMD_TEST_POSTGRES_DATA", "")
    bindir = os.environ.get("PRISMD_TEST_POSTGRES_BIN", "")
    if not data or not bindir:
        pytest.skip("PRISMD_TEST_POSTGRES_DATA/_BIN are not set: run tests/with-services.sh")
    log = os.environ.get("PRISMD_TEST_POSTGRES_LOG", "/dev/null")
    # -l: the restarted server must not inherit our pipes (run() would wait for it forever).
    command = [os.path.join(bindir, "pg_ctl"), "-D", data, "-l", log, *args]
    user = os.environ.get("PRISMD_TEST_POSTGRES_AS", "")
    if user and os.geteuid() == 0:
        command = ["runuser", "-u", user, "--", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
