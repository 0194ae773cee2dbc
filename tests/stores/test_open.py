"""Opening stores: URLs, SQLite settings and refusals, and durability across a reopen
(behaviours 97, 172–180 at the store level)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import apsw
import pytest
import trio
import trio.testing

from stores import (
    InvalidStoreURLError,
    OwnershipScope,
    SaveCheckpoint,
    StoreUnavailableError,
    migrate_store,
    open_store,
)
from stores.memory import MemoryStore
from stores.sqlite import SCHEMA_VERSION, SQLiteStore, open_sqlite_store
from tests.support.backends import Backend
from tests.support.clocks import TrioClock

SCOPE = OwnershipScope("tenant-1", "acct-1", "user-1")
SCOPE_NONE = OwnershipScope()
BINDING_NS = "prism.channels.v1.binding"
OPERATION_NS = "prism.channels.v1.operation"
REPLY_NS = "prism.channels.v1.reply"


@pytest.mark.parametrize(
    "url",
    [
        "",
        "foo://x",
        "memory",
        "memory://extra",
        "sqlite://",
        "sqlite:///",
        "sqlite://host/db.sqlite",
        "sqlite:///dir/",
        "sqlite:///db.sqlite?mode=ro",
        "postgres-ish:/x",
        # a non-UTF-8 file name as Python decodes argv: a typed error, not UnicodeEncodeError
        "sqlite:///db-\udcff.sqlite",
    ],
)
async def test_bad_urls_are_refused(url: str, tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidStoreURLError) as info:
        async with open_store(url):
            pass
    assert isinstance(info.value, ValueError)
    assert os.listdir(tmp_path) == []  # nothing written


async def test_memory_url() -> None:
    async with open_store("memory://") as store:
        assert isinstance(store, MemoryStore) and store.url == "memory://"


async def test_relative_and_absolute_sqlite_urls(tmp_path: Path, monkeypatch: Any) -> None:
    monkeypatch.chdir(tmp_path)
    async with open_store("sqlite:///var/deep/journal.sqlite") as rel:
        assert isinstance(rel, SQLiteStore) and rel.url == "sqlite:///var/deep/journal.sqlite"
    assert (tmp_path / "var" / "deep" / "journal.sqlite").is_file()
    absolute = tmp_path / "abs" / "j.sqlite"
    async with open_store(f"sqlite:///{absolute}"):
        pass
    assert absolute.is_file()


async def test_sqlite_settings_are_durable(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    store = await open_sqlite_store(f"sqlite:///{path}")
    try:
        await store.checkpoints.save_checkpoint(
            namespace="n", key="k", scope=SCOPE, version=1, value=1
        )
        probe = apsw.Connection(str(path))
        assert probe.execute("PRAGMA journal_mode").fetchall() == [("wal",)]
        assert probe.execute("PRAGMA user_version").fetchall() == [(SCHEMA_VERSION,)]
        tables = {
            r[0] for r in probe.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        assert {"prism_checkpoints", "prism_leases", "prism_events"} <= tables
        index_sql = probe.execute(
            "SELECT sql FROM sqlite_master WHERE name = 'prism_checkpoints_list'"
        ).fetchall()
        assert isinstance(index_sql[0][0], str)
        assert "namespace, category, tenant_id, updated_at DESC, key" in index_sql[0][0]
        probe.close()
        # The store's own connection runs with synchronous=FULL (2), read back at open.
        sync = await store._db.run(lambda c: c.execute("PRAGMA synchronous").fetchall())
        assert sync == [(2,)]
        # Temporary storage (a savepoint's statement journal, a sort) in memory, not in
        # temporary files, on the writer and both readers alike.
        db = store._db
        for conn in (db.conn, db.reader, db.loop_reader):
            assert conn.execute("PRAGMA temp_store").fetchall() == [(2,)]
        # The readers cannot write; the Trio thread's never waits for a lock.
        for conn in (db.reader, db.loop_reader):
            assert conn.execute("PRAGMA query_only").fetchall() == [(1,)]
        assert db.reader.execute("PRAGMA busy_timeout").fetchall() == [(5000,)]
        assert db.loop_reader.execute("PRAGMA busy_timeout").fetchall() == [(0,)]
    finally:
        await store.aclose()


async def test_directory_path_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "adir").mkdir()
    with pytest.raises(StoreUnavailableError, match="directory"):
        async with open_store(f"sqlite:///{tmp_path}/adir"):
            pass


async def test_garbage_file_is_unavailable_and_untouched(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    secret = b"SECRET-CONTENT " * 400
    path.write_bytes(secret)
    with pytest.raises(StoreUnavailableError) as info:
        async with open_store(f"sqlite:///{path}"):
            pass
    assert "SECRET" not in str(info.value)
    assert str(path) in str(info.value)
    assert path.read_bytes() == secret
    assert not (tmp_path / "j.sqlite-wal").exists()


async def test_corrupt_database_is_unavailable(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    async with open_store(f"sqlite:///{path}") as store:
        for i in range(300):
            await store.checkpoints.save_checkpoint(
                namespace="n", key=f"k{i}", scope=SCOPE, version=1, value={"pad": "SECRET" * 50}
            )
    # Fold the WAL into the main file, then smash pages in the middle of it.
    probe = apsw.Connection(str(path))
    probe.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    probe.close()
    size = path.stat().st_size
    assert size > 16 * 4096
    with path.open("r+b") as f:
        f.seek(4096 * 2)
        f.write(os.urandom(4096 * 6))
    with pytest.raises(StoreUnavailableError) as info:
        async with open_store(f"sqlite:///{path}"):
            pass
    assert "SECRET" not in str(info.value)


async def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    async with open_store(f"sqlite:///{path}"):
        pass
    probe = apsw.Connection(str(path))
    probe.execute("PRAGMA user_version = 99")
    probe.close()
    with pytest.raises(StoreUnavailableError, match="schema version 99"):
        async with open_store(f"sqlite:///{path}"):
            pass


async def test_a_version_1_file_is_upgraded_in_place(tmp_path: Path) -> None:
    """A journal written before the inbox (schema 1) keeps its rows and gains the inbox."""
    from stores.sqlite._schema import _SCHEMA

    path = tmp_path / "j.sqlite"
    old = apsw.Connection(str(path))
    old.execute("PRAGMA journal_mode=WAL")
    old.execute(_SCHEMA)
    old.execute(
        "INSERT INTO prism_checkpoints (namespace, key, version, value, created_at, updated_at)"
        " VALUES ('n', 'k', 3, '{\"kept\":true}', 1, 1)"
    )
    old.execute("PRAGMA user_version = 1")
    old.close()
    status = await migrate_store(f"sqlite:///{path}", apply=False)
    assert (status.current, status.pending) == (1, (2, 3))
    async with open_store(f"sqlite:///{path}") as store:
        kept = await store.checkpoints.load_checkpoint(namespace="n", key="k", scope=SCOPE_NONE)
        assert kept is not None and kept.version == 3 and kept.value == {"kept": True}
        assert await store.inbox.put(source="s", key="1", partition="p", order=1, payload={})
    probe = apsw.Connection(str(path))
    assert probe.execute("PRAGMA user_version").fetchall() == [(SCHEMA_VERSION,)]
    probe.close()


async def test_a_version_2_file_loses_the_index_no_listing_uses(tmp_path: Path) -> None:
    """Schema 3 drops ``prism_checkpoints_recent`` (updated on every save, used by no
    listing prismd makes); the rows stay, and a listing of every namespace at once is
    still newest first."""
    from stores.sqlite._schema import _SCHEMA, _SCHEMA_2

    path = tmp_path / "j.sqlite"
    old = apsw.Connection(str(path))
    old.execute("PRAGMA journal_mode=WAL")
    old.execute(_SCHEMA)
    old.execute(_SCHEMA_2)
    old.execute(
        "CREATE INDEX prism_checkpoints_recent"
        " ON prism_checkpoints (updated_at DESC, key, namespace)"
    )
    for ns, key, at in (("a", "k1", 5), ("b", "k2", 9), ("a", "k3", 7)):
        old.execute(
            "INSERT INTO prism_checkpoints (namespace, key, version, value, created_at,"
            " updated_at) VALUES (?, ?, 1, '{}', ?, ?)",
            (ns, key, at, at),
        )
    old.execute("PRAGMA user_version = 2")
    old.close()
    status = await migrate_store(f"sqlite:///{path}", apply=False)
    assert (status.current, status.pending) == (2, (3,))
    async with open_store(f"sqlite:///{path}") as store:
        page = await store.checkpoints.list_checkpoints()
        assert [(r.namespace, r.key) for r in page.items] == [("b", "k2"), ("a", "k3"), ("a", "k1")]
    probe = apsw.Connection(str(path))
    indexes = {r[0] for r in probe.execute("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert "prism_checkpoints_recent" not in indexes and "prism_checkpoints_list" in indexes
    assert probe.execute("PRAGMA user_version").fetchall() == [(3,)]
    probe.close()


async def test_reopen_keeps_the_journal(durable_backend: Backend) -> None:
    """Behaviours 97, 172–180 at the store level: create-only, CAS, fences, events and the
    lease owner all survive closing and reopening the store."""
    async with durable_backend.open() as store:
        cp = store.checkpoints
        # 172/173: binding created once, then applied with the created version.
        binding = await cp.save_checkpoint(
            namespace=BINDING_NS, key="b1", scope=SCOPE, version=1, expected_version=0,
            value={"sessionId": "s1", "generation": 0}, category="channel-binding",
        )  # fmt: skip
        await cp.save_checkpoint(
            namespace=BINDING_NS, key="b1", scope=SCOPE, version=2, expected_version=1,
            value={"sessionId": "s1", "leafId": "leaf-2", "generation": 1},
            category="channel-binding",
        )  # fmt: skip
        # 175: operation accepted → executing (fenced by the lease below).
        lease = await store.leases.try_acquire_lease(
            namespace=BINDING_NS,
            key="durable:tg-1",
            scope=SCOPE,
            owner_id="worker-a",
            ttl_ms=30_000,
        )
        assert lease is not None and lease.fencing_token == 1
        await cp.save_checkpoint(
            namespace=OPERATION_NS, key="o1", scope=SCOPE, version=1, expected_version=0,
            value={"state": "accepted"},
        )  # fmt: skip
        await cp.save_checkpoint(
            namespace=OPERATION_NS, key="o1", scope=SCOPE, version=2, expected_version=1,
            value={"state": "executing"}, fencing_token=lease.fencing_token,
        )  # fmt: skip
        # 176: reply pending, then delivered.
        await cp.save_checkpoint(
            namespace=REPLY_NS, key="r1", scope=SCOPE, version=1, expected_version=0,
            value={"state": "pending", "text": "hi"},
        )  # fmt: skip
        await cp.save_checkpoint(
            namespace=REPLY_NS, key="r1", scope=SCOPE, version=2, expected_version=1,
            value={"state": "delivered", "text": "hi"},
        )  # fmt: skip
        events_before = await cp.list_events()

    async with durable_backend.open() as reopened:
        cp = reopened.checkpoints
        b = await cp.load_checkpoint(namespace=BINDING_NS, key="b1", scope=SCOPE)
        assert b is not None
        assert (b.version, b.value["generation"], b.value["leafId"]) == (2, 1, "leaf-2")
        assert b.created_at_ms == binding.created_at_ms and b.category == "channel-binding"
        op = await cp.load_checkpoint(namespace=OPERATION_NS, key="o1", scope=SCOPE)
        assert op is not None and op.value["state"] == "executing" and op.fencing_token == 1
        reply = await cp.load_checkpoint(namespace=REPLY_NS, key="r1", scope=SCOPE)
        assert reply is not None and reply.value == {"state": "delivered", "text": "hi"}
        held = await reopened.leases.get_lease(
            namespace=BINDING_NS, key="durable:tg-1", scope=SCOPE
        )
        assert held is not None and held.owner_id == "worker-a" and held.token == lease.token
        assert (
            await reopened.leases.try_acquire_lease(
                namespace=BINDING_NS, key="durable:tg-1", scope=SCOPE, owner_id="worker-b",
                ttl_ms=30_000,
            )
            is None
        )  # fmt: skip
        # Create-only and CAS still hold after the reopen.
        from stores import CheckpointConflictError

        with pytest.raises(CheckpointConflictError):
            await cp.save_checkpoint(
                namespace=BINDING_NS, key="b1", scope=SCOPE, version=1, expected_version=0,
                value={},
            )  # fmt: skip
        with pytest.raises(CheckpointConflictError):  # the fence survived too
            await cp.save_checkpoint(
                namespace=OPERATION_NS, key="o1", scope=SCOPE, version=3, expected_version=2,
                value={"state": "succeeded"},
            )  # fmt: skip
        events_after = await cp.list_events()
        assert events_after == events_before
        # New events continue the sequence.
        await cp.save_checkpoint(namespace=REPLY_NS, key="r2", scope=SCOPE, version=1, value={})
        newest = await cp.list_events(after=events_before.last_seq)
        assert [e.seq for e in newest.items] == [events_before.last_seq + 1]
        # The fencing counter survives the reopen and the release.
        assert await reopened.leases.release_lease(
            namespace=BINDING_NS, key="durable:tg-1", scope=SCOPE, owner_id="worker-a",
            token=lease.token,
        )  # fmt: skip
        again = await reopened.leases.try_acquire_lease(
            namespace=BINDING_NS, key="durable:tg-1", scope=SCOPE, owner_id="worker-b",
            ttl_ms=30_000,
        )  # fmt: skip
        assert again is not None and again.fencing_token == 2


async def test_two_connections_on_one_file_share_leases(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/j.sqlite"
    async with open_store(url, clock=TrioClock()) as one, open_store(url, clock=TrioClock()) as two:
        got: list[Any] = []

        async def grab(store: Any, owner: str) -> None:
            got.append(
                await store.leases.try_acquire_lease(
                    namespace="n", key="k", scope=SCOPE, owner_id=owner, ttl_ms=60_000
                )
            )

        async with trio.open_nursery() as nursery:
            for i in range(10):
                nursery.start_soon(grab, one if i % 2 else two, f"w{i}")
        assert len([g for g in got if g is not None]) == 1


async def test_unusable_parent_is_unavailable(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("not a directory")
    with pytest.raises(StoreUnavailableError, match="directory"):
        async with open_store(f"sqlite:///{tmp_path}/afile/journal.sqlite"):
            pass


async def test_locked_database_never_blocks_the_trio_loop(tmp_path: Path) -> None:
    """A write waiting on another connection's lock runs on the worker thread: other Trio
    tasks keep running, and the write lands once the lock is released."""
    path = tmp_path / "j.sqlite"
    store = await open_sqlite_store(f"sqlite:///{path}")
    blocker = apsw.Connection(str(path))
    ticks = 0
    try:
        with trio.fail_after(20):
            blocker.execute("BEGIN IMMEDIATE")
            done = trio.Event()

            async def writer() -> None:
                await store.checkpoints.save_checkpoint(
                    namespace="n", key="k", scope=SCOPE, version=1, value=1
                )
                done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer)
                while ticks < 10:
                    await trio.sleep(0.02)
                    ticks += 1
                assert not done.is_set()
                blocker.execute("COMMIT")
                await done.wait()
        rec = await store.checkpoints.load_checkpoint(namespace="n", key="k", scope=SCOPE)
        assert rec is not None
    finally:
        if blocker.in_transaction:
            blocker.execute("ROLLBACK")
        blocker.close()
        await store.aclose()


async def test_busy_timeout_is_unavailable_and_writes_nothing(tmp_path: Path) -> None:
    path = tmp_path / "j.sqlite"
    store = await open_sqlite_store(f"sqlite:///{path}", busy_timeout_ms=100)
    blocker = apsw.Connection(str(path))
    try:
        with trio.fail_after(20):
            blocker.execute("BEGIN IMMEDIATE")
            with pytest.raises(StoreUnavailableError) as info:
                await store.checkpoints.save_checkpoint(
                    namespace="n", key="k", scope=SCOPE, version=1, value="SECRET"
                )
            assert "SECRET" not in str(info.value)
            blocker.execute("ROLLBACK")
            # The connection is still usable afterwards.
            assert (
                await store.checkpoints.load_checkpoint(namespace="n", key="k", scope=SCOPE) is None
            )
            await store.checkpoints.save_checkpoint(
                namespace="n", key="k", scope=SCOPE, version=1, value=1
            )
            assert len((await store.checkpoints.list_events()).items) == 1
    finally:
        if blocker.in_transaction:
            blocker.execute("ROLLBACK")
        blocker.close()
        await store.aclose()


async def test_short_reads_answer_on_the_loop_and_long_ones_in_the_thread(tmp_path: Path) -> None:
    """Reads of one row, and a listing that stays under READ_HERE_STEPS, answer on the Trio
    thread: with the worker thread's reads held up, they still answer. A listing that runs
    past the bound is stopped and made in the worker thread (here: after the hold ends),
    and answers the same rows."""
    store = await open_sqlite_store(f"sqlite:///{tmp_path}/reads.sqlite")
    other = OwnershipScope("tenant-1", "acct-1", "user-2")
    rows = 6_000
    try:
        with trio.fail_after(60):
            for start in range(0, rows, 500):
                await store.checkpoints.write_checkpoints(
                    [
                        SaveCheckpoint(
                            namespace="n",
                            key=f"k{i:05d}",
                            scope=other if i in (17, 4_321) else SCOPE,
                            version=1,
                            value={"i": i},
                        )
                        for i in range(start, start + 500)
                    ]
                )
            await store.leases.try_acquire_lease(
                namespace="l", key="k", scope=SCOPE, owner_id="w", ttl_ms=60_000
            )
            await store.inbox.put(source="s", key="1", partition="p", order=1, payload={})
            db = store._db
            assert db.reads_in_thread == 0
            answered: list[list[str]] = []
            async with trio.open_nursery() as nursery, db._read_limiter:
                with trio.fail_after(5):
                    row = await store.checkpoints.load_checkpoint(
                        namespace="n", key="k04321", scope=other
                    )
                    assert row is not None and row.value == {"i": 4_321}
                    page = await store.checkpoints.list_checkpoints(
                        namespace="n", key_prefix="k0432", limit=500
                    )
                    assert len(page.items) == 10
                    lease = await store.leases.get_lease(namespace="l", key="k", scope=SCOPE)
                    assert lease is not None and lease.owner_id == "w"
                    item = await store.inbox.get(source="s", key="1")
                    assert item is not None and item.state == "pending"
                    assert await store.checkpoints.last_event_seq() == rows
                assert db.reads_in_thread == 0

                async def scan() -> None:
                    # user-2's rows are 2 of 6,000: the scan reads every one.
                    page = await store.checkpoints.list_checkpoints(namespace="n", scope=other)
                    answered.append(sorted(r.key for r in page.items))

                nursery.start_soon(scan)
                # Stopped on the loop: now it waits for the worker thread's reader.
                await trio.testing.wait_all_tasks_blocked()
                assert db.reads_in_thread == 1
                assert answered == []
            assert answered == [["k00017", "k04321"]]
            assert db.reads_in_thread == 1
    finally:
        await store.aclose()


async def test_a_locked_read_on_the_loop_is_made_in_the_thread(tmp_path: Path) -> None:
    """A read that finds the file locked on the Trio thread (whose reader has no busy
    timeout) is made again in the worker thread; any other SQLite error on either is
    StoreUnavailableError, naming neither the statement nor its values."""
    store = await open_sqlite_store(f"sqlite:///{tmp_path}/busy.sqlite")
    try:
        with trio.fail_after(20):
            await store.checkpoints.save_checkpoint(
                namespace="n", key="k", scope=SCOPE, version=1, value="SECRET"
            )
            db = store._db
            faults: list[type[apsw.Error]] = []
            seen: list[str] = []

            def on_loop(_cursor: Any, _sql: str, _bindings: Any) -> bool:
                seen.append("loop")
                if faults:
                    raise faults.pop(0)("injected")
                return True

            def in_thread(_cursor: Any, _sql: str, _bindings: Any) -> bool:
                seen.append("thread")
                return True

            db.loop_reader.exec_trace = on_loop
            db.reader.exec_trace = in_thread
            faults.append(apsw.BusyError)
            row = await store.checkpoints.load_checkpoint(namespace="n", key="k", scope=SCOPE)
            assert row is not None and row.value == "SECRET"
            assert seen == ["loop", "thread"] and db.reads_in_thread == 1
            seen.clear()
            faults.append(apsw.IOError)
            with pytest.raises(StoreUnavailableError) as info:
                await store.checkpoints.load_checkpoint(namespace="n", key="k", scope=SCOPE)
            assert "IOError" in str(info.value)
            assert "SECRET" not in str(info.value) and "SELECT" not in str(info.value)
            assert seen == ["loop"] and db.reads_in_thread == 1
            # Both readers go on answering.
            seen.clear()
            assert await store.checkpoints.load_checkpoint(namespace="n", key="k", scope=SCOPE)
            assert seen == ["loop"]
            db.loop_reader.exec_trace = db.reader.exec_trace = None
    finally:
        await store.aclose()
    with pytest.raises(StoreUnavailableError, match="closed"):
        await store.checkpoints.load_checkpoint(namespace="n", key="k", scope=SCOPE)
