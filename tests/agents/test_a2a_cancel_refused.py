"""``/cancel`` of a followed task whose peer refuses ``CancelTask`` (LangGraph: "currently
not supported"; a2a-sdk: -32002 once the task ended): the message is settled cancelled at
once, and the task is no longer followed — not polled on until it ends or times out, not
counted in ``health`` — and its later end answers nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from stores import SYSTEM_CLOCK
from stores.memory import MemoryStore
from tests.agents.test_a2a_runtime import a2a_agent, op_states
from tests.fakes.a2a_agent import FakeA2A, Plan
from tests.support.builders import event
from tests.support.harness import open_harness
from tests.support.waiting import wait_until


@pytest.fixture
async def mem() -> AsyncIterator[MemoryStore]:
    async with MemoryStore(clock=SYSTEM_CLOCK) as s:
        yield s


@pytest.mark.parametrize("streaming", [False, True])
async def test_a_cancel_the_peer_refuses_stops_the_following(
    mem: MemoryStore, streaming: bool
) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=streaming)
            await nursery.start(fake.serve)
            fake.plan(Plan("work"))
            agent = a2a_agent(fake, mem, poll_interval_ms=200, max_poll_interval_ms=200)
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "go"))
                await wait_until(lambda: agent.following_now == 1 and bool(fake.tasks))
                (task_id,) = fake.tasks
                fake.friction(*["-32601"] * 2)  # CancelTask, and its v0.3 retry, refused
                await h.runtime.admit(event("2", "/cancel"))
                await h.settle()
                assert fake.tasks[task_id].state == "working"  # not cancelled remotely
                assert h.texts == ["Cancelling the current request.", "Request cancelled."]
                assert agent.following_now == 0
                polls = len(fake.requests)
                await trio.sleep(1.0)  # five poll intervals
                assert all(
                    r["method"] not in ("GetTask", "tasks/get") for r in fake.requests[polls:]
                )
                await fake.move(task_id, "completed", "too late")
                await trio.sleep(0.5)
                assert h.texts == ["Cancelling the current request.", "Request cancelled."]
                assert sorted(await op_states(mem)) == ["cancelled", "succeeded"]
            await agent.aclose()
            nursery.cancel_scope.cancel()
