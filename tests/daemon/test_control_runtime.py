"""The control socket and prismctl against the REAL messaging runtime on a memory store."""

from __future__ import annotations

import json
import os
import shlex
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from prismd.agents._base import AgentContext
from prismd.agents.registry import build_agent
from prismd.channel import InboundEvent, Reply, SendResult
from prismd.control import ControlConfig, Operator
from prismd.control._methods import ControlHandler, pairing_aliases_from_grants
from prismd.control._server import serve_control
from prismd.daemon._config import GrantConfig
from prismd.grants import GrantAuthorizer
from prismd.journal import NS_OPERATION
from prismd.journal._access import GrantStore
from prismd.journal._journal import NS_CONTROL, ChannelJournal
from prismd.journal._records import OperationRecord
from prismd.runtime import open_messaging_runtime
from stores import OwnershipScope
from stores.memory import MemoryStore
from tests.support.builders import write

from .test_control_support import connect

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser

DEADLINE = 20
PRISMCTL = [sys.executable, "-m", "prismd.cli.prismctl"]
GRANTS = (
    GrantConfig(connection="web", actors=("*",), aliases=("echo",), notifications=True),
    GrantConfig(connection="tg", pairing=True, aliases=("echo",)),
    # Everyone may chat here, but operators may not push notices.
    GrantConfig(connection="quiet", actors=("*",), aliases=("echo",)),
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
    tmp_path: Path, *, operators: tuple[Operator, ...] = (), store: MemoryStore | None = None
) -> AsyncIterator[tuple[Any, Delivered, ControlConfig]]:
    store = store if store is not None else MemoryStore()
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
                    "prismd.cli.prismctl",
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
            calls: list[tuple[str, dict[str, object], str]] = [
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
            health = await client.result("health")
            assert {health.pop(k) is not None for k in ("version", "startedAt", "uptimeMs")} == {
                True
            }
            assert health == {"status": "ok"}


async def prismctl(*args: str) -> tuple[int, str, str]:
    result = await trio.run_process(
        [*PRISMCTL, *args], capture_stdout=True, capture_stderr=True, check=False
    )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


async def chat(runtime: Any, connection: str, conversation: str, actor: str) -> None:
    """One message from ``actor``, answered, so the conversation is bound to the agent."""
    admission = await runtime.admit(
        InboundEvent(
            connection_id=connection,
            external_conversation_id=conversation,
            external_actor_id=actor,
            event_id=f"{connection}-{conversation}-1",
            text="hello",
        )
    )
    assert admission.status == "accepted", admission
    assert (await runtime.drain(deadline_ms=5000)).settled


async def test_notify_refusals_name_the_missing_grant(tmp_path: Path) -> None:
    """A notify the grants do not allow was "status denied, reason rejected" and nothing
    else; now the operator is told which [[grants]] entry is missing, or that the
    conversation is not bound. The notice text never appears in any answer."""
    text = "the notice text itself 4711"
    with trio.fail_after(DEADLINE):
        async with daemon_parts(tmp_path) as (runtime, delivered, config):
            await chat(runtime, "quiet", "chat-q", "u1")
            base = ["--socket", config.socket, "notify", "--id", "n-1", "--text", text]
            code, out, err = await prismctl(
                *base, "--connection", "quiet", "--conversation", "chat-q"
            )
            assert code == 1
            rows = [line.split(maxsplit=1) for line in out.splitlines()]
            assert ["status", "denied"] in rows and ["reason", "rejected"] in rows
            assert "hint" not in out  # printed as advice, below
            assert err == (
                "prismctl: no [[grants]] entry for connection 'quiet' with notifications = true"
                " for actor 'u1'\n"
            )
            code, out, err = await prismctl(
                "--json", *base, "--connection", "quiet", "--conversation", "chat-q"
            )
            assert (code, err) == (1, "")
            answer = json.loads(out)
            # The contract's fields are all there; the hint is one more key.
            assert answer == {
                "status": "denied",
                "reason": "rejected",
                "operationId": None,
                "duplicate": False,
                "hint": "no [[grants]] entry for connection 'quiet' with notifications = true"
                " for actor 'u1'",
            }

            code, _, err = await prismctl(*base, "--connection", "web", "--conversation", "nobody")
            assert code == 1
            assert err == (
                "prismctl: no conversation 'nobody' on connection 'web' is bound to an agent in"
                " your scope (a conversation is bound once its user has written to the agent)\n"
            )
            assert all(text not in r.text for r in delivered.replies)

            # The grant allows it: accepted, and no hint key at all.
            await chat(runtime, "web", "chat-w", "u2")
            code, out, err = await prismctl(
                "--json", *base, "--connection", "web", "--conversation", "chat-w"
            )
            assert (code, err) == (0, "")
            assert set(json.loads(out)) == {"status", "reason", "operationId", "duplicate"}
            assert delivered.replies[-1].text == text


async def test_pair_refusals_name_the_grant_and_the_ttl_maximum(tmp_path: Path) -> None:
    """``pair`` on a connection without a pairing grant named ``aliases`` (-32602); a TTL
    above 5 minutes was clamped silently. Both are now refused, saying why."""
    store = MemoryStore()
    with trio.fail_after(DEADLINE):
        async with daemon_parts(tmp_path, store=store) as (_runtime, _delivered, config):
            code, out, err = await prismctl(
                "--socket", config.socket, "pair", "--connection", "web"
            )
            assert (code, out) == (1, "")
            assert err == (
                "prismctl: pairing unavailable: "
                "no [[grants]] entry for connection 'web' with pairing = true\n"
            )
            code, out, err = await prismctl(
                "--socket", config.socket, "pair", "--connection", "tg", "--ttl-ms", "300001"
            )
            assert (code, out) == (2, "")
            assert err.startswith("usage: prismctl pair")
            assert "--ttl-ms: 300001 is outside 1000..300000" in err and "5 minutes" in err

            async with connect(config.socket) as client:
                for ttl in (300_001, 999, 2**31):
                    answer = await client.call("pair", {"connectionId": "tg", "ttlMs": ttl})
                    assert answer["error"] == {
                        "code": -32602,
                        "message": "param 'ttlMs' must be an integer between 1000 and 300000"
                        " (milliseconds; at most 5 minutes)",
                    }
                answer = await client.call("pair", {"connectionId": "web", "aliases": ["echo"]})
                assert answer["error"]["message"] == (
                    "pairing unavailable: "
                    "no [[grants]] entry for connection 'web' with pairing = true"
                )
            page = await store.checkpoints.list_checkpoints(namespace=NS_CONTROL)
            assert not page.items, "no refused request issued a token"

            code, out, err = await prismctl(
                "--socket", config.socket, "pair", "--connection", "tg", "--ttl-ms", "300000"
            )
            assert (code, err) == (0, "")
            assert out.startswith("token ")
            page = await store.checkpoints.list_checkpoints(namespace=NS_CONTROL)
            assert len(page.items) == 1
            record = page.items[0].value
            assert record["expiresAt"] - record["createdAt"] == 300_000


async def crashed_turn(store: MemoryStore) -> str:
    """An ``executing`` operation at version 2, as a daemon killed mid-run leaves it."""
    journal = ChannelJournal(store.checkpoints)
    scope = OwnershipScope("default", "web", "u1")
    record = OperationRecord(
        operation_id="chan-op-crashed",
        event_id="e-crashed",
        kind="message",
        connection_id="web",
        external_conversation_id="chat-1",
        external_actor_id="u1",
        agent_alias="echo",
        state="accepted",
        created_at_ms=1,
        updated_at_ms=1,
    )
    created = await write(journal, NS_OPERATION, scope, record)
    assert created is not None and created.version == 1
    running = attrs.evolve(record, state="executing", run_id="run-1", updated_at_ms=2)
    saved = await write(journal, NS_OPERATION, scope, running, 1)
    assert saved is not None and saved.version == 2
    return record.operation_id


async def test_reconcile_refusals_print_the_command_to_retry_with(tmp_path: Path) -> None:
    """A stale ``--version`` printed only "status conflict"; a missing acknowledgement
    printed the same. Now prismctl prints the current version and the exact command, and
    following its advice settles the operation."""
    store = MemoryStore()
    op = await crashed_turn(store)
    with trio.fail_after(DEADLINE):
        async with daemon_parts(tmp_path, store=store) as (_runtime, _delivered, config):
            code, out, _ = await prismctl("--socket", config.socket, "list-unresolved")
            assert code == 0 and out.splitlines()[1].split()[:5] == [
                op, "web", "executing", "-", "2"
            ]  # fmt: skip

            code, out, err = await prismctl(
                "--socket", config.socket, "reconcile", op, "--connection", "web", "--version", "1"
            )
            assert code == 1
            rows = [line.split() for line in out.splitlines()]
            assert ["status", "conflict"] in rows and ["currentVersion", "2"] in rows
            retry = f"prismctl --socket {config.socket} reconcile {op} --connection web --version 2"
            assert err == (
                f"prismctl: version 1 is stale: {op} is at version 2 now (state executing);"
                f" check it with 'prismctl list-unresolved', then retry:\n  {retry}\n"
            )

            code, out, err = await prismctl(*shlex.split(retry)[1:])  # exactly as advised
            assert code == 1
            assert ["detail", "duplicate_risk"] in [line.split() for line in out.splitlines()]
            advised = err.splitlines()[-1]
            assert err == (
                f"prismctl: {op} is executing: the agent may have run already; to settle it as"
                " execution_unknown (it is never re-run), add --acknowledge-duplicate-risk:\n"
                f"  {retry} --acknowledge-duplicate-risk\n"
            )

            code, out, err = await prismctl("--json", *shlex.split(retry)[1:])
            assert (code, err) == (1, "")
            assert json.loads(out) == {
                "status": "conflict",
                "outcome": None,
                "state": "executing",
                "detail": "duplicate_risk",
                "currentVersion": 2,
                "hint": "the agent may have run already: pass acknowledgeDuplicateRisk: true to"
                " settle it as execution_unknown (it is never re-run)",
            }

            code, out, err = await prismctl(*shlex.split(advised)[1:])
            assert (code, err) == (0, "")
            rows = [line.split() for line in out.splitlines()]
            assert ["status", "resolved"] in rows and ["outcome", "execution_unknown"] in rows
            assert "currentVersion" not in out and "hint" not in out


async def test_reconcile_outside_the_scope_reveals_no_version(tmp_path: Path) -> None:
    """An operator of another tenant guessing the id and a version learns nothing: the
    same ``not_found`` as for an id that does not exist, with no current version."""
    store = MemoryStore()
    op = await crashed_turn(store)
    operators = (Operator(uid=os.getuid(), tenant="someone-else"),)
    with trio.fail_after(DEADLINE):
        async with daemon_parts(tmp_path, operators=operators, store=store) as (_, _d, config):
            answers = []
            for operation in (op, "chan-op-never-existed"):
                args = ["reconcile", operation, "--connection", "web", "--version", "1"]
                code, out, err = await prismctl("--socket", config.socket, "--json", *args)
                assert code == 1
                answer = json.loads(out)
                assert answer.pop("hint") == (
                    "no such operation on this connection in your scope (see listUnresolved)"
                )
                answers.append(answer)
                code, _, err = await prismctl("--socket", config.socket, *args)
                assert err == (
                    f"prismctl: no operation {operation} on connection web in your scope;"
                    " 'prismctl list-unresolved' shows the open ones\n"
                )
            assert answers[0] == answers[1] == {
                "status": "not_found", "outcome": None, "state": None, "detail": None
            }  # fmt: skip
