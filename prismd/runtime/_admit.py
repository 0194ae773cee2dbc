"""``admit(event)`` (contract §7): validate, authorize, journal, dispatch.

Steps 1–4 (stopped, malformed, oversized) never call ``authorize``. The create-only
operation record is the dedup and the transport acknowledgment point: once it exists the
event is never lost (SPEC difference 8) and never run twice.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import trio

from ..channel import Action, Admission, ApprovalInput, InboundEvent, utf8_len
from ..grants import Grant, ownership_from_identity
from ..journal import (
    CursorRecord,
    Loaded,
    OperationInput,
    OperationRecord,
    OperationRef,
    OwnershipScope,
    bounded_claims,
    operation_id_for,
    operation_key,
)
from ..journal import admit as journal_admit
from ._approvals import admit_approval
from ._commands import admit_command
from ._core import (
    AdmitContext,
    Core,
    authorize_input,
    check_grant,
    denied,
    duplicate,
    seen_before,
    stamp_us,
)
from ._replies import Draft, Settle, answer
from ._routes import MAX_ID_BYTES, MEMO_LIMIT, Route, RouteKey, Turn, route_key
from ._turn import enqueue

TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{32,64}$")
TEXT_APPROVAL_RE = re.compile(r"^/(approve|deny)\s+([A-Za-z0-9_-]{32,64})$", re.IGNORECASE)
PAIR_RE = re.compile(r"^/(pair|start)\s+([A-Za-z0-9_-]{32,64})$")
NOT_GRANTED_HINT = (
    "No grant lets you talk to an agent here. With a pairing code, send /pair CODE;"
    " the operator grants access in the [[grants]] of prismd's config."
)
"""The hint of a refusal for want of a grant (shown by the web chat; others stay silent)."""
PAIR_ATTEMPT_RE = re.compile(r"^/pair(\s|$)", re.IGNORECASE)
"""A ``/pair`` whose token is cut, mistyped or missing: a stranger sending it is told the
code is not valid, as for a wrong token (a bare ``/start`` is Telegram's greeting: no)."""
AWAITING_DECISION_TEXT = "A previous request is awaiting an operator decision."
PAIRED_TEXT = "Paired. You can talk to the agent now."
PAIR_INVALID_TEXT = "That pairing code is not valid."
MAX_ATTACHMENTS = 8
ATTACHMENT_KINDS = frozenset({"image", "document", "voice"})
MAX_SAFE_INTEGER = 2**53 - 1
ADMIT_SHIELD_S = 10.0
RESUME_GATE_S = 2.0


log = logging.getLogger("prismd.runtime")

NOT_OPEN = Admission(status="denied", reason="unavailable")
"""What a runtime not opened yet answers (retryable: the transport is not acknowledged)."""


class Entrance:
    """The runtime's way in: :class:`~prismd.runtime.Runtime`'s ``admit``, written here
    beside the step it enters, so an adapter's event goes straight into admission."""

    __slots__ = ()
    _open: Core | None

    async def admit(self, event: InboundEvent) -> Admission:
        """Admit an inbound event (§7). Acknowledge the transport unless the result is
        :attr:`~prismd.channel.Admission.retryable`."""
        core = self._open
        if core is None:
            return NOT_OPEN
        admission = await admit(core, event)
        if log.isEnabledFor(logging.DEBUG):
            _log_admission(event, admission)
        return admission


def _log_admission(event: InboundEvent, admission: Admission) -> None:
    """One DEBUG line per admission: outcome, reason, connection and the operation id (a
    hash of the event id); never text, actor or conversation ids."""
    conn, event_id = getattr(event, "connection_id", None), getattr(event, "event_id", None)
    if isinstance(conn, str) and isinstance(event_id, str):
        where = f"connection {conn[:64]}, {operation_id_for(conn, event_id)}"
    else:
        where = "no valid event ids"
    outcome = "duplicate" if admission.duplicate else admission.status
    reason = f" ({admission.reason})" if admission.reason else ""
    log.debug("admission %s%s: %s", outcome, reason, where)


def _utf8_ok(value: str) -> bool:
    # Ids are journaled as UTF-8: a lone surrogate cannot be stored, and answering it
    # ``unavailable`` (retryable) would make the event a poison redelivery.
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _id_ok(value: object) -> bool:
    return (
        isinstance(value, str)
        and bool(value)
        and utf8_len(value) <= MAX_ID_BYTES
        and _utf8_ok(value)
    )


def _opt_str_ok(value: object) -> bool:
    return value is None or (isinstance(value, str) and utf8_len(value) <= MAX_ID_BYTES)


def validate_event(event: object) -> bool:
    """§3 validation: ids, text, approval, attachments, claims."""
    if not isinstance(event, InboundEvent):
        return False
    for value in (
        event.connection_id,
        event.external_conversation_id,
        event.external_actor_id,
        event.event_id,
    ):
        if not _id_ok(value):
            return False
    if event.thread_id is not None and not _id_ok(event.thread_id):
        return False
    if not isinstance(event.text, str):
        return False
    if event.approval is not None:
        approval = event.approval
        if not isinstance(approval, ApprovalInput):
            return False
        if not isinstance(approval.token, str) or not TOKEN_RE.match(approval.token):
            return False
        if approval.outcome not in ("allow_once", "reject_once"):
            return False
    if not isinstance(event.claims, Mapping):
        return False
    attachments = event.attachments
    if not isinstance(attachments, tuple) or len(attachments) > MAX_ATTACHMENTS:
        return False
    for ref in attachments:
        if getattr(ref, "kind", None) not in ATTACHMENT_KINDS:
            return False
        if not _id_ok(getattr(ref, "transport_file_id", None)):
            return False
        size = getattr(ref, "byte_length", 0)
        if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_SAFE_INTEGER:
            return False
        if not _opt_str_ok(getattr(ref, "mime_type", None)):
            return False
        if not _opt_str_ok(getattr(ref, "file_name", None)):
            return False
    return not (event.received_at_ms is not None and not isinstance(event.received_at_ms, int))


def text_approval(text: str) -> ApprovalInput | None:
    match = TEXT_APPROVAL_RE.match(text.strip())
    if match is None:
        return None
    if match.group(1).lower() == "approve":
        return ApprovalInput(token=match.group(2), outcome="allow_once")
    return ApprovalInput(token=match.group(2), outcome="reject_once")


def classify(event: InboundEvent) -> tuple[Action, ApprovalInput | None]:
    if event.approval is not None:
        return "approval", event.approval
    approval = text_approval(event.text)
    if approval is not None:
        return "approval", approval
    if event.text.lstrip().startswith("/"):
        return "command", None
    return "message", None


def choose_alias(grant: Grant, selection: str | None) -> str | None:
    """The actor's ``/agent`` choice when the grant allows it, else the grant's default."""
    if selection is not None and selection in grant.agent_aliases:
        return selection
    alias = grant.default_agent_alias or grant.agent_aliases[0]
    return alias if alias in grant.agent_aliases else None


async def admit(core: Core, event: InboundEvent) -> Admission:
    if core.stopped:
        return denied(core, "stopped")
    if not validate_event(event):
        return denied(core, "malformed")
    if utf8_len(event.text) > core.limits.max_input_bytes:
        limit = core.limits.max_input_bytes
        return denied(core, "oversized", f"Message too long: at most {limit} bytes (UTF-8).")
    if sum(a.byte_length or 0 for a in event.attachments) > core.limits.max_attachment_bytes:
        limit = core.limits.max_attachment_bytes
        return denied(core, "oversized", f"Attachments too large: at most {limit} bytes in all.")
    pair = PAIR_RE.match(event.text.strip()) if event.approval is None else None
    if pair is not None and core.pairing_scope is not None and core.pairings is not None:
        pairing_scope = core.pairing_scope(event.connection_id)
        if pairing_scope is not None:
            return await handle_pairing(core, event, pairing_scope, pair.group(2))
    action, approval = classify(event)
    received = event.received_at_ms if event.received_at_ms is not None else core.now_ms()
    try:
        grant = await core.authorize(authorize_input(event, action, received))
    except Exception:
        return denied(core, "authorization_failed")
    reason = check_grant(core, grant)
    if reason is not None:
        if reason == "rejected" and _pairing_typo(core, event):
            core.spawn(_pair_notice, core, event, PAIR_INVALID_TEXT)
        ungranted = reason == "rejected" and not isinstance(grant, Grant)
        return denied(core, reason, NOT_GRANTED_HINT if ungranted else None)
    assert isinstance(grant, Grant)
    scope = ownership_from_identity(grant.identity)
    operation_id = operation_id_for(event.connection_id, event.event_id)
    if action == "approval":
        alias = grant.agent_aliases[0]
    else:
        alias_choice = choose_alias(grant, await core.selections.current(event, scope))
        if alias_choice is None:
            return denied(core, "rejected")
        alias = alias_choice
    ctx = AdmitContext(event, action, grant, scope, alias, operation_id)
    created: list[bool] = []
    # From the record on, admission is shielded (bounded): a caller cancelled after the
    # create would leave an ``accepted`` record in no queue, and the transport's
    # redelivery would be answered "duplicate" — acknowledged, never run.
    with trio.CancelScope(shield=True, deadline=trio.current_time() + ADMIT_SHIELD_S):
        return await _admit_authorized(core, ctx, approval, created)
    # Only when the bound expired: undo our own record (never a duplicate's original),
    # so the transport's retry is admitted afresh.
    if created:
        await core.remove_operation(scope, event.connection_id, operation_id)
    core.count("storage_failures")
    return denied(core, "unavailable")


def _queue_full(core: Core, key: RouteKey) -> bool:
    """A message to the route of ``key`` would find its queue full: :func:`._turn.enqueue`
    would answer ``capacity`` (the route's queue or the process's). Only for a route in the
    table, hydrated and not awaiting a decision — what ``enqueue`` checks before the
    queues; any other goes the whole way, and is answered as before."""
    route = core.routes.get(key)
    if route is None or not route.hydrated or route.suspended:
        return False
    return (
        len(route.queue) >= core.limits.max_pending_per_binding
        or core.pending_total() >= core.limits.max_pending_per_process
    )


async def _admit_authorized(
    core: Core, ctx: AdmitContext, approval: ApprovalInput | None, created_flag: list[bool]
) -> Admission:
    event, action, scope = ctx.event, ctx.action, ctx.scope
    operation_id, alias = ctx.operation_id, ctx.alias
    key = route_key(event, alias, scope)
    op_loaded: Loaded[OperationRecord] | None = None
    if core.journal is not None:
        now = core.now_ms()
        record = OperationRecord(
            operation_id=operation_id,
            event_id=event.event_id,
            kind=action,
            connection_id=event.connection_id,
            external_conversation_id=event.external_conversation_id,
            external_actor_id=event.external_actor_id,
            agent_alias=alias,
            state="accepted",
            created_at_ms=now,
            updated_at_ms=now,
            thread_id=event.thread_id,
            # In the same create-only write as the record (the acknowledgment point), so
            # a message acknowledged and then killed before its claim can still run after
            # a restart; removed by the claim and by every other exit from ``accepted``.
            input=operation_input(event) if action == "message" else None,
        )
        known_as = operation_key(event.connection_id, scope, operation_id)
        if core.known.has(known_as):
            # Created (or answered as a duplicate) by this runtime, and records leave only
            # through prune: the answer is the store's, without asking it.
            return duplicate(core, operation_id)
        if action == "message" and _queue_full(core, key):
            # The record would only be removed again (capacity): answer without writing,
            # a duplicate still first (§7).
            try:
                stored = await core.journal.load_operation(scope, event.connection_id, operation_id)
            except Exception:
                core.count("storage_failures")
                return denied(core, "unavailable")
            if stored is not None:
                core.known.add(known_as)
                return duplicate(core, operation_id)
            return denied(core, "capacity")
        cursor_at = (event.connection_id, scope)
        try:
            admitted = await journal_admit(
                core.journal, scope, record, cursor=core.cursors.get(cursor_at), now_ms=now
            )
        except Exception:
            core.count("storage_failures")
            return denied(core, "unavailable")
        core.known.add(known_as)
        if admitted.operation is None:
            return duplicate(core, operation_id)
        op_loaded = admitted.operation
        created_flag.append(True)
        remember_cursor(core, cursor_at, admitted.cursor)
    elif action != "command" and seen_before(core, event.connection_id, event.event_id):
        return duplicate(core, operation_id)
    try:
        if action == "approval":
            assert approval is not None
            result = await admit_approval(core, ctx, approval)
            await _settle_or_remove(core, ctx, result)
            return result
        if action == "command":
            result = await admit_command(core, ctx)
            await _settle_or_remove(core, ctx, result)
            return result
        return await admit_message(core, ctx, op_loaded, key)
    except Exception as exc:
        await core.remove_operation(scope, event.connection_id, operation_id)
        core.count("failed")
        return denied(core, "malformed" if isinstance(exc, TypeError) else "unavailable")


def operation_input(event: InboundEvent) -> OperationInput:
    """What a message turn needs to run later, journaled in its ``accepted`` record."""
    return OperationInput(
        text=event.text,
        attachments=event.attachments,
        thread_id=event.thread_id,
        received_at_ms=event.received_at_ms,
        claims=bounded_claims(event.claims),
        admitted_us=stamp_us(),
    )


def remember_cursor(
    core: Core, at: tuple[str, OwnershipScope], cursor: Loaded[CursorRecord] | None
) -> None:
    """Keep the cursor as stored, so the next admission saves a read: the most recently
    used :data:`MEMO_LIMIT` (a forgotten one is read again, once)."""
    core.cursors.pop(at, None)
    if cursor is not None:
        if len(core.cursors) >= min(core.limits.max_routes, MEMO_LIMIT):
            core.cursors.popitem(last=False)
        core.cursors[at] = cursor


async def _settle_or_remove(core: Core, ctx: AdmitContext, result: Admission) -> None:
    """An answered command or approval: ``succeeded`` with its notice, in one transaction
    before the transport is acknowledged (the notice is sent in the background); anything
    else removes the record, so the transport's retry is admitted afresh."""
    event = ctx.event
    draft = None
    if ctx.notices:
        text = core.redact(ctx.notices[-1])
        draft = Draft.for_event(ctx.grant.identity, ctx.operation_id, event, text)
    if result.status == "accepted":
        settle = Settle(
            OperationRef(ctx.scope, event.connection_id, ctx.operation_id),
            "succeeded",
            only_from=frozenset({"accepted"}),
        )
        await answer(core, draft, scope=ctx.scope, settle=settle, send_later=True)
        core.count("admitted")
        return
    if draft is not None:
        await answer(core, draft, scope=ctx.scope, send_later=True)
    await core.remove_operation(ctx.scope, event.connection_id, ctx.operation_id)
    if result.status == "denied":
        core.count("denied")
    else:
        core.count("unsupported")


async def admit_message(
    core: Core, ctx: AdmitContext, op_loaded: Loaded[OperationRecord] | None, key: RouteKey
) -> Admission:
    conn = ctx.event.connection_id
    route = core.routes.route(key)
    if route is None:
        await core.remove_operation(ctx.scope, conn, ctx.operation_id)
        return denied(core, "capacity")
    with core.routes.pinned(route):
        return await _admit_to_route(core, ctx, op_loaded, route)


async def _admit_to_route(
    core: Core, ctx: AdmitContext, op_loaded: Loaded[OperationRecord] | None, route: Route
) -> Admission:
    event = ctx.event
    conn = event.connection_id
    gate = core.resume_gate
    if gate is not None and not gate.is_set():
        # Messages acknowledged before a restart go first on their route (FIFO); the wait
        # is bounded so recovery never holds up admission for long.
        with trio.move_on_after(RESUME_GATE_S):
            await gate.wait()
    turn = Turn(
        operation_id=ctx.operation_id,
        event=event,
        action=ctx.action,
        grant=ctx.grant,
        scope=ctx.scope,
        alias=ctx.alias,
        op=op_loaded,
    )
    queued = await enqueue(core, route, turn, ctx.grant.identity)
    if queued == "queued":
        return Admission("accepted", operation_id=ctx.operation_id)
    if queued == "suspended":
        draft = Draft.for_event(ctx.grant.identity, ctx.operation_id, event, AWAITING_DECISION_TEXT)
        core.spawn(_answer_in_background, core, draft, ctx.scope)
    await core.remove_operation(ctx.scope, conn, ctx.operation_id)
    reason = {"suspended": "awaiting_decision", "gone": "stopped"}.get(queued, queued)
    return denied(core, reason)


async def _answer_in_background(core: Core, draft: Draft, scope: OwnershipScope) -> None:
    await answer(core, draft, scope=scope)


async def handle_pairing(
    core: Core, event: InboundEvent, scope: OwnershipScope, token: str
) -> Admission:
    """SPEC difference 6: ``/pair TOKEN`` or ``/start TOKEN`` before authorize."""
    assert core.pairings is not None and core.grants is not None
    try:
        result = await core.pairings.consume(scope, connection_id=event.connection_id, token=token)
    except Exception:
        core.count("storage_failures")
        return denied(core, "unavailable")
    target = result.target
    if (
        result.status != "consumed"
        or target is None
        or (
            target.external_actor_id is not None
            and target.external_actor_id != event.external_actor_id
        )
    ):
        core.spawn(_pair_notice, core, event, PAIR_INVALID_TEXT)
        return denied(core, "rejected")
    try:
        grant = await core.grants.record(
            scope,
            connection_id=event.connection_id,
            actor_id=event.external_actor_id,
            aliases=target.aliases,
            default_alias=target.agent_alias if target.agent_alias in target.aliases else None,
        )
    except Exception:
        core.count("storage_failures")
        return denied(core, "unavailable")
    if core.on_paired is not None:
        try:
            await core.on_paired(grant)
        except Exception:
            core.count("storage_failures")
    core.spawn(_pair_notice, core, event, PAIRED_TEXT)
    core.count("admitted")
    return Admission("accepted")


def _pairing_typo(core: Core, event: InboundEvent) -> bool:
    """A refused ``/pair …`` that :data:`PAIR_RE` did not take, on a connection that pairs."""
    return (
        event.approval is None
        and core.pairing_scope is not None
        and core.pairing_scope(event.connection_id) is not None
        and PAIR_ATTEMPT_RE.match(event.text.strip()) is not None
    )


async def _pair_notice(core: Core, event: InboundEvent, text: str) -> None:
    # No owner yet: the answer to a pairing attempt is sent, not journaled.
    operation_id = operation_id_for(event.connection_id, event.event_id)
    draft = Draft.for_event(None, operation_id, event, text)
    await answer(core, draft, scope=None)
