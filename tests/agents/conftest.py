"""Fixtures for the agent and control-record tests: a memory store on a manual clock."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import attrs
import pytest
import trio
import trio.lowlevel

from stores import CheckpointConflictError, CheckpointStore
from stores.memory import MemoryStore
from tests.support.clocks import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def store(clock: ManualClock) -> AsyncIterator[MemoryStore]:
    async with MemoryStore(clock=clock) as s:
        yield s


@attrs.define
class YieldingCheckpoints:
    """Wraps a CheckpointStore and yields to the scheduler before every call, so concurrent
    tasks interleave between their load and their compare-and-swap."""

    inner: CheckpointStore
    saves: int = 0
    conflicts: int = 0

    async def load_checkpoint(self, **kw: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return await self.inner.load_checkpoint(**kw)

    async def save_checkpoint(self, **kw: Any) -> Any:
        await trio.lowlevel.checkpoint()
        self.saves += 1
        try:
            return await self.inner.save_checkpoint(**kw)
        except CheckpointConflictError:
            self.conflicts += 1
            raise

    async def write_checkpoints(self, writes: Any, **kw: Any) -> Any:
        await trio.lowlevel.checkpoint()
        self.saves += len(writes)
        results = await self.inner.write_checkpoints(writes, **kw)
        self.conflicts += sum(1 for r in results if r.status == "conflict")
        return results

    async def list_checkpoints(self, **kw: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return await self.inner.list_checkpoints(**kw)

    async def count_checkpoints(self, **kw: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return await self.inner.count_checkpoints(**kw)

    async def delete_checkpoint(self, **kw: Any) -> Any:
        return await self.inner.delete_checkpoint(**kw)

    async def list_events(self, **kw: Any) -> Any:
        return await self.inner.list_events(**kw)

    async def last_event_seq(self) -> int:
        return await self.inner.last_event_seq()
