"""The fake signal-cli + the Signal adapter + the real runtime (behaviour 159 end to end),
approval lines answered with ``/approve TOKEN``, and two adapters on one SQLite journal."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from trio.testing import MockClock

from adapters.signal import SignalAdapter
from prismd.agents._base import AgentContext
from prismd.agents.registry import build_agent
from prismd.channel import Reply, SendResult
from prismd.grants import AgentIdentity, AuthorizeInput, Grant, Principal
from prismd.limits import Limits
from prismd.runtime import ResolveAgentInput, Runtime, open_messaging_runtime
from stores import Store, open_store
from tests.fakes.signal_cli import SENDER_UUID, FakeSignalCli, text_envelope
from tests.support.clocks import TrioClock
from tests.support.waiting import wait_until


async def authorize(inp: AuthorizeInput) -> Grant:
    identity = AgentIdentity(
        tenant_id="default",
        account_id=inp.connection_id,
        user_id=inp.external_actor_id,
        principal=Principal("user", inp.external_actor_id),
        scopes=("chat",),
        issued_at_ms=0,
    )
    return Grant(identity=identity, agent_aliases=("primary",), grant_revision="r1")


@asynccontextmanager
async def stack(
    store: Store, make_adapter: Any, kind: str = "echo", **options: Any
) -> AsyncIterator[tuple[SignalAdapter, Runtime]]:
    agent = build_agent(
        kind,
        AgentContext(
            alias="primary", options=options, checkpoints=store.checkpoints, clock=TrioClock()
        ),
    )
    adapters: dict[str, SignalAdapter] = {}

    async def resolve_agent(_inp: ResolveAgentInput) -> Any:
        return agent

    async def deliver(reply: Reply) -> SendResult:
        return await adapters[reply.connection_id].send(reply)

    async with open_messaging_runtime(
        authorize=authorize,
        resolve_agent=resolve_agent,
        deliver=deliver,
        store=store,
        limits=Limits(),
        clock=TrioClock(),
        owner_id="daemon-a",
    ) as runtime:
        adapter = make_adapter(admit=runtime.admit, store=store)
        adapters[adapter.connection_id] = adapter
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            yield adapter, runtime
            nursery.cancel_scope.cancel()


async def test_159_a_direct_text_is_answered_with_one_send(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any, store: Store
) -> None:
    with trio.fail_after(60):
        async with stack(store, make_adapter) as (adapter, runtime):
            fake.push(text_envelope("final answer"))
            await fake.wait_until(lambda: bool(fake.sends))
            fake.push(text_envelope("final answer"))  # redelivered: a duplicate, not a second run
            await trio.sleep(10)
            assert runtime.diagnostics().duplicates == 1
            assert adapter.capabilities["acknowledgement"] == "none"
    assert [r["params"] for _c, r in fake.requests_for("send")] == [
        {"recipient": [SENDER_UUID], "message": "final answer"}
    ]


async def test_approval_lines_are_answered_with_approve_commands(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any, store: Store
) -> None:
    with trio.fail_after(600):
        async with stack(store, make_adapter, "mock", suspend_for_tool="shell") as (
            _adapter,
            runtime,
        ):
            fake.push(text_envelope("run it"))
            await fake.wait_until(lambda: bool(fake.sends))
            notice = fake.sends[0]["message"]
            match = re.search(r"Reply /approve ([A-Za-z0-9_-]{43}) to allow once\.", notice)
            assert match is not None and "Reply /deny " in notice and "shell" in notice
            # Answered at once: the runtime waits for the turn that asked to finish writing.
            fake.push(text_envelope(f"/approve {match.group(1)}", timestamp=2))
            await fake.wait_until(lambda: len(fake.sends) == 2)
            assert runtime.diagnostics().suspended == 1
    assert fake.sends[1] == {"recipient": [SENDER_UUID], "message": "mock: run it"}


@pytest.mark.slow
async def test_two_adapters_on_one_sqlite_journal_one_receives(
    fake: FakeSignalCli, make_adapter: Any, tmp_path: Path
) -> None:
    """Two daemons' adapters (different owner ids) on one SQLite file: one subscribes, the
    other stands by; when the first stops, the second takes over within a third of the TTL."""
    url = "sqlite:///" + str(tmp_path / "journal.sqlite")
    with trio.fail_after(30):
        async with (
            open_store(url) as first_store,
            open_store(url) as second_store,
            trio.open_nursery() as nursery,
        ):
            first = make_adapter(store=first_store, owner_id="daemon-a", lease_ttl_ms=6000)
            second = make_adapter(store=second_store, owner_id="daemon-b", lease_ttl_ms=6000)
            stop_first = trio.CancelScope()

            async def run_first(
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
            ) -> None:
                with stop_first:
                    await first.run(task_status=task_status)

            await nursery.start(run_first)
            await nursery.start(second.run)
            assert (first.health()["state"], second.health()["state"]) == ("receiving", "standby")
            await trio.sleep(3)  # B keeps trying (every 2 s at most) and stays standing by
            assert len(fake.subscribe_log) == 1
            stop_first.cancel()
            await wait_until(lambda: second.health()["subscription"] == "active")
            assert fake.max_concurrent_subscriptions == 1
            nursery.cancel_scope.cancel()
