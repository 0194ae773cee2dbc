"""A real child process for the SIGTERM/SIGKILL restart tests (behaviours 117, 119–120, 181–186).

Input: env ``PRISMD_WORKER_INPUT`` = JSON ``{"filename": "….sqlite", "connectionId",
"eventId", "chat", "actor"}``. It opens the SQLite store, runs a runtime whose agent never
finishes, admits one event (text ``hello``), waits until ``list_unresolved`` shows it
``executing``, installs its SIGTERM handler, prints ``STATE {"operationId", "version"}``
and waits. SIGTERM → ``runtime.stop()``, close the store, print ``STOPPED``, exit 0.
Missing or invalid input → exit 2 before touching anything.

Run as ``python -m tests.runtime.restart_worker`` from the repository root.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from typing import Any

import trio

from prismd.channel import InboundEvent, Reply, SendResult
from prismd.grants import AgentIdentity, AuthorizeInput, Grant, Principal
from prismd.runtime import ResolveAgentInput, open_messaging_runtime
from stores import open_store
from tests.support.scripted import ScriptedAgent

IDENTITY = AgentIdentity(
    tenant_id="e2e-tenant",
    user_id="e2e-user",
    principal=Principal("user", "e2e-user"),
    scopes=("chat",),
    issued_at_ms=0,
)


def _input() -> dict[str, str]:
    raw = os.environ.get("PRISMD_WORKER_INPUT")
    if not raw:
        raise SystemExit(2)
    try:
        data: Any = json.loads(raw)
    except ValueError:
        raise SystemExit(2) from None
    keys = ("filename", "connectionId", "eventId", "chat", "actor")
    if not isinstance(data, dict) or not all(
        isinstance(data.get(k), str) and data[k] for k in keys
    ):
        raise SystemExit(2)
    if not data["filename"].endswith(".sqlite"):
        raise SystemExit(2)
    return {k: data[k] for k in keys}


async def main(params: dict[str, str]) -> None:
    async with open_store(f"sqlite:///{params['filename']}") as store:
        agent = ScriptedAgent(wait_for_cancel=True)

        async def authorize(_inp: AuthorizeInput) -> Grant:
            return Grant(identity=IDENTITY, agent_aliases=("primary",), grant_revision="rev-1")

        async def resolve_agent(_inp: ResolveAgentInput) -> ScriptedAgent:
            return agent

        async def deliver(_reply: Reply) -> SendResult:
            return SendResult(delivered=True, message_id="1")

        with trio.open_signal_receiver(signal.SIGTERM) as signals:
            async with open_messaging_runtime(
                authorize=authorize, resolve_agent=resolve_agent, deliver=deliver, store=store
            ) as rt:
                admission = await rt.admit(
                    InboundEvent(
                        connection_id=params["connectionId"],
                        external_conversation_id=params["chat"],
                        external_actor_id=params["actor"],
                        event_id=params["eventId"],
                        text="hello",
                    )
                )
                if admission.status != "accepted":
                    raise RuntimeError("event was not accepted")
                for _ in range(200):
                    listed = await rt.list_unresolved(identity=IDENTITY)
                    if listed and listed[0].state == "executing":
                        break
                    await trio.sleep(0.005)
                else:
                    raise RuntimeError("never claimed")
                state = {"operationId": listed[0].operation_id, "version": listed[0].version}
                print("STATE " + json.dumps(state), flush=True)
                async for _signum in signals:
                    break
                await rt.stop()
    print("STOPPED", flush=True)


if __name__ == "__main__":
    trio.run(main, _input())
    sys.exit(0)
