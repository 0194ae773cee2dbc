"""The control socket and prismctl against the REAL messaging runtime on a memory store."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from prismd.agents._base import AgentContext
from prismd.agents.registry import build_agent
from prismd.channel import InboundEvent, Reply, SendResult
from prismd.config import ControlConfig, GrantConfig, Operator
from prismd.control import ControlHandler, pairing_aliases_from_grants, serve_control
from prismd.controls import GrantStore
from prismd.grants import GrantAuthorizer
from prismd.runtime import open_messaging_runtime
from stores.memory import MemoryStore

from .test_control_support import connect

DEADLINE = 20
GRANTS = (
    GrantConfig(connection="web", actors=("*",), aliases=("echo",), notifications=True),
    GrantConfig(connection="tg", pairing=True, aliases=("echo",)),
)


@attrs.define(eq=False)
class Delivered:
    replies: list[Reply] = attrs.field(factory=list)

    async def deliver(self, reply: Reply) -> SendResult:
        await trio.lowlevel.checkpoint()
        self.replies.append(reply)
        return SendResult(delivered=True, message_id=f"m{len(self.replies)}")


@asynccontextmanager
async def daemon_parts(
    tmp_path: Path, *, operators: tuple[Operator, ...] = ()
) -> AsyncIterator[tuple[Any, Delivered, ControlConfig]]:
    store = MemoryStore()
    echo = build_agent(
        "echo", AgentContext(alias="echo", options={}, checkpoints=store.checkpoints)
    )
    authorizer = GrantAuthorizer(GRANTS, load_paired=GrantStore(store.checkpoints).load)
    delivered = Delivered()

    async def resolve_agent(_request: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return echo

    config = ControlConfig(socket=str(tmp_path / "run" / "control.sock"), operators=operators)
    async with (
        open_messaging_runtime(
            authorize=authorizer.authorize,
            resolve_agent=resolve_agent,
            deliver=delivered.deliver,
            store=store,
            pairing_scope=authorizer.pairing_scope,
            on_paired=authorizer.on_paired,
        ) as runtime,
        trio.open_nursery() as nursery,
    ):
        handler = ControlHandler(
            runtime=runtime,
            store=store,
            health=lambda: {"status": "ok"},
            identity_for=authorizer.identity_for,
            pair_aliases=pairing_aliases_from_grants(GRANTS),
        )
        await nursery.start(
            lambda task_status: serve_control(
                config, handler=handler, daemon_uid=os.getuid(), task_status=task_status
            )
        )
        yield runtime, delivered, config
        nursery.cancel_scope.cancel()


async def test_operator_workflow_against_the_real_runtime(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with daemon_parts(tmp_path) as (runtime, delivered, config):
            admission = await runtime.admit(
                InboundEvent(
                    connection_id="web",
                    external_conversation_id="chat-1",
                    external_actor_id="u1",
                    event_id="e1",
                    text="hello",
                )
            )
            assert admission.status == "accepted"
            drained = await runtime.drain(deadline_ms=5000)
            assert drained.settled
            assert [r.text for r in delivered.replies] == ["hello"]

            async with connect(config.socket) as client:
                assert await client.result("listUnresolved") == []
                diagnostics = await client.result("diagnostics")
                assert diagnostics["admitted"] == 1
                assert diagnostics["completed"] == 1

                page = await client.result("events", {})
                assert page["events"], "the turn's journal writes are visible"
                assert all(e["scope"]["tenantId"] == "default" for e in page["events"])
                assert page["cursor"] == page["events"][-1]["seq"]

                outcome = await client.result(
                    "reconcile",
                    {"connectionId": "web", "operationId": "op-missing", "expectedVersion": 1},
                )
                assert outcome["status"] == "not_found"

                # The runtime answers notify with an admission; an operator scoped to the
                # tenant reaches the bound actor (SPEC difference 7), and an accepted notice
                # counts as admitted work in the diagnostics below.
                notice = await client.result(
                    "notify",
                    {
                        "connectionId": "web",
                        "externalConversationId": "chat-1",
                        "notifyId": "n-1",
                        "text": "maintenance at noon",
                    },
                )
                assert set(notice) == {"status", "reason", "operationId", "duplicate"}
                assert notice["status"] in ("accepted", "denied")
                admitted = 1 + (notice["status"] == "accepted")

                refused = await client.call("pair", {"connectionId": "web", "aliases": ["echo"]})
                assert refused["error"]["code"] == -32002
                assert refused["error"]["message"].startswith("pairing unavailable: ")
                ticket = await client.result("pair", {"connectionId": "tg", "ttlMs": 60_000})
                assert ticket["connectionId"] == "tg"
                assert len(ticket["token"]) >= 32
                assert ticket["expiresAt"].endswith("Z")

                pruned = await client.result("prune", {"now": "2100-01-01T00:00:00Z"})
                assert pruned["deleted"] >= 1
                assert set(pruned) == {"scanned", "deleted", "retained"}

            # prismctl as a subprocess against the same server.
            result = await trio.run_process(
                [
                    sys.executable,
                    "-m",
                    "prismd.ctl",
                    "--socket",
                    config.socket,
                    "--json",
                    "diagnostics",
                ],
                capture_stdout=True,
                check=False,
            )
            assert result.returncode == 0
            assert json.loads(result.stdout)["admitted"] == admitted


async def test_operator_scope_limits_events(tmp_path: Path) -> None:
    operators = (Operator(uid=os.getuid(), tenant="someone-else"),)
    with trio.fail_after(DEADLINE):
        async with daemon_parts(tmp_path, operators=operators) as (runtime, _delivered, config):
            await runtime.admit(
                InboundEvent(
                    connection_id="web",
                    external_conversation_id="chat-1",
                    external_actor_id="u1",
                    event_id="e1",
                    text="hello",
                )
            )
            assert (await runtime.drain(deadline_ms=5000)).settled
            async with connect(config.socket) as client:
                page = await client.result("events", {})
                assert page["events"] == []
                assert await client.result("listUnresolved") == []


async def test_lone_surrogates_in_params_are_invalid_params(tmp_path: Path) -> None:
    """``"\\ud800"`` is valid JSON but no store can hold it: a string param holding one is the
    caller's mistake (-32602 naming the param), not an internal error from deep in a store."""
    with trio.fail_after(DEADLINE):
        async with (
            daemon_parts(tmp_path) as (_runtime, _delivered, config),
            connect(config.socket) as client,
        ):
            calls = [
                ("reconcile", {"connectionId": "web", "operationId": "op-\ud800",
                               "expectedVersion": 1}, "operationId"),
                ("notify", {"connectionId": "web", "externalConversationId": "c\ud800",
                            "notifyId": "n-1", "text": "x"}, "externalConversationId"),
                ("notify", {"connectionId": "web", "externalConversationId": "chat-1",
                            "notifyId": "n-2", "text": "x\ud800"}, "text"),
                ("pair", {"connectionId": "tg\ud800", "aliases": ["echo"]}, "connectionId"),
                ("pair", {"connectionId": "tg", "aliases": ["e\ud800"]}, "aliases"),
            ]  # fmt: skip
            for method, params, name in calls:
                answer = await client.call(method, params)
                assert answer["error"]["code"] == -32602, (method, answer)
                assert name in answer["error"]["message"]
            assert await client.result("health") == {"status": "ok"}
