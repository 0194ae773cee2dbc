"""What every entry point decides about an inbound event before it touches a route: the
authorized context, the grant checks, the actor's agent selection, and the admission answers
(denied, duplicate) with their counters."""

from __future__ import annotations

from collections import OrderedDict

import attrs

from ..channel import Action, Admission, AuthorizeInput, Grant, InboundEvent
from ..journal import NS_BINDING, BindingRecord, OwnershipScope, binding_actor_prefix
from ._core import MEMO_LIMIT, Core
from ._types import ActorKey


@attrs.frozen
class AdmitContext:
    """An authorized event on its way through admission."""

    event: InboundEvent
    action: Action
    grant: Grant
    ownership: OwnershipScope
    alias: str
    operation_id: str
    notices: list[str] = attrs.field(factory=list, eq=False)
    """What a command answers: committed with its ``succeeded`` state, then sent."""


def authorize_input(event: InboundEvent, action: Action, received_at_ms: int) -> AuthorizeInput:
    """What ``authorize`` is asked about an inbound event (admission, re-checks, resume)."""
    return AuthorizeInput(
        connection_id=event.connection_id,
        external_conversation_id=event.external_conversation_id,
        external_actor_id=event.external_actor_id,
        event_id=event.event_id,
        text=event.text,
        action=action,
        received_at_ms=received_at_ms,
        thread_id=event.thread_id,
        claims=event.claims,
    )


def check_grant(core: Core, grant: object) -> str | None:
    """The denial reason for a grant, or None when usable (§2.2 order)."""
    if not isinstance(grant, Grant) or grant.identity is None:
        return "rejected"
    if not core.active(grant.identity):
        return "revoked"
    aliases = grant.agent_aliases
    if (
        not isinstance(aliases, tuple)
        or not aliases
        or not all(isinstance(a, str) and a for a in aliases)
    ):
        return "rejected"
    if not isinstance(grant.grant_revision, str) or not grant.grant_revision:
        return "rejected"
    return None


def actor_key(event: InboundEvent, ownership: OwnershipScope) -> ActorKey:
    return (
        event.connection_id,
        event.external_conversation_id,
        event.thread_id,
        event.external_actor_id,
        ownership.tenant_id,
        ownership.account_id,
        ownership.user_id,
    )


async def current_selection(
    core: Core, event: InboundEvent, ownership: OwnershipScope
) -> str | None:
    """The actor's ``/agent`` choice: memory first, else the binding with the newest
    selection stamp (SPEC difference 3, durable across restarts)."""
    key = actor_key(event, ownership)
    if key in core.selections:
        core.selections.move_to_end(key)
        return core.selections[key]
    selected: str | None = None
    if core.journal is not None:
        prefix = binding_actor_prefix(
            event.connection_id,
            ownership,
            event.external_conversation_id,
            event.thread_id,
            event.external_actor_id,
        )
        try:
            rows, _cursor = await core.journal.list(ownership, NS_BINDING, 500, key_prefix=prefix)
        except Exception:
            core.count("storage_failures")
            return None
        best = -1
        for row in rows:
            if row.scope != ownership:
                continue
            try:
                record = BindingRecord.from_json(row.value)
            except ValueError:
                continue
            if (
                record.external_actor_id == event.external_actor_id
                and record.external_conversation_id == event.external_conversation_id
                and record.thread_id == event.thread_id
                and record.selected_at_ms is not None
                and record.selected_at_ms > best
            ):
                best = record.selected_at_ms
                selected = record.agent_alias
    remember_selection(core, key, selected)
    return selected


def remember_selection(core: Core, key: ActorKey, alias: str | None) -> bool:
    """False when the table is full and ``key`` is new (``/agent`` answers ``capacity``)."""
    if key in core.selections:
        core.selections[key] = alias
        core.selections.move_to_end(key)
        return True
    if core.journal is not None:
        # The journal has the truth: this is a memory of the actors in use (the least
        # recently used forgotten first, and read again when they come back).
        if len(core.selections) >= min(core.limits.max_routes, MEMO_LIMIT):
            core.selections.popitem(last=False)
    elif len(core.selections) >= core.limits.max_routes:
        # Without a journal the table is the truth: only "no selection" entries can go.
        for old_key, old_alias in core.selections.items():
            if old_alias is None:
                del core.selections[old_key]
                break
        else:
            return False
    core.selections[key] = alias
    return True


def choose_alias(grant: Grant, selection: str | None) -> str | None:
    if selection is not None and selection in grant.agent_aliases:
        return selection
    alias = grant.default_agent_alias or grant.agent_aliases[0]
    return alias if alias in grant.agent_aliases else None


def denied(core: Core, reason: str, hint: str | None = None) -> Admission:
    core.count("denied")
    return Admission("denied", reason, hint=hint)


def duplicate(core: Core, operation_id: str) -> Admission:
    """An event already admitted: acknowledged again, never run twice."""
    core.count("duplicates")
    core.count("admitted")
    return Admission("accepted", operation_id=operation_id, duplicate=True)


def seen_before(core: Core, connection_id: str, event_key: str) -> bool:
    """No-journal dedup (§7 step 7): a bounded per-connection FIFO of event ids."""
    seen = core.seen.get(connection_id)
    if seen is None:
        if len(core.seen) >= core.limits.max_routes:
            return False
        seen = OrderedDict()
        core.seen[connection_id] = seen
    if event_key in seen:
        return True
    seen[event_key] = None
    while len(seen) > core.limits.max_seen_events_per_connection:
        seen.popitem(last=False)
    return False
