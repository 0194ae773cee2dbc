"""The ``a2a`` agent behind the real messaging runtime, against the loopback fake: sent
once, followed (the operation ``following`` while the remote task works), answered once,
with fixed notices for what went wrong, and a stop that leaves followed work for the restart."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio

from prismd.agents import AgentContext, build_agent
from prismd.agents.a2a import NOTICES, A2AAgent
from prismd.agents.a2a._agent import at_limit
from prismd.agents.a2a._book import Book, Phase, TaskRecord
from prismd.journal import NS_OPERATION
from prismd.limits import Limits
from stores import SYSTEM_CLOCK, OwnershipScope, Store
from stores.memory import MemoryStore
from tests.fakes.a2a_agent import FakeA2A, Plan
from tests.support.builders import IDENTITY, event
from tests.support.harness import open_harness, store_factory
from tests.support.waiting import wait_until, wait_until_async


@pytest.fixture
async def mem() -> AsyncIterator[MemoryStore]:
    async with MemoryStore(clock=SYSTEM_CLOCK) as s:
        yield s


def a2a_agent(fake: FakeA2A, store: Store, **extra: Any) -> A2AAgent:
    options = {"url": fake.base_url, "poll_interval_ms": 20, "max_poll_interval_ms": 200}
    options.update(extra)
    agent = build_agent(
        "a2a",
        AgentContext(alias="primary", options=options, checkpoints=store.checkpoints),
    )
    assert isinstance(agent, A2AAgent)
    return agent


async def op_states(store: MemoryStore) -> list[str]:
    page = await store.checkpoints.list_checkpoints(namespace=NS_OPERATION, limit=500)
    return [str(r.value["state"]) for r in page.items if isinstance(r.value, dict)]


@pytest.mark.parametrize("dialect", ["1.0", "0.3"])
async def test_long_task_is_followed_then_answered_once(dialect: str, mem: MemoryStore) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect=dialect, streaming=False)  # type: ignore[arg-type]
            await nursery.start(fake.serve)
            fake.plan(Plan("work"), Plan("complete", "one part"))
            agent = a2a_agent(fake, mem)
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                assert (await h.runtime.admit(event("1", "research this"))).status == "accepted"
                await wait_until_async(lambda: states_are(mem, ["following"]))
                # Nothing to decide while it is followed, and a plain reconcile refuses.
                assert await h.runtime.list_unresolved(identity=IDENTITY) == []
                page = await mem.checkpoints.list_checkpoints(namespace=NS_OPERATION)
                (row,) = page.items
                refused = await h.runtime.reconcile(
                    identity=IDENTITY,
                    connection_id="tg-1",
                    operation_id=str(row.value["operationId"]),
                    expected_version=row.version,
                    acknowledge_duplicate_risk=True,
                )
                assert (refused.status, refused.detail) == ("conflict", "following")
                (task_id,) = fake.tasks
                await fake.move(task_id, "completed", "first\n\nsecond")
                await wait_until(lambda: bool(h.replies))
                assert h.last().text == "first\n\nsecond"
                assert h.last().kind == "final"
                # The woken turn read its operation instead of claiming it a second time:
                # the answer was staged by CAS on that version, one write fewer.
                settled = await mem.checkpoints.load_checkpoint(
                    namespace=NS_OPERATION, key=row.key, scope=row.scope
                )
                assert settled is not None and settled.value["state"] == "succeeded"
                assert settled.value["attempts"] == 1
                # The next message continues the same context (a new task).
                assert (await h.runtime.admit(event("2", "more"))).status == "accepted"
                await h.settle()
                assert h.texts == ["first\n\nsecond", "one part"]
                sends = fake.sends()
                context = sends[1]["params"]["message"]["contextId"]
                assert context == fake.tasks[task_id].context_id
                assert "taskId" not in sends[1]["params"]["message"]
                assert [fake.sends_of(s["params"]["message"]["messageId"]) for s in sends] == [
                    1,
                    1,
                ]
                assert sorted(await op_states(mem)) == ["succeeded", "succeeded"]
            await agent.aclose()
            nursery.cancel_scope.cancel()


async def states_are(store: MemoryStore, states: list[str]) -> bool:
    return sorted(await op_states(store)) == sorted(states)


async def test_input_required_then_the_next_message_continues_the_task(mem: MemoryStore) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            fake.plan(Plan("input-required", "Which quarter?"), Plan("complete", "Q3 it is"))
            agent = a2a_agent(fake, mem)
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "report please"))
                await h.settle()
                assert h.texts == ["Which quarter?"]
                await h.runtime.admit(event("2", "Q3"))
                await h.settle()
                assert h.texts == ["Which quarter?", "Q3 it is"]
                first, second = fake.sends()
                (task_id,) = fake.tasks
                assert second["params"]["message"]["taskId"] == task_id
                assert second["params"]["message"]["contextId"] == fake.tasks[task_id].context_id
                # /new: a new context, no task carried over.
                await h.runtime.admit(event("3", "/new"))
                await h.settle()
                await h.runtime.admit(event("4", "fresh start"))
                await h.settle()
                third = fake.sends()[2]["params"]["message"]
                assert "contextId" not in third and "taskId" not in third
                del first
            await agent.aclose()
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("state", ["failed", "canceled", "rejected", "lost"])
async def test_failures_are_fixed_words(state: str, mem: MemoryStore) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            fake.plan(Plan("work"))
            agent = a2a_agent(fake, mem)
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "go"))
                await wait_until(lambda: len(fake.tasks) == 1)
                (task_id,) = fake.tasks
                if state == "lost":
                    fake.forget(task_id)
                else:
                    await fake.move(task_id, state, "SECRET remote stack trace")
                await h.settle()
                (reply,) = h.replies
                assert reply.text == f"Request failed: {NOTICES[state]}"
                assert "SECRET" not in reply.text
                assert await op_states(mem) == ["failed"]
            await agent.aclose()
            nursery.cancel_scope.cancel()


async def test_friction_is_retried_and_an_unknown_outcome_is_found_not_resent(
    mem: MemoryStore,
) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            agent = a2a_agent(fake, mem)
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                # Refusals: a 429, a 503, a -32009 — none is a send; then a cut request.
                fake.friction("429", "503", "-32009", "cut")
                fake.plan(Plan("complete", "made it"))
                await h.runtime.admit(event("1", "go"))
                await h.settle()
                assert h.texts == ["made it"]
                (sent,) = {s["params"]["message"]["messageId"] for s in fake.sends()}
                assert fake.sends_of(sent) == 1  # the cut one: found by ListTasks, not resent
                assert any(r["method"] == "ListTasks" for r in fake.requests)
            await agent.aclose()
            nursery.cancel_scope.cancel()


async def test_push_wakes_the_follower_and_streams_show_previews(mem: MemoryStore) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="0.3", streaming=True)
            await nursery.start(fake.serve)
            fake.plan(Plan("work"))
            agent = a2a_agent(fake, mem, poll_interval_ms=60_000, max_poll_interval_ms=60_000)
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "go"))
                await wait_until(
                    lambda: any(r["method"] == "tasks/resubscribe" for r in fake.requests)
                )
                (task_id,) = fake.tasks
                await fake.move(task_id, "working", "reading the sources")
                await wait_until(lambda: bool(h.previews))
                assert h.previews[-1].text == "reading the sources"
                await fake.move(task_id, "completed", "the answer")
                await h.settle()
                assert h.texts == ["the answer"]
            await agent.aclose()
            nursery.cancel_scope.cancel()


async def test_cancel_sends_cancel_task(mem: MemoryStore) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            fake.plan(Plan("work"))
            agent = a2a_agent(fake, mem)
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "go"))
                await wait_until_async(lambda: states_are(mem, ["following"]))
                await h.runtime.admit(event("2", "/cancel"))
                await h.settle()
                (task,) = fake.tasks.values()
                assert task.state == "canceled"
                assert any(r["method"] == "CancelTask" for r in fake.requests)
                assert "cancelled" in h.texts[-1].lower()
            await agent.aclose()
            nursery.cancel_scope.cancel()


async def test_stop_leaves_the_task_followed_and_a_restart_answers_once(
    mem: MemoryStore,
) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            fake.plan(Plan("work"), Plan("complete", "second answer"))
            agent = a2a_agent(fake, mem)
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "long job"))
                await wait_until_async(lambda: states_are(mem, ["following"]))
                await h.runtime.admit(event("2", "and then this"))
                await h.runtime.stop()
                assert h.replies == []
            # The remote task was not cancelled; the queued message is still accepted.
            (task_id,) = fake.tasks
            assert fake.tasks[task_id].state == "working"
            assert not any(r["method"] == "CancelTask" for r in fake.requests)
            assert sorted(await op_states(mem)) == ["accepted", "following"]
            await fake.move(task_id, "completed", "first answer", push=False)
            again = a2a_agent(fake, mem)
            async with open_harness(
                mem, SYSTEM_CLOCK, {"primary": again}, resume_accepted=True
            ) as h2:
                await wait_until(lambda: len(h2.replies) == 2)
                await h2.settle()
                assert h2.texts == ["first answer", "second answer"]
            assert len(fake.sends()) == 2
            assert all(
                fake.sends_of(s["params"]["message"]["messageId"]) == 1 for s in fake.sends()
            )
            await agent.aclose()
            await again.aclose()
            nursery.cancel_scope.cancel()


async def test_a_message_beyond_the_tenant_limit_is_refused_before_any_send(
    mem: MemoryStore,
) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            fake.plan(Plan("work"), Plan("complete", "after the first"))
            agent = build_agent(
                "a2a",
                AgentContext(
                    alias="primary",
                    options={"url": fake.base_url, "poll_interval_ms": 20},
                    checkpoints=mem.checkpoints,
                    max_remote_tasks_per_tenant=1,
                ),
            )
            assert isinstance(agent, A2AAgent)
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "long", chat="chat-1"))
                await wait_until_async(lambda: states_are(mem, ["following"]))
                await h.runtime.admit(event("2", "another", chat="chat-2"))
                await wait_until(lambda: bool(h.replies))
                assert h.texts == [f"Request failed: {NOTICES['limit']}"]
                assert len(fake.sends()) == 1
                (task_id,) = fake.tasks
                await fake.move(task_id, "completed", "done")
                await wait_until(lambda: len(h.replies) == 2)
                # Below the limit again: the next message is sent.
                await h.runtime.admit(event("3", "now", chat="chat-2"))
                await h.settle()
                assert h.texts[-1] == "after the first"
                assert len(fake.sends()) == 2
            await agent.aclose()
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("backend", ["memory", "sqlite", "postgres"])
async def test_the_tenant_limit_counts_every_open_task_beyond_a_page(
    backend: str, tmp_path: Path
) -> None:
    """``max_remote_tasks_per_tenant`` may be up to 100,000: the open task records are
    counted (through the listing index), not listed a page of at most 500 (before, a
    limit above 500 never refused). Answered tasks and other tenants do not count."""
    async with store_factory(backend, tmp_path) as stores:
        store = await stores()
        book = Book(store.checkpoints)
        tenant = OwnershipScope("t1", "a1", "u1")

        async def save(n: int, scope: OwnershipScope, phase: Phase) -> None:
            record = TaskRecord("primary", f"m{n}", phase, "s", 0)
            assert await book.save(scope, f"op-{n}", record, 0) is not None

        for n in range(501):
            await save(n, OwnershipScope("t1", "a1", f"u{n % 3}"), "following")
        await save(501, tenant, "done")
        await save(502, OwnershipScope("t2"), "sending")
        assert await at_limit(book, tenant, 501)
        assert not await at_limit(book, tenant, 502)
        assert await at_limit(book, OwnershipScope("t2", "x"), 1)
        assert not await at_limit(book, OwnershipScope("t3"), 1)


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
async def test_following_survives_a_reopened_durable_store(backend: str, tmp_path: Path) -> None:
    """The stop/restart of a followed task on a durable backend: the second runtime opens
    the journal anew (a new process would), follows the task and answers it once."""
    with trio.fail_after(40):
        async with trio.open_nursery() as nursery, store_factory(backend, tmp_path) as stores:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            fake.plan(Plan("work"))
            first_store = await stores()
            agent = a2a_agent(fake, first_store)
            async with open_harness(first_store, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "long job"))
                await wait_until(lambda: any(r["method"] == "GetTask" for r in fake.requests))
                await h.runtime.stop()
            await agent.aclose()
            (task_id,) = fake.tasks
            await fake.move(task_id, "completed", "answered after the restart", push=False)
            second_store = await stores()
            again = a2a_agent(fake, second_store)
            async with open_harness(
                second_store, SYSTEM_CLOCK, {"primary": again}, resume_accepted=True
            ) as h2:
                await wait_until(lambda: bool(h2.replies))
                await h2.settle()
                assert h2.texts == ["answered after the restart"]
                assert await h2.runtime.list_unresolved(identity=IDENTITY) == []
            (sent,) = fake.sends()
            assert fake.sends_of(sent["params"]["message"]["messageId"]) == 1
            await again.aclose()
            nursery.cancel_scope.cancel()


async def test_a_refusing_peer_holds_no_concurrency_slot(mem: MemoryStore) -> None:
    """One slot in all: the first message's send is refused (429, Retry-After 1 s); while
    it waits, the second conversation's message takes the slot and is answered first."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            fake.plan(Plan("complete", "second"), Plan("complete", "first"))
            agent = a2a_agent(fake, mem)
            async with open_harness(
                mem, SYSTEM_CLOCK, {"primary": agent}, limits=Limits(max_active_sessions=1)
            ) as h:
                fake.friction("429")
                await h.runtime.admit(event("1", "first", chat="chat-1"))
                await wait_until(lambda: fake.friction_left == 0)  # the 429 was answered
                await h.runtime.admit(event("2", "second", chat="chat-2"))
                await h.settle()
                assert h.texts == ["second", "first"]
                assert [r.external_conversation_id for r in h.replies] == ["chat-2", "chat-1"]
            await agent.aclose()
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("dialect", ["1.0", "0.3"])
async def test_a_cut_stream_falls_back_and_chunks_never_make_the_reply(
    dialect: str, mem: MemoryStore
) -> None:
    """The first stream is cut after its snapshot; the follower polls and subscribes again;
    the answer streams in 5 chunks, and the reply is the task's artifact read by GetTask,
    once, not the chunks put together."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect=dialect, streaming=True)  # type: ignore[arg-type]
            await nursery.start(fake.serve)
            fake.plan(Plan("work"))
            agent = a2a_agent(fake, mem)
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "go"))
                await wait_until(lambda: len(fake.tasks) == 1)
                fake.friction("cut")  # for the first subscribe
                subscribe = "SubscribeToTask" if dialect == "1.0" else "tasks/resubscribe"
                await wait_until(lambda: sum(r["method"] == subscribe for r in fake.requests) >= 2)
                (task_id,) = fake.tasks
                await fake.move(task_id, "completed", "a fairly long streamed answer", chunks=5)
                await h.settle()
                assert h.texts == ["a fairly long streamed answer"]
            await agent.aclose()
            nursery.cancel_scope.cancel()
