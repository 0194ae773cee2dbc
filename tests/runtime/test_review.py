"""Defects found in the hostile review pass: each test failed before its fix."""

from __future__ import annotations

import json

import trio
import trio.testing

from prismd.agents import Agent
from prismd.agents._base import EventSink, RunRequest, RunResult
from prismd.channel import TRUNCATION_MARKER
from prismd.grants import ownership_from_identity
from prismd.journal import operation_id_for
from prismd.journal._journal import NS_REPLY, ChannelJournal, binding_key
from prismd.limits import Limits
from prismd.runtime import ResolveAgentInput, open_messaging_runtime
from stores.memory import MemoryStore
from tests.support.builders import event, identity
from tests.support.clocks import TrioClock
from tests.support.harness import Host, runtime
from tests.support.scripted import ScriptedAgent

IDENT = identity()
SCOPE = ownership_from_identity(IDENT)


class StubbornAgent(ScriptedAgent):
    """Ignores cancellation for ``stubborn_s`` seconds, then answers."""

    stubborn_s: float = 60.0
    finished: int = 0

    async def run(self, request: RunRequest, *, on_event: EventSink | None = None) -> RunResult:
        self.calls.append(request)
        self.provider_calls += 1
        self._started(self.provider_calls).set()
        with trio.CancelScope(shield=True):
            await trio.sleep(self.stubborn_s)
        self.finished += 1
        return RunResult("succeeded", "late answer", "run-late", request.session_id)


async def _op_state(store: MemoryStore, event_id: str) -> tuple[str, str | None]:
    loaded = await ChannelJournal(store.checkpoints).load_operation(
        SCOPE, "tg-1", operation_id_for("tg-1", event_id)
    )
    assert loaded is not None
    return loaded.record.state, loaded.record.error_code


async def test_stop_settles_a_claimed_run_that_ignores_cancellation_within_deadline(
    autojump_clock: trio.abc.Clock,
) -> None:
    """§13.5 / brief (b): the agent shields itself for 60 s; ``stop()`` with a 2 s deadline
    still returns within 2 s with the claimed operation settled ``cancelled`` durably
    (before: it stayed ``executing`` and stop returned with work unsettled), and the late
    answer is discarded rather than overwriting the settled record."""
    clock = TrioClock()
    store = MemoryStore(clock=clock)
    agent = StubbornAgent()
    host = Host(agent=agent)
    async with runtime(host, store, clock=clock, limits=Limits(stop_deadline_ms=2_000)) as rt:
        await rt.admit(event("1"))
        await agent.wait_started(1)
        assert await _op_state(store, "1") == ("executing", None)
        t0 = trio.current_time()
        await rt.stop()
        assert trio.current_time() - t0 <= 2.0
        assert await _op_state(store, "1") == ("cancelled", "cancelled_at_shutdown")
        assert await rt.list_unresolved(identity=IDENT) == []
        assert rt.diagnostics().cancelled == 1
        await trio.sleep(120)
        assert agent.finished == 1
    assert await _op_state(store, "1") == ("cancelled", "cancelled_at_shutdown")
    assert host.texts == []
    assert agent.provider_calls == 1


class GatedHost(Host):
    """``resolve_agent`` waits for ``resolve_gate`` (the turn is popped but not claimed)."""

    resolve_gate: trio.Event
    resolving: trio.Event

    async def resolve_agent(self, inp: ResolveAgentInput) -> Agent:
        self.resolving.set()
        await self.resolve_gate.wait()
        return await super().resolve_agent(inp)


def gated_host(agent: ScriptedAgent) -> GatedHost:
    host = GatedHost(agent=agent)
    host.resolve_gate = trio.Event()
    host.resolving = trio.Event()
    return host


async def test_stop_before_the_claim_never_calls_the_agent(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Brief (a): ``stop()`` while the popped turn is still resolving its agent. Before,
    the turn went on to claim and call ``agent.run`` after stop; now it settles
    ``cancelled``/``cancelled_at_shutdown`` with no agent call and no claim."""
    clock = TrioClock()
    store = MemoryStore(clock=clock)
    agent = ScriptedAgent()
    host = gated_host(agent)
    async with runtime(host, store, clock=clock, limits=Limits(stop_deadline_ms=5_000)) as rt:
        await rt.admit(event("1"))
        await host.resolving.wait()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(rt.stop)
            await trio.testing.wait_all_tasks_blocked()
            host.resolve_gate.set()
        assert agent.calls == []
        assert await _op_state(store, "1") == ("cancelled", "cancelled_at_shutdown")
        assert rt.diagnostics().cancelled == 1
    assert host.texts == []
    loaded = await ChannelJournal(store.checkpoints).load_operation(
        SCOPE, "tg-1", operation_id_for("tg-1", "1")
    )
    assert loaded is not None and loaded.record.attempts == 0


async def test_cancel_before_the_claim_never_calls_the_agent(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Brief (a): ``/cancel`` while the popped turn is resolving its agent: settled
    ``cancelled`` without a claim or an agent call (before: claimed and run)."""
    clock = TrioClock()
    store = MemoryStore(clock=clock)
    agent = ScriptedAgent()
    host = gated_host(agent)
    async with runtime(host, store, clock=clock) as rt:
        await rt.admit(event("1"))
        await host.resolving.wait()
        await rt.admit(event("2", "/cancel"))
        host.resolve_gate.set()
        await rt.drain()
        assert agent.calls == []
        assert await _op_state(store, "1") == ("cancelled", "cancelled_before_start")
        assert rt.diagnostics().cancelled == 1
    assert sorted(host.texts) == ["Cancelling the current request.", "Request cancelled."]


class BlockingAgent(ScriptedAgent):
    """Runs whose text is ``block`` wait for ``hold``; others answer at once."""

    hold: trio.Event

    async def run(self, request: RunRequest, *, on_event: EventSink | None = None) -> RunResult:
        self.active += 1
        self.peak = max(self.peak, self.active)
        try:
            if request.input == "block":
                await self.hold.wait()
            return RunResult("succeeded", "ok", "run-x", request.session_id)
        finally:
            self.active -= 1


async def test_a_route_being_hydrated_is_never_evicted(autojump_clock: trio.abc.Clock) -> None:
    """Brief (a) "two routes for one binding": with a full route table, a route whose
    first admit is still hydrating was evicted by another actor's admit; a later admit of
    the first actor then built a second route object for the same binding, and both
    pumped it — two runs on one session at once. Now the hydrating route is pinned."""
    from prismd.runtime import BindingResolution

    clock = TrioClock()
    store = MemoryStore(clock=clock)
    agent = BlockingAgent()
    agent.hold = trio.Event()
    host = Host(agent=agent)
    binding_gate, resolving = trio.Event(), trio.Event()
    seen: list[str] = []

    async def resolve_binding(inp):  # type: ignore[no-untyped-def]
        seen.append(inp.external_actor_id)
        if len(seen) == 1:
            resolving.set()
            await binding_gate.wait()
        return BindingResolution(session_id=f"s-{inp.external_actor_id}")

    results: dict[str, str] = {}
    async with runtime(
        host,
        store,
        clock=clock,
        use_leases=False,
        limits=Limits(max_routes=1),
        resolve_binding=resolve_binding,
    ) as rt:

        async def admit(eid: str, text: str, actor: str = "user-1") -> None:
            results[eid] = (await rt.admit(event(eid, text, actor=actor))).status

        async with trio.open_nursery() as nursery:
            nursery.start_soon(admit, "1", "block")
            await resolving.wait()
            await admit("3", "hello", "user-b")
            await rt.drain()
            nursery.start_soon(admit, "4", "block")
            await trio.testing.wait_all_tasks_blocked()
            binding_gate.set()
        await trio.testing.wait_all_tasks_blocked()
        peak = agent.peak
        agent.hold.set()
        await rt.drain()
    assert results["1"] == results["4"] == "accepted"
    assert peak == 1, "two runs on one binding at once"


class SlowReplyCheckpoints:
    """Delegates to a real checkpoint store; staging a reply (create) takes ``delay_s``."""

    def __init__(self, inner: object, delay_s: float) -> None:
        self._inner = inner
        self._delay_s = delay_s

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)

    async def write_checkpoints(self, writes, **kwargs):  # type: ignore[no-untyped-def]
        if any(w.namespace == NS_REPLY and w.expected_version == 0 for w in writes):
            await trio.sleep(self._delay_s)
        return await self._inner.write_checkpoints(writes, **kwargs)  # type: ignore[attr-defined]


async def test_reply_staging_survives_cancellation_of_the_runtime(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Brief (b): the operation is already ``succeeded`` when the reply is staged; a
    cancellation arriving during staging (runtime leaving by cancellation after stop's
    deadline) used to abort the create, losing the answer with nothing listed. The
    staging is now bounded and shielded, so the reply is at least ``pending``."""
    clock = TrioClock()
    store = MemoryStore(clock=clock)
    host = Host()
    with trio.move_on_after(0.5):
        async with runtime(host, store, clock=clock, limits=Limits(stop_deadline_ms=1_000)) as rt:
            core = rt._core
            core.journal = ChannelJournal(
                SlowReplyCheckpoints(store.checkpoints, 3.0),  # type: ignore[arg-type]
                core.limits.max_journal_record_bytes,
            )
            await rt.admit(event("1"))
            await trio.sleep_forever()
    assert await _op_state(store, "1") == ("succeeded", None)
    reply = await ChannelJournal(store.checkpoints).load_reply(
        SCOPE, "tg-1", operation_id_for("tg-1", "1")
    )
    assert reply is not None and reply.record.text == "answer"


async def test_an_answer_whose_json_exceeds_the_record_cap_is_cut_not_lost() -> None:
    """Brief (b): a 60 KB answer (under ``max_response_bytes``) of characters that JSON
    escapes six-fold exceeded ``max_journal_record_bytes`` when staged; the stage raised,
    nothing was sent and nothing listed, though the operation was ``succeeded``. Now the
    text is cut (with the marker) until the record fits, staged, and sent."""
    store = MemoryStore()
    host = Host(agent=ScriptedAgent(answer="\x01" * 60_000))
    async with runtime(host, store) as rt:
        await rt.admit(event("1"))
        await rt.drain()
        diag = rt.diagnostics()
    assert len(host.replies) == 1
    sent = host.texts[0]
    assert sent.endswith(TRUNCATION_MARKER) and sent.startswith("\x01" * 1000)
    assert diag.truncated == 1 and diag.storage_failures == 0
    reply = await ChannelJournal(store.checkpoints).load_reply(
        SCOPE, "tg-1", operation_id_for("tg-1", "1")
    )
    assert reply is not None and reply.record.text == sent
    assert reply.record.state == "delivered"


async def test_prune_keeps_the_operation_of_an_unsettled_reply() -> None:
    """Brief (b)/(d): prune keeps an unsettled (``delivery_unknown``) reply, but deleted
    its settled operation, so the reply was never listed again and could not be
    reconciled (reconcile loads the operation) — kept yet unreachable. The operation of
    an unsettled reply is now kept too; a settled pair is still deleted (behaviour 93)."""
    store = MemoryStore()

    def flaky(reply):  # type: ignore[no-untyped-def]
        if reply.text == "first":
            raise OSError("network")
        from prismd.channel import SendResult

        return SendResult(delivered=True, message_id="m")

    host = Host(agent=ScriptedAgent(answer=lambda text, n: text), deliver_hook=flaky)
    async with runtime(host, store) as rt:
        await rt.admit(event("1", "first"))
        await rt.admit(event("2", "second", chat="chat-2"))
        await rt.drain()
        listed = await rt.list_unresolved(identity=IDENT)
        assert [(e.state, e.reply_state) for e in listed] == [("succeeded", "delivery_unknown")]
        later = rt._core.now_ms() + 8 * 24 * 3600 * 1000
        pruned = await rt.prune(identity=IDENT, now_ms=later)
        assert pruned.deleted >= 2  # the delivered pair (op + reply), bindings, cursor
        after = await rt.list_unresolved(identity=IDENT)
        assert [(e.operation_id, e.reply_state) for e in after] == [
            (listed[0].operation_id, "delivery_unknown")
        ]
        result = await rt.reconcile(
            identity=IDENT,
            connection_id="tg-1",
            operation_id=after[0].operation_id,
            expected_version=after[0].version,
            acknowledge_duplicate_risk=True,
        )
        assert (result.status, result.outcome) == ("resolved", "reply_unknown")
    gone = await ChannelJournal(store.checkpoints).load_operation(
        SCOPE, "tg-1", operation_id_for("tg-1", "2")
    )
    assert gone is None


async def test_admit_cancelled_after_the_record_is_created_still_queues_the_event(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Brief (c): the caller (an adapter shutting down) cancels ``admit`` after the
    ``accepted`` record was created but before the turn was queued. The transport was not
    acknowledged, so it redelivers; the redelivery is a duplicate (acknowledged) — and the
    event never ran. Admission past the record is now shielded (bounded), so the first
    admit queues the turn and the agent runs exactly once."""
    from prismd.runtime import BindingResolution

    clock = TrioClock()
    store = MemoryStore(clock=clock)
    agent = ScriptedAgent()
    host = Host(agent=agent)

    async def slow_binding(inp):  # type: ignore[no-untyped-def]
        await trio.sleep(1)
        return BindingResolution(session_id="s-1")

    async with runtime(host, store, clock=clock, resolve_binding=slow_binding) as rt:
        with trio.move_on_after(0.5):
            await rt.admit(event("1"))
        again = await rt.admit(event("1"))
        assert again.status == "accepted" and again.duplicate
        await rt.drain()
        await trio.sleep(5)
        assert agent.provider_calls == 1
        assert host.texts == ["answer"]
        assert await rt.list_unresolved(identity=IDENT) == []


class FailFirstClaimCheckpoints(SlowReplyCheckpoints):
    """The first ``accepted → executing`` save raises (a transient store error)."""

    def __init__(self, inner: object, *, commit_anyway: bool = False) -> None:
        super().__init__(inner, 0.0)
        self.failed = 0
        self.commit_anyway = commit_anyway

    async def write_checkpoints(self, writes, **kwargs):  # type: ignore[no-untyped-def]
        claim = any(json.loads(w.value_json).get("state") == "executing" for w in writes)
        if self.failed == 0 and claim:
            self.failed += 1
            if self.commit_anyway:
                await self._inner.write_checkpoints(writes, **kwargs)  # type: ignore[attr-defined]
            raise OSError("disk I/O error")
        return await self._inner.write_checkpoints(writes, **kwargs)  # type: ignore[attr-defined]


async def test_a_transient_store_error_at_claim_is_retried_not_dropped(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Brief (c): a store error while claiming dropped the turn from its queue; the
    acknowledged message stayed ``accepted`` and never ran. Now the claim is retried with
    bounded backoff (a CAS, so safe when the failed write had in fact committed)."""
    clock = TrioClock()
    store = MemoryStore(clock=clock)
    agent = ScriptedAgent()
    host = Host(agent=agent)
    async with runtime(host, store, clock=clock) as rt:
        wrapper = FailFirstClaimCheckpoints(store.checkpoints)
        rt._core.journal = ChannelJournal(wrapper)  # type: ignore[arg-type]
        await rt.admit(event("1"))
        with trio.fail_after(30):
            await rt.drain()
        assert wrapper.failed == 1
        assert agent.provider_calls == 1 and host.texts == ["answer"]
        assert await _op_state(store, "1") == ("succeeded", None)


async def test_a_claim_that_committed_despite_an_error_never_runs_twice(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The ambiguous case: the claim committed, then the store raised. The retry finds
    the record ``executing`` and does not run it (at most one run; listed for reconcile)."""
    clock = TrioClock()
    store = MemoryStore(clock=clock)
    agent = ScriptedAgent()
    host = Host(agent=agent)
    async with runtime(host, store, clock=clock) as rt:
        wrapper = FailFirstClaimCheckpoints(store.checkpoints, commit_anyway=True)
        rt._core.journal = ChannelJournal(wrapper)  # type: ignore[arg-type]
        await rt.admit(event("1"))
        with trio.fail_after(30):
            await rt.drain()
        assert agent.provider_calls == 0
        listed = await rt.list_unresolved(identity=IDENT)
        assert [e.state for e in listed] == ["executing"]


async def test_a_second_runtime_refreshes_the_binding_when_it_takes_the_lease(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Brief (a) two runtimes on one store: B hydrated the binding once; A then ran
    ``/new`` (generation 1, new session). B's next turn ran the agent on the stale
    session and its binding save (CAS lost → reload version → save its stale record)
    rewound the binding to generation 0. Now a route re-reads its binding whenever it
    newly acquires the binding lease, before running a turn."""
    clock = TrioClock()
    store = MemoryStore(clock=clock)
    agent_a, agent_b = ScriptedAgent(), ScriptedAgent()
    host_a, host_b = Host(agent=agent_a), Host(agent=agent_b)
    async with runtime(host_a, store, clock=clock) as a, runtime(host_b, store, clock=clock) as b:
        await b.admit(event("1"))
        await b.drain()
        first_session = agent_b.calls[0].session_id
        await a.admit(event("2", "/new"))
        await a.drain()
        assert "Started a new conversation." in host_a.texts
        await b.admit(event("3"))
        await b.drain()
        assert agent_b.calls[1].session_id != first_session
    binding = await ChannelJournal(store.checkpoints).load_binding(
        SCOPE, binding_key("tg-1", SCOPE, "chat-1", None, "user-1", "primary")
    )
    assert binding is not None and binding.record.generation == 1
    assert binding.record.session_id == agent_b.calls[1].session_id


async def test_an_answer_with_a_lone_surrogate_is_staged_and_sent() -> None:
    """Brief (b): a provider answer decoded from JSON can hold a lone surrogate
    (``"\\ud800"``); the journal's UTF-8 encoding refused it, so staging failed and the
    answer of a succeeded operation was lost. Outbound text now has lone surrogates
    replaced by U+FFFD before it is staged (paired ones become their character)."""
    store = MemoryStore()
    host = Host(agent=ScriptedAgent(answer="ok \ud800 and \ud83d\ude00 done"))
    async with runtime(host, store) as rt:
        await rt.admit(event("1"))
        await rt.drain()
        assert rt.diagnostics().storage_failures == 0
    assert host.texts == ["ok \ufffd and \U0001f600 done"]
    reply = await ChannelJournal(store.checkpoints).load_reply(
        SCOPE, "tg-1", operation_id_for("tg-1", "1")
    )
    assert reply is not None and reply.record.state == "delivered"


async def test_an_id_with_a_lone_surrogate_is_malformed_not_retryable() -> None:
    """An event id or conversation id with a lone surrogate cannot be journaled (UTF-8):
    it was answered ``unavailable`` (retryable), so a transport would redeliver the
    poison event forever. It is now ``malformed`` (final) before ``authorize``."""
    store = MemoryStore()
    host = Host()
    async with runtime(host, store) as rt:
        first = await rt.admit(event("1\ud800"))
        second = await rt.admit(event("2", chat="chat-\udfff"))
        assert (first.status, first.reason, first.retryable) == ("denied", "malformed", False)
        assert (second.status, second.reason) == ("denied", "malformed")
        assert rt.diagnostics().storage_failures == 0
    assert host.authorize_calls == []


async def test_stop_during_a_hung_deliver_leaves_the_reply_listed(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Brief (b) regression: ``deliver`` never returns; leaving the runtime (stop, then
    cancellation) within the deadline leaves the staged reply ``pending`` — listed by a
    restarted runtime and resendable with the duplicate-risk acknowledgement."""
    clock = TrioClock()
    store = MemoryStore(clock=clock)
    hung = Host()

    async def deliver_forever(reply):  # type: ignore[no-untyped-def]
        await trio.sleep_forever()

    t0 = trio.current_time()
    async with open_messaging_runtime(
        authorize=hung.authorize,
        resolve_agent=hung.resolve_agent,
        deliver=deliver_forever,
        store=store,
        clock=clock,
        limits=Limits(stop_deadline_ms=1_000),
    ) as rt:
        await rt.admit(event("1"))
        await trio.sleep(0.5)
    assert trio.current_time() - t0 < 2
    host = Host()
    async with runtime(host, store, clock=clock) as again:
        listed = await again.list_unresolved(identity=IDENT)
        assert [(e.state, e.reply_state) for e in listed] == [("succeeded", "pending")]
        result = await again.reconcile(
            identity=IDENT,
            connection_id="tg-1",
            operation_id=listed[0].operation_id,
            expected_version=listed[0].version,
            acknowledge_duplicate_risk=True,
        )
        assert (result.status, result.outcome) == ("resolved", "reply_delivered")
    assert host.texts == ["answer"]


async def test_a_host_seam_error_message_never_reaches_the_chat() -> None:
    """Brief (e): an exception from ``fetch_attachment`` (a Telegram file URL carries
    the bot token) was quoted in the user's ``Request failed:`` notice. Host-seam errors
    now give the generic failure text; the agent's own error is still quoted (b24)."""
    from prismd.channel import AttachmentRef

    async def fetch(ref: AttachmentRef) -> bytes:
        raise OSError("GET https://api.telegram.org/file/bot123:SECRET/photo.jpg failed")

    host = Host(agent=ScriptedAgent(capabilities=frozenset({"text", "image"})))
    image = AttachmentRef(kind="image", transport_file_id="f-1", byte_length=4)
    async with runtime(host, MemoryStore(), fetch_attachment=fetch) as rt:
        await rt.admit(event("1", "look", attachments=(image,)))
        await rt.drain()
        assert rt.diagnostics().failed == 1
    assert host.texts == ["The request failed before it produced an answer."]
    assert host.scripted.calls == []


async def test_stop_cancelled_by_its_caller_still_settles_queued_work(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Brief (b): ``stop()`` whose caller is cancelled at once (a second signal) used to
    abandon the queued settlement at its first await — the queue was already cleared, so
    the record stayed ``accepted`` with no turn anywhere. The cleanup is now shielded,
    bounded by ``stop_deadline_ms``."""
    clock = TrioClock()
    store = MemoryStore(clock=clock)
    agent = ScriptedAgent(wait_for_cancel=True)
    host = Host(agent=agent)
    limits = Limits(max_active_sessions=1, stop_deadline_ms=2_000)
    async with runtime(host, store, clock=clock, limits=limits) as rt:
        await rt.admit(event("1"))
        await agent.wait_started(1)
        await rt.admit(event("2"))
        with trio.CancelScope() as scope:
            scope.cancel()
            await rt.stop()
        assert await _op_state(store, "2") == ("cancelled", "cancelled_at_shutdown")
    assert await _op_state(store, "1") == ("cancelled", None)
    assert agent.provider_calls == 1
