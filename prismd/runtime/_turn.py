"""Turns (contract §9.1): one FIFO pump per route, slots, claim, run, settle, reply.

What happens to a message after ``admit`` returns, top to bottom:

1. :func:`enqueue` puts it on its route's queue (the one "admit to route", shared by
   admission and by the resume of messages acknowledged before a restart);
2. the route pump takes the binding lease (retrying with bounded backoff while another
   owner holds it — the record stays ``accepted`` and listed, SPEC difference 8) and keeps
   it across back-to-back turns, releasing it only once the route stayed idle;
3. the head turn is popped; cancelled/revoked turns settle without a run;
4. a concurrency slot is taken (FIFO);
5. the operation is claimed ``accepted → executing`` by CAS under the lease fence, with
   ``attempts`` + 1 (SPEC difference 5), **before** the agent is called;
6. the agent runs inside a cancel scope (``/cancel`` and ``stop()`` cancel it);
7. :func:`finish_run`: the terminal state, the binding (when it changed) and the reply
   staged ``pending`` commit together (:func:`prismd.journal.finish`); the reply goes to
   the route's outbox (:func:`~._core.send_from_route`), which delivers it and marks its
   outcome while the pump claims the next turn — replies leave in the order staged, and
   the route keeps its lease until its outbox is empty.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import trio

from ..agents import (
    Agent,
    AgentInput,
    EventSink,
    ImageBlock,
    RunFailedError,
    RunRequest,
    RunResult,
    TextBlock,
)
from ..channel import MAX_REPLY_FILES, ReplyFile
from ..grants import AgentIdentity
from ..journal import (
    FOLLOWING_STATE,
    OperationRecord,
    OperationRef,
    StoreUnavailableError,
    SuspendedRun,
    transition,
)
from ._approvals import issue_buttons
from ._core import Core
from ._following import TurnHooks, Wake, claim_following, left_for_restart, park
from ._leases import LEASE_BACKOFF_MAX_S, LEASE_BACKOFF_START_S, acquire_promptly
from ._replies import (
    CANCELLED_TEXT,
    Draft,
    Settle,
    TypingTimer,
    answer,
    outcome_of,
    preview_sink,
)
from ._routes import ActiveTurn, Route, Turn

UNSUPPORTED_MEDIA_TEXT = "That attachment cannot be processed by the selected agent."
CANCELLED_BEFORE_START = "Request cancelled before it started."
"""Renewal of a running turn's typing indicator (Telegram shows a chat action for 5 s)."""
MAX_CLAIM_RETRIES = 8
log = logging.getLogger("prismd.runtime")


# --------------------------------------------------------------------------- admit to route


async def enqueue(
    core: Core,
    route: Route,
    turn: Turn,
    identity: AgentIdentity,
    *,
    still_wanted: Callable[[], bool] | None = None,
) -> str:
    """Put ``turn`` on ``route``'s queue and start its pump: ``"queued"``, or why not.

    ``"suspended"`` (the route awaits a decision: the caller answers with the notice and
    settles or removes the record), ``"capacity"`` (route or process queue full),
    ``"malformed"`` (the host's ``resolve_binding`` returned an unusable session id),
    ``"unavailable"`` (the binding could not be read or created), ``"gone"``
    (``still_wanted`` said no after the binding was read). The route is hydrated first.
    """
    try:
        await core.routes.hydrate(route, identity)
    except TypeError:
        return "malformed"
    except Exception:
        core.count("storage_failures")
        return "unavailable"
    if route.suspended:
        return "suspended"
    if (
        len(route.queue) >= core.limits.max_pending_per_binding
        or core.pending_total() >= core.limits.max_pending_per_process
    ):
        return "capacity"
    if core.stopped or (still_wanted is not None and not still_wanted()):
        return "gone"
    route.queue.append(turn)
    core.count("admitted")
    start_pump(core, route)
    return "queued"


def start_pump(core: Core, route: Route) -> None:
    if route.pumping or not route.queue:
        return
    route.pumping = True
    core.spawn(pump, core, route)


async def pump(core: Core, route: Route) -> None:
    """Run the route's queue in order until it is empty; the lease is released once the
    route stayed idle (see :meth:`Core.release_when_idle`), or at once when the pump is
    torn down."""
    torn_down = False
    try:
        while route.queue and route.parked is None:
            if core.stopped:
                # stop() settles what it saw queued; a turn put back afterwards (lease
                # lost before its claim) must not run after stop either.
                await _settle_queue_at_stop(core, route)
                break
            head = route.queue.head
            assert head is not None
            if (
                core.leases.enabled
                and not head.cancelled
                and not await _wait_for_lease(core, route, head)
            ):
                continue
            if route.queue.head is not head:
                continue
            if route.lease_fresh:
                try:
                    await _refresh_binding(core, route)
                except Exception:
                    core.count("storage_failures")
            route.queue.pop_head()
            if head.claim_failures:
                exponent = min(head.claim_failures, 16)
                await trio.sleep(min(LEASE_BACKOFF_START_S * 2**exponent, LEASE_BACKOFF_MAX_S))
            await execute_turn(core, route, head)
    except trio.Cancelled:
        torn_down = True
        raise
    finally:
        route.pumping = False
        if torn_down or core.stopped:
            await core.leases.release_if_idle(route)
        else:
            await core.leases.release_when_idle(route)
            core.routes.release(route)  # a parked turn alone, no lease (:mod:`._following`)


async def _refresh_binding(core: Core, route: Route) -> None:
    """Re-read the durable binding after a fresh lease acquisition: another runtime on
    the store may have run ``/new``, a turn or a resume since this process hydrated it,
    and saving the stale in-memory copy would rewind it. Store errors propagate."""
    route.lease_fresh = False
    if core.journal is None or not route.hydrated:
        return
    loaded = await core.journal.load_binding(route.scope, route.binding_key)
    if loaded is not None and loaded.version != route.binding_version:
        core.routes.apply_binding(route, loaded.version, loaded.record)


async def _settle_queue_at_stop(core: Core, route: Route) -> None:
    for turn in route.queue.take_all():
        if not turn.cancel_counted:
            turn.cancel_counted = True
            core.count("cancelled")
        if not turn.settled:
            turn.cancelled = True
            await end_turn(core, route, turn, "cancelled", "cancelled_at_shutdown", None)


async def _wait_for_lease(core: Core, route: Route, head: Turn) -> bool:
    """Acquire the binding lease for ``head``; retry with bounded backoff while it is held
    elsewhere. False when the head changed (cancelled or cleared) meanwhile."""
    delay = LEASE_BACKOFF_START_S
    lost_counted = False
    while True:
        if route.queue.head is not head or head.cancelled or core.stopped:
            return False
        try:
            lease = await core.leases.ensure(route)
        except Exception:
            core.count("storage_failures")
            lease = None
        if lease is not None:
            return True
        if not lost_counted:
            core.count("lease_losses")
            lost_counted = True
        await trio.sleep(delay)
        delay = min(delay * 2, LEASE_BACKOFF_MAX_S)


# --------------------------------------------------------------------------- ending a turn


def _ref(turn: Turn) -> OperationRef:
    return OperationRef(turn.scope, turn.event.connection_id, turn.operation_id)


async def end_turn(
    core: Core,
    route: Route,
    turn: Turn,
    state: str,
    error_code: str | None,
    fence: int | None,
    text: str | None = None,
    *,
    kind: str = "notice",
    buttons: tuple[Any, ...] = (),
    approval: dict[str, Any] | None = None,
    with_binding: bool = False,
    files: tuple[ReplyFile, ...] = (),
    **extra: Any,
) -> None:
    """Settle the turn's operation in ``state`` and, when ``text`` is given, answer it —
    one journal transaction (with the route's binding when ``with_binding``), then the send.

    Only from a state the turn can have left it in (:data:`prismd.journal.OPERATION_FLOW`):
    an operator may have filed the claimed record meanwhile (``execution_unknown``), and a
    late result never undoes that. ``extra`` sets ``run_id`` / ``session_id`` when given.
    Under a lease ``fence``, nothing is written or sent once that lease is no longer held
    (a process woken after its lease expired: the conversation has moved on elsewhere).
    """
    if turn.settled_by_stop:
        return
    turn.finishing = True
    changes = {k: v for k, v in extra.items() if v is not None}
    if error_code is not None:
        changes["error_code"] = error_code
    draft = None
    if text is not None:
        draft = Draft.for_event(
            turn.grant.identity,
            turn.operation_id,
            turn.event,
            text,
            kind=kind,
            buttons=buttons,
            approval=approval,
            files=files,
        )
    answered = await answer(
        core,
        draft,
        scope=turn.scope,
        fence=fence,
        settle=Settle(_ref(turn), state, known=turn.op, change=changes),
        binding=core.routes.binding_write(route, fence) if with_binding else None,
        fenced=core.leases.holding(route, fence),
        send_behind=route,
    )
    turn.op = answered.operation
    turn.settled = True
    if with_binding:
        core.routes.binding_written(route, answered.binding)


# --------------------------------------------------------------------------- running a turn


async def execute_turn(core: Core, route: Route, turn: Turn) -> None:
    identity = turn.grant.identity
    if turn.cancelled:
        if not turn.cancel_counted:
            turn.cancel_counted = True
            core.count("cancelled")
        if not turn.settled:
            text = None if core.stopped else CANCELLED_BEFORE_START
            await end_turn(core, route, turn, "cancelled", "cancelled_before_start", None, text)
        elif not core.stopped:
            # Settled by /cancel while queued: only the notice is left to send.
            await _notice(core, route, turn, CANCELLED_BEFORE_START, core.leases.fence_now(route))
        return
    if not core.active(identity):
        core.count("denied")
        await end_turn(
            core, route, turn, "failed", "identity_revoked", core.leases.fence_now(route)
        )
        return
    active = ActiveTurn(state="waiting", turn=turn)
    route.active = active
    try:
        # A wait for a slot is under the turn's scope: /cancel and stop() end it.
        if not await acquire_promptly(core.slots, wait_within=active.cancel_scope):
            await _cancelled_waiting(core, route, turn, active)
            return
        hooks = TurnHooks(core, route, turn, active, slot_held=True, start_pump=start_pump)
        try:
            ran = await _run_with_slot(core, route, turn, active, hooks)
        finally:
            # The slot bounds concurrent agent runs; the journal writes and the send that
            # end the turn do not hold it up for the next run. The turn took it and gives
            # it back, unless a followed remote task gave it back already (the hooks then
            # no longer hold it: :mod:`._following`).
            if hooks.slot_held:
                hooks.slot_held = False
                core.slots.release()
        if ran is not None:
            # Only a followed turn may be left for the restart (:mod:`._following`).
            if turn.following and left_for_restart(core, turn, active.stopping):
                return
            if ran[1].status == "following":
                park(core, route, turn, hooks.parked or Wake(core, route, turn, start_pump))
                return
            await finish_run(core, route, turn, *ran)
    finally:
        route.active = None
        active.ended.set()


async def _notice(core: Core, route: Route, turn: Turn, text: str, fence: int | None) -> None:
    """A notice for a turn whose operation is already settled."""
    await answer(
        core,
        Draft.for_event(turn.grant.identity, turn.operation_id, turn.event, text),
        scope=turn.scope,
        fence=fence,
    )


async def _cancelled_waiting(core: Core, route: Route, turn: Turn, active: ActiveTurn) -> None:
    if not turn.cancel_counted:
        turn.cancel_counted = True
        core.count("cancelled")
    text = None if active.stopping else CANCELLED_BEFORE_START
    await end_turn(core, route, turn, "cancelled", "cancelled_while_queued", None, text)


async def _cancelled_before_claim(
    core: Core, route: Route, turn: Turn, active: ActiveTurn, fence: int | None
) -> None:
    if not turn.cancel_counted:
        turn.cancel_counted = True
        core.count("cancelled")
    if active.stopping or core.stopped:
        await end_turn(core, route, turn, "cancelled", "cancelled_at_shutdown", fence)
        return
    await end_turn(core, route, turn, "cancelled", "cancelled_before_start", fence, CANCELLED_TEXT)


async def _run_with_slot(
    core: Core, route: Route, turn: Turn, active: ActiveTurn, hooks: TurnHooks
) -> tuple[Agent, RunResult, int | None] | None:
    """Claim and run; the run's agent, result and fence for :func:`finish_run`, or
    ``None`` when the turn ended here (settled, put back on the queue, or lost)."""
    identity = turn.grant.identity
    if not core.active(identity):
        core.count("denied")
        await end_turn(
            core, route, turn, "failed", "identity_revoked", core.leases.fence_now(route)
        )
        return None
    # A fresh scope for the run itself: a cancel that arrived while waiting is honoured.
    run_scope = trio.CancelScope()
    if active.cancelled:
        run_scope.cancel()
    active.cancel_scope = run_scope
    active.state = "running"
    fence = core.leases.fence_now(route)
    in_agent = False
    try:
        agent = await core.resolve_agent(route, identity)
        try:
            agent_input = await build_input(core, agent, turn)
        except _Unsupported:
            core.count("unsupported")
            await end_turn(
                core, route, turn, "failed", "unsupported_media", fence, UNSUPPORTED_MEDIA_TEXT
            )
            return None
        if route.session_id is None:
            route.session_id, route.leaf_id = await core.routes.derive_session(
                route, identity, route.generation
            )
        if active.cancelled or core.stopped:
            # ``/cancel`` or ``stop()`` arrived before the claim (while resolving the agent,
            # fetching media, deriving the session): no agent call at all.
            await _cancelled_before_claim(core, route, turn, active, fence)
            return None
        if core.leases.enabled:
            # The claim is written only under a live lease fence. Lost meanwhile (renewal
            # failed, taken over)? The turn goes back to the head of the queue, still
            # ``accepted``, and the pump waits for the lease again (SPEC difference 8).
            lease = None
            try:
                lease = await core.leases.ensure(route)
            except Exception:
                core.count("storage_failures")
            if lease is None:
                route.queue.push_front(turn)
                return None
            fence = lease.fencing_token
        if turn.following or (turn.op is not None and turn.op.record.state == FOLLOWING_STATE):
            # Recovered after a restart: follow the remote task again, never re-run.
            try:
                followed = await claim_following(core, turn, fence)
            except Exception:
                core.count("storage_failures")
                followed = False
            claimed = "claimed" if followed else "lost"
        else:
            claimed = await claim(core, route, turn, fence)
        if claimed in ("unavailable", "retry") and not core.stopped:
            if claimed == "unavailable" or turn.claim_failures < MAX_CLAIM_RETRIES:
                # Not a lost CAS: the acknowledged record is still ours to run. Back to the
                # head of the queue; the pump backs off (bounded). While the store is down
                # it is retried for as long as that lasts: never dropped from memory.
                turn.claim_failures += 1
                route.queue.push_front(turn)
                return None
            log.warning(
                "claim of %s kept failing (%d attempts); it stays accepted and is listed",
                turn.operation_id,
                turn.claim_failures,
            )
        if claimed != "claimed":
            return None
        hooks.fence = fence
        request = RunRequest(
            session_id=route.session_id,
            input=agent_input,
            identity=identity,
            idempotency_key=turn.operation_id,
            leaf_id=route.leaf_id,
            hooks=hooks,
        )
        sink = preview_sink(core, route, active)
        result: RunResult | None = None
        in_agent = True
        with run_scope:
            try:
                result = await _run_agent(core, route, agent, request, sink, hooks)
            except RunFailedError as exc:
                result = exc.result
        if result is None:
            result = RunResult(status="aborted", text="", run_id="", session_id=request.session_id)
    except Exception as exc:
        core.count("failed")
        # Only the agent's own error message is shown (redacted); a host seam's
        # (resolve_agent, fetch_attachment, resolve_binding) may carry URLs or paths.
        detail = str(exc) if in_agent else None
        await end_turn(
            core, route, turn, "failed", "runtime_error", fence, core.failure_text(detail)
        )
        return None
    return agent, result, fence


async def claim(core: Core, route: Route, turn: Turn, fence: int | None) -> str:
    """CAS ``accepted → executing`` (attempts + 1) under the lease fence, before any run.

    ``"claimed"``; ``"lost"`` (the record is no longer ``accepted``: someone else's);
    ``"unavailable"`` (the store is down) or ``"retry"`` (another error, e.g. a record that
    does not parse): whether the write landed is unknown, so the caller may retry — the
    retry is again a CAS from ``accepted``, never a second run.
    """
    if core.journal is None:
        return "claimed"

    def claimed(record: OperationRecord) -> dict[str, Any]:
        return {"attempts": record.attempts + 1, "session_id": route.session_id}

    try:
        saved = await transition(
            core.journal,
            _ref(turn),
            "executing",
            now_ms=core.now_ms(),
            known=turn.op,
            fence=fence,
            change=claimed,
            allowed=lambda record: record.state == "accepted",
        )
    except StoreUnavailableError:
        core.count("storage_failures")
        turn.op = None
        return "unavailable"
    except Exception:
        core.count("storage_failures")
        turn.op = None
        return "retry"
    if saved is None:
        core.count("storage_failures")
        return "lost"
    turn.op = saved
    return "claimed"


async def finish_run(
    core: Core, route: Route, turn: Turn, agent: Agent, result: RunResult, fence: int | None
) -> None:
    """Settle the operation as :func:`~._replies.outcome_of` says, with the binding and the
    answer in the same transaction, then send the answer (§9.1 steps 9–11)."""
    if turn.settled_by_stop:
        # stop() already settled this operation ``cancelled`` after its deadline.
        return
    outcome = outcome_of(core, result)
    if result.status == "suspended":
        route.suspended = True
        route.suspended_run = SuspendedRun(turn.operation_id, result.run_id, result.session_id)
    elif result.leaf_id is not None:
        route.leaf_id = result.leaf_id
    if outcome.counter is not None:
        core.count(outcome.counter)
    text = outcome.text
    buttons: tuple[Any, ...] = ()
    approval: dict[str, Any] | None = None
    if result.status == "suspended":
        text, buttons, approval = await issue_buttons(
            core, route, agent, turn.grant, result.run_id, result.session_id
        )
    await end_turn(
        core,
        route,
        turn,
        outcome.state,
        outcome.error_code,
        fence,
        text,
        kind=outcome.kind,
        buttons=buttons,
        approval=approval,
        with_binding=True,
        files=result.files[:MAX_REPLY_FILES] if outcome.kind == "final" else (),
        run_id=result.run_id or None,
        session_id=result.session_id or None,
    )


class _Unsupported(Exception):
    pass


async def _run_agent(
    core: Core,
    route: Route,
    agent: Agent,
    request: RunRequest,
    sink: EventSink | None,
    hooks: TurnHooks,
) -> RunResult:
    """``agent.run``, with the host's typing indicator once the run outlasts the
    connection's typing delay (see :class:`TypingTimer`); it ends however the run ends."""
    if core.on_typing is None:
        return await agent.run(request, on_event=sink)
    timer = core.typing_timer
    if timer is None:
        timer = core.typing_timer = TypingTimer(core)
    watch = timer.watch(route)
    hooks.stop_typing = functools.partial(timer.end, watch)
    try:
        return await agent.run(request, on_event=sink)
    finally:
        timer.end(watch)


async def build_input(core: Core, agent: Agent, turn: Turn) -> AgentInput:
    """§9.4: text, or a user message with text and image blocks; else unsupported."""
    event = turn.event
    if not event.attachments:
        return event.text
    images = [a for a in event.attachments if a.kind == "image"]
    if not images:
        if event.text.strip():
            return event.text
        raise _Unsupported()
    if "image" not in agent.input_capabilities or core.fetch_attachment is None:
        raise _Unsupported()
    blocks: list[TextBlock | ImageBlock] = []
    if event.text:
        blocks.append(TextBlock(event.text))
    for ref in images:
        fetched = await core.fetch_attachment(ref)
        data = _fetched_bytes(fetched)
        if not data:
            raise _Unsupported()
        mime = getattr(fetched, "mime_type", None) or ref.mime_type
        blocks.append(ImageBlock(data=data, mime_type=mime))
    return tuple(blocks)


def _fetched_bytes(fetched: object) -> bytes | None:
    if fetched is None:
        return None
    if isinstance(fetched, bytes | bytearray):
        return bytes(fetched)
    data = getattr(fetched, "data", None)
    if isinstance(data, bytes | bytearray):
        return bytes(data)
    return None
