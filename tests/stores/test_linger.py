"""SQLite group commit: a write that lingers for company (``linger_s``).

A lingering write with no transaction in flight waits up to ``linger_s`` for another write
to lead one and shares its commit; else it leads one itself when the time is up. Either
way its call answers once the write is durable. Cancelled while it lingers, it writes
nothing; the store's ``aclose`` writes what lingers before it closes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio
import trio.testing

from stores import OwnershipScope, SaveCheckpoint, open_store
from stores.sqlite import SQLiteStore

NS = "prism.channels.v1.operation"
SCOPE = OwnershipScope("tenant-1", "acct-1", "user-1")


def put(key: str) -> SaveCheckpoint:
    return SaveCheckpoint(
        namespace=NS, key=key, scope=SCOPE, version=1, value={"key": key}, expected_version=0
    )


@asynccontextmanager
async def sqlite(path: Path) -> AsyncIterator[SQLiteStore]:
    async with open_store(f"sqlite:///{path}") as store:
        assert isinstance(store, SQLiteStore)
        yield store


async def stored(store: SQLiteStore) -> set[str]:
    page = await store.checkpoints.list_checkpoints(namespace=NS, scope=SCOPE)
    return {record.key for record in page.items}


async def test_a_lingering_write_shares_the_next_writes_commit(tmp_path: Path) -> None:
    async with sqlite(tmp_path / "s.sqlite") as store:
        answered: list[str] = []

        async def lingering() -> None:
            (result,) = await store.checkpoints.write_checkpoints([put("mark")], linger_s=30)
            assert result.ok
            answered.append("mark")

        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lingering)
                await trio.testing.wait_all_tasks_blocked()
                # Nothing is written while it waits for company.
                assert answered == [] and store.statistics().commits == 0
                (result,) = await store.checkpoints.write_checkpoints([put("admission")])
                assert result.ok
        assert answered == ["mark"]
        stats = store.statistics()
        assert (stats.commits, stats.writes) == (1, 2)
        assert await stored(store) == {"mark", "admission"}


async def test_a_lone_lingering_write_commits_when_its_time_is_up(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    async with sqlite(tmp_path / "s.sqlite") as store:
        with trio.fail_after(10):
            start = trio.current_time()
            (result,) = await store.checkpoints.write_checkpoints([put("mark")], linger_s=0.5)
        assert result.ok
        assert trio.current_time() - start >= 0.5
        assert store.statistics().commits == 1
        assert await stored(store) == {"mark"}


async def test_a_write_cancelled_while_it_lingers_writes_nothing(tmp_path: Path) -> None:
    async with sqlite(tmp_path / "s.sqlite") as store:
        with trio.fail_after(10):
            with trio.move_on_after(0.05) as scope:
                await store.checkpoints.write_checkpoints([put("gone")], linger_s=30)
            assert scope.cancelled_caught
            # The store goes on: the next write commits alone, without the withdrawn one.
            (result,) = await store.checkpoints.write_checkpoints([put("next")])
        assert result.ok
        assert store.statistics().commits == 1
        assert await stored(store) == {"next"}


async def test_closing_the_store_writes_what_lingers(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    answered: list[bool] = []
    with trio.fail_after(10):
        async with sqlite(path) as store, trio.open_nursery() as nursery:

            async def lingering() -> None:
                (result,) = await store.checkpoints.write_checkpoints([put("mark")], linger_s=60)
                answered.append(result.ok)

            nursery.start_soon(lingering)
            await trio.testing.wait_all_tasks_blocked()
            await store.aclose()
        assert answered == [True]
        async with sqlite(path) as reopened:
            assert await stored(reopened) == {"mark"}


async def test_the_memory_store_takes_linger_and_writes_at_once() -> None:
    async with open_store("memory://") as store:
        with trio.fail_after(10):
            (result,) = await store.checkpoints.write_checkpoints([put("mark")], linger_s=60)
        assert result.ok
