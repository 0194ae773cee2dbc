"""An acknowledged message is never stranded by a store outage (issue 10): while the store
fails, the queued message's claim is retried with bounded backoff for as long as it takes
(it was dropped from memory after 8 attempts), health says the store is failing, and the
log says so once per interval instead of once per call."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio

from prismd.journal import ChannelJournal
from stores import StoreUnavailableError
from stores.memory import MemoryStore
from tests.support.builders import event
from tests.support.clocks import TrioClock
from tests.support.harness import Host, runtime


class FlakyCheckpoints:
    """The store's checkpoints; every call fails while ``down`` (a full disk, a lost volume)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.down = False
        self.refused = 0

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        async def call(*args: Any, **kwargs: Any) -> Any:
            if self.down:
                self.refused += 1
                raise StoreUnavailableError("SQLite store journal.sqlite: DiskFullError")
            return await attr(*args, **kwargs)

        return call


async def test_a_claim_is_retried_through_a_long_outage_and_then_runs(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="prismd.journal")
    clock = TrioClock()
    store = MemoryStore(clock=clock)
    host = Host()
    flaky = FlakyCheckpoints(store.checkpoints)
    async with runtime(host, store, clock=clock) as rt:
        core = rt._core
        core.journal = ChannelJournal(flaky, core.limits.max_journal_record_bytes)
        assert rt.health() == {"store": "ok"}
        assert (await rt.admit(event("1"))).status == "accepted"
        flaky.down = True
        await trio.sleep(90)  # far longer than the 8 attempts the claim used to get
        assert host.replies == []
        assert rt.health() == {"store": "failing"}
        assert flaky.refused > 20
        warnings = [r for r in caplog.records if "store is failing" in r.getMessage()]
        assert 2 <= len(warnings) <= 90 / 30 + 1, [r.getMessage() for r in warnings]
        assert all(
            "StoreUnavailableError" in r.getMessage() and "journal.sqlite" not in r.getMessage()
            for r in warnings
        )
        flaky.down = False
        with trio.fail_after(10):
            await host.delivered.wait()
            await rt.drain()
        assert host.texts == ["answer"]
        assert rt.health() == {"store": "ok"}
        assert any("answers again" in r.getMessage() for r in caplog.records)
