"""Parked remote tasks (``prismd/agents/a2a/_follower.py``): following costs nothing between
polls — no Trio task per followed task while it waits — and every parked turn is still
answered once, in order with the messages queued behind it."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import pytest
import trio

from prismd.agents.a2a import NOTICES, A2AAgent, next_poll
from prismd.agents.a2a._follower import Followed
from prismd.journal import NS_OPERATION
from prismd.runtime._following import Wake
from stores import SYSTEM_CLOCK
from stores.memory import MemoryStore
from tests.agents.test_a2a_runtime import a2a_agent, op_states
from tests.fakes.a2a_agent import FakeA2A, Plan
from tests.support.builders import event
from tests.support.harness import Host, open_harness
from tests.support.waiting import wait_until, wait_until_async


@pytest.fixture
async def mem() -> AsyncIterator[MemoryStore]:
    async with MemoryStore(clock=SYSTEM_CLOCK) as s:
        yield s


def trio_tasks() -> int:
    """Every Trio task alive now."""
    count = 0
    root = trio.lowlevel.current_root_task()
    assert root is not None
    todo = [root]
    while todo:
        task = todo.pop()
        count += 1
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return count


async def _park(h: Host, agent: A2AAgent, mem: MemoryStore, first: int, n: int) -> None:
    for i in range(first, first + n):
        admitted = await h.runtime.admit(event(f"e{i}", "go", chat=f"chat-{i}"))
        assert admitted.status == "accepted"
    await wait_until(lambda: agent.following_now == first + n)
    await wait_until_async(
        lambda: _all_following(mem, first + n),
    )


async def _all_following(mem: MemoryStore, n: int) -> bool:
    states = await op_states(mem)
    return states.count("following") == n


async def test_parked_tasks_hold_no_task_each_and_are_answered_once(mem: MemoryStore) -> None:
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            fake.plan(*(Plan("work") for _ in range(60)))
            agent = a2a_agent(fake, mem, poll_interval_ms=60_000, max_poll_interval_ms=60_000)
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await _park(h, agent, mem, 0, 5)
                # Let the pumps end and the idle leases go (their release is scheduled).
                await trio.sleep(1.5)
                few = trio_tasks()
                await _park(h, agent, mem, 5, 55)
                await trio.sleep(1.5)
                many = trio_tasks()
                # 55 more tasks followed, not 55 more Trio tasks (nor 2 × 55: no pump, no
                # lease renewer, no run): the follower's fixed set serves them all.
                assert many - few <= 3, (few, many)
                assert agent.following_now == 60
                # Each parked turn is kept as its wake alone (ids and grant), its event and
                # route's parts not copied: rebuilt from the route when it runs again. Its
                # route is released meanwhile (its lease went): the wake is kept by key.
                routes = h.runtime._core.routes
                released = [p for _key, p in routes.released()]
                assert len(released) == 60
                assert not any(r.parked for r in routes.values())
                parked = [r.parked for r in routes.values() if r.parked] + released
                assert len(parked) == 60
                assert all(isinstance(p, Wake) and p.turn is None for p in parked)
                assert all(sys.getsizeof(p) <= 88 for p in parked)
                # Each task was read once when parked, and is due for its next poll.
                assert len([r for r in fake.requests if r["method"] == "GetTask"]) == 60
                agents = {"primary": agent}
                assert all(next_poll(agents, "primary", t) is not None for t in fake.tasks)
                # A message behind a parked task waits for it.
                assert (await h.runtime.admit(event("late", "after", chat="chat-3"))).status == (
                    "accepted"
                )
                fake.plan(Plan("complete", "the late answer"))
                await trio.sleep(0.3)
                assert len(fake.sends()) == 60
                for task_id in list(fake.tasks):
                    await fake.move(task_id, "completed", f"answer {task_id}", push=False)
                    # Polls come a minute apart: a push (here, its effect) wakes the task.
                    assert agent.observe(task_id)
                await wait_until(lambda: len(h.replies) == 61)
                await h.settle()
                texts = sorted(h.texts)
                assert texts == sorted(
                    [f"answer {t}" for t in list(fake.tasks)[:60]] + ["the late answer"]
                )
                # The late message was sent only after the task before it was answered.
                chat3 = [r.text for r in h.replies if r.external_conversation_id == "chat-3"]
                assert chat3[-1] == "the late answer" and len(chat3) == 2
                # A woken turn answers its own event, in its own conversation.
                answers = [r for r in h.replies if r.text.startswith("answer ")]
                assert sorted(
                    (r.connection_id, r.external_conversation_id, r.thread_id, r.in_reply_to)
                    for r in answers
                ) == sorted(("tg-1", f"chat-{i}", None, f"e{i}") for i in range(60))
                assert all(fake.sends_of(s["params"]["message"]["messageId"]) == 1
                           for s in fake.sends())  # fmt: skip
                assert agent.following_now == 0
                page = await mem.checkpoints.list_checkpoints(namespace=NS_OPERATION, limit=500)
                assert {str(r.value["state"]) for r in page.items if isinstance(r.value, dict)} == {
                    "succeeded"
                }
            await agent.aclose()
            nursery.cancel_scope.cancel()


async def test_a_parked_task_past_its_timeout_is_cancelled_and_told(mem: MemoryStore) -> None:
    """``task_timeout_ms``: the follower wakes the parked turn at the deadline (polls a
    minute apart would not); the run cancels the task remotely and says so, once."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            fake.plan(Plan("work"))
            agent = a2a_agent(
                fake, mem, poll_interval_ms=60_000, max_poll_interval_ms=60_000,
                task_timeout_ms=1000,
            )  # fmt: skip
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "slow job"))
                await wait_until(lambda: agent.following_now == 1)
                await wait_until(lambda: bool(h.replies))
                await h.settle()
                (reply,) = h.replies
                assert reply.text == f"Request failed: {NOTICES['timeout']}"
                (task,) = fake.tasks.values()
                assert task.state == "canceled"
                assert [r["method"] for r in fake.requests].count("CancelTask") == 1
                assert await op_states(mem) == ["failed"]
                assert agent.following_now == 0
            await agent.aclose()
            nursery.cancel_scope.cancel()


def test_a_followed_record_is_small_and_its_booleans_are_bits() -> None:
    """What the follower keeps per parked task between polls: eleven slots (120 bytes, where
    sixteen took 160), its booleans one bit each of one small int, its state string shared
    by every task in that state."""

    def nothing() -> None:
        return None

    one = Followed(
        key="op-1", task_id="t-1", state="".join(["work", "ing"]), deadline_ms=2**41,
        delay=2.0, pushed=True, wake=nothing, on_event=None,
    )  # fmt: skip
    two = Followed(
        key="op-2", task_id="t-2", state="".join(["wor", "king"]), deadline_ms=2**41,
        delay=2.0, pushed=False, wake=nothing, on_event=None,
    )  # fmt: skip
    assert sys.getsizeof(one) <= 120
    assert one.state is two.state
    assert (one.pushed, two.pushed) == (True, False)
    one.hurry = True
    one.restream = True
    assert (one.pushed, one.hurry, one.streaming, one.may_stream, one.restream) == (
        True, True, False, False, True,
    )  # fmt: skip
    one.pushed = False
    one.hurry = False
    assert (one.pushed, one.hurry, one.restream) == (False, False, True)
    assert not two.hurry and not two.restream
