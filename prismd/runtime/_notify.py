"""Host notices (contract §9.5) and pairing tickets (SPEC difference 6).

``notify`` finds its target among the *durable* bindings of the caller's ownership scope
(SPEC difference 3), so it works after a restart, not only for routes in memory. It never
creates a route's binding, runs no agent and takes no queue slot.
"""

from __future__ import annotations

from ..channel import Action, Admission, utf8_len
from ..grants import AgentIdentity, AuthorizeInput, Grant, missing_grant, ownership_from_identity
from ..journal import (
    NS_BINDING,
    BindingRecord,
    OperationRecord,
    OperationRef,
    OwnershipScope,
    binding_actor_prefix,
    ms_to_iso,
    notify_operation_id,
)
from ..journal import admit as journal_admit
from ._core import Core, check_grant, denied, duplicate, seen_before
from ._replies import Draft, Settle, answer
from ._routes import MAX_ID_BYTES
from .api import PairingTicket


async def authorize_actor(
    core: Core,
    connection_id: str,
    external_conversation_id: str,
    actor_id: str,
    thread_id: str | None,
    *,
    action: Action,
    event_id: str = "",
) -> Grant | None:
    """What ``authorize`` answers now about an actor outside any message of theirs (a
    notice to them, their conversation's history): no text, no claims. Raises what
    ``authorize`` raises."""
    return await core.authorize(
        AuthorizeInput(
            connection_id=connection_id,
            external_conversation_id=external_conversation_id,
            external_actor_id=actor_id,
            thread_id=thread_id,
            received_at_ms=core.now_ms(),
            action=action,
            event_id=event_id,
            text="",
        )
    )


MAX_NOTIFY_ID_BYTES = MAX_ID_BYTES - 8
OPERATOR_PRINCIPAL_KIND = "operator"
_MAX_BINDING_PAGES = 20


class PairingUnavailableError(Exception):
    """Pairing is off for that connection, or the caller may not pair into its scope."""


def _ok_id(value: object, limit: int = MAX_ID_BYTES) -> bool:
    return isinstance(value, str) and bool(value) and utf8_len(value) <= limit


def _conversation(connection_id: str, external_conversation_id: str, thread_id: str | None) -> str:
    """How a refusal names the target (ids the caller gave; nothing it cannot see)."""
    thread = "" if thread_id is None else f" thread {thread_id!r}"
    return f"conversation {external_conversation_id!r}{thread} on connection {connection_id!r}"


async def _candidates(
    core: Core,
    scope: OwnershipScope,
    connection_id: str,
    external_conversation_id: str,
    thread_id: str | None,
    *,
    operator: bool,
) -> list[tuple[OwnershipScope, BindingRecord]]:
    """Bindings of this conversation/thread, each with the scope it is stored under.

    A user identity sees only bindings stored under exactly its own scope (contract
    §9.5). An operator identity (principal kind ``operator``) sees every binding whose
    stored scope lies inside its partial scope (SPEC difference 7), never another
    tenant's.
    """

    def visible(stored: OwnershipScope) -> bool:
        return scope.matches_filter(stored) if operator else stored == scope

    found: dict[tuple[str, str, OwnershipScope], tuple[OwnershipScope, BindingRecord]] = {}
    for route in core.routes.values():
        if (
            route.connection_id == connection_id
            and route.external_conversation_id == external_conversation_id
            and route.thread_id == thread_id
            and visible(route.scope)
            and route.hydrated
            and route.session_id
        ):
            found[(route.actor_id, route.alias, route.scope)] = (
                route.scope,
                core.routes.binding_record(route),
            )
    if core.journal is not None:
        if operator:
            prefix = f"b1:{connection_id or '-'}:"
        else:
            prefix = binding_actor_prefix(connection_id, scope, external_conversation_id, thread_id)
        bindings = await core.journal.records(
            scope,
            NS_BINDING,
            key_prefix=prefix,
            max_pages=_MAX_BINDING_PAGES,
            within=visible,
        )
        for loaded in bindings:
            record: BindingRecord = loaded.record
            if (
                record.connection_id == connection_id
                and record.external_conversation_id == external_conversation_id
                and record.thread_id == thread_id
                and record.external_actor_id is not None
            ):
                found.setdefault(
                    (record.external_actor_id, record.agent_alias, loaded.scope),
                    (loaded.scope, record),
                )
    return list(found.values())


async def notify(
    core: Core,
    *,
    identity: AgentIdentity,
    connection_id: str,
    external_conversation_id: str,
    notify_id: str,
    text: str,
    thread_id: str | None = None,
) -> Admission:
    if core.stopped:
        return denied(core, "stopped")
    if (
        not isinstance(text, str)
        or not text.strip()
        or not _ok_id(connection_id)
        or not _ok_id(external_conversation_id)
        or not _ok_id(notify_id, MAX_NOTIFY_ID_BYTES)
        or (thread_id is not None and not _ok_id(thread_id))
    ):
        return denied(core, "malformed")
    if not core.active(identity):
        return denied(core, "revoked")
    try:
        scope = ownership_from_identity(identity)
    except Exception:
        return denied(core, "malformed")
    operator = identity.principal.kind == OPERATOR_PRINCIPAL_KIND
    try:
        found = await _candidates(
            core,
            scope,
            connection_id,
            external_conversation_id,
            thread_id,
            operator=operator,
        )
    except Exception:
        core.count("storage_failures")
        return denied(core, "unavailable")
    targets = sorted({(c.external_actor_id or "", stored) for stored, c in found}, key=repr)
    where = _conversation(connection_id, external_conversation_id, thread_id)
    if not targets:
        # The same answer whether the conversation exists outside the caller's scope or not.
        return denied(
            core,
            "rejected",
            f"no {where} is bound to an agent in your scope "
            "(a conversation is bound once its user has written to the agent)",
        )
    if len(targets) > 1:
        return denied(
            core,
            "rejected",
            f"{where} has {len(targets)} bound actors in your scope; notify needs exactly one",
        )
    actor_id, target_scope = targets[0]
    candidates = [c for _scope, c in found]
    event_id = f"notify-{notify_id}"
    try:
        grant = await authorize_actor(
            core,
            connection_id,
            external_conversation_id,
            actor_id,
            thread_id,
            action="notify",
            event_id=event_id,
        )
    except Exception:
        return denied(core, "rejected", f"checking the grant of actor {actor_id!r} failed")
    if check_grant(core, grant) is not None or not isinstance(grant, Grant):
        return denied(
            core,
            "rejected",
            f"no [[grants]] entry or pairing for connection {connection_id!r} covers actor "
            f"{actor_id!r}",
        )
    if grant.notifications is not True:
        return denied(core, "rejected", missing_grant(connection_id, "notifications", actor_id))
    if ownership_from_identity(grant.identity) != target_scope:
        return denied(
            core,
            "rejected",
            f"the grant of actor {actor_id!r} now maps to another scope than its conversation",
        )
    if not operator and (
        grant.identity.principal.kind != identity.principal.kind
        or grant.identity.principal.id != identity.principal.id
    ):
        return denied(
            core, "rejected", f"the caller is not actor {actor_id!r} (its grant names another)"
        )
    # The notice is journaled under the bound actor's scope and sent as them, so the
    # same liveness checks apply as for their own replies.
    sender = grant.identity if operator else identity
    scope = target_scope
    usable = [c for c in candidates if c.agent_alias in grant.agent_aliases]
    if len(usable) > 1:
        # Several aliases bound: the actor's current selection, else the grant's default,
        # else the most recently updated binding.
        selected = max(usable, key=lambda c: c.selected_at_ms or -1)
        if selected.selected_at_ms is not None:
            usable = [selected]
        else:
            default = [c for c in usable if c.agent_alias == grant.default_agent_alias]
            usable = default or [max(usable, key=lambda c: c.updated_at_ms)]
    if len(usable) != 1:
        return denied(
            core,
            "rejected",
            f"the agent bound to the {where} is not among the aliases granted to {actor_id!r}",
        )
    binding = usable[0]
    alias = binding.agent_alias
    if core.pending_total() >= core.limits.max_pending_per_process:
        return denied(core, "capacity")
    operation_id = notify_operation_id(connection_id, scope, actor_id, alias, notify_id)
    now = core.now_ms()
    record = OperationRecord(
        operation_id=operation_id,
        event_id=event_id,
        kind="notify",
        connection_id=connection_id,
        external_conversation_id=external_conversation_id,
        external_actor_id=actor_id,
        agent_alias=alias,
        state="accepted",
        created_at_ms=now,
        updated_at_ms=now,
        thread_id=thread_id,
        session_id=binding.session_id or None,
    )
    if core.journal is not None:
        try:
            admitted = await journal_admit(
                core.journal, scope, record, cursor=None, now_ms=now, with_cursor=False
            )
        except Exception:
            core.count("storage_failures")
            return denied(core, "unavailable")
        if admitted.operation is None:
            return duplicate(core, operation_id)
    elif seen_before(core, connection_id, event_id):
        return duplicate(core, operation_id)
    draft = Draft.for_event(sender, operation_id, record, core.redact(text))
    # The notice is staged with its operation's ``succeeded`` in one transaction.
    await answer(
        core,
        draft,
        scope=scope,
        settle=Settle(OperationRef(scope, connection_id, operation_id), "succeeded"),
    )
    core.count("admitted")
    return Admission("accepted", operation_id=operation_id)


async def create_pairing(
    core: Core,
    *,
    identity: AgentIdentity,
    connection_id: str,
    aliases: tuple[str, ...] | None = None,
    ttl_ms: int | None = None,
) -> PairingTicket:
    """Issue a one-time pairing token for ``connection_id`` (stored hashed, TTL ≤ 5 min).

    Raises :class:`PairingUnavailableError` when pairing is off for the connection, the
    identity is inactive, or the connection's pairing scope lies outside the caller's
    ownership; ``ValueError`` when no aliases are given.
    """
    if not core.active(identity):
        raise PairingUnavailableError("identity is not active")
    if core.pairing_scope is None or core.pairings is None:
        raise PairingUnavailableError("pairing is not enabled (no [[grants]] with pairing = true)")
    scope = core.pairing_scope(connection_id)
    if scope is None:
        raise PairingUnavailableError(missing_grant(connection_id, "pairing"))
    if not ownership_from_identity(identity).matches_filter(scope):
        raise PairingUnavailableError("pairing scope is outside the caller's ownership")
    if not aliases:
        raise ValueError("pairing needs at least one agent alias")
    # The store clamps the TTL to [1 s, 5 min]; the control socket refuses values outside.
    issued = await core.pairings.create(
        scope, connection_id=connection_id, aliases=tuple(aliases), ttl_ms=ttl_ms
    )
    return PairingTicket(
        token=issued.token, expires_at=ms_to_iso(issued.expires_at_ms), connection_id=connection_id
    )
