"""The messaging runtime's public surface, as the daemon, control socket and adapters use it.

``prismd.runtime.open_messaging_runtime(...)`` yields an object satisfying
:class:`MessagingRuntime`; the host's callbacks get ``ResolveAgentInput`` and
``BindingInput``. Result records are frozen attrs classes; the control socket renders them
in camelCase (``attrs.asdict`` + a key conversion).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Literal, Protocol, TypeAlias

import attrs

from ..agents import Agent
from ..channel import Admission, InboundEvent
from ..grants import AgentIdentity, AuthorizeInput, Grant
from ..journal import OwnershipScope


@attrs.frozen
class ResolveAgentInput:
    """What ``resolve_agent`` is called with on every turn (and status/resume)."""

    agent_alias: str
    identity: AgentIdentity
    scope: OwnershipScope
    connection_id: str
    external_conversation_id: str


@attrs.frozen
class BindingInput:
    """What an optional host ``resolve_binding`` gets to map a route to a session (§2.4)."""

    connection_id: str
    external_conversation_id: str
    external_actor_id: str
    identity: AgentIdentity
    scope: OwnershipScope
    agent_alias: str
    generation: int
    thread_id: str | None = None


@attrs.frozen
class BindingResolution:
    session_id: str
    leaf_id: str | None = None


Authorize: TypeAlias = Callable[[AuthorizeInput], Awaitable[Grant | None]]
ResolveAgent: TypeAlias = Callable[[ResolveAgentInput], Awaitable[Agent]]
ResolveBinding: TypeAlias = Callable[[BindingInput], Awaitable[BindingResolution]]


ReconcileStatus: TypeAlias = Literal["resolved", "not_found", "conflict", "denied", "unavailable"]


@attrs.frozen
class UnresolvedEntry:
    operation_id: str
    connection_id: str
    state: str
    version: int
    updated_at: str
    """ISO 8601 UTC."""
    reply_state: str | None = None
    reason: str | None = None
    """Why a reply failed or is unknown, in the channel's short words (``50007`` → "the user
    blocks direct messages"); sent only when set."""


@attrs.frozen
class UnresolvedPage:
    """A page of ``list_unresolved_page``: pass ``next_cursor`` as ``after`` for the next
    (``None``: this was the last page). ``limit`` is the page size used, ``capped`` whether
    the one asked for was above ``max_journal_page``."""

    entries: tuple[UnresolvedEntry, ...]
    next_cursor: str | None
    limit: int
    capped: bool = False


@attrs.frozen
class ReconcileResult:
    status: ReconcileStatus
    outcome: str | None = None
    """``abandoned``, ``execution_unknown``, ``none``, ``reply_delivered``,
    ``reply_failed``, ``reply_unknown`` or ``reply_held`` (the channel held the resend
    again: the reply stays ``pending`` until its conversation reconnects)."""
    state: str | None = None
    detail: str | None = None
    current_version: int | None = None
    """On a ``conflict``: the operation's stored version now, to retry with. Only for a
    record inside the caller's scope (a foreign one is ``not_found``). Not in the contract's
    shape: the control socket sends it only when set."""


@attrs.frozen
class PruneResult:
    scanned: int = 0
    deleted: int = 0
    retained: int = 0


@attrs.frozen
class DrainResult:
    settled: bool
    pending: int
    completed: int
    failed: int
    cancelled: int


@attrs.frozen
class Diagnostics:
    """Bounded counters only (§13.6); never text, ids, tokens or keys."""

    admitted: int = 0
    denied: int = 0
    unsupported: int = 0
    duplicates: int = 0
    queued: int = 0
    active: int = 0
    completed: int = 0
    failed: int = 0
    cancelled: int = 0
    suspended: int = 0
    deliveries: int = 0
    delivery_failures: int = 0
    truncated: int = 0
    storage_failures: int = 0
    lease_losses: int = 0


@attrs.frozen
class PairingTicket:
    """A one-time pairing token (shown once, stored only as a hash) and its expiry."""

    token: str
    expires_at: str
    connection_id: str


class MessagingRuntime(Protocol):
    async def admit(self, event: InboundEvent) -> Admission: ...

    async def notify(
        self,
        *,
        identity: AgentIdentity,
        connection_id: str,
        external_conversation_id: str,
        notify_id: str,
        text: str,
        thread_id: str | None = None,
    ) -> Admission: ...

    async def list_unresolved(
        self, *, identity: AgentIdentity, limit: int | None = None
    ) -> list[UnresolvedEntry]: ...

    async def list_unresolved_page(
        self, *, identity: AgentIdentity, limit: int | None = None, after: str | None = None
    ) -> UnresolvedPage: ...

    async def count_unresolved(
        self, *, identities: Sequence[AgentIdentity], limit: int
    ) -> tuple[int, bool]:
        """``(entries, capped)``: what :meth:`list_unresolved_page` lists for each of
        ``identities``, every page, summed; counting stops at ``limit`` (``capped``: there
        may be more). Cheap enough to ask every few seconds; store errors propagate."""
        ...

    async def reconcile(
        self,
        *,
        identity: AgentIdentity,
        connection_id: str,
        operation_id: str,
        expected_version: int,
        acknowledge_duplicate_risk: bool = False,
    ) -> ReconcileResult: ...

    async def prune(self, *, identity: AgentIdentity, now_ms: int | None = None) -> PruneResult: ...

    async def create_pairing(
        self,
        *,
        identity: AgentIdentity,
        connection_id: str,
        aliases: tuple[str, ...] | None = None,
        ttl_ms: int | None = None,
    ) -> PairingTicket: ...

    def diagnostics(self) -> Diagnostics: ...

    def health(self) -> dict[str, str]: ...

    async def drain(self, *, deadline_ms: int | None = None) -> DrainResult: ...

    async def stop(self) -> None: ...
