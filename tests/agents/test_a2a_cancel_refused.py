"""``/cancel`` of a followed task whose peer refuses ``CancelTask`` (LangGraph: "currently
not supported"; a2a-sdk: -32002 once the task ended): the message is settled cancelled at
once, and the task is no longer followed — not polled on until it ends or times out, not
counted in ``health`` — and its later end answers nothing. A task that was over already
when the cancel came (-32002 "already terminal") is read, and its answer given."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from prismd.agents.a2a import A2AAgent, cancel_remote
from prismd.journal import NS_OPERATION
from stores import ANY_SCOPE, SYSTEM_CLOCK
from stores.memory import MemoryStore
from tests.agents.test_a2a_runtime import a2a_agent, op_states
from tests.fakes.a2a_agent import FakeA2A, Plan
from tests.support.builders import event, identity
from tests.support.harness import Host, open_harness
from tests.support.waiting import wait_until


@pytest.fixture
async def mem() -> AsyncIterator[MemoryStore]:
    async with MemoryStore(clock=SYSTEM_CLOCK) as s:
        yield s


@asynccontextmanager
async def following(
    mem: MemoryStore, *, dialect: str = "1.0", streaming: bool = False, poll_ms: int = 200
) -> AsyncIterator[tuple[FakeA2A, A2AAgent, Host, str]]:
    """A peer, its agent and a runtime following the one task a message ("go") made."""
    async with trio.open_nursery() as nursery:
        fake = FakeA2A(dialect=dialect, streaming=streaming)  # type: ignore[arg-type]
        await nursery.start(fake.serve)
        fake.plan(Plan("work"))
        agent = a2a_agent(fake, mem, poll_interval_ms=poll_ms, max_poll_interval_ms=poll_ms)
        async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
            await h.runtime.admit(event("1", "go"))
            await wait_until(lambda: agent.following_now == 1 and bool(fake.tasks))
            (task_id,) = fake.tasks
            yield fake, agent, h, task_id
        await agent.aclose()
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("streaming", [False, True])
async def test_a_cancel_the_peer_refuses_stops_the_following(
    mem: MemoryStore, streaming: bool
) -> None:
    with trio.fail_after(20):
        async with following(mem, streaming=streaming) as (fake, agent, h, task_id):
            fake.friction(*["-32601"] * 2)  # CancelTask, and its v0.3 retry, refused
            await h.runtime.admit(event("2", "/cancel"))
            await h.settle()
            assert fake.tasks[task_id].state == "working"  # not cancelled remotely
            assert h.texts == ["Cancelling the current request.", "Request cancelled."]
            assert agent.following_now == 0
            polls = len(fake.requests)
            await trio.sleep(1.0)  # five poll intervals
            assert all(r["method"] not in ("GetTask", "tasks/get") for r in fake.requests[polls:])
            await fake.move(task_id, "completed", "too late")
            await trio.sleep(0.5)
            assert h.texts == ["Cancelling the current request.", "Request cancelled."]
            assert sorted(await op_states(mem)) == ["cancelled", "succeeded"]


# No poll before the cancel in these: the follower would answer the finished task first.
NO_POLL_MS = 60_000


@pytest.mark.parametrize("dialect", ["1.0", "0.3"])
async def test_a_cancel_that_finds_the_task_over_answers_with_it(
    mem: MemoryStore, dialect: str
) -> None:
    """The task ended at the peer before its follower's next poll, and ``/cancel`` came
    in between: CancelTask answers -32002 (TaskNotCancelable: "already terminal"); the
    reference says GetTask. The work is done: its answer is the message's, once."""
    with trio.fail_after(20):
        async with following(mem, dialect=dialect, poll_ms=NO_POLL_MS) as (fake, agent, h, task):
            await fake.move(task, "completed", "the finished answer", push=False)
            await h.runtime.admit(event("2", "/cancel"))
            await h.settle()
            assert fake.tasks[task].state == "completed"
            assert h.texts == ["Cancelling the current request.", "the finished answer"]
            assert agent.following_now == 0
            assert sorted(await op_states(mem)) == ["succeeded", "succeeded"]
            assert await h.runtime.list_unresolved(identity=identity()) == []


async def test_an_operators_cancel_of_a_task_over_already_answers_with_it(
    mem: MemoryStore,
) -> None:
    """``reconcile --cancel-remote`` on a task the peer finished before its next poll:
    nothing to cancel (-32002), said so; the follower is woken and answers at once."""
    with trio.fail_after(20):
        async with following(mem, poll_ms=NO_POLL_MS) as (fake, agent, h, task_id):
            await fake.move(task_id, "completed", "the finished answer", push=False)
            page = await mem.checkpoints.list_checkpoints(namespace=NS_OPERATION)
            (operation,) = page.items
            assert isinstance(operation.value, dict)
            operation_id = str(operation.value["operationId"])
            result = await cancel_remote({"primary": agent}, ANY_SCOPE, operation_id)
            assert result == {"status": "conflict", "detail": "remote_task_over"}
            await wait_until(lambda: h.texts == ["the finished answer"])
            await h.settle()
            assert fake.tasks[task_id].state == "completed"
            assert sorted(await op_states(mem)) == ["succeeded"]
