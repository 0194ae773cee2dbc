"""A runtime harness for the approval, notify and media tests (tests/runtime/test_*.py).

The common fixtures of the behaviours list: connection ``tg-1``, chat ``chat-1``, actor
``user-1``, identity tenant ``tenant-1`` / user ``user-1`` / principal ``user:user-1``, grant
aliases ``("primary",)`` revision ``rev-1``; ``deliver`` records replies and answers
``delivered``. "Restart" = a second harness on the same store.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from prismd.agents._base import (
    Agent,
    EventSink,
    RunRequest,
    RunResult,
    RunState,
    StreamEvent,
)
from prismd.channel import (
    ApprovalInput,
    AttachmentRef,
    AuthorizeInput,
    Grant,
    InboundEvent,
    Preview,
    Reply,
    SendResult,
)
from prismd.identity import AgentIdentity, Principal
from stores.memory import MemoryStore

from .conftest import ManualClock

SECRET = "sk-SECRET-VALUE-123"


def identity_for(
    user: str = "user-1", tenant: str = "tenant-1", *, revoked_at_ms: int | None = None
) -> AgentIdentity:
    return AgentIdentity(
        tenant_id=tenant,
        principal=Principal("user", user),
        scopes=("chat",),
        issued_at_ms=0,
        user_id=user,
        revoked_at_ms=revoked_at_ms,
    )


IDENTITY = identity_for()


def grant_for(
    identity: AgentIdentity = IDENTITY,
    aliases: tuple[str, ...] = ("primary",),
    *,
    notifications: bool = False,
    revision: str = "rev-1",
    default_alias: str | None = None,
) -> Grant:
    return Grant(
        identity=identity,
        agent_aliases=aliases,
        grant_revision=revision,
        default_agent_alias=default_alias,
        notifications=notifications,
    )


def event(
    event_id: str = "1",
    text: str = "hello",
    *,
    actor: str = "user-1",
    chat: str = "chat-1",
    connection: str = "tg-1",
    thread: str | None = None,
    approval: tuple[str, str] | None = None,
    attachments: tuple[AttachmentRef, ...] = (),
) -> InboundEvent:
    return InboundEvent(
        connection_id=connection,
        external_conversation_id=chat,
        external_actor_id=actor,
        event_id=event_id,
        text=text,
        thread_id=thread,
        approval=None if approval is None else ApprovalInput(approval[0], approval[1]),  # type: ignore[arg-type]
        attachments=attachments,
    )


class ExactRedactor:
    """Replaces each secret with ``[REDACTED]`` (the behaviours list's redactor)."""

    def __init__(self, *secrets: str) -> None:
        self.secrets = secrets

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "[REDACTED]")
        return text


@attrs.define(eq=False)
class Harness:
    """One runtime over a store, recording everything the host sees."""

    store: MemoryStore
    clock: ManualClock
    agents: dict[str, Agent]
    grants: dict[str, Grant | None]
    """Grant by actor id; a missing actor falls back to ``default_grant``."""
    default_grant: Grant | None
    runtime: Any = None
    replies: list[Reply] = attrs.field(factory=list)
    previews: list[Preview] = attrs.field(factory=list)
    authorize_calls: list[AuthorizeInput] = attrs.field(factory=list)
    resolve_calls: list[str] = attrs.field(factory=list)
    deliver_hook: Callable[[Reply], SendResult | None] | None = None
    """When set and it returns a result, ``deliver`` answers that (the reply is still recorded)."""

    async def authorize(self, request: AuthorizeInput) -> Grant | None:
        self.authorize_calls.append(request)
        return self.grants.get(request.external_actor_id, self.default_grant)

    async def resolve_agent(self, request: Any) -> Agent:
        self.resolve_calls.append(request.agent_alias)
        return self.agents[request.agent_alias]

    async def deliver(self, reply: Reply) -> SendResult:
        self.replies.append(reply)
        if self.deliver_hook is not None:
            result = self.deliver_hook(reply)
            if result is not None:
                return result
        return SendResult(True, message_id=str(len(self.replies)))

    def on_preview(self, preview: Preview) -> None:
        self.previews.append(preview)

    @property
    def actions(self) -> list[str]:
        return [c.action for c in self.authorize_calls]

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.replies]

    def last(self) -> Reply:
        assert self.replies, "nothing was delivered"
        return self.replies[-1]

    async def settle(self) -> None:
        """Wait until every queued turn, resume and notice has finished."""
        with trio.fail_after(120):
            result = await self.runtime.drain(deadline_ms=60_000)
        assert result.settled, result


@asynccontextmanager
async def open_harness(
    store: MemoryStore,
    clock: ManualClock,
    agents: Mapping[str, Agent],
    *,
    grant: Grant | None = None,
    grants: Mapping[str, Grant | None] | None = None,
    use_journal: bool = True,
    fetch_attachment: Callable[[AttachmentRef], Awaitable[Any]] | None = None,
    **kwargs: Any,
) -> AsyncIterator[Harness]:
    from prismd.runtime import open_messaging_runtime

    harness = Harness(
        store=store,
        clock=clock,
        agents=dict(agents),
        grants=dict(grants or {}),
        default_grant=grant_for() if grant is None else grant,
    )
    extra: dict[str, Any] = dict(kwargs)
    if fetch_attachment is not None:
        extra["fetch_attachment"] = fetch_attachment
    async with open_messaging_runtime(
        authorize=harness.authorize,
        resolve_agent=harness.resolve_agent,
        deliver=harness.deliver,
        store=store if use_journal else None,
        clock=clock,
        on_preview=harness.on_preview,
        **extra,
    ) as runtime:
        harness.runtime = runtime
        yield harness


@attrs.define(eq=False)
class RecordingAgent:
    """A model stand-in that records every input and answers ``answer`` (streamed)."""

    agent_id: str = "recording"
    definition_revision: str = "rec-1"
    input_capabilities: frozenset[str] = frozenset({"text"})
    supports_approvals: bool = False
    answer: str = "model answer"
    inputs: list[Any] = attrs.field(factory=list)

    async def run(self, request: RunRequest, *, on_event: EventSink | None = None) -> RunResult:
        self.inputs.append(request.input)
        run_id = f"rec-{len(self.inputs)}"
        if on_event is not None:
            on_event(StreamEvent("message_started", run_id))
            on_event(StreamEvent("message_delta", run_id, self.answer))
            on_event(StreamEvent("message_finished", run_id, self.answer))
        await trio.lowlevel.checkpoint()
        return RunResult("succeeded", self.answer, run_id, request.session_id)

    async def status(self, **_kw: Any) -> RunState | None:
        return None

    async def resume(self, **kw: Any) -> RunResult:
        raise AssertionError("RecordingAgent never suspends")
