"""Shared fixtures for runtime tests: identities, grants, a recording host, store factories.

The common fixture of the behaviours list: connection ``tg-1``, chat ``chat-1``, actor
``user-1``, event id ``"1"``, text ``hello``; identity tenant ``tenant-1``/user ``user-1``;
grant aliases ``("primary",)``, revision ``rev-1``; ``deliver`` records replies.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from prismd.channel import (
    AttachmentRef,
    AuthorizeInput,
    Grant,
    InboundEvent,
    Preview,
    Reply,
    SendResult,
)
from prismd.identity import AgentIdentity, Principal
from prismd.limits import Limits
from prismd.runtime import ResolveAgentInput, Runtime, open_messaging_runtime
from stores import Store, open_store

from .scripted import ScriptedAgent

BASE_MS = 1_790_000_000_000


@attrs.frozen
class TrioClock:
    """Wall-clock milliseconds that follow Trio's (virtual) clock, so leases expire in
    ``autojump_clock`` time."""

    base_ms: int = BASE_MS

    def now_ms(self) -> int:
        try:
            return self.base_ms + int(trio.current_time() * 1000)
        except RuntimeError:
            return self.base_ms


def identity(
    user: str | None = "user-1",
    tenant: str = "tenant-1",
    account: str | None = None,
    revoked_at_ms: int | None = None,
) -> AgentIdentity:
    return AgentIdentity(
        tenant_id=tenant,
        account_id=account,
        user_id=user,
        principal=Principal("user", user or tenant),
        scopes=("chat",),
        issued_at_ms=0,
        revoked_at_ms=revoked_at_ms,
    )


def grant(
    ident: AgentIdentity | None = None,
    aliases: tuple[str, ...] = ("primary",),
    default: str | None = None,
    revision: str = "rev-1",
    notifications: bool = False,
) -> Grant:
    return Grant(
        identity=ident or identity(),
        agent_aliases=aliases,
        grant_revision=revision,
        default_agent_alias=default,
        notifications=notifications,
    )


def event(
    event_id: str = "1",
    text: str = "hello",
    *,
    conn: str = "tg-1",
    chat: str = "chat-1",
    actor: str = "user-1",
    thread: str | None = None,
    attachments: tuple[AttachmentRef, ...] = (),
    claims: dict[str, Any] | None = None,
    approval: Any = None,
) -> InboundEvent:
    return InboundEvent(
        connection_id=conn,
        external_conversation_id=chat,
        external_actor_id=actor,
        event_id=event_id,
        text=text,
        attachments=attachments,
        thread_id=thread,
        claims=claims or {},
        approval=approval,
    )


@attrs.define(eq=False)
class Host:
    """The host side: authorize, resolve_agent and deliver, all recording."""

    agent: ScriptedAgent = attrs.field(factory=ScriptedAgent)
    grant_for: Callable[[AuthorizeInput], Grant | None] = attrs.field(default=lambda _inp: grant())
    agents: dict[str, ScriptedAgent] = attrs.field(factory=dict)
    deliver_result: Callable[[Reply], SendResult] | None = None
    deliveries: list[Reply] = attrs.field(factory=list)
    authorize_calls: list[AuthorizeInput] = attrs.field(factory=list)
    resolved: list[ResolveAgentInput] = attrs.field(factory=list)
    previews: list[Preview] = attrs.field(factory=list)
    delivered: trio.Event = attrs.field(factory=trio.Event)

    async def authorize(self, inp: AuthorizeInput) -> Grant | None:
        self.authorize_calls.append(inp)
        return self.grant_for(inp)

    async def resolve_agent(self, inp: ResolveAgentInput) -> ScriptedAgent:
        self.resolved.append(inp)
        return self.agents.get(inp.agent_alias, self.agent)

    async def deliver(self, reply: Reply) -> SendResult:
        self.deliveries.append(reply)
        self.delivered.set()
        if self.deliver_result is not None:
            return self.deliver_result(reply)
        return SendResult(delivered=True, message_id=str(len(self.deliveries)))

    def on_preview(self, preview: Preview) -> None:
        self.previews.append(preview)

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.deliveries]


@asynccontextmanager
async def runtime(host: Host, store: Store | None = None, **kwargs: Any) -> AsyncIterator[Runtime]:
    kwargs.setdefault("limits", Limits())
    async with open_messaging_runtime(
        authorize=host.authorize,
        resolve_agent=host.resolve_agent,
        deliver=host.deliver,
        store=store,
        on_preview=host.on_preview,
        **kwargs,
    ) as rt:
        yield rt


StoreFactory = Callable[[], Awaitable[Store]]


@asynccontextmanager
async def store_factory(
    kind: str, tmp_path: Path, clock: Any = None
) -> AsyncIterator[StoreFactory]:
    """A factory opening a store of ``kind`` (``memory`` or ``sqlite``); every call opens
    the *same* data (a "restart" reopens the file; memory is shared). Every store it opened
    is closed when the block ends."""
    options: dict[str, Any] = {} if clock is None else {"clock": clock}
    shared: list[Store] = []
    async with AsyncExitStack() as stack:

        async def open_one() -> Store:
            if kind == "memory":
                if not shared:
                    shared.append(
                        await stack.enter_async_context(open_store("memory://", **options))
                    )
                return shared[0]
            url = f"sqlite:///{tmp_path / 'journal.sqlite'}"
            return await stack.enter_async_context(open_store(url, **options))

        yield open_one
