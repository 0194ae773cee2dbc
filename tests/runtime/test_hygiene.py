"""Outbound text hygiene, stop durability, bounded dedup and a randomized invariant check."""

from __future__ import annotations

import random

import attrs
import trio
import trio.testing

from prismd.channel import (
    TRUNCATION_MARKER,
    Redactor,
    Reply,
    SendResult,
    bound_detail,
    truncate_utf8,
    utf8_len,
)
from prismd.grants import ownership_from_identity
from prismd.journal import ReplyRecord, StoredButton, operation_id_for
from prismd.journal._journal import ChannelJournal
from prismd.limits import Limits
from prismd.runtime._replies import fit_record, fits_unmeasured
from stores import compact_json
from tests.support.builders import event, grant, identity
from tests.support.harness import Host, StoreFactory, runtime
from tests.support.scripted import ScriptedAgent

IDENT = identity()
SCOPE = ownership_from_identity(IDENT)


def test_redactor_replaces_longest_secret_first() -> None:
    redactor = Redactor(("abc", "abcdef", ""))
    assert redactor.redact("x abcdef y abc") == "x [REDACTED] y [REDACTED]"
    assert Redactor().redact("nothing") == "nothing"


def test_truncation_keeps_utf8_prefix_and_marker() -> None:
    """§6.2: the largest prefix of max − len(marker) bytes, no broken code point."""
    text = "é" * 100  # 200 bytes
    cut, truncated = truncate_utf8(text, 51)
    assert truncated and cut.endswith(TRUNCATION_MARKER)
    assert utf8_len(cut) <= 51
    assert cut[: -len(TRUNCATION_MARKER)] == "é" * ((51 - utf8_len(TRUNCATION_MARKER)) // 2)
    assert truncate_utf8("short", 51) == ("short", False)
    assert bound_detail("€" * 300, 512) == "€" * 170


async def test_long_answer_truncated_and_counted() -> None:
    """§9.2: a reply over max_response_bytes is cut with the marker; ``truncated`` + 1."""
    host = Host(agent=ScriptedAgent(answer="a" * 5000))
    async with runtime(host, limits=Limits(max_response_bytes=1024)) as rt:
        await rt.admit(event())
        await rt.drain()
        assert rt.diagnostics().truncated == 1
    [reply] = host.replies
    assert reply.text.endswith(TRUNCATION_MARKER) and utf8_len(reply.text) <= 1024


def test_a_reply_record_fitted_without_measuring_it_fits_when_measured() -> None:
    """A reply record is encoded once (when journaled) unless a bound on its strings
    leaves a doubt; the bound never calls a record fitting that does not fit, whatever
    its text (escapes, multi-byte characters, long ids) and at every size around it."""
    rng = random.Random(11)
    alphabet = ['"', "\\", "\x00", "\x1f", "\n", "é", "€", "😀", "\u2028", "a", "\ufffd"]
    budget = 4096
    fast = 0
    for _ in range(600):
        chars = rng.randrange(0, 250)
        texts = ["".join(rng.choice(alphabet) for _ in range(chars)) for _ in range(4)]
        record = ReplyRecord(
            operation_id=texts[1][:200],
            connection_id=texts[2][:40],
            external_conversation_id=texts[3][:100],
            kind="final",
            text=texts[0],
            state="delivery_failed",
            created_at_ms=253_402_300_799_999,
            updated_at_ms=253_402_300_799_999,
            thread_id=texts[3][:50],
            attempts=2**53 - 1,
            message_id=texts[2][:60],
            reason=texts[1][:100],
        )
        if fits_unmeasured(record, budget):
            fast += 1
            assert utf8_len(compact_json(record.to_json())) <= budget
            assert fit_record(record, budget + 4096) is record
        else:
            assert not fits_unmeasured(record, budget - 1)
    assert 100 < fast < 600  # both sides of the bound were tried
    # The tightest case: every character escaped to six bytes, every number at its widest.
    for n in range(0, 120, 7):
        e = "\x00" * n
        worst = attrs.evolve(
            record,
            operation_id=e,
            connection_id=e,
            external_conversation_id=e,
            text=e,
            thread_id=e,
            message_id=e,
            reason=e,
        )
        size = utf8_len(compact_json(worst.to_json()))
        for tight in range(size - 700, size + 700):
            assert not fits_unmeasured(worst, tight) or size <= tight
    buttons = (StoredButton("Allow", "allow_once"),)
    short = ReplyRecord("op", "c", "chat", "notice", "hi", "pending", 1, 1, buttons=buttons)
    assert not fits_unmeasured(short, budget)  # controls and approvals are measured
    assert fit_record(short, budget + 4096) is short


async def test_failed_delivery_is_counted_and_listed(stores: StoreFactory) -> None:
    """§9.2: ``delivered: false`` counts a delivery failure and leaves a resendable reply."""
    store = await stores()
    host = Host(deliver_hook=lambda _r: SendResult(delivered=False, reason="blocked" * 200))
    async with runtime(host, store) as rt:
        await rt.admit(event())
        await rt.drain()
        assert rt.diagnostics().delivery_failures == 1
        [entry] = await rt.list_unresolved(identity=IDENT)
        assert entry.reply_state == "delivery_failed"
    reply = await ChannelJournal(store.checkpoints).load_reply(
        SCOPE, "tg-1", operation_id_for("tg-1", "1")
    )
    assert reply is not None and reply.record.reason is not None
    assert utf8_len(reply.record.reason) <= 512 and reply.record.attempts == 1
    # The operator's listing says why (prismctl list-unresolved's REASON column).
    assert entry.reason == reply.record.reason


async def test_stop_settles_queued_and_claimed_durably(stores: StoreFactory) -> None:
    """§13.5: stop() cancels the claimed run and the queued turn; both ops end
    ``cancelled`` in the journal and nothing is left unresolved."""
    store = await stores()
    agent = ScriptedAgent(wait_for_cancel=True)
    async with runtime(Host(agent=agent), store) as rt:
        first = await rt.admit(event("1"))
        second = await rt.admit(event("2"))
        await agent.wait_started(1)
        await rt.stop()
        assert await rt.list_unresolved(identity=IDENT) == []
        assert rt.diagnostics().cancelled == 2
    journal = ChannelJournal(store.checkpoints)
    states = []
    for result in (first, second):
        assert result.operation_id is not None
        loaded = await journal.load_operation(SCOPE, "tg-1", result.operation_id)
        assert loaded is not None
        states.append((loaded.record.state, loaded.record.error_code))
    assert states == [("cancelled", None), ("cancelled", "cancelled_at_shutdown")]
    assert agent.cancelled_runs == 1


async def test_in_memory_dedup_window_is_bounded() -> None:
    """§7 step 7 (no journal): the seen-set keeps the newest N ids per connection."""
    host = Host()
    async with runtime(host, limits=Limits(max_seen_events_per_connection=2)) as rt:
        for eid in ("1", "2", "3"):
            await rt.admit(event(eid))
        assert (await rt.admit(event("3"))).duplicate
        assert not (await rt.admit(event("1"))).duplicate  # evicted from the window
        await rt.drain()
    assert host.scripted.provider_calls == 4


async def test_randomized_runs_each_event_at_most_once(stores: StoreFactory) -> None:
    """Random interleavings of messages, duplicates and /cancel across routes: every
    accepted event runs at most once, replies never exceed accepted events, and after
    drain nothing is unresolved."""
    rng = random.Random(1234)
    store = await stores()
    agent = ScriptedAgent(answer=lambda text, _n: f"re: {text}")
    host = Host(agent=agent)
    accepted: set[str] = set()
    async with runtime(host, store, limits=Limits(max_active_sessions=2)) as rt:
        for i in range(60):
            actor = f"user-{rng.randrange(3)}"
            roll = rng.random()
            if roll < 0.15:
                await rt.admit(event(f"c{i}", "/cancel", actor=actor))
            elif roll < 0.3 and accepted:
                eid = rng.choice(sorted(accepted))
                assert (await rt.admit(event(eid, f"msg {eid}"))).duplicate
            else:
                result = await rt.admit(event(str(i), f"msg {i}", actor=actor))
                if result.status == "accepted":
                    accepted.add(str(i))
            if rng.random() < 0.3:
                await trio.testing.wait_all_tasks_blocked()
        await rt.drain()
        assert await rt.list_unresolved(identity=IDENT) == []
        diag = rt.diagnostics()
        journal = ChannelJournal(store.checkpoints)
        states = {}
        for eid in accepted:
            loaded = await journal.load_operation(SCOPE, "tg-1", operation_id_for("tg-1", eid))
            assert loaded is not None, eid
            states[eid] = loaded.record.state
    ran = [c.input for c in agent.calls]
    # At most once: no event's text reached the agent twice, nor one that was not accepted.
    assert len(ran) == len(set(ran))
    assert set(ran) <= {f"msg {e}" for e in accepted}
    # And at least once unless cancelled: every accepted event either ran to an answer or
    # was settled cancelled (by a /cancel before or during its run) — none was lost.
    assert set(states.values()) <= {"succeeded", "cancelled"}, states
    for eid, state in states.items():
        if state == "succeeded":
            assert f"msg {eid}" in ran, eid
    assert sum(1 for s in states.values() if s == "succeeded") > len(accepted) // 2
    finals = [r for r in host.replies if r.kind == "final"]
    assert len(finals) == diag.completed <= len(accepted)
    assert all(isinstance(r, Reply) for r in host.replies)
    assert attrs.asdict(diag)["queued"] == 0


async def test_resolve_binding_maps_sessions_and_bad_ids_are_malformed(
    stores: StoreFactory,
) -> None:
    """§2.4: a host ``resolve_binding`` chooses the session; an empty session id is a
    ``malformed`` denial at admission and leaves no operation behind."""
    from prismd.runtime import BindingInput, BindingResolution

    seen: list[BindingInput] = []

    async def resolve_binding(inp: BindingInput) -> BindingResolution:
        seen.append(inp)
        if inp.external_actor_id == "bad":
            return BindingResolution(session_id="")
        return BindingResolution(session_id=f"host-{inp.agent_alias}-{inp.generation}")

    store = await stores()
    host = Host()
    async with runtime(host, store, resolve_binding=resolve_binding) as rt:
        assert (await rt.admit(event("1"))).status == "accepted"
        bad = await rt.admit(event("2", actor="bad"))
        assert (bad.status, bad.reason) == ("denied", "malformed")
        await rt.drain()
        assert await rt.list_unresolved(identity=IDENT) == []
    assert [c.session_id for c in host.scripted.calls] == ["host-primary-0"]
    assert seen[0].generation == 0 and seen[0].scope == SCOPE


def test_utf8_len_counts_the_encoded_bytes_for_any_text() -> None:
    for text in ["", "plain ascii", "é", "日本語", "😀", "\ud800", "a\udfffb", "\x00\x7f"]:
        assert utf8_len(text) == len(text.encode("utf-8", "surrogatepass")), repr(text)


async def test_two_owners_given_one_session_id_by_the_host_each_keep_their_transcript(
    stores: StoreFactory,
) -> None:
    """§2.4: ``resolve_binding`` chooses session ids, and nothing makes them unique across
    owners. Two tenants given the same one are both answered, and each transcript holds
    only its owner's turns."""
    from prismd.agents import AgentContext, EchoAgent, build_agent
    from prismd.runtime import BindingInput, BindingResolution

    async def one_session_for_everyone(_inp: BindingInput) -> BindingResolution:
        return BindingResolution(session_id="main")

    store = await stores()
    echo = build_agent(
        "echo",
        AgentContext(alias="primary", options={"history": True}, checkpoints=store.checkpoints),
    )
    assert isinstance(echo, EchoAgent)
    a, b = identity(tenant="tenant-a"), identity(tenant="tenant-b")
    host = Host(agent=echo, grants={"user-a": grant(a), "user-b": grant(b)})
    async with runtime(host, store, resolve_binding=one_session_for_everyone) as rt:
        for event_id, actor, text in (("1", "user-a", "hi from a"), ("2", "user-b", "hi from b")):
            assert (await rt.admit(event(event_id, text, actor=actor))).status == "accepted"
            await host.settle()
        assert (await rt.admit(event("3", "again a", actor="user-a"))).status == "accepted"
        await host.settle()
    assert host.texts == ["hi from a", "hi from b", "again a"]
    transcripts = [
        [e.text for e in await echo.session_entries("main", ownership_from_identity(who))]
        for who in (a, b)
    ]
    assert transcripts == [["hi from a", "hi from a", "again a", "again a"], ["hi from b"] * 2]
