"""Poll leases of one follower when several instances share the store (PostgreSQL's
:class:`~stores.PollStore`): see :mod:`._follower`'s docstring, *Several instances*."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Final

import trio

from stores import PollLease, PollStore, PollWait

POLL_LEASE_MS: Final = 15_000
"""A poll lease's time: renewed every third of it while the call is in flight; a dead
instance's poll is taken over this long after its last renewal at most."""


class PollGate:
    """The leases one follower (one instance) takes on its agent's tasks' due polls."""

    def __init__(self, polls: PollStore, alias: str, lease_ms: int) -> None:
        self.polls = polls
        self.alias = alias
        self.lease_ms = lease_ms
        self.owner = f"a2a-follower-{uuid.uuid4()}"

    def key(self, task_id: str) -> str:
        return f"{self.alias}/{task_id}"

    async def reserve(self, task_id: str, hurry: bool) -> PollLease | PollWait | None:
        """The task's poll lease when it is due (or ``hurry``) and nobody polls it now;
        else when to ask again; ``None`` when its row is gone (the task was answered)."""
        return await self.polls.reserve(
            self.key(task_id), owner_id=self.owner, ttl_ms=self.lease_ms, hurry=hurry
        )

    async def renew(self, lease: PollLease, body: trio.CancelScope) -> None:
        """Renew ``lease`` every third of its time until cancelled; cancel ``body`` (the
        call) when it was taken over."""
        while True:
            await trio.sleep(self.lease_ms / 3000)
            if await self.polls.renew(lease, ttl_ms=self.lease_ms) is None:
                body.cancel()
                return

    async def release(self, lease: PollLease | None, seconds: float) -> bool:
        """Release ``lease`` with the next due time in ``seconds``; ``False`` when it was
        taken over (what was read under it is not applied)."""
        if lease is None:
            return True
        return await self.polls.settle(lease, delay_ms=int(seconds * 1000))

    async def end(self, lease: PollLease | None) -> bool:
        """The task is over: its row goes; ``False`` when the lease was taken over."""
        return lease is None or await self.polls.finish(lease)


@asynccontextmanager
async def holding(gate: PollGate | None, lease: PollLease | None) -> AsyncIterator[None]:
    """Renew ``lease`` while the block runs (a call in flight); the block is cancelled when
    the lease was taken over meanwhile. Nothing without a gate (one instance)."""
    if gate is None or lease is None:
        yield
        return
    async with trio.open_nursery() as nursery:
        body = trio.CancelScope()
        nursery.start_soon(gate.renew, lease, body)
        with body:
            yield
        nursery.cancel_scope.cancel()
