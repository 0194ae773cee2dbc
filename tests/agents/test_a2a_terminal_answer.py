"""A send answered with a task already terminal is replied at once (issue 37): read once
more by ``GetTask`` for the answer, as every answer is — and, when the peer no longer knows
the task by then (a peer that keeps no finished task, or restarted in between) or cannot
be reached, answered from the task the send returned instead of being told "lost"."""

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


@pytest.mark.parametrize("dialect", ["1.0", "0.3"])
@pytest.mark.parametrize("streaming", [False, True])
async def test_a_terminal_send_answer_is_replied_though_the_peer_forgot_the_task(
    mem: MemoryStore, dialect: str, streaming: bool
) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect=dialect, streaming=streaming)  # type: ignore[arg-type]
            await nursery.start(fake.serve)
            fake.plan(Plan("complete", "done at once"))
            fake.stall = trio.Event()
            agent = a2a_agent(fake, mem)
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "quick one"))
                await wait_until(
                    lambda: any(r["method"] in ("GetTask", "tasks/get") for r in fake.requests)
                )
                (task_id,) = fake.tasks
                fake.forget(task_id)  # before the GetTask is answered
                fake.stall.set()
                await h.settle()
                assert h.texts == ["done at once"]
                assert await op_states(mem) == ["succeeded"]
            (sent,) = fake.sends()
            assert fake.sends_of(sent["params"]["message"]["messageId"]) == 1
            # At once: no stream, no poll beyond the one read.
            gets = [r for r in fake.requests if r["method"] in ("GetTask", "tasks/get")]
            assert len(gets) == 1
            assert not any("ubscribe" in r["method"] for r in fake.requests)
            await agent.aclose()
            nursery.cancel_scope.cancel()
