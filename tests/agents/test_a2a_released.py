"""A parked remote task whose route was released while it waits (``Routes.release``,
``prismd/runtime/_following.py``): ``/cancel``, a stop and a restart, a message behind it and
a grant withdrawn meanwhile behave as for a route kept in memory."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from prismd.agents.a2a import A2AAgent
from prismd.journal import NS_OPERATION
from stores import SYSTEM_CLOCK
from stores.memory import MemoryStore
from tests.agents.test_a2a_runtime import a2a_agent, op_states, states_are
from tests.fakes.a2a_agent import FakeA2A, Plan
from tests.support.builders import event
from tests.support.harness import Host, open_harness
from tests.support.waiting import wait_until, wait_until_async


@pytest.fixture
async def mem() -> AsyncIterator[MemoryStore]:
    async with MemoryStore(clock=SYSTEM_CLOCK) as s:
        yield s


def slow_agent(fake: FakeA2A, mem: MemoryStore) -> A2AAgent:
    """Polls a minute apart: the task is read once when parked, then only when pushed."""
    return a2a_agent(fake, mem, poll_interval_ms=60_000, max_poll_interval_ms=60_000)


async def park_released(h: Host, agent: A2AAgent, mem: MemoryStore) -> None:
    """One message followed, and its route released (its idle lease went)."""
    assert (await h.runtime.admit(event("1", "long job"))).status == "accepted"
    await wait_until(lambda: agent.following_now == 1)
    await wait_until_async(lambda: states_are(mem, ["following"]))
    routes = h.runtime._core.routes
    await wait_until(lambda: len(routes.released()) == 1)
    assert not any(route.parked for route in routes.values())


@asynccontextmanager
async def parked(mem: MemoryStore, *plans: Plan) -> AsyncIterator[tuple[FakeA2A, A2AAgent, Host]]:
    """The fake (answering ``plans``), a slow agent and a harness, with one message
    followed and its route released; the agent closed and the fake stopped after."""
    async with trio.open_nursery() as nursery:
        fake = FakeA2A(dialect="1.0", streaming=False)
        await nursery.start(fake.serve)
        fake.plan(*plans)
        agent = slow_agent(fake, mem)
        async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
            await park_released(h, agent, mem)
            yield fake, agent, h
        await agent.aclose()
        nursery.cancel_scope.cancel()


async def test_cancel_reaches_a_task_whose_route_was_released(mem: MemoryStore) -> None:
    with trio.fail_after(30):
        async with parked(mem, Plan("work")) as (fake, _agent, h):
            await h.runtime.admit(event("2", "/cancel"))
            await h.settle()
            (task,) = fake.tasks.values()
            assert task.state == "canceled"
            assert [r["method"] for r in fake.requests].count("CancelTask") == 1
            assert "cancelled" in h.texts[-1].lower()
            assert h.runtime._core.routes.released() == []


async def test_a_message_behind_a_released_route_waits_and_both_are_answered_in_order(
    mem: MemoryStore,
) -> None:
    with trio.fail_after(30):
        async with parked(mem, Plan("work"), Plan("complete", "second answer")) as (fake, agent, h):
            assert (await h.runtime.admit(event("2", "and then"))).status == "accepted"
            # Held: the second message is not sent while the first task works.
            await trio.sleep(0.3)
            assert len(fake.sends()) == 1
            assert h.replies == []
            (task_id,) = fake.tasks
            await fake.move(task_id, "completed", "first answer", push=False)
            assert agent.observe(task_id)
            await wait_until(lambda: len(h.replies) == 2)
            await h.settle()
            assert h.texts == ["first answer", "second answer"]
            assert [r.in_reply_to for r in h.replies] == ["1", "2"]
        assert all(fake.sends_of(s["params"]["message"]["messageId"]) == 1
                   for s in fake.sends())  # fmt: skip


async def test_stop_forgets_a_released_route_and_a_restart_answers_once(
    mem: MemoryStore,
) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            fake.plan(Plan("work"))
            agent = slow_agent(fake, mem)
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await park_released(h, agent, mem)
                with trio.fail_after(5):  # the stop does not wait for the parked turn
                    await h.runtime.stop()
                assert h.replies == []
                assert h.runtime._core.inflight == 0
            (task_id,) = fake.tasks
            assert fake.tasks[task_id].state == "working"
            assert await op_states(mem) == ["following"]
            await fake.move(task_id, "completed", "the answer", push=False)
            again = a2a_agent(fake, mem)
            async with open_harness(
                mem, SYSTEM_CLOCK, {"primary": again}, resume_accepted=True
            ) as h2:
                await wait_until(lambda: len(h2.replies) == 1)
                await h2.settle()
                assert h2.texts == ["the answer"]
            assert len(fake.sends()) == 1
            await agent.aclose()
            await again.aclose()
            nursery.cancel_scope.cancel()


async def test_a_grant_withdrawn_while_followed_ends_the_turn_unanswered(
    mem: MemoryStore,
) -> None:
    """The wake asks ``authorize`` again (as a restart does): refused now, the operation
    is settled ``failed`` (``rejected``), nothing is sent, and the route is free."""
    with trio.fail_after(30):
        async with parked(mem, Plan("work")) as (fake, agent, h):
            h.grants["user-1"] = None
            (task_id,) = fake.tasks
            await fake.move(task_id, "completed", "too late", push=False)
            assert agent.observe(task_id)
            await wait_until_async(lambda: states_are(mem, ["failed"]))
            await h.settle()
            assert h.replies == []
            page = await mem.checkpoints.list_checkpoints(namespace=NS_OPERATION)
            (row,) = page.items
            assert isinstance(row.value, dict) and row.value["errorCode"] == "rejected"
            routes = h.runtime._core.routes
            assert routes.released() == []
            assert not any(route.busy for route in routes.values())
