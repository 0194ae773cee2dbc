"""Resume acknowledged messages after a restart (SPEC difference 8, issue 3).

An ``accepted`` operation record that carries ``input`` was acknowledged to its transport
by a previous process that died before claiming it. The claim ``accepted → executing`` is
a CAS written before any agent call, so such a record provably never ran: running it now
is its first run, not a replay, and the claim CAS still guarantees at most one run even
when several runtimes on one store recover at once.

Guarantees:

* Recovered turns are enqueued oldest first (``createdAt``), each exactly as ``admit``
  would after its record exists: re-authorized with action ``message``, the route hydrated,
  per-route FIFO, capacity and lease rules unchanged.
* A denial now settles the record ``failed`` (``identity_revoked`` / ``rejected``) without
  a run; an ``authorize`` exception, a full queue, a full route table or a store error
  leave it ``accepted`` and it is retried with bounded backoff until the runtime stops.
* Recovered turns count as ``admitted`` (the previous process admitted them; a counter
  restarted with the process, so they are counted once per process that queues them);
  ``duplicates`` is unchanged.
* Only records created before the millisecond this runtime started are considered: later
  ones belong to a live admission (this process's or another runtime's), which queues
  them itself. A record of another *live* runtime on the same store created earlier may
  be queued here too; the claim CAS lets exactly one of the two run it.
* Nothing here logs or raises inbound text.
"""

from __future__ import annotations

import attrs
import trio

from ..channel import InboundEvent
from ..grants import Grant, ownership_from_identity
from ..journal import (
    FOLLOWING_STATE,
    NS_OPERATION,
    Loaded,
    OperationRecord,
    OperationRef,
    OwnershipScope,
)
from ._admit import AWAITING_DECISION_TEXT
from ._core import Core, authorize_input, check_grant
from ._following import release_agent
from ._leases import LEASE_BACKOFF_MAX_S, LEASE_BACKOFF_START_S
from ._replies import Draft, Settle, answer
from ._routes import Turn, route_key
from ._turn import enqueue

MAX_AUTHORIZE_FAILURES = 8
_RESUMED_STATES = frozenset({"accepted", FOLLOWING_STATE})


@attrs.define(eq=False)
class _Pending:
    loaded: Loaded[OperationRecord]
    authorize_failures: int = 0


def _event(record: OperationRecord) -> InboundEvent:
    event = InboundEvent(
        connection_id=record.connection_id,
        external_conversation_id=record.external_conversation_id,
        external_actor_id=record.external_actor_id,
        event_id=record.event_id,
        thread_id=record.thread_id,
    )
    inp = record.input
    if inp is None:
        # A followed operation (its text was dropped when it left ``accepted``): the agent
        # follows the journaled remote task and never needs the text again.
        return event
    return attrs.evolve(
        event,
        text=inp.text,
        attachments=tuple(
            attrs.evolve(a, connection_id=record.connection_id) for a in inp.attachments
        ),
        thread_id=record.thread_id if record.thread_id is not None else inp.thread_id,
        received_at_ms=inp.received_at_ms,
        claims=dict(inp.claims),
    )


def _admission_order(pending: _Pending) -> tuple[int, int, str]:
    """Oldest first: the millisecond, then the microsecond stamp of the admission (records
    written before it had one count as the millisecond's first), then the id."""
    record = pending.loaded.record
    admitted = record.input.admitted_us if record.input is not None else None
    return (record.created_at_ms, admitted or 0, record.operation_id)


def _resumable(record: OperationRecord) -> bool:
    """Never started (``accepted``), or following a remote task (SPEC difference 9)."""
    if record.kind != "message":
        return False
    if record.state == FOLLOWING_STATE:
        return True
    return record.state == "accepted" and record.input is not None


async def collect(
    core: Core, cutoff_ms: int, states: frozenset[str] = _RESUMED_STATES
) -> list[_Pending]:
    """Every resumable record (any scope) in ``states`` created before ``cutoff_ms``, oldest
    first. Pages are bounded by ``max_journal_page``; cursors are followed to the end."""
    assert core.journal is not None
    operations: list[Loaded[OperationRecord]] = await core.journal.open_records(
        NS_OPERATION, page_size=core.limits.max_journal_page
    )
    found = [
        _Pending(loaded)
        for loaded in operations
        if loaded.record.state in states
        and _resumable(loaded.record)
        and loaded.record.created_at_ms < cutoff_ms
    ]
    found.sort(key=_admission_order)
    return found


def _known(core: Core, operation_id: str) -> bool:
    """The operation is already queued or running in this process."""
    for route in core.routes.values():
        active = route.active
        if (
            active is not None
            and active.turn is not None
            and active.turn.operation_id == operation_id
        ):
            return True
        if any(t.operation_id == operation_id for t in route.queue):
            return True
    return False


async def _deny(core: Core, loaded: Loaded[OperationRecord], code: str) -> None:
    core.count("denied")
    record = loaded.record
    settled = await core.settle_operation(
        loaded.scope,
        record.connection_id,
        record.operation_id,
        "failed",
        error_code=code,
        only_from=_RESUMED_STATES,
    )
    if settled and record.state == FOLLOWING_STATE:
        # Its remote task is followed no more: the agent closes what it keeps for it.
        await release_agent(core, record.agent_alias, loaded.scope, record.operation_id)


async def _try_enqueue(core: Core, item: _Pending) -> str:
    """``"done"`` (queued, settled or no longer ours) or ``"retry"`` (left accepted)."""
    loaded = item.loaded
    record = loaded.record
    if _known(core, record.operation_id):
        return "done"
    event = _event(record)
    received = event.received_at_ms if event.received_at_ms is not None else core.now_ms()
    try:
        grant = await core.authorize(authorize_input(event, "message", received))
    except Exception:
        item.authorize_failures += 1
        return "retry" if item.authorize_failures < MAX_AUTHORIZE_FAILURES else "done"
    reason = check_grant(core, grant)
    if reason is not None:
        await _deny(core, loaded, "identity_revoked" if reason == "revoked" else "rejected")
        return "done"
    assert isinstance(grant, Grant)
    scope = ownership_from_identity(grant.identity)
    if scope != loaded.scope or record.agent_alias not in grant.agent_aliases:
        # The grant now names another owner or no longer allows the journaled agent.
        await _deny(core, loaded, "rejected")
        return "done"
    route = core.routes.route(route_key(event, record.agent_alias, scope))
    if route is None:
        return "retry"
    turn = Turn(
        operation_id=record.operation_id,
        event=event,
        action="message",
        grant=grant,
        scope=scope,
        alias=record.agent_alias,
        op=loaded,
    )
    with core.routes.pinned(route):
        queued = await enqueue(
            core,
            route,
            turn,
            grant.identity,
            still_wanted=lambda: not _known(core, record.operation_id),
        )
    if queued in ("queued", "gone"):
        return "done"
    if queued == "suspended":
        # The conversation awaits a decision: this message cannot run before it; it is
        # settled with the notice that says so, in one transaction.
        core.count("denied")
        draft = Draft.for_event(grant.identity, record.operation_id, event, AWAITING_DECISION_TEXT)
        settle = Settle(
            OperationRef(scope, record.connection_id, record.operation_id),
            "failed",
            known=loaded,
            change={"error_code": "awaiting_decision"},
            only_from=frozenset({"accepted"}),
        )
        core.spawn(_answer_denied, core, draft, scope, settle)
        return "done"
    return "retry"


async def _answer_denied(core: Core, draft: Draft, scope: OwnershipScope, settle: Settle) -> None:
    await answer(core, draft, scope=scope, settle=settle)


async def _still_resumable(core: Core, item: _Pending) -> bool:
    assert core.journal is not None
    record = item.loaded.record
    try:
        loaded = await core.journal.load_operation(
            item.loaded.scope, record.connection_id, record.operation_id
        )
    except Exception:
        core.count("storage_failures")
        return True
    if loaded is None or not _resumable(loaded.record):
        return False
    item.loaded = loaded._replace(scope=item.loaded.scope)
    return True


async def resume_accepted(core: Core, cutoff_ms: int) -> None:
    """Queue every resumable record; retry what could not be queued with bounded backoff
    until done or the runtime stops. Sets ``core.resume_gate`` after the first pass."""
    gate = core.resume_gate
    try:
        delay = LEASE_BACKOFF_START_S
        pending: list[_Pending] | None = None
        while not core.stopped:
            try:
                if pending is None:
                    pending = await collect(core, cutoff_ms)
                else:
                    pending = [p for p in pending if await _still_resumable(core, p)]
            except Exception:
                core.count("storage_failures")
                pending = None
            else:
                left: list[_Pending] = []
                for item in pending:
                    if core.stopped:
                        return
                    # Once one record of a route waits, later ones of that route wait too
                    # (per-route FIFO); the simple rule: everything after a retry waits.
                    if left or await _try_enqueue(core, item) == "retry":
                        left.append(item)
                pending = left
                if gate is not None:
                    gate.set()
                if not pending:
                    return
            await trio.sleep(delay)
            delay = min(delay * 2, LEASE_BACKOFF_MAX_S)
    finally:
        if gate is not None:
            gate.set()


_FOLLOWING_ONLY = frozenset({FOLLOWING_STATE})


async def follow_orphans(core: Core, every_s: float) -> None:
    """Several instances on one store (SPEC difference 9): every ``every_s`` (the lease
    TTL), queue here each ``following`` operation that is neither queued nor running here.

    Its turn waits for the conversation's binding lease like any other: while the instance
    that follows the task is alive it holds that lease, and its turn ends the operation (the
    claim here then finds it settled: nothing runs). Once that instance died and its lease
    expired, this one takes the lease over (a new fencing token: the old owner's late writes
    are refused) and its claim keeps the operation ``following`` — the remote task is
    followed here, never sent again. Runs until the runtime stops; store errors are counted
    and the next round tries again.
    """
    if core.resume_gate is not None:
        await core.resume_gate.wait()
    while not core.stopped:
        await trio.sleep(every_s)
        try:
            pending = await collect(core, 2**53, _FOLLOWING_ONLY)
        except Exception:
            core.count("storage_failures")
            continue
        here = _known_ids(core)  # one pass over the routes, not one per operation
        for item in pending:
            if core.stopped:
                return
            if item.loaded.record.operation_id not in here:
                await _try_enqueue(core, item)


def _known_ids(core: Core) -> set[str]:
    """The operations queued or running in this process."""
    ids: set[str] = set()
    for route in core.routes.values():
        active = route.active
        if active is not None and active.turn is not None:
            ids.add(active.turn.operation_id)
        if route.parked is not None:
            ids.add(route.parked.operation_id)
        ids.update(t.operation_id for t in route.queue)
    ids.update(parked.operation_id for _key, parked in core.routes.released())
    return ids
