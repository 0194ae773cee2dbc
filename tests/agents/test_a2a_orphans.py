"""A followed operation the runtime settles without running the agent again — its
sender's grant refused when the task ends, or at a restart — is settled ``failed`` and
leaves no remote task listed as followed (``listRemoteTasks``) nor counted against the
tenant's ``max_remote_tasks_per_tenant``."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from prismd.agents.a2a import list_remote_tasks
from prismd.agents.a2a._agent import at_limit
from prismd.agents.a2a._book import Book
from prismd.journal import NS_OPERATION
from stores import ANY_SCOPE, SYSTEM_CLOCK, OwnershipScope
from stores.memory import MemoryStore
from tests.agents.test_a2a_runtime import a2a_agent
from tests.fakes.a2a_agent import FakeA2A, Plan
from tests.support.builders import IDENTITY, event
from tests.support.harness import Host, open_harness, runtime, store_factory
from tests.support.waiting import wait_until, wait_until_async


@pytest.fixture
async def mem() -> AsyncIterator[MemoryStore]:
    async with MemoryStore(clock=SYSTEM_CLOCK) as s:
        yield s


async def test_a_grant_refused_when_the_task_ends_leaves_nothing_followed(
    mem: MemoryStore,
) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            fake.plan(Plan("work"))
            agent = a2a_agent(fake, mem)
            # The runtime knows its agents by alias, as the daemon's does.
            h = Host(agent=None, agents={"primary": agent})
            async with runtime(h, mem, clock=SYSTEM_CLOCK, agents={"primary": agent}):
                await h.runtime.admit(event("1", "go"))
                await wait_until(lambda: agent.following_now == 1)
                (task_id,) = fake.tasks
                h.default_grant = None  # the pairing revoked meanwhile
                await fake.move(task_id, "completed", "too late")
                await h.settle()
                assert h.texts == []
                page = await mem.checkpoints.list_checkpoints(namespace=NS_OPERATION)
                assert [r.value["state"] for r in page.items] == ["failed"]
                listed, _ = await list_remote_tasks(mem.checkpoints, ANY_SCOPE)
                assert listed == []
                scope = OwnershipScope(tenant_id=IDENTITY.tenant_id)
                assert not await at_limit(Book(mem.checkpoints), scope, 1)
            await agent.aclose()
            nursery.cancel_scope.cancel()


async def test_a_grant_refused_at_the_restart_settles_the_followed_message(
    tmp_path: Path,
) -> None:
    """Stopped while its task was followed, then the pairing revoked before the restart:
    the restart settles the message ``failed`` (``identity_revoked``) — it was left
    ``following``, taken up by nobody, at every restart — and closes its remote task."""
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery, store_factory("sqlite", tmp_path) as stores:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            fake.plan(Plan("work"))
            first_store = await stores()
            agent = a2a_agent(fake, first_store)
            async with open_harness(first_store, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "long job"))
                await wait_until(lambda: agent.following_now == 1)
                await h.runtime.stop()
            await agent.aclose()
            second_store = await stores()
            again = a2a_agent(fake, second_store)
            h2 = Host(agent=None, agents={"primary": again}, default_grant=None)
            async with runtime(
                h2, second_store, clock=SYSTEM_CLOCK, agents={"primary": again},
                resume_accepted=True,
            ):  # fmt: skip

                async def settled() -> bool:
                    page = await second_store.checkpoints.list_checkpoints(namespace=NS_OPERATION)
                    return [r.value["state"] for r in page.items] == ["failed"]

                await wait_until_async(settled)
                listed, _ = await list_remote_tasks(second_store.checkpoints, ANY_SCOPE)
                assert listed == []
                assert h2.replies == []
            (sent,) = fake.sends()
            assert fake.sends_of(sent["params"]["message"]["messageId"]) == 1
            await again.aclose()
            nursery.cancel_scope.cancel()
