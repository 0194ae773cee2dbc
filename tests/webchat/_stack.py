"""A real messaging runtime (memory or SQLite store) behind a real web chat adapter on loopback."""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio

from adapters.webchat._adapter import WebchatAdapter
from prismd.agents._base import AgentContext
from prismd.agents.registry import build_agent
from prismd.channel import Preview, Reply, SendResult
from prismd.grants import AgentIdentity, AuthorizeInput, Grant, Principal
from prismd.limits import Limits
from prismd.runtime import ResolveAgentInput, Runtime, open_messaging_runtime
from stores import SYSTEM_CLOCK, Clock, open_store

OPERATOR = AgentIdentity(
    tenant_id="default",
    principal=Principal("operator", "test-operator"),
    scopes=("operator",),
    issued_at_ms=0,
)
"""Lists and settles every record of the stack's tenant (what ``prismctl`` acts as)."""


async def authorize_everyone(request: AuthorizeInput) -> Grant:
    """The default loopback web chat's ``actors = ["*"]``: everyone gets ``primary``,
    scoped to (default, connection, actor)."""
    await trio.lowlevel.checkpoint()
    identity = AgentIdentity(
        tenant_id="default",
        account_id=request.connection_id,
        user_id=request.external_actor_id,
        principal=Principal("user", request.external_actor_id),
        scopes=("chat",),
        issued_at_ms=0,
    )
    return Grant(
        identity=identity,
        agent_aliases=("primary",),
        grant_revision="rev-1",
        default_agent_alias="primary",
    )


def sqlite_url(directory: Path) -> str:
    return "sqlite:///" + str(directory / "journal.sqlite")


@asynccontextmanager
async def chat_stack(
    kind: str = "echo",
    options: Mapping[str, Any] | None = None,
    results: trio.MemorySendChannel[SendResult] | None = None,
    registry: dict[str, WebchatAdapter] | None = None,
    *,
    store_url: str = "memory://",
    clock: Clock = SYSTEM_CLOCK,
    limits: Limits | None = None,
    previews: bool = False,
    typing: bool = False,
    **adapter_kwargs: Any,
) -> AsyncIterator[tuple[WebchatAdapter, Runtime]]:
    """Everyone who reaches the socket is granted the ``primary`` agent (the default
    loopback web chat's ``actors = ["*"]``), scoped to (default, connection, actor).
    Every ``deliver`` result is sent to ``results`` when given. ``deliver`` routes by
    connection id through ``registry`` (when given), so a test can swap in a restarted adapter.

    The adapter is wired as the daemon wires it: resume tokens in the store's checkpoints,
    the runtime as its ``conversations``. ``store_url="sqlite:///…"`` makes everything
    survive the block, so a second ``chat_stack`` on the same file is a restarted daemon.
    ``previews=True`` streams previews to the adapter as the daemon does (``preview`` frames);
    ``typing=True`` hands it the runtime's typing calls as the daemon does (``typing`` frames).
    """
    async with open_store(store_url, clock=clock) as store:
        agent = build_agent(
            kind,
            AgentContext(
                alias="primary", options=dict(options or {}), checkpoints=store.checkpoints
            ),
        )
        adapters: dict[str, WebchatAdapter] = {} if registry is None else registry

        async def resolve_agent(request: ResolveAgentInput) -> Any:
            await trio.lowlevel.checkpoint()
            return agent

        async def deliver(reply: Reply) -> SendResult:
            result = await adapters[reply.connection_id].send(reply)
            if results is not None:
                await results.send(result)
            return result

        def preview(preview: Preview) -> None:
            # as the daemon's host routes previews: to the adapter of the connection
            adapter = adapters.get(preview.connection_id)
            if adapter is not None:
                adapter.send_draft(preview)

        def tells_unanswered(connection_id: str) -> bool:
            # as the daemon's host answers: as the connection's adapter declares
            adapter = adapters.get(connection_id)
            return adapter is not None and adapter.features.unanswered_notices

        async def on_typing(
            connection_id: str, external_conversation_id: str, thread: str | None
        ) -> None:
            # as the daemon's host routes typing: to the adapter of the connection
            adapter = adapters.get(connection_id)
            if adapter is not None and adapter.features.typing:
                await adapter.send_typing(external_conversation_id, thread)

        async with open_messaging_runtime(
            authorize=authorize_everyone,
            resolve_agent=resolve_agent,
            deliver=deliver,
            on_preview=preview if previews else None,
            on_typing=on_typing if typing else None,
            tells_unanswered=tells_unanswered,
            store=store,
            clock=clock,
            limits=limits or Limits(),
        ) as runtime:
            adapter_kwargs.setdefault("checkpoints", store.checkpoints)
            adapter_kwargs.setdefault("conversations", runtime)
            adapter_kwargs.setdefault("clock", clock)
            adapter = WebchatAdapter(
                connection_id="web", listen="127.0.0.1:0", admit=runtime.admit, **adapter_kwargs
            )
            adapters.setdefault("web", adapter)
            async with trio.open_nursery() as nursery:
                await nursery.start(adapter.run)
                yield adapter, runtime
                nursery.cancel_scope.cancel()
