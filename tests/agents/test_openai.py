"""The ``openai`` agent against the fake OpenAI-compatible server on loopback: streaming,
retries, failures, cancellation, history, tools and approvals, options."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from prismd.agents import (
    NS_RUN,
    AgentContext,
    AgentOptionError,
    Decision,
    OpenAIAgent,
    RunFailedError,
    RunRequest,
    RunResult,
    StreamEvent,
    Tool,
    build_agent,
    validate_agent_options,
)
from prismd.agents._chat import retry_after_seconds
from prismd.grants import AgentIdentity, Principal, ownership_from_identity
from stores.memory import MemoryStore
from tests.fakes.openai_api import Answer, Failure, FakeOpenAI, Hang, start_fake_openai
from tests.support.clocks import ManualClock

IDENTITY = AgentIdentity(
    tenant_id="tenant-1", principal=Principal("user", "user-1"), scopes=("chat",),
    issued_at_ms=0, user_id="user-1",
)  # fmt: skip
OWNER = ownership_from_identity(IDENTITY)
KEY = "sk-test-FAKE-KEY-0123456789abcdef"


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with trio.open_nursery() as nursery:
        yield await start_fake_openai(nursery, api_key=KEY)
        nursery.cancel_scope.cancel()


def reader(key: str = KEY) -> Any:
    def read(env_name: str | None, file_name: str | None, name: str) -> str:
        assert env_name == "OPENAI_API_KEY" and file_name is None and name == "api_key_env"
        return key

    return read


@attrs.define
class Calls:
    """The tools of these tests and every call they got."""

    log: list[tuple[str, Mapping[str, Any]]] = attrs.field(factory=list)
    gate: trio.Event | None = None
    started: trio.Event = attrs.field(factory=trio.Event)

    async def weather(self, arguments: Mapping[str, Any]) -> Any:
        self.log.append(("weather", arguments))
        return {"city": arguments.get("city"), "sky": "clear"}

    async def delete(self, arguments: Mapping[str, Any]) -> Any:
        self.log.append(("delete", arguments))
        self.started.set()
        if self.gate is not None:
            await self.gate.wait()
        return "deleted"

    async def broken(self, arguments: Mapping[str, Any]) -> Any:
        self.log.append(("broken", arguments))
        raise RuntimeError(f"secret detail {KEY}")

    def tools(self) -> list[Tool]:
        schema = {"type": "object", "properties": {"city": {"type": "string"}}}
        return [
            Tool("weather", "The weather in a city.", schema, self.weather),
            Tool(
                "delete", "Delete files.", {"type": "object"}, self.delete, requires_approval=True
            ),
            Tool("broken", "Always fails.", {"type": "object"}, self.broken),
        ]


CALLS: Calls = Calls()


def test_tools(ctx: AgentContext) -> list[Tool]:
    """A ``tools`` factory (referenced as ``tests.agents.test_openai:test_tools``)."""
    return CALLS.tools()


test_tools.__test__ = False  # type: ignore[attr-defined]


@pytest.fixture
def calls() -> Calls:
    CALLS.log.clear()
    CALLS.gate = None
    CALLS.started = trio.Event()
    return CALLS


def agent_for(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock, **options: Any
) -> OpenAIAgent:
    opts: dict[str, Any] = {"base_url": fake.base_url, "model": "gpt-4o-mini"}
    opts.setdefault("api_key_env", "OPENAI_API_KEY")
    opts.update(options)
    opts = {k: v for k, v in opts.items() if v is not None}
    agent = build_agent(
        "openai",
        AgentContext(
            alias="gpt", options=opts, checkpoints=store.checkpoints, clock=clock,
            read_secret=reader(),
        ),
    )  # fmt: skip
    assert isinstance(agent, OpenAIAgent)
    return agent


def request(text: str = "hello", session: str = "sess-1") -> RunRequest:
    return RunRequest(session_id=session, input=text, identity=IDENTITY, idempotency_key="op-1")


async def failure(agent: OpenAIAgent, text: str = "hello") -> RunResult:
    with pytest.raises(RunFailedError) as info:
        await agent.run(request(text))
    return info.value.result


# --------------------------------------------------------------------------- answers


async def test_answer_streams_deltas_and_sends_the_configured_request(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock
) -> None:
    agent = agent_for(
        fake, store, clock, system_prompt="Be brief.", max_output_tokens=64, temperature=0.2
    )
    fake.push(Answer("Hello **there**, friend.", chunk_chars=5))
    events: list[StreamEvent] = []
    with trio.fail_after(10):
        result = await agent.run(request("hi"), on_event=events.append)
    assert (result.status, result.text) == ("succeeded", "Hello **there**, friend.")
    deltas = [e.text for e in events if e.kind == "message_delta"]
    assert deltas == ["Hello", " **th", "ere**", ", fri", "end."]
    assert events[0].kind == "message_started" and events[-1].kind == "message_finished"
    assert events[-1].text == result.text and {e.run_id for e in events} == {result.run_id}
    sent = fake.completions[-1]
    assert sent.headers["authorization"] == f"Bearer {KEY}"
    assert sent.headers["accept"] == "text/event-stream"
    assert sent.body == {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "hi"},
        ],
        "stream": True,
        "max_tokens": 64,
        "temperature": 0.2,
    }
    await agent.aclose()


async def test_history_across_three_turns_bounded_and_per_session(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock
) -> None:
    agent = agent_for(fake, store, clock, max_history_messages=4)
    with trio.fail_after(10):
        for text in ("one", "two", "three"):
            result = await agent.run(request(text))
    assert result.text == "You said: three (I remember 2 earlier message(s).)"
    # the third request carried turns one and two (4 messages: the bound)
    assert [m["content"] for m in fake.completions[-1].body["messages"]] == [
        "one",
        "You said: one (I remember 0 earlier message(s).)",
        "two",
        "You said: two (I remember 1 earlier message(s).)",
        "three",
    ]
    with trio.fail_after(10):
        await agent.run(request("four"))
    # the bound drops the oldest turn, from the request and from the store
    assert fake.completions[-1].body["messages"][0]["content"] == "two"
    entries = await agent.session_entries("sess-1", OWNER)
    assert [e.text for e in entries] == [
        "three", "You said: three (I remember 2 earlier message(s).)",
        "four", "You said: four (I remember 2 earlier message(s).)",
    ]  # fmt: skip
    # another session (what /new starts) sees none of it
    with trio.fail_after(10):
        fresh = await agent.run(request("again", session="sess-2"))
    assert fresh.text == "You said: again (I remember 0 earlier message(s).)"
    # a restarted agent on the same store continues the conversation
    again = agent_for(fake, store, clock, max_history_messages=4)
    with trio.fail_after(10):
        later = await again.run(request("five"))
    assert later.text == "You said: five (I remember 2 earlier message(s).)"
    stateless = agent_for(fake, store, clock, max_history_messages=0)
    with trio.fail_after(10):
        alone = await stateless.run(request("six", session="sess-3"))
    assert alone.text.endswith("(I remember 0 earlier message(s).)") and alone.leaf_id is None
    assert await stateless.session_entries("sess-3", OWNER) == ()
    for a in (agent, again, stateless):
        await a.aclose()


# --------------------------------------------------------------------------- failures


async def test_429_is_retried_after_retry_after_then_answers(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    agent = agent_for(fake, store, clock)
    fake.push(Failure(429, retry_after="7"), Failure(503), Answer("finally"))
    started = trio.current_time()
    with trio.fail_after(60):
        result = await agent.run(request())
    assert result.text == "finally"
    assert len(fake.completions) == 3
    gaps = [b.at - a.at for a, b in zip(fake.completions, fake.completions[1:])]
    assert gaps[0] >= 7 and gaps[1] < 7  # Retry-After honoured, then the backoff
    assert trio.current_time() - started < 20
    await agent.aclose()


async def test_retries_are_bounded_and_the_failure_is_a_fixed_text(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    agent = agent_for(fake, store, clock)
    fake.push(*[Failure(500)] * 4)
    with trio.fail_after(60):
        failed = await failure(agent)
    assert len(fake.completions) == 4
    assert failed.error is not None and failed.error.code == "provider_unavailable"
    assert failed.error.message == "the model server failed (HTTP 500); try again later"
    # a Retry-After beyond the bound is not waited for
    fake.push(Failure(429, retry_after="3600"))
    with trio.fail_after(60):
        limited = await failure(agent)
    assert limited.error is not None and limited.error.code == "provider_rate_limited"
    assert len(fake.completions) == 5
    await agent.aclose()


async def test_a_wrong_key_fails_without_quoting_the_server_or_the_key(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock
) -> None:
    wrong = "sk-wrong-key-0000111122223333"
    agent = build_agent(
        "openai",
        AgentContext(
            alias="gpt",
            options={"base_url": fake.base_url, "model": "m", "api_key_env": "OPENAI_API_KEY"},
            checkpoints=store.checkpoints,
            read_secret=reader(wrong),
        ),
    )
    assert isinstance(agent, OpenAIAgent)
    with trio.fail_after(10):
        failed = await failure(agent)
    assert len(fake.completions) == 1  # a 401 is not retried
    assert failed.error is not None and failed.error.code == "provider_unauthorized"
    message = failed.error.message or ""
    assert message == "the model server refused the API key (HTTP 401)"
    assert wrong[-4:] not in message and "Incorrect" not in message
    await agent.aclose()


async def test_a_401_without_a_configured_key_says_none_is_configured(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock
) -> None:
    """No api_key_env/api_key_file: the server's 401 is not "refused the API key" (there
    was none) but names the two keys that configure one."""

    def no_secret(env_name: str | None, file_name: str | None, name: str) -> str:
        raise AssertionError("no key is configured: nothing to read")

    agent = build_agent(
        "openai",
        AgentContext(
            alias="gpt",
            options={"base_url": fake.base_url, "model": "m"},
            checkpoints=store.checkpoints,
            read_secret=no_secret,
        ),
    )
    assert isinstance(agent, OpenAIAgent)
    with trio.fail_after(10):
        failed = await failure(agent)
    assert len(fake.completions) == 1
    assert "authorization" not in fake.completions[0].headers
    assert failed.error is not None and failed.error.code == "provider_unauthorized"
    assert failed.error.message == (
        "the model server wants an API key (HTTP 401) and none is configured;"
        " set api_key_env or api_key_file in [agents.gpt]"
    )
    await agent.aclose()


async def test_a_stream_that_breaks_after_the_first_token_is_not_retried(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    agent = agent_for(fake, store, clock)
    fake.push(Answer("partial answer here", chunk_chars=3, drop_after=2))
    events: list[StreamEvent] = []
    with pytest.raises(RunFailedError) as info, trio.fail_after(30):
        await agent.run(request(), on_event=events.append)
    error = info.value.result.error
    assert error is not None and error.code == "provider_stream_broken"
    assert len(fake.completions) == 1
    assert [e.text for e in events if e.kind == "message_delta"] == ["par", "tia"]
    assert await agent.session_entries("sess-1", OWNER) == ()  # no half answer kept
    # dropped before any token: retried
    fake.push(Answer("whole", drop_after=0), Answer("whole"))
    with trio.fail_after(30):
        result = await agent.run(request())
    assert result.text == "whole" and len(fake.completions) == 3
    await agent.aclose()


async def test_a_hanging_server_fails_after_timeout_ms(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    agent = agent_for(fake, store, clock, timeout_ms=5000)
    fake.push(Hang())
    start = trio.current_time()
    with trio.fail_after(60):
        failed = await failure(agent)
    assert failed.error is not None and failed.error.code == "provider_timeout"
    assert 5 <= trio.current_time() - start < 10
    await fake.wait_disconnect()
    # a stream that stalls mid-answer: the same bound between chunks
    fake.push(Answer("slow then stuck", chunk_chars=2, hang_after=3))
    with trio.fail_after(60):
        stalled = await failure(agent)
    assert stalled.error is not None and stalled.error.code == "provider_timeout"
    # slow but steady is fine
    fake.push(Answer("slow but steady", chunk_chars=3, delay_s=2.0))
    with trio.fail_after(60):
        assert (await agent.run(request())).text == "slow but steady"
    await agent.aclose()


@pytest.mark.slow
async def test_unreachable_server_is_a_clear_failure(
    store: MemoryStore, clock: ManualClock
) -> None:
    with trio.socket.socket() as probe:
        await probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    agent = build_agent(
        "openai",
        AgentContext(
            alias="gpt",
            options={"base_url": f"http://127.0.0.1:{port}/v1", "model": "m"},
            checkpoints=store.checkpoints,
        ),
    )
    assert isinstance(agent, OpenAIAgent)
    with trio.fail_after(30):
        failed = await failure(agent)
    assert failed.error is not None and failed.error.code == "provider_unreachable"
    await agent.aclose()


async def test_cancelling_a_streaming_run_closes_the_connection(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock
) -> None:
    agent = agent_for(fake, store, clock)
    fake.push(Answer("a long answer " * 50, chunk_chars=4, delay_s=0.05))
    first_delta = trio.Event()

    def on_event(event: StreamEvent) -> None:
        if event.kind == "message_delta":
            first_delta.set()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            scope = trio.CancelScope()

            async def run() -> None:
                with scope:
                    await agent.run(request(), on_event=on_event)

            nursery.start_soon(run)
            await first_delta.wait()
            cancelled_at = trio.current_time()
            scope.cancel()
        closed_at = await fake.wait_disconnect()
    assert closed_at - cancelled_at < 1.0
    assert await agent.session_entries("sess-1", OWNER) == ()
    await agent.aclose()


# --------------------------------------------------------------------------- tools


async def test_tool_calls_split_across_chunks_run_once_and_feed_the_answer(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock, calls: Calls
) -> None:
    agent = agent_for(fake, store, clock, tools="tests.agents.test_openai:test_tools")
    fake.push(
        Answer(
            "Let me look.", tool_calls=(("weather", {"city": "Paris"}), ("broken", {})), split=4
        ),
        Answer("It is clear in Paris."),
    )
    with trio.fail_after(10):
        result = await agent.run(request("weather in Paris?"))
    assert result.text == "It is clear in Paris."
    assert calls.log == [("weather", {"city": "Paris"}), ("broken", {})]
    first, second = fake.completions
    assert [t["function"]["name"] for t in first.body["tools"]] == ["weather", "delete", "broken"]
    assert first.body["tools"][0]["function"]["parameters"]["properties"] == {
        "city": {"type": "string"}
    }
    messages = second.body["messages"]
    assistant, weather, broken = messages[-3:]
    assert assistant["role"] == "assistant" and assistant["content"] == "Let me look."
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["weather", "broken"]
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}
    assert weather["tool_call_id"] == assistant["tool_calls"][0]["id"]
    assert json.loads(weather["content"]) == {"city": "Paris", "sky": "clear"}
    # a failing tool: the model is told its type, never its text
    assert broken["content"] == "error: the tool failed (RuntimeError)"
    assert KEY not in json.dumps(second.body)
    # the history keeps the texts, not the tool traffic
    entries = await agent.session_entries("sess-1", OWNER)
    assert [e.text for e in entries] == ["weather in Paris?", "It is clear in Paris."]
    await agent.aclose()


async def test_tool_rounds_are_bounded(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock, calls: Calls
) -> None:
    agent = agent_for(fake, store, clock, tools="tests.agents.test_openai:test_tools")
    fake.push(*[Answer(tool_calls=(("weather", {"city": "X"}),))] * 10)
    with trio.fail_after(20):
        failed = await failure(agent)
    assert failed.error is not None and failed.error.code == "tool_rounds_exceeded"
    assert len(fake.completions) == 8 and len(calls.log) == 7
    await agent.aclose()


async def suspend(agent: OpenAIAgent, fake: FakeOpenAI) -> tuple[RunResult, int, str]:
    fake.push(Answer("I will delete them.", tool_calls=(("delete", {"path": "/tmp/x"}),)))
    with trio.fail_after(10):
        result = await agent.run(request("delete the logs"))
    assert result.status == "suspended"
    state = await agent.status(run_id=result.run_id, session_id="sess-1", scope=OWNER)
    assert state is not None and state.status == "suspended"
    (pending,) = state.pending
    assert pending.kind == "tool_approval" and pending.tool_name == "delete"
    assert pending.reason == 'the model wants to call delete with {"path": "/tmp/x"}'
    return result, state.version, pending.approval_id


async def resume(
    agent: OpenAIAgent, run: RunResult, version: int, decisions: tuple[Decision, ...] = (),
    deny: bool = False,
) -> RunResult:  # fmt: skip
    with trio.fail_after(10):
        return await agent.resume(
            run_id=run.run_id, session_id="sess-1", scope=OWNER, identity=IDENTITY,
            expected_version=version, decisions=decisions, deny=deny,
        )  # fmt: skip


async def test_an_approved_tool_runs_once_and_the_run_answers(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock, calls: Calls
) -> None:
    agent = agent_for(fake, store, clock, tools="tests.agents.test_openai:test_tools")
    run, version, approval = await suspend(agent, fake)
    assert calls.log == []
    # another process on the same store continues it
    other = agent_for(fake, store, clock, tools="tests.agents.test_openai:test_tools")
    fake.push(Answer("Deleted."))
    result = await resume(other, run, version, (Decision(approval, "allow_once"),))
    assert (result.status, result.text) == ("succeeded", "Deleted.")
    assert calls.log == [("delete", {"path": "/tmp/x"})]
    tool_message = fake.completions[-1].body["messages"][-1]
    assert tool_message == {
        "role": "tool",
        "tool_call_id": fake.completions[-1].body["messages"][-2]["tool_calls"][0]["id"],
        "content": "deleted",
    }
    # a retried resume returns the stored answer and calls nothing
    again = await resume(agent, run, version, (Decision(approval, "allow_once"),))
    assert (again.status, again.text) == ("succeeded", "Deleted.")
    assert len(calls.log) == 1 and len(fake.completions) == 2
    entries = await other.session_entries("sess-1", OWNER)
    assert [e.text for e in entries] == ["delete the logs", "Deleted."]
    for a in (agent, other):
        await a.aclose()


async def test_a_rejected_tool_is_reported_to_the_model_and_deny_ends_the_run(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock, calls: Calls
) -> None:
    agent = agent_for(fake, store, clock, tools="tests.agents.test_openai:test_tools")
    run, version, approval = await suspend(agent, fake)
    with pytest.raises(RunFailedError) as info:
        await resume(agent, run, version, (Decision("someone-else", "allow_once"),))
    assert info.value.result.error is not None
    assert info.value.result.error.code == "missing_decision"
    with pytest.raises(RunFailedError) as stale:
        await resume(agent, run, version + 5, (Decision(approval, "allow_once"),))
    assert stale.value.result.error is not None
    assert stale.value.result.error.code == "version_conflict"
    fake.push(Answer("Understood, nothing deleted."))
    result = await resume(agent, run, version, (Decision(approval, "reject_once"),))
    assert result.text == "Understood, nothing deleted." and calls.log == []
    assert "denied" in fake.completions[-1].body["messages"][-1]["content"]
    # /cancel on a suspended run: a terminal denial
    run2, version2, _approval2 = await suspend(agent, fake)
    denied = await resume(agent, run2, version2, deny=True)
    assert denied.status == "denied" and calls.log == []
    state = await agent.status(run_id=run2.run_id, session_id="sess-1", scope=OWNER)
    assert state is not None and state.status == "denied" and state.pending == ()
    await agent.aclose()


async def test_a_crash_mid_tool_leaves_an_interrupted_run_that_never_calls_again(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock, calls: Calls
) -> None:
    agent = agent_for(fake, store, clock, tools="tests.agents.test_openai:test_tools")
    run, version, approval = await suspend(agent, fake)
    calls.gate = trio.Event()  # the tool blocks: the "process" dies while it runs
    async with trio.open_nursery() as nursery:
        nursery.start_soon(resume, agent, run, version, (Decision(approval, "allow_once"),))
        with trio.fail_after(10):
            await calls.started.wait()
        row = await store.checkpoints.load_checkpoint(
            namespace=NS_RUN, key=f"r1:gpt:{run.run_id}", scope=OWNER
        )
        assert row is not None and row.value["status"] == "dispatching"  # journaled first
        nursery.cancel_scope.cancel()
    # Cancellation ends it cleanly; a crash runs no code, so restore what it would leave.
    await store.checkpoints.save_checkpoint(
        namespace=NS_RUN, key=f"r1:gpt:{run.run_id}", scope=OWNER, version=row.version + 5,
        value=row.value, expected_version=None,
    )  # fmt: skip
    restarted = agent_for(fake, store, clock, tools="tests.agents.test_openai:test_tools")
    state = await restarted.status(run_id=run.run_id, session_id="sess-1", scope=OWNER)
    assert state is not None and state.status == "suspended"
    (pending,) = state.pending
    assert pending.kind == "tool_interrupted" and pending.tool_name == "delete"
    assert pending.approval_id != approval
    # the old approval cannot start it again
    with pytest.raises(RunFailedError):
        await resume(restarted, run, state.version, (Decision(approval, "allow_once"),))
    ended = await resume(restarted, run, state.version, deny=True)
    assert ended.status == "failed" and ended.error is not None
    assert ended.error.code == "tool_interrupted"
    assert len(calls.log) == 1
    await agent.aclose()
    await restarted.aclose()


@pytest.mark.slow
async def test_a_cancelled_resume_ends_the_run_state(
    fake: FakeOpenAI, store: MemoryStore, clock: ManualClock, calls: Calls
) -> None:
    agent = agent_for(fake, store, clock, tools="tests.agents.test_openai:test_tools")
    run, version, approval = await suspend(agent, fake)
    fake.push(Hang())
    with trio.move_on_after(1):
        await resume(agent, run, version, (Decision(approval, "allow_once"),))
    state = await agent.status(run_id=run.run_id, session_id="sess-1", scope=OWNER)
    assert state is not None and state.status == "cancelled"
    assert calls.log == [("delete", {"path": "/tmp/x"})]
    await agent.aclose()


# --------------------------------------------------------------------------- options


BASE = {"base_url": "https://x/v1", "model": "m"}


@pytest.mark.parametrize(
    ("options", "key", "match"),
    [
        ({"model": "m"}, "base_url", "is required"),
        ({"base_url": "https://api.openai.com/v1"}, "model", "is required"),
        ({"base_url": "ftp://x/v1", "model": "m"}, "base_url", "http"),
        ({"base_url": "http://example.com/v1", "model": "m"}, "base_url", "loopback"),
        ({"base_url": "https://u:p@example.com/v1", "model": "m"}, "base_url", "credentials"),
        ({"base_url": "https://example.com/v1?key=1", "model": "m"}, "base_url", "query"),
        ({**BASE, "timeout_ms": 5}, "timeout_ms", "between"),
        ({**BASE, "timeout_ms": "9"}, "timeout_ms", "integer"),
        ({**BASE, "temperature": 3}, "temperature", "between"),
        ({**BASE, "temperature": "hot"}, "temperature", "number"),
        ({**BASE, "max_output_tokens": 0}, "max_output_tokens",
         "between"),
        ({**BASE, "max_history_messages": -1},
         "max_history_messages", "between"),
        ({**BASE, "api_key_env": "A", "api_key_file": "f"},
         "api_key_file", "not both"),
        ({**BASE, "api_key_env": "NOT A NAME"}, "api_key_env",
         "environment variable"),
        ({**BASE, "tools": "nocolon"}, "tools", "module:callable"),
        ({**BASE, "system_prompt": 3}, "system_prompt", "string"),
        ({**BASE, "stream": False}, "stream", "unknown option"),
    ],
)  # fmt: skip
def test_options_name_the_bad_key(options: dict[str, Any], key: str, match: str) -> None:
    with pytest.raises(AgentOptionError, match=match) as info:
        validate_agent_options("openai", options)
    assert info.value.key == key and str(info.value).startswith(f"{key}: ")


def test_good_options_and_loopback_http() -> None:
    for url in ("http://127.0.0.1:8080/v1", "http://localhost:11434/v1", "http://[::1]:8000/v1"):
        validate_agent_options("openai", {"base_url": url, "model": "llama3"})
    validate_agent_options(
        "openai",
        {
            "base_url": "https://api.openai.com/v1/", "model": "gpt-4o-mini",
            "api_key_env": "OPENAI_API_KEY", "system_prompt": "", "timeout_ms": 30_000,
            "max_history_messages": 0, "max_output_tokens": 512, "temperature": 0,
            "tools": "pkg.mod:tools",
        },
    )  # fmt: skip


@pytest.mark.parametrize(
    ("factory", "match"),
    [
        ("tests.agents.test_openai:nothing_here", "has no attribute"),
        ("tests.agents.no_such_module:tools", "cannot import module"),
        ("tests.agents.test_openai:bad_tools", "not a Tool"),
        ("tests.agents.test_openai:raising_tools", r"failed \(KeyError\)"),
    ],
)
async def test_tool_factory_errors_name_the_key(
    store: MemoryStore, clock: ManualClock, factory: str, match: str
) -> None:
    with pytest.raises(AgentOptionError, match=match) as info:
        build_agent(
            "openai",
            AgentContext(
                alias="gpt",
                options={**BASE, "tools": factory},
                checkpoints=store.checkpoints,
            ),
        )
    assert info.value.key == "tools"


def bad_tools(ctx: AgentContext) -> list[Any]:
    return ["not a tool"]


def raising_tools(ctx: AgentContext) -> list[Tool]:
    raise KeyError(KEY)


def test_tool_definitions_are_checked() -> None:
    async def call(arguments: Mapping[str, Any]) -> str:
        return ""

    with pytest.raises(ValueError, match="tool name"):
        Tool("bad name!", "x", {"type": "object"}, call)
    with pytest.raises(ValueError, match="JSON schema object"):
        Tool("ok", "x", {"type": "string"}, call)


def test_retry_after_headers() -> None:
    import httpx

    assert retry_after_seconds(httpx.Headers({"retry-after": "3"})) == 3
    assert retry_after_seconds(httpx.Headers({"retry-after-ms": "250", "retry-after": "9"})) == 0.25
    dated = httpx.Headers({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"})
    assert retry_after_seconds(dated, now=1445412470) == 10
    assert retry_after_seconds(httpx.Headers({"retry-after": "soon"})) is None
    assert retry_after_seconds(httpx.Headers({})) is None


async def test_an_unexpected_client_error_names_only_its_type(
    store: MemoryStore, clock: ManualClock
) -> None:
    import httpx

    class Exploding(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            raise RuntimeError(f"boom {request.headers['authorization']}")

    agent = OpenAIAgent.from_context(
        AgentContext(
            alias="gpt",
            options={"base_url": "https://api.example/v1", "model": "m",
                     "api_key_env": "OPENAI_API_KEY"},
            checkpoints=store.checkpoints, read_secret=reader(),
        ),
        transport=Exploding(),
    )  # fmt: skip
    failed = await failure(agent)
    assert failed.error is not None and failed.error.code == "provider_error"
    assert failed.error.message == "the model request failed (RuntimeError)"
    await agent.aclose()


# --------------------------------------------------------------------------- check-config


def config_with(agent: str, tmp_path: Any) -> Any:
    from prismd.daemon._config import load_config

    path = tmp_path / "prismd.toml"
    path.write_text(
        f"""
[[connections]]
id = "web"
kind = "webchat"

[agents.gpt]
kind = "openai"
{agent}

[[grants]]
connection = "web"
actors = ["*"]
aliases = ["gpt"]
"""
    )
    return load_config(str(path))


@pytest.mark.parametrize(
    ("agent", "key", "message"),
    [
        ('base_url = "http://api.example.com/v1"\nmodel = "m"', "[agents.gpt].base_url",
         "http:// is accepted only for loopback hosts"),
        ('base_url = "https://x/v1"', "[agents.gpt].model", "is required"),
        ('base_url = "https://x/v1"\nmodel = "m"\napi_key = "sk-inline"', "[agents.gpt].api_key",
         "secrets are never inline"),
        ('base_url = "https://x/v1"\nmodel = "m"\ntemperature = 9', "[agents.gpt].temperature",
         "between 0 and 2"),
        ('base_url = "https://x/v1"\nmodel = "m"\nstream = true', "[agents.gpt].stream",
         "unknown option"),
    ],
)  # fmt: skip
def test_check_config_names_the_bad_openai_key(
    tmp_path: Any, agent: str, key: str, message: str
) -> None:
    from prismd.daemon._config import ConfigError

    with pytest.raises(ConfigError) as info:
        config_with(agent, tmp_path)
    assert info.value.key == key and message in str(info.value)
    assert "sk-inline" not in str(info.value)


def test_check_config_reads_the_key_and_imports_the_tools(tmp_path: Any) -> None:
    from prismd.daemon._config import ConfigError
    from prismd.daemon._runnable import check_runnable

    base = 'base_url = "https://api.openai.com/v1"\nmodel = "gpt-4o-mini"\n'
    config = config_with(base + 'api_key_env = "PRISMD_TEST_NO_SUCH_KEY"', tmp_path)
    with pytest.raises(ConfigError) as info:
        check_runnable(config, env={})
    assert info.value.key == "[agents.gpt].api_key_env"
    assert "PRISMD_TEST_NO_SUCH_KEY is not set" in str(info.value)
    check_runnable(config, env={"PRISMD_TEST_NO_SUCH_KEY": KEY})
    keyfile = tmp_path / "key.txt"
    keyfile.write_text(KEY + "\n")
    check_runnable(config_with(base + f'api_key_file = "{keyfile}"', tmp_path), env={})
    missing = config_with(base + f'api_key_file = "{tmp_path / "nope"}"', tmp_path)
    with pytest.raises(ConfigError) as info:
        check_runnable(missing, env={})
    assert info.value.key == "[agents.gpt].api_key_file"
    broken = config_with(base + 'tools = "tests.agents.no_such_module:tools"', tmp_path)
    with pytest.raises(ConfigError) as info:
        check_runnable(broken, env={})
    assert info.value.key == "[agents.gpt].tools" and "cannot import module" in str(info.value)
    good = config_with(base + 'tools = "tests.agents.daemon_tools:tools"', tmp_path)
    check_runnable(good, env={})


async def test_the_daemon_wiring_registers_the_key_as_a_secret(
    tmp_path: Any, store: MemoryStore
) -> None:
    from prismd.daemon._wiring import build_agents

    base = 'base_url = "https://api.openai.com/v1"\nmodel = "gpt-4o-mini"\n'
    config = config_with(base + 'api_key_env = "OPENAI_API_KEY"', tmp_path)
    secrets: list[str] = []
    agents = build_agents(config, store, env={"OPENAI_API_KEY": KEY}, secrets=secrets)
    assert secrets == [KEY] and isinstance(agents["gpt"], OpenAIAgent)
    from prismd.daemon._config import ConfigError

    with pytest.raises(ConfigError) as info:
        build_agents(config, store, env={})
    assert info.value.key == "[agents.gpt].api_key_env"
