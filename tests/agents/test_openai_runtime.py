"""The ``openai`` agent behind the real messaging runtime: previews, failure notices, the
approval round trip through the runtime's controls, and transcripts that follow retention."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing

from prismd.agents import NS_RUN, AgentContext, OpenAIAgent, build_agent
from prismd.grants import AgentIdentity, Principal, ownership_from_identity
from stores.memory import MemoryStore
from tests.fakes.openai_api import Answer, Failure, FakeOpenAI, start_fake_openai
from tests.support.builders import IDENTITY, event
from tests.support.clocks import ManualClock
from tests.support.harness import ExactRedactor, open_harness

from .test_openai import CALLS, KEY, Calls, reader

OPERATOR = AgentIdentity(
    tenant_id="tenant-1", principal=Principal("operator", "op"), scopes=("operator",),
    issued_at_ms=0,
)  # fmt: skip
DAY_MS = 24 * 3600 * 1000


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with trio.open_nursery() as nursery:
        yield await start_fake_openai(nursery, api_key=KEY)
        nursery.cancel_scope.cancel()


@pytest.fixture
def calls() -> Calls:
    CALLS.log.clear()
    CALLS.gate = None
    CALLS.started = trio.Event()
    return CALLS


def openai_agent(fake: FakeOpenAI, store: MemoryStore, clock: ManualClock, **extra: Any) -> Any:
    agent = build_agent(
        "openai",
        AgentContext(
            alias="primary",
            options={
                "base_url": fake.base_url, "model": "gpt-4o-mini",
                "api_key_env": "OPENAI_API_KEY", **extra,
            },
            checkpoints=store.checkpoints, clock=clock, read_secret=reader(),
        ),
    )  # fmt: skip
    assert isinstance(agent, OpenAIAgent)
    return agent


async def test_answer_previews_and_a_provider_outage_notice(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    agent = openai_agent(fake, store, clock)
    async with open_harness(store, clock, {"primary": agent}, redactor=ExactRedactor(KEY)) as h:
        fake.push(Answer(f"The key is {KEY}, says the model.", chunk_chars=6))
        assert (await h.runtime.admit(event("1", "hi"))).status == "accepted"
        await h.settle()
        final = h.last()
        assert final.kind == "final"
        assert final.text == "The key is [REDACTED], says the model."
        assert len(h.previews) >= 3 and h.previews[-1].text == final.text
        assert all(KEY not in p.text for p in h.previews)
        # the provider is down: every attempt fails, the user gets a bounded notice
        fake.push(*[Failure(503)] * 4)
        assert (await h.runtime.admit(event("2", "still there?"))).status == "accepted"
        await h.settle()
        assert h.last().text == (
            "Request failed: the model server failed (HTTP 503); try again later"
        )
        assert h.runtime.diagnostics().failed == 1
        # and the next message is answered again
        assert (await h.runtime.admit(event("3", "and now?"))).status == "accepted"
        await h.settle()
        assert h.last().text.startswith("You said: and now? (I remember 1 earlier")
    await agent.aclose()


async def test_tool_approval_round_trip_through_the_runtime(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock, calls: Calls,
    autojump_clock: trio.testing.MockClock,
) -> None:  # fmt: skip
    agent = openai_agent(fake, store, clock, tools="tests.agents.test_openai:test_tools")
    async with open_harness(store, clock, {"primary": agent}) as h:
        fake.push(Answer(tool_calls=(("delete", {"path": "/var/log/old"}),)))
        assert (await h.runtime.admit(event("1", "clean up"))).status == "accepted"
        await h.settle()
        notice = h.last()
        assert notice.text == (
            "Approval required for tool delete: the model wants to call delete with "
            '{"path": "/var/log/old"}'
        )
        values = {c.label: c.value for c in notice.buttons}
        assert calls.log == []
        fake.push(Answer("Done: the old logs are gone."))
        allow = values["Allow once"][4:]
        admitted = await h.runtime.admit(event("2", "", approval=(allow, "allow_once")))
        assert admitted.status == "accepted"
        await h.settle()
        assert h.last().text == "Done: the old logs are gone." and h.last().kind == "final"
        assert calls.log == [("delete", {"path": "/var/log/old"})]
        # the spent token is refused; the tool never runs twice
        again = await h.runtime.admit(event("3", "", approval=(allow, "allow_once")))
        assert again.status == "denied"
        await h.settle()
        assert len(calls.log) == 1
        # the conversation goes on with the history of that turn
        assert (await h.runtime.admit(event("4", "thanks"))).status == "accepted"
        await h.settle()
        history = [m["content"] for m in fake.completions[-1].body["messages"]]
        assert history == ["clean up", "Done: the old logs are gone.", "thanks"]
    await agent.aclose()


async def all_rows(store: MemoryStore) -> list[Any]:
    rows: list[Any] = []
    cursor = None
    while True:
        page = await store.checkpoints.list_checkpoints(cursor=cursor, limit=500)
        rows.extend(page.items)
        if page.next_cursor is None:
            return rows
        cursor = page.next_cursor


@pytest.mark.parametrize("kind", ["echo", "mock", "openai"])
async def test_after_a_prune_past_retention_no_record_keeps_message_text(
    kind: str, fake: FakeOpenAI, store: MemoryStore, clock: ManualClock, calls: Calls,
    autojump_clock: trio.testing.MockClock,
) -> None:  # fmt: skip
    """Issue 10: the agents' transcripts and run state go with the journal's retention."""
    if kind == "openai":
        agent = openai_agent(fake, store, clock, tools="tests.agents.test_openai:test_tools")
        fake.push(
            Answer(tool_calls=(("weather", {"city": "Quito-XYZZY"}),)),
            Answer("It is sunny in Quito-XYZZY."),
            Answer("Second answer ZORK-42."),
        )
    else:
        agent = build_agent(
            kind, AgentContext(alias="primary", options={}, checkpoints=store.checkpoints)
        )
    texts = ["weather in Quito-XYZZY?", "second message ZORK-42"]
    async with open_harness(store, clock, {"primary": agent}) as h:
        for number, text in enumerate(texts, start=1):
            assert (await h.runtime.admit(event(str(number), text))).status == "accepted"
            await h.settle()
        dumped = json.dumps([r.value for r in await all_rows(store)])
        assert "Quito-XYZZY" in dumped and "ZORK-42" in dumped  # kept within retention
        within = await h.runtime.prune(identity=OPERATOR, now_ms=clock.ms + DAY_MS)
        assert within.deleted == 0
        clock.advance(31 * DAY_MS)
        result = await h.runtime.prune(identity=OPERATOR)
        assert result.deleted > 0
    leftover = json.dumps([r.value for r in await all_rows(store)])
    assert "Quito-XYZZY" not in leftover and "ZORK-42" not in leftover
    if isinstance(agent, OpenAIAgent):
        await agent.aclose()


async def test_prune_keeps_a_suspended_run(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock, calls: Calls,
    autojump_clock: trio.testing.MockClock,
) -> None:  # fmt: skip
    agent = openai_agent(fake, store, clock, tools="tests.agents.test_openai:test_tools")
    async with open_harness(store, clock, {"primary": agent}) as h:
        fake.push(Answer(tool_calls=(("delete", {"path": "/x"}),)))
        await h.runtime.admit(event("1", "clean up"))
        await h.settle()
        allow = {c.label: c.value for c in h.last().buttons}["Allow once"][4:]
        clock.advance(31 * DAY_MS)
        await h.runtime.prune(identity=OPERATOR)
        (row,) = (await store.checkpoints.list_checkpoints(namespace=NS_RUN)).items
        state = await agent.status(
            run_id=row.key.split(":", 2)[2],
            session_id=row.value["sessionId"],
            scope=ownership_from_identity(IDENTITY),
        )
        assert state is not None and state.status == "suspended"
        # the approval's own TTL has passed meanwhile: it is refused cleanly, nothing runs
        refused = await h.runtime.admit(event("2", "", approval=(allow, "allow_once")))
        assert refused.status == "denied"
        await h.settle()
        assert calls.log == []
    await agent.aclose()
