"""A real child process for the resume-after-SIGKILL test (SPEC difference 8, issue 3).

Input: env ``PRISMD_WORKER_INPUT`` = JSON ``{"filename": "….sqlite"}``. It opens the SQLite
store, runs a runtime (owner ``resume-owner``) whose ``resolve_agent`` never returns (so no
turn is ever claimed), admits ``m1``, ``m2``, ``m3`` on ``chat-1`` and ``m4`` on ``chat-2``
(all answered ``accepted``: the transport would now be acknowledged), prints ``READY`` and
waits to be killed. Missing or invalid input → exit 2 before touching anything.

Run as ``python -m tests.runtime.resume_worker`` from the repository root.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import trio

from prismd.channel import InboundEvent, Reply, SendResult
from prismd.grants import AgentIdentity, AuthorizeInput, Grant, Principal
from prismd.runtime import ResolveAgentInput, open_messaging_runtime
from stores import open_store

IDENTITY = AgentIdentity(
    tenant_id="e2e-tenant",
    user_id="e2e-user",
    principal=Principal("user", "e2e-user"),
    scopes=("chat",),
    issued_at_ms=0,
)
OWNER = "resume-owner"
EVENTS = (("m1", "chat-1"), ("m2", "chat-1"), ("m3", "chat-1"), ("m4", "chat-2"))


def _filename() -> str:
    raw = os.environ.get("PRISMD_WORKER_INPUT")
    if not raw:
        raise SystemExit(2)
    try:
        data: Any = json.loads(raw)
    except ValueError:
        raise SystemExit(2) from None
    name = data.get("filename") if isinstance(data, dict) else None
    if not isinstance(name, str) or not name.endswith(".sqlite"):
        raise SystemExit(2)
    return name


async def main(filename: str) -> None:
    async with open_store(f"sqlite:///{filename}") as store:

        async def authorize(_inp: AuthorizeInput) -> Grant:
            return Grant(identity=IDENTITY, agent_aliases=("primary",), grant_revision="rev-1")

        async def resolve_agent(_inp: ResolveAgentInput) -> Any:
            await trio.sleep_forever()

        async def deliver(_reply: Reply) -> SendResult:
            return SendResult(delivered=True, message_id="1")

        async with open_messaging_runtime(
            authorize=authorize,
            resolve_agent=resolve_agent,
            deliver=deliver,
            store=store,
            owner_id=OWNER,
        ) as rt:
            for n, (text, chat) in enumerate(EVENTS, start=1):
                admission = await rt.admit(
                    InboundEvent(
                        connection_id="tg-e2e",
                        external_conversation_id=chat,
                        external_actor_id="actor-e2e",
                        event_id=f"ev-{n}",
                        text=text,
                        claims={"platform": "telegram", "chatType": "private"},
                    )
                )
                if admission.status != "accepted":
                    raise RuntimeError("event was not accepted")
            print("READY", flush=True)
            await trio.sleep_forever()


if __name__ == "__main__":
    trio.run(main, _filename())
    sys.exit(0)
