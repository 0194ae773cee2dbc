"""SPEC difference 8 / issue 3: nothing acknowledged is dropped.

A message admitted (``accepted``, transport acknowledged) but not yet claimed when the
process dies keeps its input in the operation record; a runtime opened with
``resume_accepted=True`` runs it once (its first run), in FIFO order per route. The input
is removed at the claim and at every other exit from ``accepted``.

"Kill" in process: runtime A's ``resolve_agent`` never returns (no claim is ever written),
its ``stop()`` is disabled and its nursery cancelled — nothing is settled, route 1's lease
stays held by A. The restarted runtime B is A's successor (same owner, adopting its
leases at once, as the daemon does); one memory test lets a foreign owner wait for the
dead owner's lease TTL (virtual time). Real time otherwise: SQLite runs in threads, which
``autojump_clock`` would race. The SQLite variant with a real SIGKILL is at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from prismd.channel import InboundEvent
from prismd.grants import AgentIdentity, AuthorizeInput, Grant, Principal, ownership_from_identity
from prismd.journal._journal import NS_OPERATION, ChannelJournal
from prismd.limits import Limits
from prismd.runtime import Runtime, open_messaging_runtime
from stores import OwnershipScope, Store, open_store
from tests.support.builders import event, grant, identity
from tests.support.clocks import TrioClock
from tests.support.harness import Host, store_factory
from tests.support.scripted import ScriptedAgent, input_text

REPO = Path(__file__).resolve().parents[2]
CHAT1 = ("m1", "m2", "m3")
SUCCESSOR: dict[str, Any] = {"owner_id": "runtime-a", "adopt_own_leases": True}


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Store]:
    async with store_factory(request.param, tmp_path, clock=TrioClock()) as factory:
        yield await factory()


def _events() -> list[InboundEvent]:
    out = [event(str(n), text, chat="chat-1") for n, text in enumerate(CHAT1, start=1)]
    out.append(event("4", "m4", chat="chat-2"))
    return out


def _open(host: Host, store: Store, **kwargs: Any) -> Any:
    kwargs.setdefault("resolve_agent", host.resolve_agent)
    kwargs.setdefault("authorize", host.authorize)
    return open_messaging_runtime(
        deliver=host.deliver,
        store=store,
        clock=TrioClock(),
        **kwargs,
    )


async def _admit_then_kill(store: Store, events: list[InboundEvent]) -> None:
    """Runtime A admits ``events`` (all ``accepted``), then dies without ``stop()``."""
    host = Host()
    resolving: list[object] = []

    async def never(inp: object) -> Any:
        resolving.append(inp)
        await trio.sleep_forever()

    with trio.CancelScope() as cs:
        async with _open(host, store, resolve_agent=never, owner_id="runtime-a") as rt:
            for ev in events:
                admission = await rt.admit(ev)
                assert (admission.status, admission.reason) == ("accepted", None)
                assert not admission.duplicate
            routes = len({ev.external_conversation_id for ev in events})
            await _wait(lambda: len(resolving) >= routes)
            rt._stop_done = True  # a kill: stop() never runs, nothing is settled
            cs.cancel()
            await trio.sleep_forever()
    assert cs.cancelled_caught


async def _ops(store: Store) -> dict[str, dict[str, Any]]:
    """Raw stored operation values by event id (any scope)."""
    rows, _ = await ChannelJournal(store.checkpoints).list(OwnershipScope(), NS_OPERATION, 500)
    return {row.value["eventId"]: row.value for row in rows}


async def _wait(pred: Callable[[], bool], within_s: float = 20) -> None:
    """Poll ``pred`` (the host records are plain lists, no events to wait on)."""
    with trio.fail_after(within_s):
        while True:
            if pred():
                return
            await trio.sleep(0.02)


def _echo() -> ScriptedAgent:
    return ScriptedAgent(answer=lambda text, _n: f"re {text}")


def _texts_by_chat(agent: ScriptedAgent, chat_of: dict[str, str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for call in agent.calls:
        text = input_text(call.input)
        out.setdefault(chat_of[text], []).append(text)
    return out


CHAT_OF = {"m1": "chat-1", "m2": "chat-1", "m3": "chat-1", "m4": "chat-2", "m5": "chat-1"}


@pytest.mark.slow
async def test_killed_accepted_messages_run_once_in_fifo_order(store: Store) -> None:
    await _admit_then_kill(store, _events())
    before = await _ops(store)
    assert sorted(before) == ["1", "2", "3", "4"]
    assert all(v["state"] == "accepted" for v in before.values())
    assert [before[k]["input"]["text"] for k in "1234"] == ["m1", "m2", "m3", "m4"]
    await trio.sleep(0.01)
    agent = _echo()
    host = Host(agent=agent)

    async def slow_for_recovered(inp: AuthorizeInput) -> Grant | None:
        # Recovery re-authorizes slowly: without the FIFO gate m5 would overtake m1–m3.
        if inp.text != "m5":
            await trio.sleep(0.05)
        return await host.authorize(inp)

    async with _open(
        host, store, resume_accepted=True, authorize=slow_for_recovered, **SUCCESSOR
    ) as rt:
        # Admitted after the restart: goes after the recovered ones on its route.
        late = await rt.admit(event("5", "m5", chat="chat-1"))
        assert late.status == "accepted" and not late.duplicate
        await _wait(lambda: len(host.replies) == 5)
        await trio.sleep(0.2)
        diag = rt.diagnostics()
        assert (diag.admitted, diag.duplicates, diag.completed) == (5, 0, 5)
    assert _texts_by_chat(agent, CHAT_OF) == {
        "chat-1": ["m1", "m2", "m3", "m5"],
        "chat-2": ["m4"],
    }
    assert agent.provider_calls == 5
    assert sorted(host.texts) == sorted(f"re m{n}" for n in range(1, 6))
    after = await _ops(store)
    assert {v["state"] for v in after.values()} == {"succeeded"}
    assert all("input" not in v for v in after.values())
    assert all(v["attempts"] == 1 for v in after.values())


@pytest.mark.slow
async def test_default_does_not_resume(store: Store) -> None:
    await _admit_then_kill(store, _events())
    await trio.sleep(0.01)
    agent = _echo()
    host = Host(agent=agent)
    async with _open(host, store, **SUCCESSOR) as rt:
        await trio.sleep(0.5)
        listed = await rt.list_unresolved(identity=identity())
        assert sorted(e.state for e in listed) == ["accepted"] * 4
        assert rt.diagnostics().admitted == 0
        # Reconciling an accepted record (abandoned) removes its input too.
        entry = listed[0]
        result = await rt.reconcile(
            identity=identity(),
            connection_id=entry.connection_id,
            operation_id=entry.operation_id,
            expected_version=entry.version,
        )
        assert result.status == "resolved"
    assert agent.calls == [] and host.replies == []
    stored = await _ops(store)
    by_op = {v["operationId"]: v for v in stored.values()}
    abandoned = by_op.pop(entry.operation_id)
    assert abandoned["state"] != "accepted" and "input" not in abandoned
    assert all(v["state"] == "accepted" and "input" in v for v in by_op.values())


async def test_input_written_at_admit_and_removed_at_claim(store: Store) -> None:
    gate = trio.Event()
    agent = ScriptedAgent(gate=gate)
    host = Host(agent=agent)
    claims = {"platform": "telegram", "chatType": "supergroup", "isForum": True, "other": "x"}
    async with _open(host, store) as rt:
        await rt.admit(event("1", "first"))
        with trio.fail_after(20):
            await agent.wait_started(1)
        await rt.admit(event("2", "second", claims=claims, thread="t-9"))
        stored = await _ops(store)
        assert stored["1"]["state"] == "executing" and "input" not in stored["1"]
        assert stored["2"]["state"] == "accepted"
        # The admission's microsecond stamp (what orders a route's records of one ms).
        admitted_us = stored["2"]["input"].pop("admittedUs")
        assert isinstance(admitted_us, int) and admitted_us > 0
        assert stored["2"]["input"] == {
            "text": "second",
            "threadId": "t-9",
            "claims": {"platform": "telegram", "chatType": "supergroup", "isForum": True},
        }
        gate.set()
        await _wait(lambda: len(host.replies) == 2)
        await rt.drain()
    assert all("input" not in v for v in (await _ops(store)).values())


async def test_commands_carry_no_input(store: Store) -> None:
    host = Host()
    async with _open(host, store) as rt:
        await rt.admit(event("1", "/status"))
        await rt.drain()
    assert "input" not in (await _ops(store))["1"]


async def test_oversized_input_falls_back_to_no_input(store: Store) -> None:
    """Control characters expand sixfold in JSON: 30 000 of them fit ``max_input_bytes``
    but not ``max_journal_record_bytes``; the record is written without input and the
    message still runs in this process."""
    gate = trio.Event()
    agent = ScriptedAgent(gate=gate)
    host = Host(agent=agent)
    big = "\x01" * 30_000
    async with _open(host, store, limits=Limits()) as rt:
        await rt.admit(event("1", "first"))
        with trio.fail_after(20):
            await agent.wait_started(1)
        admission = await rt.admit(event("2", big))
        assert admission.status == "accepted"
        stored = await _ops(store)
        assert stored["2"]["state"] == "accepted" and "input" not in stored["2"]
        gate.set()
        await _wait(lambda: len(host.replies) == 2)
        assert rt.diagnostics().storage_failures == 0
    assert [input_text(c.input) for c in agent.calls] == ["first", big]


async def test_denied_at_recovery_settles_failed_without_run(store: Store) -> None:
    await _admit_then_kill(store, _events())
    await trio.sleep(0.01)
    revoked = grant(identity(revoked_at_ms=1))

    def grant_for(inp: AuthorizeInput) -> Grant | None:
        assert inp.action == "message"
        return revoked if inp.external_conversation_id == "chat-1" else None

    agent = _echo()
    host = Host(agent=agent, grant_for=grant_for)
    async with _open(host, store, resume_accepted=True, **SUCCESSOR) as rt:
        await _wait(lambda: len(host.authorize_calls) == 4)
        await trio.sleep(0.2)
        diag = rt.diagnostics()
        assert (diag.admitted, diag.denied) == (0, 4)
    assert agent.calls == [] and host.replies == []
    stored = await _ops(store)
    assert {k: (v["state"], v["errorCode"]) for k, v in stored.items()} == {
        "1": ("failed", "identity_revoked"),
        "2": ("failed", "identity_revoked"),
        "3": ("failed", "identity_revoked"),
        "4": ("failed", "rejected"),
    }
    assert all("input" not in v for v in stored.values())
    assert sorted(c.text for c in host.authorize_calls) == ["m1", "m2", "m3", "m4"]


@pytest.mark.slow
async def test_authorize_error_at_recovery_leaves_accepted(store: Store) -> None:
    await _admit_then_kill(store, _events())
    await trio.sleep(0.01)

    def broken(_inp: AuthorizeInput) -> Grant | None:
        raise RuntimeError("authorizer down")

    agent = _echo()
    host = Host(agent=agent, grant_for=broken)
    async with _open(host, store, resume_accepted=True, **SUCCESSOR):
        await _wait(lambda: len(host.authorize_calls) >= 2)
        await trio.sleep(0.3)
    assert agent.calls == []
    stored = await _ops(store)
    assert all(v["state"] == "accepted" and "input" in v for v in stored.values())


@pytest.mark.slow
async def test_two_runtimes_recovering_concurrently_run_each_once(store: Store) -> None:
    await _admit_then_kill(store, _events())
    await trio.sleep(0.01)
    agent_b, agent_c = _echo(), _echo()
    host_b, host_c = Host(agent=agent_b), Host(agent=agent_c)
    async with (
        _open(host_b, store, resume_accepted=True, **SUCCESSOR) as b,
        _open(host_c, store, resume_accepted=True, owner_id="runtime-c") as c,
    ):
        await _wait(lambda: len(host_b.replies) + len(host_c.replies) == 4)
        await trio.sleep(0.3)
        await b.drain()
        await c.drain()
    texts = [input_text(x.input) for x in agent_b.calls + agent_c.calls]
    assert sorted(texts) == ["m1", "m2", "m3", "m4"]
    assert sorted(host_b.texts + host_c.texts) == ["re m1", "re m2", "re m3", "re m4"]
    for agent in (agent_b, agent_c):
        chat1 = [t for t in map(input_text, (x.input for x in agent.calls)) if t in CHAT1]
        assert chat1 == sorted(chat1)
    stored = await _ops(store)
    assert all(v["state"] == "succeeded" and v["attempts"] == 1 for v in stored.values())
    assert all("input" not in v for v in stored.values())


async def test_stop_settles_recovered_queued_turns_cancelled(store: Store) -> None:
    await _admit_then_kill(store, _events())
    await trio.sleep(0.01)
    agent = ScriptedAgent(gate=trio.Event())
    host = Host(agent=agent)
    async with _open(host, store, resume_accepted=True, **SUCCESSOR) as rt:
        with trio.fail_after(20):
            await agent.wait_started(2)  # m1 and m4; m2 and m3 wait in chat-1's queue
        assert rt.diagnostics().queued == 2
        await rt.stop()
    assert sorted(input_text(c.input) for c in agent.calls) == ["m1", "m4"]
    stored = await _ops(store)
    for key in "23":
        assert (stored[key]["state"], stored[key]["errorCode"]) == (
            "cancelled",
            "cancelled_at_shutdown",
        )
    assert stored["1"]["state"] == stored["4"]["state"] == "cancelled"
    assert all("input" not in v for v in stored.values())


async def test_foreign_owner_waits_for_dead_lease_then_resumes(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Difference 8: route 1's lease is still held by the dead A; a runtime with another
    owner keeps those records ``accepted`` (and runs chat-2 at once), then runs them in
    order after the lease TTL."""
    async with open_store("memory://", clock=TrioClock()) as store:
        await _admit_then_kill(store, _events())
        await trio.sleep(1)
        agent = _echo()
        host = Host(agent=agent)
        async with _open(host, store, resume_accepted=True, owner_id="runtime-b") as rt:
            await _wait(lambda: len(host.replies) == 1, within_s=10)
            assert host.texts == ["re m4"]
            assert rt.diagnostics().lease_losses >= 1
            stored = await _ops(store)
            assert [stored[k]["state"] for k in "123"] == ["accepted"] * 3
            await _wait(lambda: len(host.replies) == 4, within_s=300)
        assert _texts_by_chat(agent, CHAT_OF) == {"chat-1": list(CHAT1), "chat-2": ["m4"]}
        assert all("input" not in v for v in (await _ops(store)).values())


async def test_messages_admitted_in_one_millisecond_resume_in_their_order(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Seven messages of one route admitted within one (virtual) millisecond: their
    records tie on ``createdAtMs`` and their operation ids (hashes) sort otherwise, yet the
    restarted runtime runs them in the order they were admitted (the records' admission
    stamp, in microseconds)."""
    texts = [f"t{n}" for n in range(1, 8)]  # within max_pending_per_binding (8)
    events = [event(f"same-ms-{n}", text, chat="chat-1") for n, text in enumerate(texts)]
    async with open_store("memory://", clock=TrioClock()) as store:
        await _admit_then_kill(store, events)
        before = await _ops(store)
        assert len({v["createdAtMs"] for v in before.values()}) == 1
        by_hash = [
            v["input"]["text"]
            for _k, v in sorted(before.items(), key=lambda kv: kv[1]["operationId"])
        ]
        assert by_hash != texts  # what ordering by the id would have run
        stamps = [before[ev.event_id]["input"]["admittedUs"] for ev in events]
        assert stamps == sorted(stamps) and len(set(stamps)) == len(stamps)
        await trio.sleep(0.01)  # the restart: a later millisecond than the admissions
        agent = _echo()
        host = Host(agent=agent)
        async with _open(host, store, resume_accepted=True, **SUCCESSOR):
            await _wait(lambda: len(host.replies) == len(texts), within_s=60)
        assert [input_text(call.input) for call in agent.calls] == texts


E2E = AgentIdentity(
    tenant_id="e2e-tenant",
    user_id="e2e-user",
    principal=Principal("user", "e2e-user"),
    scopes=("chat",),
    issued_at_ms=0,
)


@pytest.mark.slow
async def test_sigkill_then_resume_sqlite(tmp_path: Path) -> None:
    """A real process admits m1–m3 (chat-1) and m4 (chat-2), is SIGKILLed before any
    claim; the restarted runtime (same owner, adopting its lease) runs each once."""
    filename = tmp_path / "resume.sqlite"
    env = dict(os.environ)
    env["PRISMD_WORKER_INPUT"] = json.dumps({"filename": str(filename)})
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "tests.runtime.resume_worker"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        buffer = b""
        with trio.fail_after(30):
            while b"READY" not in buffer:
                chunk = await proc.stdout.receive_some(4096)
                assert chunk, "worker exited before READY"
                buffer += chunk
    finally:
        proc.kill()
        with trio.fail_after(30):
            await proc.wait()
    async with open_store(f"sqlite:///{filename}") as store:
        before = await _ops(store)
        assert {v["input"]["text"] for v in before.values()} == {"m1", "m2", "m3", "m4"}
        agent = _echo()
        host = Host(
            agent=agent,
            grant_for=lambda _inp: Grant(
                identity=E2E, agent_aliases=("primary",), grant_revision="rev-1"
            ),
        )
        rt: Runtime
        with trio.fail_after(30):
            async with open_messaging_runtime(
                authorize=host.authorize,
                resolve_agent=host.resolve_agent,
                deliver=host.deliver,
                store=store,
                owner_id="resume-owner",
                adopt_own_leases=True,
                resume_accepted=True,
            ) as rt:
                await _wait(lambda: len(host.replies) == 4, within_s=25)
                await rt.drain()
        assert _texts_by_chat(agent, CHAT_OF) == {"chat-1": list(CHAT1), "chat-2": ["m4"]}
        assert [host.authorize_calls[0].claims] == [{"platform": "telegram", "chatType": "private"}]
        after = await _ops(store)
        assert all(v["state"] == "succeeded" and "input" not in v for v in after.values())
        scope = ownership_from_identity(E2E)
        assert all(row["connectionId"] == "tg-e2e" for row in after.values()) and scope
