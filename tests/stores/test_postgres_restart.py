"""The PostgreSQL server restarted under load (``pg_ctl restart -m fast``): calls in flight fail
with StoreUnavailableError, later calls on the same store succeed (no reopen), and nothing
acknowledged is lost."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import trio

from stores import OwnershipScope, Store, StoreUnavailableError, open_store
from tests.support import pgserver

pytestmark = [pytest.mark.slow, pytest.mark.serial]

SCOPE = OwnershipScope("tenant-1", "acct-1", "user-1")
NS = "prism.channels.v1.operation"


@pytest.fixture
def url() -> Iterator[str]:
    fresh = pgserver.fresh_url()
    yield fresh
    pgserver.drop_schema(fresh)


async def every_key(store: Store) -> set[str]:
    keys: set[str] = set()
    cursor = None
    while True:
        page = await store.checkpoints.list_checkpoints(namespace=NS, cursor=cursor, limit=500)
        keys.update(r.key for r in page.items)
        if (cursor := page.next_cursor) is None:
            return keys


async def every_event_key(store: Store) -> list[str]:
    keys: list[str] = []
    after = 0
    while True:
        page = await store.checkpoints.list_events(after=after, limit=500)
        if not page.items:
            return keys
        keys += [e.key for e in page.items]
        after = page.last_seq


async def test_restart_under_load_loses_nothing_acknowledged(url: str) -> None:
    acked: list[str] = []
    failures: list[BaseException] = []
    progress = trio.Event()
    stop = trio.Event()

    async def writer(lane: int) -> None:
        nonlocal progress
        i = 0
        while not stop.is_set():
            key = f"lane{lane}-{i}"
            i += 1
            try:
                await store.checkpoints.save_checkpoint(
                    namespace=NS, key=key, scope=SCOPE, version=1, expected_version=0,
                    value={"lane": lane, "i": i},
                )  # fmt: skip
            except StoreUnavailableError as exc:
                failures.append(exc)
                await trio.sleep(0.05)  # the server is away: try again shortly
                continue
            acked.append(key)
            progress.set()
            progress = trio.Event()

    async def acked_at_least(count: int) -> None:
        while len(acked) < count:
            await progress.wait()

    with trio.fail_after(120):
        async with open_store(url) as store:
            async with trio.open_nursery() as nursery:
                for lane in range(4):
                    nursery.start_soon(writer, lane)
                await acked_at_least(40)
                done = await trio.to_thread.run_sync(
                    pgserver.pg_ctl, "restart", "-m", "fast", "-w", "-t", "60"
                )
                assert done.returncode == 0, done.stdout + done.stderr
                # The same store, not reopened, writes again once the server is back.
                await acked_at_least(len(acked) + 40)
                stop.set()
            stored = await every_key(store)
            events = await every_event_key(store)
    assert failures, "no call failed although the server went away under load"
    assert all(isinstance(f, StoreUnavailableError) for f in failures)
    assert set(acked) <= stored
    assert set(acked) <= set(events)
    # A failed call may have committed (the outcome of a COMMIT cut off is unknown), but
    # never half: every stored row has its event, and no event is there twice.
    assert stored == set(events) and len(events) == len(set(events))
