"""Operator recovery (contract §13.1–§13.3): list_unresolved, reconcile, prune.

Nothing is replayed behind the operator's back: the model is never re-run, and a reply
is resent only on an explicit ``reconcile`` (with ``acknowledge_duplicate_risk`` when the
first send may have landed) — or, when its channel *held* it (proven unsent, no live
connection), once its conversation reconnects (:mod:`._delivery`).

Scope (SPEC difference 7): an identity scoped to a tenant (or tenant + account) lists
*and* settles every record inside that scope. Rows are found with a partial-scope list,
then loaded/written under the row's own stored scope after checking it lies inside the
caller's — never another tenant's.
"""

from __future__ import annotations

from typing import Any

from ..agents import AGENT_NAMESPACES, agent_record_kept
from ..grants import AgentIdentity, ownership_from_identity
from ..journal import (
    FOLLOWING_STATE,
    NS_BINDING,
    NS_CONTROL,
    NS_CURSOR,
    NS_OPERATION,
    NS_REPLY,
    UNRESOLVED_OPERATION_STATES,
    UNRESOLVED_REPLY_STATES,
    UNSETTLED_REPLY_STATES,
    Change,
    CheckpointRecord,
    Loaded,
    OperationRecord,
    OperationRef,
    OwnershipScope,
    ReplyRecord,
    maybe_answerless,
    ms_to_iso,
    operation_key,
    reply_key,
    transition,
)
from ._core import Core, is_held
from ._delivery import resend
from ._relay import RELAY_SEPARATOR
from ._unanswered import tell
from .api import PruneResult, ReconcileResult, UnresolvedEntry, UnresolvedPage

MAX_PAGES = 20
MAX_SAFE_INTEGER = 2**53 - 1
DAY_MS = 24 * 60 * 60 * 1000


def _inside(caller: OwnershipScope, stored: OwnershipScope) -> bool:
    return caller.matches_filter(stored)


async def list_unresolved(
    core: Core, *, identity: AgentIdentity, limit: int | None = None
) -> list[UnresolvedEntry]:
    """The first page of :func:`list_unresolved_page` (the contract's shape)."""
    return list((await list_unresolved_page(core, identity=identity, limit=limit)).entries)


_PHASES = (NS_OPERATION, NS_REPLY)


def _encode_after(phase: int, cursor: str | None) -> str:
    return f"{phase}:{cursor or ''}"


def _decode_after(after: str | None) -> tuple[int, str | None] | None:
    if after is None:
        return 0, None
    phase, sep, cursor = after.partition(":")
    if not sep or phase not in ("0", "1"):
        return None
    return int(phase), cursor or None


async def list_unresolved_page(
    core: Core,
    *,
    identity: AgentIdentity,
    limit: int | None = None,
    after: str | None = None,
) -> UnresolvedPage:
    """Every unresolved operation and unsettled reply in the caller's scope, a page at a
    time: first the operations an operator may have to settle, then the operations whose
    reply is unsettled. ``next_cursor`` (pass it as ``after``) is ``None`` on the last page.

    Reads the journal's open categories only (an index the store keeps with each record),
    so the cost follows the unresolved set, not the journal's length: an ``executing``
    record behind a million settled ones is listed. ``limit`` is clamped to
    ``max_journal_page`` (``capped`` says so).
    """
    cap = core.limits.max_journal_page
    asked = cap if limit is None else int(limit)
    want = max(1, min(asked, cap))
    capped = asked > cap
    position = _decode_after(after)
    if core.journal is None or not core.active(identity) or position is None:
        return UnresolvedPage((), None, want, capped)
    phase, cursor = position
    scope = ownership_from_identity(identity)
    out: list[UnresolvedEntry] = []
    try:
        while phase < len(_PHASES) and len(out) < want:
            namespace = _PHASES[phase]
            rows, cursor = await core.journal.list(
                scope, namespace, want - len(out), cursor=cursor, open_only=True
            )
            for row in rows:
                if not _inside(scope, row.scope):
                    continue
                entry = await unresolved_entry(core, namespace, row)
                if entry is not None:
                    out.append(entry)
            if cursor is None:
                phase, cursor = phase + 1, None
    except Exception:
        core.count("storage_failures")
        return UnresolvedPage((), None, want, capped)
    next_cursor = None if phase >= len(_PHASES) else _encode_after(phase, cursor)
    out.sort(key=lambda e: e.updated_at, reverse=True)
    return UnresolvedPage(tuple(out), next_cursor, want, capped)


async def unresolved_entry(
    core: Core, namespace: str, row: CheckpointRecord
) -> UnresolvedEntry | None:
    """The listing entry of one open record, or ``None`` when it is not the operator's to
    settle after all (its operation is listed itself, or an answer exists)."""
    assert core.journal is not None
    if namespace == NS_OPERATION:
        try:
            record = OperationRecord.from_json(row.value)
        except ValueError:
            return None
        if record.state not in UNRESOLVED_OPERATION_STATES:
            if not maybe_answerless(record):
                return None
            # Killed between the terminal write and the reply staging (a journal written
            # before both committed together): without a reply row nothing else lists it,
            # and the answer would be lost silently.
            reply_row = await core.journal.load_reply(
                row.scope, record.connection_id, record.operation_id
            )
            if reply_row is not None:
                return None
        return UnresolvedEntry(
            record.operation_id,
            record.connection_id,
            record.state,
            row.version,
            ms_to_iso(row.updated_at_ms),
        )
    reply = open_reply(row)
    if reply is None:
        return None
    op = await core.journal.load_operation(row.scope, reply.connection_id, reply.operation_id)
    if not reply_listed(reply.operation_id, None if op is None else op.record.state):
        return None
    if op is None:
        return await _relay_entry(core, row, reply)
    return UnresolvedEntry(
        op.record.operation_id,
        op.record.connection_id,
        op.record.state,
        op.version,
        ms_to_iso(op.updated_at_ms),
        reply_state=reply.state,
        reason=reply.reason,
    )


def open_reply(row: CheckpointRecord) -> ReplyRecord | None:
    """The reply of an open reply row, or ``None`` when it is not unsettled after all (or
    does not decode): such a row is never listed."""
    value = row.value
    if not isinstance(value, dict) or value.get("state") not in UNRESOLVED_REPLY_STATES:
        return None
    try:
        return ReplyRecord.from_json(value)
    except ValueError:
        return None


def reply_listed(operation_id: str, operation_state: str | None) -> bool:
    """Whether the unsettled reply of ``operation_id`` is listed, by its operation's state
    (``None``: it has no operation record). Not while its operation is unresolved (listed
    with it); not without an operation to reconcile it by, but for a relay (listed by its
    own id)."""
    if operation_state is None:
        return RELAY_SEPARATOR in operation_id
    return operation_state not in UNRESOLVED_OPERATION_STATES


async def _relay_entry(core: Core, row: CheckpointRecord, reply: ReplyRecord) -> UnresolvedEntry:
    """A relay (:mod:`._relay`) whose send is unsettled: listed by its own id
    (``<operation id>~<key>``) and version, since reconciling its operation does not touch
    it; ``state`` is its operation's (``pruned`` once that is gone)."""
    assert core.journal is not None
    base = reply.operation_id.partition(RELAY_SEPARATOR)[0]
    op = await core.journal.load_operation(row.scope, reply.connection_id, base)
    return UnresolvedEntry(
        reply.operation_id,
        reply.connection_id,
        "pruned" if op is None else op.record.state,
        row.version,
        ms_to_iso(row.updated_at_ms),
        reply_state=reply.state,
        reason=reply.reason,
    )


_KEYS = {NS_OPERATION: operation_key, NS_REPLY: reply_key}


async def _find(
    core: Core, caller: OwnershipScope, namespace: str, connection_id: str, operation_id: str
) -> Loaded[Any] | str | None:
    """``operation_id``'s record of ``namespace`` (an operation, or a reply): loaded by the
    exact caller scope, else searched for in the caller's partial scope.

    Returns the loaded record, ``None`` (not found) or ``"ambiguous"``.
    """
    assert core.journal is not None
    key_of = _KEYS[namespace]
    exact = await core.journal.load(namespace, caller, key_of(connection_id, caller, operation_id))
    if exact is not None:
        return exact
    if caller.user_id is not None and caller.account_id is not None:
        return None
    matches: list[CheckpointRecord] = []
    cursor: str | None = None
    for _page in range(MAX_PAGES * 5):
        rows, cursor = await core.journal.list(caller, namespace, 500, cursor=cursor)
        for row in rows:
            if not _inside(caller, row.scope):
                continue
            if row.key == key_of(connection_id, row.scope, operation_id):
                matches.append(row)
        if cursor is None or not rows:
            break
    if not matches:
        return None
    if len({(m.scope.tenant_id, m.scope.account_id, m.scope.user_id) for m in matches}) > 1:
        return "ambiguous"
    scope = matches[0].scope
    return await core.journal.load(namespace, scope, key_of(connection_id, scope, operation_id))


async def reconcile(
    core: Core,
    *,
    identity: AgentIdentity,
    connection_id: str,
    operation_id: str,
    expected_version: int,
    acknowledge_duplicate_risk: bool = False,
) -> ReconcileResult:
    if core.journal is None:
        return ReconcileResult("unavailable")
    if not core.active(identity):
        return ReconcileResult("denied")
    if (
        not isinstance(operation_id, str)
        or not operation_id
        or not isinstance(connection_id, str)
        or isinstance(expected_version, bool)
        or not isinstance(expected_version, int)
        or not 0 <= expected_version <= MAX_SAFE_INTEGER
    ):
        return ReconcileResult("not_found")
    caller = ownership_from_identity(identity)
    try:
        found = await _find(core, caller, NS_OPERATION, connection_id, operation_id)
    except Exception:
        core.count("storage_failures")
        return ReconcileResult("unavailable")
    if found is None and RELAY_SEPARATOR in operation_id:
        return await _reconcile_relay(
            core, caller, connection_id, operation_id, expected_version, acknowledge_duplicate_risk
        )
    if found is None:
        return ReconcileResult("not_found")
    if isinstance(found, str):
        return ReconcileResult("conflict", detail="ambiguous")
    loaded = found
    record = loaded.record
    scope = loaded.scope
    if not _inside(caller, scope):
        return ReconcileResult("not_found")
    if loaded.version != expected_version:
        return ReconcileResult("conflict", state=record.state, current_version=loaded.version)
    if record.state == "executing":
        if not acknowledge_duplicate_risk:
            return ReconcileResult(
                "conflict",
                state=record.state,
                detail="duplicate_risk",
                current_version=loaded.version,
            )
        return await _transition(core, scope, loaded, "execution_unknown")
    if record.state == "accepted":
        return await _transition(core, scope, loaded, "abandoned")
    if record.state == FOLLOWING_STATE:
        # A remote task is followed (nothing to decide); cancelling it is its own act
        # (``reconcile … --cancel-remote``), settled by its follower.
        return ReconcileResult(
            "conflict", state=record.state, detail="following", current_version=loaded.version
        )
    try:
        reply = await core.journal.load_reply(scope, connection_id, operation_id)
    except Exception:
        core.count("storage_failures")
        return ReconcileResult("unavailable")
    if reply is None and maybe_answerless(record):
        # The answer never existed outside the dead process; the model is not re-run.
        # Flagging it handled (CAS on the expected version) takes it off the list.
        return await _mark_handled(core, scope, loaded)
    if reply is None:
        return ReconcileResult("resolved", outcome="none", state=record.state)
    return await _settle_reply(
        core, scope, reply, acknowledge_duplicate_risk, record.state, loaded.version
    )


async def _reconcile_relay(
    core: Core,
    caller: OwnershipScope,
    connection_id: str,
    relay_id: str,
    expected_version: int,
    acknowledge_duplicate_risk: bool,
) -> ReconcileResult:
    """Reconcile a relay listed by :func:`_relay_entry`: the version is its reply record's;
    a send that may have landed is resent only with ``acknowledge_duplicate_risk``."""
    try:
        found = await _find(core, caller, NS_REPLY, connection_id, relay_id)
    except Exception:
        core.count("storage_failures")
        return ReconcileResult("unavailable")
    if found is None:
        return ReconcileResult("not_found")
    if isinstance(found, str):
        return ReconcileResult("conflict", detail="ambiguous")
    state = found.record.state
    if found.version != expected_version:
        return ReconcileResult("conflict", state=state, current_version=found.version)
    return await _settle_reply(
        core, found.scope, found, acknowledge_duplicate_risk, state, found.version
    )


async def _settle_reply(
    core: Core,
    scope: OwnershipScope,
    reply: Loaded[ReplyRecord],
    acknowledge_duplicate_risk: bool,
    state: str,
    version: int,
) -> ReconcileResult:
    """The reply part of a reconcile: nothing to do once delivered; a send that may have
    landed is resent only with ``acknowledge_duplicate_risk`` (a held reply is proven
    unsent, its channel had no connection, like a refused one: it needs none). ``state``
    and ``version`` are what the result reports (the operation's, or the relay's)."""
    if reply.record.state == "delivered":
        return ReconcileResult("resolved", outcome="none", state=state)
    if (
        reply.record.state in UNSETTLED_REPLY_STATES
        and not is_held(reply.record)
        and not acknowledge_duplicate_risk
    ):
        return ReconcileResult(
            "conflict", state=state, detail="duplicate_risk", current_version=version
        )
    # Reopen-then-send (see _delivery.resend): a concurrent re-drive or a second operator
    # resending the same reply loses the reopen and sends nothing.
    sent = await resend(core, scope, reply)
    if sent is None:
        return ReconcileResult("conflict", state=state)
    return ReconcileResult(
        "resolved", outcome=_RESEND_OUTCOMES.get(sent, "reply_unknown"), state=state
    )


async def _mark_handled(
    core: Core, scope: OwnershipScope, loaded: Loaded[OperationRecord]
) -> ReconcileResult:
    return await _resolve(core, scope, loaded, None, {"reply_staged": True}, "none")


async def _transition(
    core: Core, scope: OwnershipScope, loaded: Loaded[OperationRecord], state: str
) -> ReconcileResult:
    result = await _resolve(core, scope, loaded, state, None, state)
    if result.status == "resolved":
        # The message will never be answered: its user may be told (issue 38).
        await tell(core, loaded.record)
    return result


async def _resolve(
    core: Core,
    scope: OwnershipScope,
    loaded: Loaded[OperationRecord],
    to: str | None,
    change: Change | None,
    outcome: str,
) -> ReconcileResult:
    """One CAS at the version the operator saw: ``resolved`` with ``outcome``, else
    conflict (with the current version) or unavailable."""
    assert core.journal is not None
    record = loaded.record
    try:
        # fence=None: the stored fencing token, so a dead holder's fence does not block it.
        saved = await transition(
            core.journal,
            OperationRef(scope, record.connection_id, record.operation_id),
            to,
            now_ms=core.now_ms(),
            known=loaded,
            change=change,
            retry=False,
        )
    except Exception:
        core.count("storage_failures")
        return ReconcileResult("unavailable")
    if saved is None:
        return await _lost_race(core, scope, record)
    return ReconcileResult("resolved", outcome=outcome, state=saved.record.state)


async def _lost_race(core: Core, scope: OwnershipScope, op: OperationRecord) -> ReconcileResult:
    """``conflict`` after a lost compare-and-swap, with the version the record has now."""
    assert core.journal is not None
    current = None
    try:
        now = await core.journal.load_operation(scope, op.connection_id, op.operation_id)
    except Exception:
        core.count("storage_failures")
    else:
        current = None if now is None else now.version
    return ReconcileResult("conflict", state=op.state, current_version=current)


_RESEND_OUTCOMES = {
    "delivered": "reply_delivered",
    "delivery_failed": "reply_failed",
    "pending": "reply_held",
}
"""A resend's marked state → the reconcile outcome (else ``reply_unknown``)."""


def _kept(namespace: str, value: Any) -> bool:
    if namespace in AGENT_NAMESPACES:
        return agent_record_kept(namespace, value)
    if not isinstance(value, dict):
        return namespace == NS_OPERATION
    if namespace == NS_OPERATION:
        state = value.get("state")
        return (
            not isinstance(state, str)
            or state in UNRESOLVED_OPERATION_STATES
            or state == FOLLOWING_STATE
        )
    if namespace == NS_REPLY:
        return value.get("state") in UNSETTLED_REPLY_STATES
    if namespace == NS_BINDING:
        return value.get("suspended") is True
    return False


async def _reply_unsettled(core: Core, row: CheckpointRecord) -> bool:
    assert core.journal is not None
    value = row.value
    if not isinstance(value, dict):
        return False
    conn, op_id = value.get("connectionId"), value.get("operationId")
    if not isinstance(conn, str) or not isinstance(op_id, str):
        return False
    reply = await core.journal.checkpoints.load_checkpoint(
        namespace=NS_REPLY, key=reply_key(conn, row.scope, op_id), scope=row.scope
    )
    return _kept(NS_REPLY, None if reply is None else reply.value)


def _timestamp(row: CheckpointRecord) -> int:
    value = row.value
    if isinstance(value, dict):
        ms = value.get("updatedAtMs")
        if isinstance(ms, int) and not isinstance(ms, bool):
            return ms
    return row.updated_at_ms


async def prune(core: Core, *, identity: AgentIdentity, now_ms: int | None = None) -> PruneResult:
    """Delete settled records older than ``retention_days`` in the caller's scope.

    Bounded: at most ``MAX_PAGES`` pages of ``max_journal_page`` rows per namespace per
    call. Keeps unresolved operations, unsettled replies and suspended bindings. The
    agents' records (transcripts, run state: :data:`~prismd.agents.AGENT_NAMESPACES`) go
    under the same retention, except runs still in flight.
    """
    if core.journal is None or not core.active(identity):
        return PruneResult()
    caller = ownership_from_identity(identity)
    now = core.now_ms() if now_ms is None else now_ms
    cutoff = now - core.limits.retention_days * DAY_MS
    scanned = deleted = retained = 0
    for namespace in (NS_OPERATION, NS_REPLY, NS_BINDING, NS_CURSOR, NS_CONTROL, *AGENT_NAMESPACES):
        cursor: str | None = None
        for _page in range(MAX_PAGES):
            try:
                rows, cursor = await core.journal.list(
                    caller, namespace, core.limits.max_journal_page, cursor=cursor
                )
            except Exception:
                core.count("storage_failures")
                break
            for row in rows:
                if not _inside(caller, row.scope):
                    continue
                scanned += 1
                if _timestamp(row) > cutoff or _kept(namespace, row.value):
                    retained += 1
                    continue
                try:
                    if namespace == NS_OPERATION and await _reply_unsettled(core, row):
                        # The kept reply is reachable (listed, reconciled) only
                        # through its operation: keep both.
                        retained += 1
                        continue
                    removed = await core.journal.remove(namespace, row.scope, row.key)
                except Exception:
                    core.count("storage_failures")
                    removed = False
                if removed:
                    deleted += 1
                else:
                    retained += 1
            if cursor is None or not rows:
                break
    return PruneResult(scanned=scanned, deleted=deleted, retained=retained)
