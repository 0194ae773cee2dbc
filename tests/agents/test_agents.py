"""The built-in agents: echo, mock (delays, failures, durable tool approvals), python, registry."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio

from prismd.agents import (
    NS_RUN,
    AgentContext,
    AgentOptionError,
    Decision,
    EchoAgent,
    ImageBlock,
    MockAgent,
    RunFailedError,
    RunRequest,
    RunResult,
    StreamEvent,
    TextBlock,
    build_agent,
    validate_agent_options,
)
from prismd.agents._session import MAX_SESSION_ENTRIES, session_key
from prismd.grants import AgentIdentity, Principal, ownership_from_identity
from stores.memory import MemoryStore
from tests.support.clocks import ManualClock

from .conftest import YieldingCheckpoints

IDENTITY = AgentIdentity(
    tenant_id="tenant-1", principal=Principal("user", "user-1"), scopes=("chat",),
    issued_at_ms=0, user_id="user-1",
)  # fmt: skip
OWNER = ownership_from_identity(IDENTITY)


def request(text: Any = "hello world", session: str = "sess-1") -> RunRequest:
    return RunRequest(session_id=session, input=text, identity=IDENTITY, idempotency_key="op-1")


def ctx(store: MemoryStore, clock: ManualClock, alias: str = "primary", **options: Any) -> Any:
    return AgentContext(alias=alias, options=options, checkpoints=store.checkpoints, clock=clock)


def mock(store: MemoryStore, clock: ManualClock, **options: Any) -> MockAgent:
    agent = build_agent("mock", ctx(store, clock, **options))
    assert isinstance(agent, MockAgent)
    return agent


# --------------------------------------------------------------------------- echo


async def test_echo_answers_with_the_input_and_streams_one_delta(
    store: MemoryStore, clock: ManualClock
) -> None:
    agent = build_agent("echo", ctx(store, clock, history=True))
    assert isinstance(agent, EchoAgent)
    assert agent.agent_id == "primary" and agent.input_capabilities == {"text"}
    assert agent.supports_approvals is False and agent.definition_revision
    events: list[StreamEvent] = []
    result = await agent.run(request("hi there"), on_event=events.append)
    assert (result.status, result.text, result.session_id) == ("succeeded", "hi there", "sess-1")
    assert [(e.kind, e.text) for e in events] == [
        ("message_started", ""),
        ("message_delta", "hi there"),
        ("message_finished", "hi there"),
    ]
    assert {e.run_id for e in events} == {result.run_id}
    entries = await agent.session_entries("sess-1", OWNER)
    assert [(e.role, e.text) for e in entries] == [("user", "hi there"), ("assistant", "hi there")]
    assert result.leaf_id == entries[-1].id


async def test_echo_joins_text_blocks_and_run_ids_are_unique(
    store: MemoryStore, clock: ManualClock
) -> None:
    agent = build_agent("echo", ctx(store, clock, history=True))
    blocks = (TextBlock("a"), ImageBlock(b"\x89PNG"), TextBlock("b"))
    first = await agent.run(request(blocks))
    second = await agent.run(request("again"))
    assert first.text == "a\nb"
    assert first.run_id != second.run_id
    assert await agent.status(run_id=first.run_id, session_id="sess-1", scope=OWNER) is None
    with pytest.raises(RunFailedError) as info:
        await agent.resume(
            run_id=first.run_id,
            session_id="sess-1",
            scope=OWNER,
            identity=IDENTITY,
            expected_version=1,
        )
    assert info.value.result.status == "failed"


async def test_transcripts_are_per_session_scoped_and_bounded(
    store: MemoryStore, clock: ManualClock
) -> None:
    agent = build_agent("echo", ctx(store, clock, history=True))
    assert isinstance(agent, EchoAgent)
    for i in range(MAX_SESSION_ENTRIES // 2 + 5):
        last = await agent.run(request(f"m{i}"))
    entries = await agent.session_entries("sess-1", OWNER)
    assert len(entries) == MAX_SESSION_ENTRIES
    assert entries[-1].text == f"m{MAX_SESSION_ENTRIES // 2 + 4}"
    assert entries[-1].id == last.leaf_id
    assert await agent.session_entries("sess-2", OWNER) == ()
    other = ownership_from_identity(IDENTITY).__class__("tenant-2", None, "user-1")
    assert await agent.session_entries("sess-1", other) == ()
    # Another alias on the same store keeps its own transcripts.
    echo2 = build_agent("echo", ctx(store, clock, alias="secondary", history=True))
    assert isinstance(echo2, EchoAgent)
    assert await echo2.session_entries("sess-1", OWNER) == ()


async def test_echo_without_history_writes_nothing(store: MemoryStore, clock: ManualClock) -> None:
    """By default echo keeps no transcript: a run writes no record and answers no leaf, so
    the route's binding is not rewritten after each turn (issue 40)."""
    agent = build_agent("echo", ctx(store, clock))
    assert isinstance(agent, EchoAgent) and agent.history is False
    first = await agent.run(request("hi there"))
    second = await agent.run(request("again"))
    assert (first.status, first.text, first.leaf_id) == ("succeeded", "hi there", None)
    assert (second.text, second.leaf_id) == ("again", None)
    assert await agent.session_entries("sess-1", OWNER) == ()
    assert (await store.checkpoints.list_checkpoints()).items == ()
    # The option is part of the definition: the two configurations are told apart.
    keeping = build_agent("echo", ctx(store, clock, history=True))
    assert keeping.definition_revision != agent.definition_revision


# --------------------------------------------------------------------------- mock


async def test_mock_answers_with_prefix_and_streams_words(
    store: MemoryStore, clock: ManualClock
) -> None:
    agent = mock(store, clock)
    assert agent.input_capabilities == {"text"} and agent.supports_approvals
    events: list[StreamEvent] = []
    result = await agent.run(request("hello big world"), on_event=events.append)
    assert result.status == "succeeded" and result.text == "mock: hello big world"
    deltas = [e.text for e in events if e.kind == "message_delta"]
    assert len(deltas) == 4 and "".join(deltas) == "mock: hello big world"
    assert events[0].kind == "message_started" and events[-1].kind == "message_finished"
    assert events[-1].text == "mock: hello big world"
    entries = await agent.session_entries("sess-1", OWNER)
    assert [e.text for e in entries] == ["hello big world", "mock: hello big world"]
    custom = mock(store, clock, reply_prefix="")
    assert (await custom.run(request("x"))).text == "x"


async def test_mock_vision_option(store: MemoryStore, clock: ManualClock) -> None:
    agent = mock(store, clock, vision=True)
    assert agent.input_capabilities == {"text", "image"}
    result = await agent.run(request((TextBlock("look"), ImageBlock(b"1234", "image/png"))))
    assert result.text == "mock: look [1 image(s)]"


async def test_mock_delay_uses_trio_time(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    agent = mock(store, clock, delay_ms=1500)
    start = trio.current_time()
    result = await agent.run(request("hi"))
    assert result.text == "mock: hi"
    assert trio.current_time() - start == pytest.approx(1.5)


async def test_mock_cancellation_during_delay_aborts_the_run(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    agent = mock(store, clock, delay_ms=10_000)
    events: list[StreamEvent] = []
    with trio.move_on_after(1) as scope:
        await agent.run(request("hi"), on_event=events.append)
    assert scope.cancelled_caught
    assert events == []
    assert await agent.session_entries("sess-1", OWNER) == ()


async def test_mock_fail_raises_run_failed(store: MemoryStore, clock: ManualClock) -> None:
    agent = mock(store, clock, fail=True)
    with pytest.raises(RunFailedError) as info:
        await agent.run(request("hi"))
    result = info.value.result
    assert result.status == "failed" and result.session_id == "sess-1"
    assert result.error is not None
    assert (result.error.code, result.error.message) == ("mock_failure", "mock agent failure")


async def test_definition_revision_is_stable_and_option_sensitive(
    store: MemoryStore, clock: ManualClock
) -> None:
    a = mock(store, clock, delay_ms=5)
    b = mock(store, clock, delay_ms=5)
    c = mock(store, clock, delay_ms=6)
    e = build_agent("echo", ctx(store, clock))
    assert a.definition_revision == b.definition_revision
    assert len({a.definition_revision, c.definition_revision, e.definition_revision}) == 3


# --------------------------------------------------------------------------- durable approvals


async def suspended_run(agent: MockAgent) -> tuple[str, int, str]:
    result = await agent.run(request("do it"))
    assert result.status == "suspended" and result.text == ""
    state = await agent.status(run_id=result.run_id, session_id="sess-1", scope=OWNER)
    assert state is not None and state.status == "suspended" and len(state.pending) == 1
    pending = state.pending[0]
    assert pending.kind == "tool_approval" and pending.tool_name == "write"
    assert "write" in pending.reason
    return result.run_id, state.version, pending.approval_id


async def resume_allowing(
    agent: MockAgent, run_id: str, version: int, approval_id: str, /, **overrides: Any
) -> RunResult:
    """``agent.resume`` of the ``suspended_run`` with ``approval_id`` allowed once, unless
    ``overrides`` say otherwise."""
    args: dict[str, Any] = dict(
        run_id=run_id,
        session_id="sess-1",
        scope=OWNER,
        identity=IDENTITY,
        expected_version=version,
        decisions=(Decision(approval_id, "allow_once"),),
    )
    args.update(overrides)
    return await agent.resume(**args)


async def test_suspend_survives_a_new_agent_instance_and_resumes_once(
    store: MemoryStore, clock: ManualClock
) -> None:
    first = mock(store, clock, suspend_for_tool="write")
    run_id, version, approval_id = await suspended_run(first)
    row = await store.checkpoints.load_checkpoint(
        namespace=NS_RUN, key=f"r1:primary:{run_id}", scope=OWNER
    )
    assert row is not None and row.version == version
    # "Restart": a new agent instance on the same store.
    second = mock(store, clock, suspend_for_tool="write")
    assert second.definition_revision == first.definition_revision
    state = await second.status(run_id=run_id, session_id="sess-1", scope=OWNER)
    assert state is not None and state.status == "suspended" and state.version == version
    assert await second.tool_runs(run_id, OWNER) == 0
    events: list[StreamEvent] = []
    result = await resume_allowing(
        second,
        run_id,
        version,
        approval_id,
        on_event=events.append,
    )
    assert result.status == "succeeded" and result.text == "mock: do it"
    assert "".join(e.text for e in events if e.kind == "message_delta") == "mock: do it"
    assert await second.tool_runs(run_id, OWNER) == 1
    done = await first.status(run_id=run_id, session_id="sess-1", scope=OWNER)
    assert done is not None and done.status == "succeeded" and done.pending == ()
    entries = await second.session_entries("sess-1", OWNER)
    assert [(e.role, e.text) for e in entries] == [("user", "do it"), ("assistant", "mock: do it")]
    assert result.leaf_id == entries[-1].id
    # A retried resume (same or stale version) returns the same result; the tool stays at 1.
    again = await resume_allowing(first, run_id, version, approval_id)
    assert (again.status, again.text) == ("succeeded", "mock: do it")
    assert await first.tool_runs(run_id, OWNER) == 1


async def test_concurrent_resumes_run_the_tool_once(store: MemoryStore, clock: ManualClock) -> None:
    checkpoints = YieldingCheckpoints(store.checkpoints)
    ctx_ = AgentContext(
        alias="primary",
        options={"suspend_for_tool": "write"},
        checkpoints=checkpoints,
        clock=clock,
    )
    agents = [build_agent("mock", ctx_) for _ in range(4)]
    assert isinstance(agents[0], MockAgent)
    run_id, version, approval_id = await suspended_run(agents[0])
    results: list[str] = []

    async def resume(agent: Any) -> None:
        r = await resume_allowing(agent, run_id, version, approval_id)
        results.append(r.text)

    async with trio.open_nursery() as nursery:
        for agent in agents:
            nursery.start_soon(resume, agent)
    assert results == ["mock: do it"] * 4
    assert await agents[0].tool_runs(run_id, OWNER) == 1
    assert checkpoints.conflicts >= 1


@pytest.mark.parametrize("how", ["deny", "reject"])
async def test_deny_and_reject_end_denied_without_the_tool(
    store: MemoryStore, clock: ManualClock, how: str
) -> None:
    agent = mock(store, clock, suspend_for_tool="write")
    run_id, version, approval_id = await suspended_run(agent)
    result = await resume_allowing(
        agent,
        run_id,
        version,
        approval_id,
        decisions=() if how == "deny" else (Decision(approval_id, "reject_once"),),
        deny=how == "deny",
    )
    assert result.status == "denied" and result.text == ""
    assert await agent.tool_runs(run_id, OWNER) == 0
    state = await agent.status(run_id=run_id, session_id="sess-1", scope=OWNER)
    assert state is not None and state.status == "denied"
    # Allowing after the denial changes nothing.
    late = await resume_allowing(agent, run_id, version, approval_id)
    assert late.status == "denied" and await agent.tool_runs(run_id, OWNER) == 0


async def test_resume_errors(store: MemoryStore, clock: ManualClock) -> None:
    agent = mock(store, clock, suspend_for_tool="write")
    run_id, version, approval_id = await suspended_run(agent)

    async def resume(**kw: Any) -> str:
        with pytest.raises(RunFailedError) as info:
            await resume_allowing(agent, run_id, version, approval_id, **kw)
        assert info.value.result.status == "failed" and info.value.result.error is not None
        return str(info.value.result.error.code)

    assert await resume(expected_version=version + 5) == "version_conflict"
    assert await resume(decisions=(Decision("other", "allow_once"),)) == "missing_decision"
    assert await resume(decisions=()) == "missing_decision"
    assert await resume(run_id="run-unknown") == "run_not_found"
    assert await resume(session_id="sess-other") == "run_not_found"
    other = OWNER.__class__("tenant-2", None, "user-1")
    assert await resume(scope=other) == "run_not_found"
    assert await agent.status(run_id=run_id, session_id="sess-x", scope=OWNER) is None
    assert await agent.status(run_id=run_id, session_id="sess-1", scope=other) is None
    assert await agent.tool_runs(run_id, OWNER) == 0


async def test_cancelled_resume_finishes_later_without_rerunning_the_tool(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    agent = mock(store, clock, suspend_for_tool="write", delay_ms=5_000)
    with trio.fail_after(60):
        run_id, version, approval_id = await suspended_run(agent)
    with trio.move_on_after(1) as scope:
        await resume_allowing(agent, run_id, version, approval_id)
    assert scope.cancelled_caught
    assert await agent.tool_runs(run_id, OWNER) == 1
    state = await agent.status(run_id=run_id, session_id="sess-1", scope=OWNER)
    assert state is not None and state.status == "running"
    result = await resume_allowing(agent, run_id, version, approval_id)
    assert result.status == "succeeded" and result.text == "mock: do it"
    assert await agent.tool_runs(run_id, OWNER) == 1


# --------------------------------------------------------------------------- registry, python


class FactoryAgent:
    """A minimal agent for the python factory test."""

    def __init__(self, context: AgentContext) -> None:
        self.context = context

    agent_id = "factory"
    definition_revision = "f-1"
    input_capabilities = frozenset({"text"})
    supports_approvals = False

    async def run(self, request: RunRequest, *, on_event: Any = None) -> Any:
        raise AssertionError

    async def status(self, **kw: Any) -> None:
        return None

    async def resume(self, **kw: Any) -> Any:
        raise AssertionError


def make_agent(context: AgentContext) -> FactoryAgent:
    return FactoryAgent(context)


def make_nothing(context: AgentContext) -> object:
    return object()


NOT_CALLABLE = 42


async def test_python_factory_builds_the_agent(store: MemoryStore, clock: ManualClock) -> None:
    spec = f"{__name__}:make_agent"
    agent = build_agent("python", ctx(store, clock, factory=spec, temperature=1))
    assert isinstance(agent, FactoryAgent)
    assert agent.context.options["temperature"] == 1 and agent.context.alias == "primary"


@pytest.mark.parametrize(
    ("factory", "error", "match"),
    [
        ("no_such_module_xyz:f", AgentOptionError, "cannot import module"),
        (f"{__name__}:missing", AgentOptionError, "has no attribute"),
        (f"{__name__}:NOT_CALLABLE", AgentOptionError, "not callable"),
        (f"{__name__}:make_nothing", TypeError, "without 'agent_id'"),
        ("not a spec", AgentOptionError, "module:callable"),
    ],
)
async def test_python_factory_errors_are_clear(
    store: MemoryStore, clock: ManualClock, factory: str, error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        build_agent("python", ctx(store, clock, factory=factory))


@pytest.mark.parametrize(
    ("kind", "options", "key"),
    [
        ("echo", {"delay_ms": 1}, "delay_ms"),
        ("echo", {"history": "yes"}, "history"),
        ("mock", {"delay_ms": -1}, "delay_ms"),
        ("mock", {"delay_ms": True}, "delay_ms"),
        ("mock", {"delay_ms": 1.5}, "delay_ms"),
        ("mock", {"fail": "yes"}, "fail"),
        ("mock", {"vision": 1}, "vision"),
        ("mock", {"suspend_for_tool": ""}, "suspend_for_tool"),
        ("mock", {"suspend_for_tool": 3}, "suspend_for_tool"),
        ("mock", {"reply_prefix": 3}, "reply_prefix"),
        ("mock", {"model": "x"}, "model"),
        ("python", {}, "factory"),
        ("python", {"factory": "nocolon"}, "factory"),
        ("openai", {}, "base_url"),
        ("llama", {}, "kind"),
    ],
)
def test_validate_agent_options_names_the_bad_key(
    kind: str, options: dict[str, Any], key: str
) -> None:
    with pytest.raises(ValueError) as info:
        validate_agent_options(kind, options)
    assert isinstance(info.value, AgentOptionError) and info.value.key == key
    assert str(info.value).startswith(f"{key}: ")


def test_validate_agent_options_accepts_good_options() -> None:
    validate_agent_options("echo", {})
    validate_agent_options("echo", {"history": True})
    validate_agent_options(
        "mock",
        {"delay_ms": 0, "fail": False, "suspend_for_tool": "write", "vision": True},
    )
    validate_agent_options("python", {"factory": "pkg.mod:make", "anything": [1]})


async def test_unknown_kinds_and_bad_options_fail_the_build(
    store: MemoryStore, clock: ManualClock
) -> None:
    with pytest.raises(AgentOptionError, match="base_url: is required"):
        build_agent("openai", ctx(store, clock))
    with pytest.raises(ValueError, match="unknown agent kind 'nope'"):
        build_agent("nope", ctx(store, clock))
    with pytest.raises(AgentOptionError, match="fail"):
        build_agent("mock", ctx(store, clock, fail="no"))


def test_public_surface() -> None:
    import prismd.agents as agents

    for name in ("Agent", "AgentContext", "EchoAgent", "MockAgent", "build_agent"):
        assert hasattr(agents, name)
    assert agents.AGENT_KINDS == ("a2a", "echo", "mock", "openai", "python")
    for name in ("OpenAIAgent", "Tool", "AGENT_NAMESPACES", "agent_record_kept"):
        assert hasattr(agents, name)


async def test_suspended_run_survives_reopening_a_sqlite_store(tmp_path: Any) -> None:
    """Durable run state on a real file: a new store and agent resume the run once."""
    from stores import open_store

    url = f"sqlite:///{tmp_path}/agents.sqlite"
    clock = ManualClock()
    with trio.fail_after(30):
        async with open_store(url, clock=clock) as first_store:
            ctx1 = AgentContext(
                alias="primary",
                options={"suspend_for_tool": "write"},
                checkpoints=first_store.checkpoints,
                clock=clock,
            )
            first = build_agent("mock", ctx1)
            assert isinstance(first, MockAgent)
            run_id, version, approval_id = await suspended_run(first)
        async with open_store(url, clock=clock) as second_store:
            ctx2 = attrs.evolve(ctx1, checkpoints=second_store.checkpoints)
            second = build_agent("mock", ctx2)
            assert isinstance(second, MockAgent)
            result = await resume_allowing(second, run_id, version, approval_id)
            assert (result.status, result.text) == ("succeeded", "mock: do it")
            assert await second.tool_runs(run_id, OWNER) == 1
            entries = await second.session_entries("sess-1", OWNER)
            assert [e.role for e in entries] == ["user", "assistant"]


async def test_transcripts_stay_within_byte_bounds(store: MemoryStore, clock: ManualClock) -> None:
    """Large inputs never push a transcript past the store's value limit."""
    from prismd.agents._session import MAX_ENTRY_BYTES, MAX_SESSION_BYTES, NS_SESSION

    agent = build_agent("echo", ctx(store, clock, history=True))
    assert isinstance(agent, EchoAgent)
    big = "é" * 40_000  # 80,000 UTF-8 bytes, above the per-entry clip
    for _ in range(30):
        result = await agent.run(request(big))
        assert result.text == big  # the answer itself is never clipped
    entries = await agent.session_entries("sess-1", OWNER)
    assert 2 <= len(entries) < 60
    assert all(len(e.text.encode()) <= MAX_ENTRY_BYTES for e in entries)
    assert entries[-1].id == result.leaf_id and entries[-1].role == "assistant"
    row = await store.checkpoints.load_checkpoint(
        namespace=NS_SESSION, key=session_key("primary", "sess-1", OWNER), scope=OWNER
    )
    assert row is not None
    import json

    assert len(json.dumps(row.value)) <= MAX_SESSION_BYTES
