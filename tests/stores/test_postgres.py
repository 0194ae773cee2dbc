"""PostgreSQL only, on the real server ``make test`` starts: URLs, migrations, failures halfway,
lost connections, cancellation, timeouts, the event stream under concurrent writers, and
leases between independent pools (the conformance suite covers the contract itself)."""

from __future__ import annotations

import secrets
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, TypedDict

import pytest
import trio

from stores import (
    CheckpointConflictError,
    DeleteCheckpoint,
    InvalidStoreURLError,
    OwnershipScope,
    PostgresOptions,
    SaveCheckpoint,
    Store,
    StoreUnavailableError,
    StoreUnreachableError,
    migrate_store,
    open_store,
    parse_postgres_url,
)
from stores.postgres import PostgresStore
from stores.postgres._schema import LATEST, MIGRATIONS
from tests.support import pgserver
from tests.support.clocks import ManualClock

from .test_sqlite_processes import spawn

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser

SCOPE = OwnershipScope("tenant-1", "acct-1", "user-1")
NS = "prism.channels.v1.operation"


class CheckpointAt(TypedDict):
    """Where a checkpoint is: the keyword arguments every checkpoint call takes."""

    namespace: str
    key: str
    scope: OwnershipScope


HUGE = secrets.token_hex(6000)
"""A key the server refuses: incompressible, past the btree's limit for one index entry."""


@pytest.fixture
def url() -> Iterator[str]:
    """A fresh schema on the test server, dropped afterwards."""
    fresh = pgserver.fresh_url()
    yield fresh
    pgserver.drop_schema(fresh)


@pytest.fixture
async def store(url: str) -> AsyncIterator[PostgresStore]:
    async with open_store(url) as opened:
        assert isinstance(opened, PostgresStore)
        yield opened


def put(key: str, version: int = 1, **kw: Any) -> SaveCheckpoint:
    args: dict[str, Any] = {
        "namespace": NS,
        "key": key,
        "scope": SCOPE,
        "version": version,
        "value": {"k": key},
        "expected_version": version - 1,
    }
    return SaveCheckpoint(**(args | kw))


async def stored_keys(store: Store) -> set[str]:
    page = await store.checkpoints.list_checkpoints(namespace=NS, limit=500)
    return {r.key for r in page.items}


async def event_keys(store: Store) -> list[str]:
    page = await store.checkpoints.list_events(limit=500)
    return [e.key for e in page.items]


def schema_table(url: str, table: str) -> str:
    return f'"{pgserver.schema_of(url)}".{table}'


# --------------------------------------------------------------------------- URLs


def test_url_forms_and_display_without_password() -> None:
    parsed = parse_postgres_url("postgres://prismd:pw-7f3a@db.example:6543/journal?schema=one")
    assert (parsed.host, parsed.port, parsed.user, parsed.database, parsed.schema) == (
        "db.example",
        6543,
        "prismd",
        "journal",
        "one",
    )
    assert parsed.password == "pw-7f3a" and "pw-7f3a" not in repr(parsed)
    assert parsed.display == "postgresql://prismd@db.example:6543/journal?schema=one"
    socket_dir = parse_postgres_url("postgresql:///prismd?host=/run/postgresql")
    assert socket_dir.host == "/run/postgresql" and socket_dir.schema == "public"
    assert socket_dir.display == "postgresql:///prismd?host=%2Frun%2Fpostgresql"
    v6 = parse_postgres_url("postgresql://u@[::1]:5432/d?sslmode=require")
    assert (v6.host, v6.sslmode, v6.where) == ("::1", "require", "[::1]:5432/d")


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ("postgresql://h/d?bogus=1", "unknown parameter 'bogus'"),
        ("postgresql://h/d?schema=Has-Caps", "schema must be a lower-case SQL identifier"),
        ("postgresql://h/d?sslmode=sometimes", "sslmode must be one of"),
        ("postgresql://h:99999/d", "malformed host or port"),
        ("postgresql://h/d/extra", "path must be /DATABASE"),
        ("postgresql://a,b/d", "several hosts"),
        ("postgresql:///d?host=relative", "socket directory path"),
        ("postgresql://h/d#frag", "#fragment"),
        ("postgresql://h/d with space", "spaces or control characters"),
    ],
)
async def test_bad_urls_say_what_is_wrong(bad: str, says: str) -> None:
    with pytest.raises(InvalidStoreURLError, match=says):
        async with open_store(bad):
            pass


# --------------------------------------------------------------------------- reaching the server


async def test_unreachable_server_names_host_port_and_reason_never_the_password() -> None:
    pgserver.server_url()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens here once closed
    with trio.fail_after(30), pytest.raises(StoreUnreachableError) as info:
        async with open_store(f"postgresql://prismd:pw-7f3a@127.0.0.1:{port}/prismd"):
            pass
    message = str(info.value)
    assert f"127.0.0.1:{port}/prismd" in message and "Connect call failed" not in message
    assert "refused" in message.lower() and "pw-7f3a" not in message


async def test_a_server_that_never_answers_times_out_in_real_time() -> None:
    pgserver.server_url()
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # the kernel accepts; nobody ever answers the startup message
        port = silent.getsockname()[1]
        start = time.monotonic()
        with trio.fail_after(30), pytest.raises(StoreUnreachableError, match="within 300 ms"):
            async with open_store(
                f"postgresql://u@127.0.0.1:{port}/d",
                postgres=PostgresOptions(connect_timeout_ms=300),
            ):
                pass
        assert time.monotonic() - start < 10


async def test_a_missing_database_is_not_worth_retrying() -> None:
    base = pgserver.admin_url(pgserver.server_url())
    missing = base.rsplit("/", 1)[0] + "/no_such_db_7f3a"
    with trio.fail_after(30), pytest.raises(StoreUnavailableError) as info:
        async with open_store(missing):
            pass
    assert not isinstance(info.value, StoreUnreachableError)
    assert 'database "no_such_db_7f3a" does not exist' in str(info.value)


async def test_the_url_never_shows_a_password_and_options_override_it(url: str) -> None:
    with_password = url.replace("postgresql://postgres@", "postgresql://postgres:pw-7f3a@")
    assert "pw-7f3a" in with_password
    # The test server trusts loopback, so any password logs in; what matters is where it shows.
    options = PostgresOptions(password="other-7f3a", pool_size=2)
    async with open_store(with_password, postgres=options) as store:
        assert "pw-7f3a" not in store.url and "other-7f3a" not in store.url
        assert store.url.startswith("postgresql://postgres@127.0.0.1:")
        assert repr(options).count("other-7f3a") == 0


# --------------------------------------------------------------------------- migrations


async def test_check_changes_nothing_then_migrate_applies_once(url: str) -> None:
    with trio.fail_after(30):
        before = await migrate_store(url, apply=False)
        everything = tuple(m.version for m in MIGRATIONS)
        assert (before.current, before.latest, before.pending) == (0, LATEST, everything)
        schema = pgserver.schema_of(url)
        assert (
            await pgserver.query(url, "SELECT 1 FROM pg_namespace WHERE nspname = $1", schema) == []
        )
        first = await migrate_store(url)
        assert first.applied == tuple(m.version for m in MIGRATIONS) and first.up_to_date
        again = await migrate_store(url)
        assert again.applied == () and again.up_to_date
        async with open_store(url) as store:
            assert isinstance(store, PostgresStore) and store.schema_status.applied == ()
    rows = await pgserver.query(
        url, f"SELECT version FROM {schema_table(url, 'prism_schema_migrations')}"
    )
    assert rows == [(m.version,) for m in MIGRATIONS]


async def test_a_version_1_schema_is_upgraded_with_its_rows_kept(url: str) -> None:
    """A schema migrated by the build before the inbox (version 1) gets migration 2 at the
    next start; its journal is untouched."""
    from stores.postgres._schema import render

    schema = pgserver.schema_of(url)
    async with pgserver.admin(url) as admin:
        await admin.execute(f'CREATE SCHEMA "{schema}"')
        await admin.execute(render(MIGRATIONS[0].sql, schema))
        await admin.execute(
            f"CREATE TABLE {schema_table(url, 'prism_schema_migrations')} (version integer"
            " PRIMARY KEY, name text NOT NULL, checksum text NOT NULL,"
            " applied_at timestamptz NOT NULL DEFAULT now())"
        )
        await admin.execute(
            f"INSERT INTO {schema_table(url, 'prism_schema_migrations')} (version, name, checksum)"
            " VALUES (1, $1, $2)",
            MIGRATIONS[0].name,
            MIGRATIONS[0].checksum,
        )
        await admin.execute(
            f"INSERT INTO {schema_table(url, 'prism_checkpoints')} (namespace, key, version,"
            " value, created_at, updated_at) VALUES ('n', 'k', 3, '{\"kept\": 1}', 1, 1)"
        )
    with trio.fail_after(30):
        status = await migrate_store(url, apply=False)
        assert (status.current, status.pending) == (1, tuple(range(2, LATEST + 1)))
        async with open_store(url) as store:
            assert isinstance(store, PostgresStore)
            assert store.schema_status.applied == tuple(range(2, LATEST + 1))
            kept = await store.checkpoints.load_checkpoint(
                namespace="n", key="k", scope=OwnershipScope()
            )
            assert kept is not None and kept.value == {"kept": 1}
            assert await store.inbox.put(source="s", key="1", partition="p", order=1, payload={})


async def test_twenty_instances_starting_together_migrate_exactly_once(url: str) -> None:
    applied: list[tuple[int, ...]] = []

    async def instance() -> None:
        async with open_store(url, postgres=PostgresOptions(pool_size=2)) as store:
            assert isinstance(store, PostgresStore)
            applied.append(store.schema_status.applied)
            await store.checkpoints.save_checkpoint(
                namespace=NS, key=f"up-{len(applied)}-{time.monotonic_ns()}", scope=SCOPE,
                version=1, value={},
            )  # fmt: skip

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for _ in range(20):
                nursery.start_soon(instance)
    assert len(applied) == 20
    assert sorted(applied) == [()] * 19 + [tuple(m.version for m in MIGRATIONS)]
    table = schema_table(url, "prism_schema_migrations")
    counted = await pgserver.query(
        url, f"SELECT version, count(*) FROM {table} GROUP BY version ORDER BY version"
    )
    assert counted == [(m.version, 1) for m in MIGRATIONS]
    assert (
        len(await pgserver.query(url, f"SELECT seq FROM {schema_table(url, 'prism_events')}")) == 20
    )


async def test_a_newer_schema_is_refused_clearly(url: str) -> None:
    await migrate_store(url)
    table = schema_table(url, "prism_schema_migrations")
    await pgserver.query(
        url, f"INSERT INTO {table} (version, name, checksum) VALUES (99, 'x', 'x')"
    )
    for attempt in ("open", "check"):
        with trio.fail_after(30), pytest.raises(StoreUnavailableError) as info:
            if attempt == "open":
                async with open_store(url):
                    pass
            else:
                await migrate_store(url, apply=False)
        assert f"at version 99, newer than this prismd knows ({LATEST})" in str(info.value)


async def test_a_migration_recorded_differently_is_refused(url: str) -> None:
    await migrate_store(url)
    table = schema_table(url, "prism_schema_migrations")
    await pgserver.query(url, f"UPDATE {table} SET checksum = 'edited' WHERE version = 1")
    with trio.fail_after(30), pytest.raises(StoreUnavailableError, match="differently"):
        async with open_store(url):
            pass


# --------------------------------------------------------------------------- failing halfway


async def test_a_transaction_failing_halfway_leaves_nothing(store: PostgresStore) -> None:
    """The server refuses the second write of a batch (a key past the index limit): the
    first one, written earlier in the same transaction, is gone too, with its event."""
    huge = HUGE
    with trio.fail_after(30):
        with pytest.raises(StoreUnavailableError) as info:
            await store.checkpoints.write_checkpoints([put("first"), put(huge)])
        assert huge not in str(info.value) and "SQLSTATE 54000" in str(info.value)
        assert await stored_keys(store) == set()
        assert await event_keys(store) == []
        # The store is fine afterwards.
        await store.checkpoints.write_checkpoints([put("first")])
        assert await stored_keys(store) == {"first"}


async def test_a_refused_job_fails_alone_in_a_group_commit(url: str, store: PostgresStore) -> None:
    """Jobs queued behind a transaction share the next one; when the server refuses one of
    them, the others still commit (each job alone) and only that one fails."""
    results: dict[str, str] = {}

    async def write(key: str) -> None:
        try:
            await store.checkpoints.write_checkpoints([put(key)])
            results[key] = "ok"
        except StoreUnavailableError:
            results[key] = "refused"

    with trio.fail_after(30):
        async with pgserver.admin(url) as admin:
            # Hold every event-writing transaction at its last statement.
            await admin.execute("BEGIN")
            locked = schema_table(url, "prism_event_seq")
            await admin.execute(f"LOCK TABLE {locked}")
            async with trio.open_nursery() as nursery:
                nursery.start_soon(write, "leader")
                await wait_for_lock_waiter(admin, locked)
                for key in ("a", "b", HUGE, "c"):
                    nursery.start_soon(write, key)
                await trio.testing.wait_all_tasks_blocked()
                commits = store.statistics().commits
                await admin.execute("ROLLBACK")
    assert results == {"leader": "ok", "a": "ok", "b": "ok", HUGE: "refused", "c": "ok"}
    assert await stored_keys(store) == {"leader", "a", "b", "c"}
    assert sorted(await event_keys(store)) == ["a", "b", "c", "leader"]
    assert store.statistics().commits == commits + 4  # the leader, then a, b, c one by one


async def lock_waiters(admin: pgserver.Admin, table: str) -> list[int]:
    """The pids of the prismd backends waiting for a lock on ``table`` (schema-qualified):
    this test's own, not those of the tests running beside it on the same server."""
    rows = await admin.fetch(
        "SELECT a.pid FROM pg_stat_activity a JOIN pg_locks l ON l.pid = a.pid"
        " WHERE a.application_name = 'prismd' AND NOT l.granted"
        " AND l.relation = $1::text::regclass",
        table,
    )
    pids: list[int] = []
    for row in rows:
        pid = row[0]
        assert isinstance(pid, int), pid
        pids.append(pid)
    return pids


async def wait_for_lock_waiter(admin: pgserver.Admin, table: str) -> int:
    """The pid of the prismd backend waiting for a lock on ``table`` (polls the server)."""
    while True:
        pids = await lock_waiters(admin, table)
        if pids:
            return pids[0]
        await trio.sleep(0.02)


async def test_connection_lost_mid_transaction(url: str, store: PostgresStore) -> None:
    """The server side of a transaction in flight is killed: the caller is told the store is
    unavailable, nothing of the transaction exists, and the next call reconnects."""
    with trio.fail_after(30):
        async with pgserver.admin(url) as admin:
            await admin.execute("BEGIN")
            locked = schema_table(url, "prism_event_seq")
            await admin.execute(f"LOCK TABLE {locked}")
            outcome: list[BaseException] = []

            async def write() -> None:
                try:
                    await store.checkpoints.write_checkpoints([put("a"), put("b")], atomic=True)
                except StoreUnavailableError as exc:
                    outcome.append(exc)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(write)
                pid = await wait_for_lock_waiter(admin, locked)
                await admin.execute("SELECT pg_terminate_backend($1)", pid)
            await admin.execute("ROLLBACK")
        assert len(outcome) == 1 and "connection lost" in str(outcome[0])
        assert await stored_keys(store) == set()
        assert await event_keys(store) == []
        await store.checkpoints.write_checkpoints([put("a"), put("b")], atomic=True)
        assert await stored_keys(store) == {"a", "b"}


# --------------------------------------------------------------------------- cancel, timeouts


async def test_a_cancelled_read_stops_waiting_and_the_server_stops_too(
    url: str, store: PostgresStore
) -> None:
    with trio.fail_after(30):
        await store.checkpoints.save_checkpoint(
            namespace=NS, key="k", scope=SCOPE, version=1, value={}
        )
        async with pgserver.admin(url) as admin:
            await admin.execute("BEGIN")
            locked = schema_table(url, "prism_checkpoints")
            await admin.execute(f"LOCK TABLE {locked} IN ACCESS EXCLUSIVE MODE")
            with trio.move_on_after(0.3) as scope:
                await store.checkpoints.load_checkpoint(namespace=NS, key="k", scope=SCOPE)
            assert scope.cancelled_caught
            cancelled_at = time.monotonic()
            # The statement does not linger on the server either.
            while True:
                if not await lock_waiters(admin, locked):
                    break
                await trio.sleep(0.02)
            assert time.monotonic() - cancelled_at < 5
            await admin.execute("ROLLBACK")
        loaded = await store.checkpoints.load_checkpoint(namespace=NS, key="k", scope=SCOPE)
        assert loaded is not None and loaded.version == 1


async def test_statement_timeout_is_the_servers_and_the_store_recovers(url: str) -> None:
    options = PostgresOptions(statement_timeout_ms=400)
    with trio.fail_after(30):
        async with open_store(url, postgres=options) as store, pgserver.admin(url) as admin:
            await admin.execute("BEGIN")
            await admin.execute(
                f"LOCK TABLE {schema_table(url, 'prism_checkpoints')} IN ACCESS EXCLUSIVE MODE"
            )
            start = time.monotonic()
            with pytest.raises(StoreUnavailableError, match="statement_timeout"):
                await store.checkpoints.load_checkpoint(namespace=NS, key="k", scope=SCOPE)
            with pytest.raises(StoreUnavailableError, match="statement_timeout"):
                await store.checkpoints.save_checkpoint(
                    namespace=NS, key="k", scope=SCOPE, version=1, value={}
                )
            assert time.monotonic() - start < 10
            await admin.execute("ROLLBACK")
            assert await store.checkpoints.load_checkpoint(
                namespace=NS, key="k", scope=SCOPE
            ) is None  # fmt: skip
            await store.checkpoints.save_checkpoint(
                namespace=NS, key="k", scope=SCOPE, version=1, value={}
            )


# --------------------------------------------------------------------------- group commit


async def test_concurrent_writers_share_transactions(store: PostgresStore) -> None:
    results: list[str] = []

    async def writer(i: int) -> None:
        try:
            await store.checkpoints.save_checkpoint(
                namespace=NS, key=f"k{i // 2}", scope=SCOPE, version=1, value={},
                expected_version=0,
            )  # fmt: skip
            results.append("ok")
        except CheckpointConflictError:
            results.append("conflict")

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for i in range(100):
                nursery.start_soon(writer, i)
    assert sorted(results) == ["conflict"] * 50 + ["ok"] * 50
    stats = store.statistics()
    assert stats.writes == 100 and stats.commits < 100
    assert len(await event_keys(store)) == 50


async def test_a_batch_of_a_thousand_writes_is_one_transaction(store: PostgresStore) -> None:
    writes = [put(f"k{i}") for i in range(999)] + [DeleteCheckpoint(NS, "k0", SCOPE)]
    with trio.fail_after(60):
        results = await store.checkpoints.write_checkpoints(writes, atomic=True)
    assert all(r.ok for r in results) and store.statistics().commits == 1
    events = await store.checkpoints.list_events(after=990, limit=500)
    assert [e.seq for e in events.items] == list(range(991, 1001))
    assert events.items[-1].action == "delete"


# --------------------------------------------------------------------------- the event stream


async def test_followers_never_see_a_later_event_before_an_earlier_one(url: str) -> None:
    """Four instances (independent pools), each with eight writers of varied batches, and
    two followers reading by cursor: every page starts right after the cursor and has no
    hole, so a committed event is never passed over (issue 13's stream relies on it)."""
    writers_done = trio.Event()
    total = 0
    seen: dict[int, list[int]] = {0: [], 1: []}

    async def writer(store: Store, instance: int, lane: int) -> None:
        nonlocal total
        for i in range(12):
            size = 1 + (i * 7 + lane) % 5
            batch = [put(f"i{instance}-l{lane}-{i}-{j}") for j in range(size)]
            results = await store.checkpoints.write_checkpoints(batch, atomic=i % 3 == 0)
            total += sum(r.ok for r in results)

    async def follower(store: Store, number: int) -> None:
        cursor = 0
        while True:
            done = writers_done.is_set()
            page = await store.checkpoints.list_events(after=cursor, limit=37)
            seqs = [e.seq for e in page.items]
            assert seqs == list(range(cursor + 1, cursor + 1 + len(seqs))), (cursor, seqs)
            seen[number] += seqs
            cursor = page.last_seq
            if done and not seqs:
                return

    async def instance(number: int) -> None:
        async with open_store(url) as store, trio.open_nursery() as lanes:
            for lane in range(8):
                lanes.start_soon(writer, store, number, lane)

    with trio.fail_after(120):
        async with open_store(url) as reader, trio.open_nursery() as nursery:
            nursery.start_soon(follower, reader, 0)
            nursery.start_soon(follower, reader, 1)
            async with trio.open_nursery() as instances:
                for number in range(4):
                    instances.start_soon(instance, number)
            writers_done.set()
    assert total > 4 * 8 * 12
    assert seen[0] == seen[1] == list(range(1, total + 1))


# --------------------------------------------------------------------------- leases


async def test_two_processes_race_for_one_lease_and_one_wins_each_round(url: str) -> None:
    await migrate_store(url)
    with trio.fail_after(120):
        a, b = await spawn("contender", url, "proc-a"), await spawn("contender", url, "proc-b")
        assert [await a.line(), await b.line()] == ["ready", "ready"]
        wins = {"proc-a": 0, "proc-b": 0}
        for round_ in range(30):
            await a.send(f"go {round_}\n")
            await b.send(f"go {round_}\n")
            answers = {"proc-a": await a.line(), "proc-b": await b.line()}
            won = [owner for owner, line in answers.items() if line.startswith("won ")]
            assert len(won) == 1, answers
            assert answers[won[0]] == f"won {round_} 1"
            wins[won[0]] += 1
        for child in (a, b):
            await child.send("quit\n")
            assert await child.exit_code() == 0
    assert sum(wins.values()) == 30


async def test_expiry_takeover_and_the_old_owner_is_refused(url: str) -> None:
    """Two instances (independent pools, one clock): A's lease expires, B takes over with
    the next fence and writes; A can then neither renew, release nor overwrite B's record."""
    clock = ManualClock()
    lease_at: dict[str, Any] = {"namespace": "route", "key": "chat-1", "scope": SCOPE}
    with trio.fail_after(60):
        async with open_store(url, clock=clock) as a, open_store(url, clock=clock) as b:
            held = await a.leases.try_acquire_lease(owner_id="a", ttl_ms=1000, **lease_at)
            assert held is not None and held.fencing_token == 1
            op: CheckpointAt = {"namespace": NS, "key": "op-1", "scope": SCOPE}
            await a.checkpoints.save_checkpoint(
                **op, version=1, expected_version=0, value={"by": "a"}, fencing_token=1
            )
            assert await b.leases.try_acquire_lease(owner_id="b", ttl_ms=1000, **lease_at) is None
            clock.ms += 1001
            taken = await b.leases.try_acquire_lease(owner_id="b", ttl_ms=1000, **lease_at)
            assert taken is not None and taken.fencing_token == 2
            await b.checkpoints.save_checkpoint(
                **op, version=2, expected_version=1, value={"by": "b"}, fencing_token=2
            )
            assert (
                await a.leases.renew_lease(owner_id="a", token=held.token, ttl_ms=1000, **lease_at)
                is None
            )
            assert not await a.leases.release_lease(owner_id="a", token=held.token, **lease_at)
            with pytest.raises(CheckpointConflictError):
                await a.checkpoints.save_checkpoint(
                    **op, version=3, expected_version=2, value={"by": "a"}, fencing_token=1
                )
            current = await a.leases.get_lease(**lease_at)
            assert current is not None and current.owner_id == "b" and current.fencing_token == 2
            record = await b.checkpoints.load_checkpoint(**op)
            assert record is not None and record.value == {"by": "b"} and record.version == 2


def test_connect_failures_say_whether_trying_again_can_help() -> None:
    """What the server says at login is shown (it names no value of ours; a password that
    would appear is removed); only what may pass (a server starting, full) is retried."""
    import asyncpg

    from stores.postgres._driver import Driver

    driver = Driver(
        url=parse_postgres_url("postgresql://prismd:pw-7f3a@db:5433/journal"),
        options=PostgresOptions(),
        loop=None,
        size=2,
    )
    login = driver.connect_error(
        asyncpg.InvalidPasswordError('password authentication failed for user "prismd"')
    )
    assert type(login) is StoreUnavailableError
    assert str(login) == (
        "PostgreSQL store db:5433/journal: cannot connect: password authentication failed"
        ' for user "prismd" (SQLSTATE 28P01)'
    )
    starting = driver.connect_error(
        asyncpg.CannotConnectNowError("the database system is starting up")
    )
    assert isinstance(starting, StoreUnreachableError) and "57P03" in str(starting)
    echoed = driver.connect_error(asyncpg.PostgresError("role pw-7f3a is odd"))
    assert "pw-7f3a" not in str(echoed) and "[REDACTED]" in str(echoed)
    refused = driver.connect_error(ConnectionRefusedError(111, "Connect call failed"))
    assert isinstance(refused, StoreUnreachableError) and str(refused).endswith(
        "cannot connect: Connection refused"
    )
    # Once connected, a server's words are not shown: they can quote a value.
    failed = driver.error(asyncpg.UniqueViolationError("Key (key)=(secret-value) exists"))
    assert "secret-value" not in str(failed) and "SQLSTATE 23505" in str(failed)


async def test_connections_give_up_on_a_silent_peer_in_bounded_time(url: str) -> None:
    """A peer that stops answering (a pulled cable) must not hang a call for the kernel's
    quarter of an hour: keepalives and TCP_USER_TIMEOUT bound it in real time."""
    options = PostgresOptions(statement_timeout_ms=2000, connect_timeout_ms=1000)
    async with open_store(url, postgres=options) as store:
        assert isinstance(store, PostgresStore)
        (conn,) = store._driver._idle  # the one the migration used
        sock = conn._transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 3000


async def test_a_role_that_may_not_create_the_schema_is_told_why(url: str) -> None:
    role = f"r_{pgserver.schema_of(url)}"
    await pgserver.query(url, f'CREATE ROLE "{role}" LOGIN')
    try:
        restricted = url.replace("postgresql://postgres@", f"postgresql://{role}@")
        with trio.fail_after(30), pytest.raises(StoreUnavailableError) as info:
            async with open_store(restricted):
                pass
        assert "permission denied (SQLSTATE 42501)" in str(info.value)
        assert not isinstance(info.value, StoreUnreachableError)
    finally:
        await pgserver.query(url, f'DROP ROLE "{role}"')


def test_released_migrations_keep_their_checksums() -> None:
    """A released migration's text is never edited (a database records its checksum and
    refuses a changed one): the text built from shared pieces is pinned here."""
    assert [(m.version, m.checksum) for m in MIGRATIONS[:2]] == [
        (1, "9e186ce33793b79c"),
        (2, "9e8571a120671f5d"),
    ]
