"""The behaviours list's common fixture, as builders: connection ``tg-1``, chat ``chat-1``,
actor ``user-1``, event id ``"1"``, text ``hello``; identity tenant ``tenant-1`` / user
``user-1`` / principal ``user:user-1``; grant aliases ``("primary",)``, revision ``rev-1``."""

from __future__ import annotations

from typing import Any

from prismd.channel import ApprovalInput, AttachmentRef, InboundEvent
from prismd.grants import AgentIdentity, Grant, Principal
from prismd.journal import ChannelJournal, Loaded, OwnershipScope, Write


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


IDENTITY = identity()


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
    approval: ApprovalInput | tuple[str, str] | None = None,
) -> InboundEvent:
    """An inbound event; ``approval`` may be given as ``(token, decision)``."""
    if isinstance(approval, tuple):
        approval = ApprovalInput(approval[0], approval[1])  # type: ignore[arg-type]
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


async def write(
    journal: ChannelJournal,
    namespace: str,
    scope: OwnershipScope,
    record: Any,
    expected_version: int = 0,
    fence: int | None = None,
) -> Loaded[Any] | None:
    """One record written through the journal's write path (:meth:`ChannelJournal.commit`):
    create-only at version 0, else a compare-and-swap from ``expected_version``; ``None``
    when it lost. Operations and replies derive their key from the record."""
    committed = await journal.commit((Write(namespace, scope, record, expected_version, fence),))
    return committed.items[0]
