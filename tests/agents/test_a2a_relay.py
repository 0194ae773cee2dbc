"""``auth-required`` behind the real runtime, against the loopback fake: the remote task's
status message is relayed to the chat once per observed status — not again by later polls,
a stream, a restart — while the task is followed on, and its completion is answered after."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

import pytest
import trio

from prismd.agents import AgentContext, build_agent
from prismd.agents.a2a import A2AAgent
from prismd.channel import Reply, SendResult
from prismd.journal import NS_OPERATION, NS_REPLY
from stores import SYSTEM_CLOCK, Store
from stores.memory import MemoryStore
from tests.fakes.a2a_agent import FakeA2A, Plan
from tests.support.builders import IDENTITY, event
from tests.support.harness import open_harness
from tests.support.waiting import wait_until, wait_until_async

SIGN_IN = "Sign in at the portal, then I go on."


@pytest.fixture
async def mem() -> AsyncIterator[MemoryStore]:
    async with MemoryStore(clock=SYSTEM_CLOCK) as s:
        yield s


def a2a_agent(fake: FakeA2A, store: Store, **extra: Any) -> A2AAgent:
    options = {"url": fake.base_url, "poll_interval_ms": 20, "max_poll_interval_ms": 60}
    options.update(extra)
    agent = build_agent(
        "a2a", AgentContext(alias="primary", options=options, checkpoints=store.checkpoints)
    )
    assert isinstance(agent, A2AAgent)
    return agent


@asynccontextmanager
async def remote(
    store: Store, *, dialect: Literal["1.0", "0.3"], streaming: bool
) -> AsyncIterator[tuple[FakeA2A, A2AAgent]]:
    """The loopback fake A2A server (a long task planned) and an ``a2a`` agent on it,
    closed once the block is done."""
    async with trio.open_nursery() as nursery:
        fake = FakeA2A(dialect=dialect, streaming=streaming)
        await nursery.start(fake.serve)
        fake.plan(Plan("work"))
        agent = a2a_agent(fake, store)
        yield fake, agent
        await agent.aclose()
        nursery.cancel_scope.cancel()


async def op_states(store: MemoryStore) -> list[str]:
    page = await store.checkpoints.list_checkpoints(namespace=NS_OPERATION, limit=500)
    return sorted(str(r.value["state"]) for r in page.items if isinstance(r.value, dict))


async def reply_rows(store: MemoryStore) -> list[dict[str, Any]]:
    page = await store.checkpoints.list_checkpoints(namespace=NS_REPLY, limit=500)
    return [dict(r.value) for r in page.items if isinstance(r.value, dict)]


def polls(fake: FakeA2A) -> int:
    return sum(1 for r in fake.requests if r["method"] in ("GetTask", "tasks/get"))


@pytest.mark.parametrize(("dialect", "streaming"), [("1.0", False), ("0.3", False), ("1.0", True)])
async def test_auth_required_is_relayed_once_then_the_answer_follows(
    dialect: str, streaming: bool, mem: MemoryStore
) -> None:
    with trio.fail_after(20):
        async with remote(mem, dialect=dialect, streaming=streaming) as (fake, agent):  # type: ignore[arg-type]
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "fetch my invoices"))
                await wait_until_async(lambda: _states_are(mem, ["following"]))
                (task_id,) = fake.tasks
                await fake.move(task_id, "auth-required", SIGN_IN)
                await wait_until(lambda: len(h.replies) == 1)
                relayed = h.last()
                assert (relayed.text, relayed.kind) == (SIGN_IN, "notice")
                assert relayed.operation_id is not None and "~auth-" in relayed.operation_id
                # Followed on: more polls of the same status relay nothing more.
                seen = polls(fake)
                await wait_until(lambda: polls(fake) >= seen + 3)
                assert len(h.replies) == 1
                assert await op_states(mem) == ["following"]
                # The agent resumes on its own.
                await fake.move(task_id, "working", None)
                await fake.move(task_id, "completed", "here are your invoices")
                await wait_until(lambda: len(h.replies) == 2)
                await h.settle()
                assert h.texts == [SIGN_IN, "here are your invoices"]
                assert h.last().kind == "final"
                assert await op_states(mem) == ["succeeded"]
                rows = await reply_rows(mem)
                assert sorted(r["state"] for r in rows) == ["delivered", "delivered"]
            (sent,) = fake.sends()
            assert fake.sends_of(sent["params"]["message"]["messageId"]) == 1


async def test_a_restart_relays_the_same_status_never_again_and_a_new_one_once(
    mem: MemoryStore,
) -> None:
    with trio.fail_after(30):
        async with remote(mem, dialect="1.0", streaming=False) as (fake, agent):
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "fetch my invoices"))
                await wait_until_async(lambda: _states_are(mem, ["following"]))
                (task_id,) = fake.tasks
                await fake.move(task_id, "auth-required", SIGN_IN)
                await wait_until(lambda: len(h.replies) == 1)
                await h.runtime.stop()
            assert await op_states(mem) == ["following"]
            again = a2a_agent(fake, mem)
            async with open_harness(
                mem, SYSTEM_CLOCK, {"primary": again}, resume_accepted=True
            ) as h2:
                # Followed again, the same auth-required status seen again: not relayed.
                seen = polls(fake)
                await wait_until(lambda: polls(fake) >= seen + 3)
                assert h2.replies == []
                # A new episode (another status) is relayed once, then the answer.
                await fake.move(task_id, "working", None)
                await fake.move(task_id, "auth-required", "One more sign-in, please.")
                await wait_until(lambda: len(h2.replies) == 1)
                seen = polls(fake)
                await wait_until(lambda: polls(fake) >= seen + 3)
                await fake.move(task_id, "completed", "done at last")
                await wait_until(lambda: len(h2.replies) == 2)
                await h2.settle()
                assert h2.texts == ["One more sign-in, please.", "done at last"]
            assert h.texts == [SIGN_IN]
            assert await op_states(mem) == ["succeeded"]
            (sent,) = fake.sends()
            assert fake.sends_of(sent["params"]["message"]["messageId"]) == 1
            await again.aclose()


async def test_an_auth_required_status_without_a_message_gets_fixed_words(
    mem: MemoryStore,
) -> None:
    with trio.fail_after(20):
        async with (
            remote(mem, dialect="0.3", streaming=False) as (fake, agent),
            open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h,
        ):
            await h.runtime.admit(event("1", "go"))
            await wait_until_async(lambda: _states_are(mem, ["following"]))
            (task_id,) = fake.tasks
            await fake.move(task_id, "auth-required", None)
            await wait_until(lambda: len(h.replies) == 1)
            assert h.texts == [
                "The remote agent needs an authorization to go on; it continues once it has it."
            ]
            await fake.move(task_id, "canceled", None)
            await wait_until(lambda: len(h.replies) == 2)
            assert h.last().text == "Request failed: the remote agent cancelled it."


async def test_a_relay_whose_send_is_unknown_is_listed_and_reconciled_by_its_own_id(
    mem: MemoryStore,
) -> None:
    """The relay's send raises (it may have landed): the relay is listed under its own id
    and version — reconciling the answered operation would not reach it — is resent only
    with the duplicate risk acknowledged, and then leaves the list."""
    cut: list[str] = []

    def cut_the_first_notice(reply: Reply) -> SendResult | None:
        if reply.kind == "notice" and not cut:
            cut.append(reply.text)
            raise ConnectionError("cut after the request went out")
        return None

    with trio.fail_after(20):
        async with (
            remote(mem, dialect="1.0", streaming=False) as (fake, agent),
            open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h,
        ):
            h.deliver_hook = cut_the_first_notice
            await h.runtime.admit(event("1", "fetch my invoices"))
            await wait_until_async(lambda: _states_are(mem, ["following"]))
            (task_id,) = fake.tasks
            await fake.move(task_id, "auth-required", SIGN_IN)
            await wait_until(lambda: len(h.replies) == 1)
            await fake.move(task_id, "completed", "here are your invoices")
            await wait_until(lambda: len(h.replies) == 2)
            await h.settle()
            assert cut == [SIGN_IN]
            (entry,) = await h.runtime.list_unresolved(identity=IDENTITY)
            assert "~auth-" in entry.operation_id
            assert (entry.state, entry.reply_state) == ("succeeded", "delivery_unknown")
            unacknowledged = await h.runtime.reconcile(
                identity=IDENTITY,
                connection_id=entry.connection_id,
                operation_id=entry.operation_id,
                expected_version=entry.version,
            )
            assert (unacknowledged.status, unacknowledged.detail) == (
                "conflict",
                "duplicate_risk",
            )
            stale = await h.runtime.reconcile(
                identity=IDENTITY,
                connection_id=entry.connection_id,
                operation_id=entry.operation_id,
                expected_version=entry.version + 1,
                acknowledge_duplicate_risk=True,
            )
            assert (stale.status, stale.current_version) == ("conflict", entry.version)
            resent = await h.runtime.reconcile(
                identity=IDENTITY,
                connection_id=entry.connection_id,
                operation_id=entry.operation_id,
                expected_version=entry.version,
                acknowledge_duplicate_risk=True,
            )
            assert (resent.status, resent.outcome) == ("resolved", "reply_delivered")
            assert h.texts == [SIGN_IN, "here are your invoices", SIGN_IN]
            assert await h.runtime.list_unresolved(identity=IDENTITY) == []
            again = await h.runtime.reconcile(
                identity=IDENTITY,
                connection_id=entry.connection_id,
                operation_id=entry.operation_id,
                expected_version=entry.version + 2,
                acknowledge_duplicate_risk=True,
            )
            assert again.status in ("resolved", "conflict")
            assert len(h.replies) == 3, "a settled relay was sent again"


async def _states_are(store: MemoryStore, states: list[str]) -> bool:
    return await op_states(store) == sorted(states)


async def test_without_a_journal_a_status_is_relayed_once_while_the_turn_lives(
    mem: MemoryStore,
) -> None:
    with trio.fail_after(20):
        async with (
            remote(mem, dialect="1.0", streaming=False) as (fake, agent),
            open_harness(mem, SYSTEM_CLOCK, {"primary": agent}, use_journal=False) as h,
        ):
            await h.runtime.admit(event("1", "go"))
            await wait_until(lambda: polls(fake) >= 1)
            (task_id,) = fake.tasks
            await fake.move(task_id, "auth-required", SIGN_IN)
            await wait_until(lambda: len(h.replies) == 1)
            seen = polls(fake)
            await wait_until(lambda: polls(fake) >= seen + 3)
            await fake.move(task_id, "completed", "fine")
            await wait_until(lambda: len(h.replies) == 2)
            assert h.texts == [SIGN_IN, "fine"]
