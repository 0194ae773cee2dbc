"""End to end on a SQLite file (behaviours 111–117, 119–120), with a real child process
killed by SIGTERM and SIGKILL for the restart scenarios."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest
import trio

from prismd.grants import AgentIdentity, Principal
from prismd.journal._journal import ChannelJournal
from prismd.limits import Limits
from prismd.runtime.api import Diagnostics
from stores import OwnershipScope, open_store
from tests.support.builders import event, grant, identity
from tests.support.harness import Host, runtime
from tests.support.scripted import ScriptedAgent

REPO = Path(__file__).resolve().parents[2]
E2E = AgentIdentity(
    tenant_id="e2e-tenant",
    user_id="e2e-user",
    principal=Principal("user", "e2e-user"),
    scopes=("chat",),
    issued_at_ms=0,
)


def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'e2e.sqlite'}"


async def test_sqlite_turn_and_restart_dedup_b111_b112(tmp_path: Path) -> None:
    """Behaviours 111, 112: a turn on SQLite replies ``answer 1`` and diagnostics carry no
    text; reopened, the same event is a duplicate with nothing run or listed."""
    agent = ScriptedAgent(answer=lambda _t, n: f"answer {n}")
    host = Host(agent=agent)
    async with open_store(sqlite_url(tmp_path)) as store:
        async with runtime(host, store) as rt:
            assert (await rt.admit(event("1", "very private words"))).status == "accepted"
            assert (await rt.drain()).settled
            diag = json.dumps(attrs.asdict(rt.diagnostics()))
        assert host.texts == ["answer 1"] and "very private words" not in diag
    host2 = Host(agent=agent)
    async with open_store(sqlite_url(tmp_path)) as store, runtime(host2, store) as rt:
        again = await rt.admit(event("1", "very private words"))
        await rt.drain()
        assert again.duplicate
        assert await rt.list_unresolved(identity=identity()) == []
    assert agent.provider_calls == 1 and host2.replies == []


async def test_two_handles_lease_held_elsewhere_b113(tmp_path: Path) -> None:
    """Behaviour 113 (with SPEC difference 8): the second handle's runtime accepts event 2,
    delivers nothing while the owner runs, counts a lease loss and keeps the record."""
    async with (
        open_store(sqlite_url(tmp_path)) as owner_store,
        open_store(sqlite_url(tmp_path)) as other_store,
    ):
        agent = ScriptedAgent(wait_for_cancel=True)
        other = Host()
        async with runtime(Host(agent=agent), owner_store) as a:
            await a.admit(event("1"))
            await agent.wait_started(1)
            async with runtime(other, other_store) as b:
                result = await b.admit(event("2"))
                assert result.status == "accepted"
                await trio.sleep(0.3)
                assert b.diagnostics().lease_losses >= 1
                assert other.replies == []
                states = {e.state for e in await b.list_unresolved(identity=identity())}
                assert states == {"accepted", "executing"}
                await b.stop()
            await a.stop()
    assert other.scripted.provider_calls == 0


async def test_capacity_on_sqlite_b114(tmp_path: Path) -> None:
    """Behaviour 114: queue of one per binding, one route: 1, 2 accepted, 3 capacity."""
    gate = trio.Event()
    agent = ScriptedAgent(gate=gate)
    async with open_store(sqlite_url(tmp_path)) as store:
        limits = Limits(max_pending_per_binding=1, max_routes=1)
        async with runtime(Host(agent=agent), store, limits=limits) as rt:
            assert (await rt.admit(event("1"))).status == "accepted"
            await agent.wait_started(1)
            assert (await rt.admit(event("2"))).status == "accepted"
            third = await rt.admit(event("3"))
            assert (third.status, third.reason) == ("denied", "capacity")
            gate.set()
            await rt.drain()
    assert agent.provider_calls == 2


async def test_revoked_on_sqlite_journals_nothing_b115(tmp_path: Path) -> None:
    """Behaviour 115: a revoked grant is denied; nothing is journaled or listed."""
    async with open_store(sqlite_url(tmp_path)) as store:
        host = Host(grant_for=lambda _i: grant(identity(revoked_at_ms=1)))
        async with runtime(host, store) as rt:
            result = await rt.admit(event("1"))
            assert (result.status, result.reason) == ("denied", "revoked")
            assert (await rt.drain()).settled
            await rt.stop()
            assert await rt.list_unresolved(identity=identity()) == []
    assert host.scripted.provider_calls == 0


@pytest.mark.slow
async def test_duplicate_latency_b116(tmp_path: Path) -> None:
    """Behaviour 116: 20 re-admissions of a processed event are duplicates, p95 < 500 ms."""
    async with open_store(sqlite_url(tmp_path)) as store:
        host = Host()
        async with runtime(host, store) as rt:
            await rt.admit(event("1"))
            await rt.drain()
            latencies = []
            for _ in range(20):
                start = time.perf_counter()
                assert (await rt.admit(event("1"))).duplicate
                latencies.append(time.perf_counter() - start)
    latencies.sort()
    assert latencies[18] < 0.5
    assert host.scripted.provider_calls == 1


async def _start_worker(
    tmp_path: Path, event_id: str
) -> tuple[trio.Process, str, dict[str, int | str]]:
    env = dict(os.environ)
    env["PRISMD_WORKER_INPUT"] = json.dumps(
        {
            "filename": str(tmp_path / "e2e.sqlite"),
            "connectionId": "tg-e2e",
            "eventId": event_id,
            "chat": "chat-e2e",
            "actor": "actor-e2e",
        }
    )
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "tests.runtime.restart_worker"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    buffer = b""
    with trio.fail_after(30):
        while b"\n" not in buffer:
            chunk = await proc.stdout.receive_some(4096)
            assert chunk, "worker exited before STATE"
            buffer += chunk
    line, _, rest = buffer.partition(b"\n")
    assert line.startswith(b"STATE ")
    return proc, rest.decode(), json.loads(line[6:])


async def _read_rest(proc: trio.Process, already: str) -> str:
    assert proc.stdout is not None
    out = already.encode()
    with trio.fail_after(30):
        while True:
            chunk = await proc.stdout.receive_some(4096)
            if not chunk:
                break
            out += chunk
        await proc.wait()
    return out.decode()


@pytest.mark.slow
async def test_sigterm_settles_claimed_work_cancelled_b117(tmp_path: Path) -> None:
    """Behaviour 117: SIGTERM after the claim → STOPPED, exit 0, the op ``cancelled``,
    nothing unresolved."""
    proc, rest, state = await _start_worker(tmp_path, "e2e-1")
    proc.send_signal(signal.SIGTERM)
    out = await _read_rest(proc, rest)
    assert proc.returncode == 0 and "STOPPED" in out
    async with open_store(sqlite_url(tmp_path)) as store:
        scope = OwnershipScope("e2e-tenant", None, "e2e-user")
        loaded = await ChannelJournal(store.checkpoints).load_operation(
            scope, "tg-e2e", str(state["operationId"])
        )
        assert loaded is not None and loaded.record.state in ("cancelled", "failed")
        async with runtime(Host(), store) as rt:
            assert await rt.list_unresolved(identity=E2E) == []


@pytest.mark.slow
async def test_sigkill_leaves_executing_reconcilable_never_rerun_b119_b120(
    tmp_path: Path,
) -> None:
    """Behaviours 119, 120 (and the issue's restart scenario): SIGKILL after the claim
    leaves the op ``executing``; a restarted runtime lists it, reconciles it to
    ``execution_unknown`` and treats the event as a duplicate — no agent run."""
    proc, _rest, state = await _start_worker(tmp_path, "e2e-2")
    proc.kill()
    with trio.fail_after(30):
        await proc.wait()
    agent = ScriptedAgent()
    async with open_store(sqlite_url(tmp_path)) as store:
        host = Host(agent=agent, grant_for=lambda _i: grant(E2E))
        async with runtime(host, store) as rt:
            listed = await rt.list_unresolved(identity=E2E)
            assert [(e.operation_id, e.state) for e in listed] == [
                (state["operationId"], "executing")
            ]
            result = await rt.reconcile(
                identity=E2E,
                connection_id="tg-e2e",
                operation_id=listed[0].operation_id,
                expected_version=listed[0].version,
                acknowledge_duplicate_risk=True,
            )
            assert (result.status, result.outcome) == ("resolved", "execution_unknown")
            settled = await ChannelJournal(store.checkpoints).load_operation(
                OwnershipScope("e2e-tenant", None, "e2e-user"),
                "tg-e2e",
                listed[0].operation_id,
            )
            # Claimed exactly once (by the killed child), never re-run after the restart.
            assert settled is not None and settled.record.attempts == 1
            assert settled.record.state == "execution_unknown"
            again = await rt.admit(
                event("e2e-2", conn="tg-e2e", chat="chat-e2e", actor="actor-e2e")
            )
            assert again.duplicate
            assert await rt.list_unresolved(identity=E2E) == []
    assert agent.provider_calls == 0


@pytest.mark.slow
async def test_worker_refuses_bad_input_b181() -> None:
    """The worker exits non-zero before doing anything when its input is missing/invalid."""
    for value in (None, "{", json.dumps({"filename": "x.txt"})):
        env = dict(os.environ)
        env.pop("PRISMD_WORKER_INPUT", None)
        if value is not None:
            env["PRISMD_WORKER_INPUT"] = value
        with trio.fail_after(30):
            done = await trio.run_process(
                [sys.executable, "-m", "tests.runtime.restart_worker"],
                cwd=REPO,
                env=env,
                check=False,
                capture_stdout=True,
                capture_stderr=True,
            )
        assert done.returncode != 0 and b"STATE" not in done.stdout


def test_diagnostics_names_are_the_fifteen_counters() -> None:
    assert len(attrs.fields(Diagnostics)) == 15


@pytest.mark.slow
async def test_two_handles_same_event_runs_once_and_deferred_turn_completes(
    tmp_path: Path,
) -> None:
    """Two runtimes on two handles of one SQLite file: the same event admitted on both
    runs once (the loser is a duplicate); B's turn for the busy binding waits for A's
    lease and then runs exactly once (SPEC difference 8 on SQLite)."""
    async with (
        open_store(sqlite_url(tmp_path)) as store_a,
        open_store(sqlite_url(tmp_path)) as store_b,
    ):
        gate = trio.Event()
        agent_a = ScriptedAgent(gate=gate, answer="from A")
        agent_b = ScriptedAgent(answer="from B")
        host_a, host_b = Host(agent=agent_a), Host(agent=agent_b)
        async with runtime(host_a, store_a) as a, runtime(host_b, store_b) as b:
            first = await a.admit(event("1"))
            same = await b.admit(event("1"))
            assert first.status == "accepted" and not first.duplicate and same.duplicate
            await agent_a.wait_started(1)
            assert (await b.admit(event("2"))).status == "accepted"
            await trio.sleep(0.2)
            assert host_b.replies == []
            gate.set()
            with trio.fail_after(20):
                await a.drain()
                await b.drain()
            assert await b.list_unresolved(identity=identity()) == []
    assert (agent_a.provider_calls, agent_b.provider_calls) == (1, 1)
    assert host_a.texts == ["from A"] and host_b.texts == ["from B"]
