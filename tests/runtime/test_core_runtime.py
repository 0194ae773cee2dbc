"""Core runtime behaviours without a journal (contract behaviours 1–37, 49–53)."""

from __future__ import annotations

import attrs
import trio
import trio.testing

from prismd.channel import Redactor, ReplyKind
from prismd.grants import AuthorizeInput, Grant
from prismd.limits import Limits
from prismd.runtime.api import Diagnostics
from stores import OwnershipScope
from stores.memory import MemoryStore
from tests.support.builders import event, grant, identity
from tests.support.harness import Host, runtime
from tests.support.scripted import ScriptedAgent

GROUP_TUPLES = {("chat-g", "77", "user-1"), ("chat-g", "88", "user-1")}


def group_grants(inp: AuthorizeInput) -> Grant | None:
    if inp.claims.get("forwarded") is True:
        return None
    if (inp.external_conversation_id, inp.thread_id, inp.external_actor_id) in GROUP_TUPLES:
        return grant()
    return None


async def test_group_topic_ownership_b1_b2_b3_b4_b5() -> None:
    """Behaviours 1–5: only granted (chat, thread, actor) tuples are accepted; each topic
    runs in its own session and replies carry the thread id."""
    host = Host(grant_for=group_grants)
    async with runtime(host) as rt:
        ok1 = await rt.admit(event("1", chat="chat-g", thread="77"))
        assert ok1.status == "accepted"  # b1
        assert (await rt.admit(event("2", chat="chat-g", thread="77", actor="user-2"))).reason == (
            "rejected"
        )  # b2
        for other in (
            event("3", chat="chat-x", thread="77"),
            event("4", chat="chat-g"),
            event("5", chat="chat-g", thread="78"),
        ):
            assert (await rt.admit(other)).reason == "rejected"  # b3
        forwarded = event("6", chat="chat-g", thread="77", claims={"forwarded": True})
        assert (await rt.admit(forwarded)).reason == "rejected"  # b4
        assert (await rt.admit(event("7", chat="chat-g", thread="88"))).status == "accepted"
        await rt.drain()
    assert host.scripted.provider_calls == 2  # b5
    assert len(host.scripted.sessions) == 2
    assert sorted((r.external_conversation_id, r.thread_id, r.text) for r in host.replies) == [
        ("chat-g", "77", "answer"),
        ("chat-g", "88", "answer"),
    ]


async def test_cancel_during_stream_sends_only_partial_preview_b8() -> None:
    """Behaviour 8: previews are exactly the partial text and no final is delivered."""
    host = Host(agent=ScriptedAgent(deltas=("partial",), wait_for_cancel=True))
    async with runtime(host) as rt:
        await rt.admit(event("1"))
        await host.scripted.wait_started(1)
        await trio.testing.wait_all_tasks_blocked()
        assert (await rt.admit(event("2", "/cancel"))).status == "accepted"
        await rt.drain()
    assert [p.text for p in host.previews] == ["partial"]
    assert all(r.kind != "final" for r in host.replies)


async def test_accepted_message_runs_once_and_replies_b9_b10() -> None:
    """Behaviours 9, 10: accepted with a chan-op- id, settled drain, one final reply."""
    host = Host()
    async with runtime(host) as rt:
        result = await rt.admit(event())
        assert result.status == "accepted"
        assert result.operation_id is not None and result.operation_id.startswith("chan-op-")
        drained = await rt.drain()
        assert drained.settled
    assert [r.kind for r in host.replies] == ["final"]
    reply = host.replies[0]
    assert reply.text == "answer" and reply.connection_id == "tg-1" and reply.in_reply_to == "1"
    assert [len(v) for v in host.scripted.sessions.values()] == [2]


async def test_duplicate_event_is_not_rerun_b11() -> None:
    """Behaviour 11: the same event again is a duplicate; no second call or delivery."""
    host = Host()
    async with runtime(host) as rt:
        first = await rt.admit(event())
        await rt.drain()
        again = await rt.admit(event())
        await rt.drain()
        assert again.status == "accepted" and again.duplicate
        assert again.operation_id == first.operation_id
        assert rt.diagnostics().duplicates == 1
    assert host.scripted.provider_calls == 1 and len(host.replies) == 1


async def test_denials_never_reach_provider_b12_b13_b15_b16_b17_b18() -> None:
    """Behaviours 12, 13, 15–18: denials before/at authorize; nothing runs or is sent."""
    calls: list[AuthorizeInput] = []
    answers: list[Grant | None] = [None]

    def grant_for(inp: AuthorizeInput) -> Grant | None:
        calls.append(inp)
        return answers[0]

    host = Host(grant_for=grant_for)
    async with runtime(host) as rt:
        assert (await rt.admit(event("1"))).reason == "rejected"  # b12
        assert len(calls) == 1
        assert (await rt.admit(event("2", conn=""))).reason == "malformed"  # b13
        big = "x" * (64 * 1024 + 1)
        limits_rt = rt
        assert (await limits_rt.admit(event("3", big))).reason == "oversized"
        assert len(calls) == 1
        answers[0] = grant(aliases=())
        assert (await rt.admit(event("4"))).reason == "rejected"  # b15
        for partial in (
            grant(revision=""),
            attrs.evolve(grant(), agent_aliases="primary"),  # type: ignore[arg-type]
        ):
            answers[0] = partial
            result = await rt.admit(event(f"p-{len(calls)}"))
            assert result.status == "denied"  # b16
        answers[0] = grant()
        bad_thread = attrs.evolve(event("5"), thread_id=77)  # type: ignore[arg-type]
        assert (await rt.admit(bad_thread)).reason == "malformed"  # b17
        await rt.drain()
    assert host.scripted.provider_calls == 0 and host.replies == []  # b18


async def test_agent_command_unknown_alias_b14() -> None:
    """Behaviour 14: ``/agent secondary`` with only primary granted is unknown_alias."""
    host = Host()
    async with runtime(host) as rt:
        result = await rt.admit(event("1", "/agent secondary"))
        await rt.drain()
    assert (result.status, result.reason) == ("unsupported", "unknown_alias")
    assert host.texts == ["That agent alias is not available to this account."]


async def test_claims_never_widen_ownership_b19_b27() -> None:
    """Behaviours 19, 27: claims pretending another tenant are ignored; the secure agent
    bound to tenant-1/user-1 answers."""
    agent = ScriptedAgent(answer="secure answer", owner=OwnershipScope("tenant-1", None, "user-1"))
    host = Host(agent=agent)
    claims = {"tenantId": "tenant-9", "userId": "user-9", "agentAlias": "evil"}
    async with runtime(host) as rt:
        assert (await rt.admit(event("1", claims=claims))).status == "accepted"
        await rt.drain()
    assert agent.provider_calls == 1 and host.texts == ["secure answer"]


async def test_sessions_per_tenant_connection_b20() -> None:
    """Behaviour 20: connection tg-b maps to tenant-2; tg-a's two turns share a session."""

    def grant_for(inp: AuthorizeInput) -> Grant:
        tenant = "tenant-2" if inp.connection_id == "tg-b" else "tenant-1"
        return grant(identity(tenant=tenant))

    host = Host(grant_for=grant_for)
    async with runtime(host) as rt:
        for conn, eid in (("tg-a", "1"), ("tg-b", "1"), ("tg-a", "2"), ("tg-c", "1")):
            assert (await rt.admit(event(eid, conn=conn))).status == "accepted"
            await rt.drain()
    assert sorted(len(v) for v in host.scripted.sessions.values()) == [2, 2, 4]
    assert host.scripted.provider_calls == 4


async def test_one_binding_runs_fifo_one_at_a_time_b21(autojump_clock: trio.abc.Clock) -> None:
    """Behaviour 21: per-route FIFO, peak concurrency 1, one session continued."""
    gate = trio.Event()
    agent = ScriptedAgent(answer=lambda _t, n: f"answer {n}", gate=gate)
    host = Host(agent=agent)
    async with runtime(host) as rt:
        await rt.admit(event("1"))
        await rt.admit(event("2"))
        await trio.sleep(0.01)
        assert agent.provider_calls == 1
        gate.set()
        await rt.drain()
    assert agent.provider_calls == 2 and agent.peak == 1
    assert host.texts == ["answer 1", "answer 2"]
    assert [len(v) for v in agent.sessions.values()] == [4]
    # The second turn continues the branch the first one ended on.
    assert agent.calls[0].leaf_id is None
    assert agent.calls[1].leaf_id is not None and agent.calls[1].leaf_id.startswith("leaf-run-")


async def test_cancel_active_and_queued_b22() -> None:
    """Behaviour 22: /cancel aborts the active run and the queued turn; exact notices."""
    agent = ScriptedAgent(deltas=("partial",), wait_for_cancel=True)
    host = Host(agent=agent)
    async with runtime(host) as rt:
        await rt.admit(event("1"))
        await rt.admit(event("2"))
        await agent.wait_started(1)
        await trio.testing.wait_all_tasks_blocked()
        assert (await rt.admit(event("3", "/cancel"))).status == "accepted"
        await rt.drain()
        assert rt.diagnostics().cancelled == 2
    assert agent.provider_calls == 1
    assert "Cancelling the current request and 1 queued request." in host.texts
    assert "Request cancelled." in host.texts
    assert "Request cancelled before it started." in host.texts
    assert all("partial" not in t for t in host.texts)


async def test_cancel_on_idle_binding_b23() -> None:
    """Behaviour 23: ``/cancel`` with nothing running answers ``Nothing to cancel.``."""
    host = Host()
    async with runtime(host) as rt:
        assert (await rt.admit(event("1", "/cancel"))).status == "accepted"
        await rt.drain()
    assert host.texts[0] == "Nothing to cancel." and host.scripted.provider_calls == 0


async def test_failure_notice_is_redacted_b24() -> None:
    """Behaviour 24: a throwing provider yields one redacted ``Request failed:`` notice."""
    secret = "sk-secret-123"

    def answer(_text: str, n: int) -> str:
        return "first answer"

    agent = ScriptedAgent(answer=answer)
    host = Host(agent=agent)
    async with runtime(host, redactor=Redactor((secret,))) as rt:
        await rt.admit(event("1"))
        await rt.drain()
        agent.fail = f"provider exploded with {secret}"
        await rt.admit(event("2"))
        await rt.drain()
        diag = rt.diagnostics()
    notices = [r for r in host.replies if r.kind == "notice"]
    assert len(notices) == 1
    assert notices[0].text.startswith("Request failed:")
    assert secret not in notices[0].text and "first answer" not in notices[0].text
    assert (diag.failed, diag.completed) == (1, 1)


async def test_revoked_identity_denied_b25() -> None:
    """Behaviour 25: a grant whose identity is revoked is denied ``revoked``."""
    host = Host(grant_for=lambda _i: grant(identity(revoked_at_ms=1)))
    async with runtime(host) as rt:
        assert (await rt.admit(event())).reason == "revoked"
        await rt.drain()
    assert host.scripted.provider_calls == 0 and host.replies == []


async def test_revoked_mid_run_sends_nothing_b26() -> None:
    """Behaviour 26: identity revoked while the provider answers → no reply, failed=1."""
    gate = trio.Event()
    ident = identity()
    holder = [grant(ident)]
    host = Host(agent=ScriptedAgent(gate=gate), grant_for=lambda _i: holder[0])
    async with runtime(host) as rt:
        await rt.admit(event())
        await host.scripted.wait_started(1)
        object.__setattr__(ident, "revoked_at_ms", 1)
        gate.set()
        await rt.drain()
        assert rt.diagnostics().failed == 1
    assert host.replies == []


async def test_secure_agent_refuses_foreign_grant_b28() -> None:
    """Behaviour 28: admitted, but the secure agent refuses another owner before the
    provider: ``Request failed:`` notice, failed=1."""
    agent = ScriptedAgent(owner=OwnershipScope("tenant-1", None, "user-1"))
    host = Host(agent=agent, grant_for=lambda _i: grant(identity("user-9", "tenant-9")))
    async with runtime(host) as rt:
        assert (await rt.admit(event())).status == "accepted"
        await rt.drain()
        assert rt.diagnostics().failed == 1
    assert agent.provider_calls == 0
    assert host.texts[0].startswith("Request failed:")


async def test_commands_while_running_b29_b30_b31(autojump_clock: trio.abc.Clock) -> None:
    """Behaviours 29–31: /status answers at once while a run blocks; unknown commands are
    unsupported without notice; /new is refused while busy."""
    gate = trio.Event()
    agent = ScriptedAgent(gate=gate)
    host = Host(agent=agent)
    async with runtime(host) as rt:
        await rt.admit(event("1"))
        await agent.wait_started(1)
        with trio.fail_after(0.05):
            assert (await rt.admit(event("2", "/status"))).status == "accepted"
        for i, text in enumerate(("/config set model gpt", "/model gpt", "/")):
            assert (await rt.admit(event(f"u{i}", text))).status == "unsupported"
        assert (await rt.admit(event("3", "/new"))).status == "accepted"
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
        await rt.drain()
        assert rt.diagnostics().unsupported == 3
    assert agent.provider_calls == 1
    assert any("state: running" in t for t in host.texts)
    assert any("Finish or cancel" in t for t in host.texts)


async def test_new_and_agent_switch_sessions_b32_b33() -> None:
    """Behaviours 32, 33: /new starts a new session; /agent research switches alias."""
    host = Host(grant_for=lambda _i: grant(aliases=("primary", "research"), default="primary"))
    async with runtime(host) as rt:
        for eid, text in (("1", "hi"), ("2", "/new"), ("3", "hi again")):
            await rt.admit(event(eid, text))
            await rt.drain()
        sessions = [c.session_id for c in host.scripted.calls]
        assert len(set(sessions)) == 2  # b32
        assert [len(host.scripted.sessions[s]) for s in dict.fromkeys(sessions)] == [2, 2]
        await rt.admit(event("4", "/agent research"))
        await rt.admit(event("5", "hello research"))
        await rt.drain()
    assert [r.agent_alias for r in host.resolved] == ["primary", "primary", "research"]  # b33
    assert host.scripted.provider_calls == 3


async def test_capacity_limits_and_nothing_evicted_b34_b35() -> None:
    """Behaviours 34, 35: per-binding and route-table capacity; queued work still runs."""
    gate = trio.Event()
    agent = ScriptedAgent(gate=gate)
    host = Host(agent=agent)
    limits = Limits(max_pending_per_binding=1, max_routes=1)
    async with runtime(host, limits=limits) as rt:
        assert (await rt.admit(event("1"))).status == "accepted"
        await agent.wait_started(1)
        assert (await rt.admit(event("2"))).status == "accepted"
        third = await rt.admit(event("3"))
        assert (third.status, third.reason) == ("denied", "capacity") and third.retryable
        other = await rt.admit(event("4", actor="user-2"))
        assert (other.status, other.reason) == ("denied", "capacity")
        gate.set()
        await rt.drain()
    assert agent.provider_calls == 2
    assert [r.kind for r in host.replies] == ["final", "final"]


async def test_process_queue_cap_follows_turns_queued_taken_cancelled_and_stopped() -> None:
    """The process-wide queue cap counts what is queued on every route as it changes: a
    turn that starts running, one cancelled by ``/cancel`` and those settled at stop leave
    room again, and every admission is answered by that count alone."""
    gate = trio.Event()
    agent = ScriptedAgent(gate=gate)
    host = Host(agent=agent)
    async with runtime(host, limits=Limits(max_pending_per_process=2)) as rt:
        for eid, actor in (("a1", "user-a"), ("b1", "user-b")):
            assert (await rt.admit(event(eid, actor=actor))).status == "accepted"
        await agent.wait_started(2)
        assert rt.diagnostics().queued == 0  # both popped and running
        for eid, actor in (("a2", "user-a"), ("b2", "user-b")):
            assert (await rt.admit(event(eid, actor=actor))).status == "accepted"
        assert rt.diagnostics().queued == 2
        full = await rt.admit(event("c1", actor="user-c"))
        assert (full.status, full.reason) == ("denied", "capacity")
        # /cancel on a's route cancels its running turn and its queued one.
        assert (await rt.admit(event("a3", "/cancel", actor="user-a"))).status == "accepted"
        await trio.testing.wait_all_tasks_blocked()
        assert rt.diagnostics().queued == 1
        assert (await rt.admit(event("c2", actor="user-c"))).status == "accepted"
        await agent.wait_started(3)
        assert rt.diagnostics().queued == 1
        assert (await rt.admit(event("c3", actor="user-c"))).status == "accepted"
        assert (await rt.admit(event("c4", actor="user-c"))).reason == "capacity"
        assert rt.diagnostics().queued == 2
        await rt.stop()
        assert rt.diagnostics().queued == 0
    assert agent.provider_calls == 3  # a1, b1, c2: nothing queued ran after stop


async def test_slots_queue_and_stop_b36_b37() -> None:
    """Behaviours 36, 37: slot waiters are active-not-queued; stop cancels all three."""
    agent = ScriptedAgent(wait_for_cancel=True)
    host = Host(agent=agent)
    async with runtime(host, limits=Limits(max_active_sessions=1)) as rt:
        await rt.admit(event("1"))
        await agent.wait_started(1)
        await rt.admit(event("2"))
        await rt.admit(event("3", actor="user-b"))
        await trio.testing.wait_all_tasks_blocked()
        diag = rt.diagnostics()
        assert (diag.queued, diag.active) == (1, 1)
        await rt.stop()
        diag = rt.diagnostics()
        assert diag.queued == 0 and diag.cancelled == 3
        assert agent.provider_calls == 1
        late = await rt.admit(event("9"))
        assert (late.status, late.reason) == ("denied", "stopped")


async def test_construction_calls_nothing_and_counters_zero_b49_b50_b51() -> None:
    """Behaviours 49–51: construction is inert; early denials never call back."""

    async def boom(*_a: object) -> object:
        raise AssertionError("callback called")

    from prismd.runtime import open_messaging_runtime

    async with open_messaging_runtime(authorize=boom, resolve_agent=boom, deliver=boom) as rt:  # type: ignore[arg-type]
        diag = rt.diagnostics()
        assert attrs.asdict(diag) == dict.fromkeys(attrs.asdict(Diagnostics()), 0)
        assert len(attrs.asdict(diag)) == 15
        assert (await rt.admit(event(""))).reason == "malformed"
        assert (await rt.admit(event("1", "x" * (32 * 1024 + 1)))).reason == "oversized"
        await rt.stop()
        assert (await rt.admit(event("2"))).reason == "stopped"
        expected = dict.fromkeys(attrs.asdict(Diagnostics()), 0) | {"denied": 3}
        assert attrs.asdict(rt.diagnostics()) == expected


async def test_threads_get_distinct_sessions_b52() -> None:
    """Behaviour 52: two events differing only in thread id use two sessions."""
    host = Host()
    async with runtime(host) as rt:
        await rt.admit(event("1", thread="topic-a"))
        await rt.admit(event("2", thread="topic-b"))
        await rt.drain()
    assert len({c.session_id for c in host.scripted.calls}) == 2


def test_reply_kind_has_no_draft_b53() -> None:
    """Behaviour 53: the reply kind admits only ``final`` and ``notice``."""
    assert set(ReplyKind.__args__) == {"final", "notice"}  # type: ignore[attr-defined]


async def test_help_and_agent_usage_texts() -> None:
    """Commands §8: /help text, /agent usage, and /status of an idle route."""
    host = Host()
    async with runtime(host) as rt:
        assert (await rt.admit(event("1", "/help"))).status == "accepted"
        usage = await rt.admit(event("2", "/agent"))
        assert (usage.status, usage.reason) == ("unsupported", "invalid_argument")
        await rt.admit(event("3", "/status"))
        await rt.admit(event("4", "/help@bot"))
        await rt.drain()
    assert sorted(host.texts) == [
        "Agent: primary; state: idle.",
        "Commands: /help, /status, /new, /agent <alias>, /cancel.",
        "Usage: /agent <alias>.",
    ]


async def test_a_full_queue_refuses_without_writing_and_a_duplicate_is_still_one() -> None:
    """A message whose queue is full is refused (``capacity``, retryable) without its record
    being written and removed again — nothing reaches the store for it — while one already
    admitted is still answered ``duplicate`` first (§7), and the refused one, redelivered
    once there is room, is admitted and answered once."""
    gate = trio.Event()
    agent = ScriptedAgent(gate=gate)
    host = Host(agent=agent)
    limits = Limits(max_pending_per_binding=1)
    async with MemoryStore() as store, runtime(host, store, limits=limits) as rt:
        assert (await rt.admit(event("1"))).status == "accepted"
        await agent.wait_started(1)
        assert (await rt.admit(event("2"))).status == "accepted"  # queued: the queue is full
        before = await store.checkpoints.last_event_seq()
        third = await rt.admit(event("3"))
        assert (third.status, third.reason) == ("denied", "capacity") and third.retryable
        assert await store.checkpoints.last_event_seq() == before  # no write, no removal
        again = await rt.admit(event("2"))
        assert again.duplicate and again.status == "accepted"
        assert await store.checkpoints.last_event_seq() == before
        gate.set()
        await rt.drain()
        assert (await rt.admit(event("3"))).status == "accepted"
        await rt.drain()
    assert agent.provider_calls == 3
    assert [r.kind for r in host.replies] == ["final", "final", "final"]
