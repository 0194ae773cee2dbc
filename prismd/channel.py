"""Transport-neutral shapes that cross the runtime boundary (contract §3).

Adapters build :class:`InboundEvent` from a platform update, await
``runtime.admit(event)`` and acknowledge the transport only when the returned
:class:`Admission` is not :attr:`Admission.retryable`. Replies leave through the host's
``deliver(reply) -> SendResult`` (normally the adapter's ``send``); a ``deliver`` that
raises means the outcome is *ambiguous*. A ``SendResult`` with ``held=True`` means "not
sent, and not failed": the channel has no live connection to the conversation and asks
for the reply again when one opens (the web chat; see ``Runtime.redeliver_pending``).

These records have no validators on purpose: ``admit`` validates and answers
``denied/malformed`` instead of raising, whatever an adapter hands it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal, Protocol, TypeAlias

import attrs
import trio

from .identity import AgentIdentity

AttachmentKind: TypeAlias = Literal["image", "document", "voice"]
ApprovalOutcome: TypeAlias = Literal["allow_once", "reject_once"]
Action: TypeAlias = Literal["message", "command", "approval", "notify"]
ReplyKind: TypeAlias = Literal["final", "notice"]
AdmissionStatus: TypeAlias = Literal["accepted", "denied", "unsupported"]

RETRYABLE_DENIALS = frozenset({"capacity", "unavailable", "stopped"})


@attrs.frozen
class AttachmentRef:
    kind: AttachmentKind
    transport_file_id: str
    byte_length: int = 0
    mime_type: str | None = None
    file_name: str | None = None


@attrs.frozen
class ApprovalInput:
    token: str
    outcome: ApprovalOutcome


@attrs.frozen
class InboundEvent:
    connection_id: str
    external_conversation_id: str
    external_actor_id: str
    event_id: str
    text: str = ""
    attachments: tuple[AttachmentRef, ...] = ()
    approval: ApprovalInput | None = None
    thread_id: str | None = None
    received_at_ms: int | None = None
    claims: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Admission:
    status: AdmissionStatus
    reason: str | None = None
    operation_id: str | None = None
    duplicate: bool = False
    hint: str | None = None
    """For a refusal the user or operator can act on: one sentence saying what to do (a
    limit, a missing grant, ``/help``). Fixed text with ids or numbers only, never message
    text or secrets. Not part of the contract's shape: the control socket and the web chat
    send it only when set."""

    @property
    def retryable(self) -> bool:
        """The adapter must not acknowledge the transport (offset, 2xx) for this one."""
        return self.status == "denied" and self.reason in RETRYABLE_DENIALS


@attrs.frozen
class Control:
    label: str
    value: str


@attrs.frozen
class Reply:
    connection_id: str
    external_conversation_id: str
    text: str
    kind: ReplyKind
    controls: tuple[Control, ...] = ()
    thread_id: str | None = None
    in_reply_to: str | None = None
    operation_id: str | None = None
    """The journaled operation this reply answers (one reply per operation): a stable id a
    channel may show its client, so a reply seen twice (history and live) is shown once."""


def _held_is_not_delivered(instance: SendResult, _attribute: object, held: bool) -> None:
    if held and instance.delivered:
        raise ValueError("a held reply is not delivered")


@attrs.frozen
class SendResult:
    """The outcome of one ``deliver``: delivered, refused (``delivered=False``), or held.

    ``held=True``: nothing was sent *and* nothing failed — the channel has no live
    connection for the conversation right now and will ask the runtime to re-drive the
    reply when one opens. The runtime keeps the reply record ``pending`` (marked held)
    instead of settling it ``delivery_failed``.
    """

    delivered: bool
    message_id: str | None = None
    reason: str | None = None
    held: bool = attrs.field(default=False, validator=_held_is_not_delivered)

    @classmethod
    def hold(cls, reason: str | None = None) -> SendResult:
        """Not sent, not failed: re-drive it when the conversation reconnects."""
        return cls(False, reason=reason, held=True)


@attrs.frozen
class PastReply:
    """A delivered reply the journal still holds (``Runtime.recent_replies``): the text as
    sent (redacted, bounded), without controls (their tokens are never stored)."""

    operation_id: str
    kind: ReplyKind
    text: str
    created_at_ms: int
    in_reply_to: str | None = None
    """The event id of the operation it answers, when that record is still kept."""


@attrs.frozen
class Preview:
    """A streaming preview of an answer (never journaled, never a reply)."""

    connection_id: str
    external_conversation_id: str
    text: str
    thread_id: str | None = None


@attrs.frozen
class AuthorizeInput:
    connection_id: str
    external_conversation_id: str
    external_actor_id: str
    event_id: str
    text: str
    action: Action
    received_at_ms: int
    thread_id: str | None = None
    claims: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Grant:
    """What the host's ``authorize`` returns for an allowed actor (ChannelAuthorization)."""

    identity: AgentIdentity
    agent_aliases: tuple[str, ...]
    grant_revision: str
    default_agent_alias: str | None = None
    notifications: bool = False


# --------------------------------------------------------------------------- adapters
#
# What the supervisor needs from a channel adapter (Telegram, Signal, web chat).
#
# An adapter is built with an ``admit`` callable (``runtime.admit``) and whatever durable
# state it needs. The supervisor starts ``run`` with ``nursery.start``; ``run`` calls
# ``task_status.started()`` once it is serving (lease held, socket bound, …) and then runs
# until cancelled. A fatal condition (e.g. Telegram 401) is raised as
# :class:`AdapterFatalError`: the supervisor does not restart the adapter after it. Any other
# exception is a crash: the supervisor restarts ``run`` with bounded backoff.
#
# ``send`` is the runtime's ``deliver`` for replies on this connection: it returns a
# :class:`~prismd.channel.SendResult` for a known outcome and raises for an ambiguous one.

Admit = Callable[[InboundEvent], Awaitable[Admission]]


class AdapterFatalError(Exception):
    """The adapter cannot work with its configuration (bad credentials, webhook conflict)."""


class DeliveryOutcomeUnknownError(Exception):
    """The platform may or may not have accepted the message (ambiguous delivery)."""


class ChannelAdapter(Protocol):
    @property
    def connection_id(self) -> str: ...

    async def run(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None: ...

    async def send(self, reply: Reply) -> SendResult: ...

    def health(self) -> Mapping[str, str]:
        """Bounded enums only (no ids, numbers, paths or text)."""
        ...
