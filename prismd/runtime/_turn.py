"""Turns (contract §9.1): one FIFO pump per route, slots, claim, run, settle, reply.

What happens to a message after ``admit`` returns, top to bottom:

1. the route pump takes the binding lease (retrying with bounded backoff while another
   owner holds it — the record stays ``accepted`` and listed, SPEC difference 8);
2. the head turn is popped; cancelled/revoked turns settle without a run;
3. a concurrency slot is taken (FIFO);
4. the operation is claimed ``accepted → executing`` by CAS under the lease fence, with
   ``attempts`` + 1 (SPEC difference 5), **before** the agent is called;
5. the agent runs inside a cancel scope (``/cancel`` and ``stop()`` cancel it);
6. the terminal state is written, then the binding, then the reply is staged and sent.
"""

from __future__ import annotations

import logging
from typing import Any

import attrs
import trio

from ..agents._base import (
    Agent,
    AgentInput,
    EventSink,
    ImageBlock,
    RunFailedError,
    RunRequest,
    RunResult,
    StreamEvent,
    TextBlock,
)
from ..channel import Preview
from ..journal import OperationRecord, SuspendedRun
from ._core import LEASE_BACKOFF_MAX_S, LEASE_BACKOFF_START_S, Core
from ._types import ActiveTurn, Route, Turn

UNSUPPORTED_MEDIA_TEXT = "That attachment cannot be processed by the selected agent."
CANCELLED_BEFORE_START = "Request cancelled before it started."
CANCELLED_TEXT = "Request cancelled."
TYPING_INTERVAL_S = 4.0
MAX_CLAIM_RETRIES = 8
log = logging.getLogger("prismd.runtime")
EMPTY_ANSWER_TEXT = "The request completed without a text answer."


class _Unsupported(Exception):
    pass


def start_pump(core: Core, route: Route) -> None:
    if route.pumping or not route.queue:
        return
    route.pumping = True
    core.spawn(pump, core, route)


async def pump(core: Core, route: Route) -> None:
    """Run the route's queue in order until it is empty, then release the lease."""
    try:
        while route.queue:
            if core.stopped:
                # stop() settles what it saw queued; a turn put back afterwards (lease
                # lost before its claim) must not run after stop either.
                await _settle_queue_at_stop(core, route)
                break
            head = route.queue[0]
            if core.leasing and not head.cancelled and not await _wait_for_lease(core, route, head):
                continue
            if not route.queue or route.queue[0] is not head:
                continue
            if route.lease_fresh:
                try:
                    await _refresh_binding(core, route)
                except Exception:
                    core.count("storage_failures")
            route.queue.popleft()
            if head.claim_failures:
                await trio.sleep(
                    min(LEASE_BACKOFF_START_S * 2**head.claim_failures, LEASE_BACKOFF_MAX_S)
                )
            await execute_turn(core, route, head)
    finally:
        route.pumping = False
        await core.release_if_idle(route)


async def _refresh_binding(core: Core, route: Route) -> None:
    """Re-read the durable binding after a fresh lease acquisition: another runtime on
    the store may have run ``/new``, a turn or a resume since this process hydrated it,
    and saving the stale in-memory copy would rewind it. Store errors propagate."""
    route.lease_fresh = False
    if core.journal is None or not route.hydrated:
        return
    loaded = await core.journal.load_binding(route.ownership, route.binding_key)
    if loaded is not None and loaded.version != route.binding_version:
        core.apply_binding(route, loaded.version, loaded.record)


async def _settle_queue_at_stop(core: Core, route: Route) -> None:
    queued = list(route.queue)
    route.queue.clear()
    for turn in queued:
        if not turn.cancel_counted:
            turn.cancel_counted = True
            core.count("cancelled")
        if not turn.settled:
            turn.cancelled = True
            await settle_turn(core, turn, "cancelled", "cancelled_at_shutdown", None)


async def _wait_for_lease(core: Core, route: Route, head: Turn) -> bool:
    """Acquire the binding lease for ``head``; retry with bounded backoff while it is held
    elsewhere. False when the head changed (cancelled or cleared) meanwhile."""
    delay = LEASE_BACKOFF_START_S
    lost_counted = False
    while True:
        if not route.queue or route.queue[0] is not head or head.cancelled or core.stopped:
            return False
        try:
            lease = await core.ensure_lease(route)
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


_UNSETTLED = frozenset({"accepted", "executing"})


async def settle_turn(
    core: Core, turn: Turn, state: str, error_code: str | None, fence: int | None, **extra: Any
) -> None:
    """Write the turn's terminal state: CAS from the version this runtime last wrote,
    else load and retry (bounded, shielded: a cancelled turn still settles durably)."""
    if turn.settled_by_stop:
        return
    with trio.CancelScope(shield=True), trio.move_on_after(10):
        known = turn.op
        if core.journal is not None and known is not None:
            changes = {k: v for k, v in extra.items() if v is not None}
            updated = attrs.evolve(
                known.record,
                state=state,
                error_code=error_code if error_code is not None else known.record.error_code,
                updated_at_ms=core.now_ms(),
                **changes,
            )
            try:
                saved = await core.journal.save_operation(
                    turn.ownership, updated, known.version, fence
                )
            except Exception:
                saved = None
            if saved is not None:
                turn.op = saved
                turn.settled = True
                return
        turn.op = None
        # Only from a state this turn can have left it in: an operator may have filed the
        # claimed record meanwhile (``execution_unknown``); a late result never undoes that.
        await core.settle_operation(
            turn.ownership,
            turn.event.connection_id,
            turn.operation_id,
            state,
            fence=fence,
            error_code=error_code,
            only_from=_UNSETTLED,
            **extra,
        )
    turn.settled = True


async def turn_notice(
    core: Core, route: Route, turn: Turn, text: str, fence: int | None, kind: str = "notice"
) -> None:
    if turn.settled_by_stop:
        return
    await core.send_reply(
        identity=turn.grant.identity,
        ownership=turn.ownership,
        operation_id=turn.operation_id,
        connection_id=route.connection_id,
        conversation_id=route.conversation_id,
        thread_id=route.thread_id,
        text=text,
        kind=kind,
        in_reply_to=turn.event.event_id,
        fence=fence,
        known_op=turn.op,
    )


async def execute_turn(core: Core, route: Route, turn: Turn) -> None:
    identity = turn.grant.identity
    if turn.cancelled:
        if not turn.cancel_counted:
            turn.cancel_counted = True
            core.count("cancelled")
        if not turn.settled:
            await settle_turn(core, turn, "cancelled", "cancelled_before_start", None)
        if not core.stopped:
            await turn_notice(
                core, route, turn, CANCELLED_BEFORE_START, core.route_fence_now(route)
            )
        return
    if not core.active(identity):
        core.count("denied")
        await settle_turn(core, turn, "failed", "identity_revoked", core.route_fence_now(route))
        return
    active = ActiveTurn(state="waiting", turn=turn)
    route.active = active
    try:
        got_slot = False
        with active.cancel_scope:
            await core.slots.acquire()
            got_slot = True
        if not got_slot:
            await _cancelled_waiting(core, route, turn, active)
            return
        try:
            await _run_with_slot(core, route, turn, active)
        finally:
            core.slots.release()
    finally:
        route.active = None


async def _cancelled_waiting(core: Core, route: Route, turn: Turn, active: ActiveTurn) -> None:
    if not turn.cancel_counted:
        turn.cancel_counted = True
        core.count("cancelled")
    await settle_turn(core, turn, "cancelled", "cancelled_while_queued", None)
    if not active.stopping:
        await turn_notice(core, route, turn, CANCELLED_BEFORE_START, None)


async def _cancelled_before_claim(
    core: Core, route: Route, turn: Turn, active: ActiveTurn, fence: int | None
) -> None:
    if not turn.cancel_counted:
        turn.cancel_counted = True
        core.count("cancelled")
    if active.stopping or core.stopped:
        await settle_turn(core, turn, "cancelled", "cancelled_at_shutdown", fence)
        return
    await settle_turn(core, turn, "cancelled", "cancelled_before_start", fence)
    await turn_notice(core, route, turn, CANCELLED_TEXT, fence)


async def _run_with_slot(core: Core, route: Route, turn: Turn, active: ActiveTurn) -> None:
    identity = turn.grant.identity
    if not core.active(identity):
        core.count("denied")
        await settle_turn(core, turn, "failed", "identity_revoked", core.route_fence_now(route))
        return
    # A fresh scope for the run itself: a cancel that arrived while waiting is honoured.
    run_scope = trio.CancelScope()
    if active.cancelled:
        run_scope.cancel()
    active.cancel_scope = run_scope
    active.state = "running"
    fence = core.route_fence_now(route)
    in_agent = False
    try:
        agent = await core.resolve_agent(route, identity)
        try:
            agent_input = await build_input(core, agent, turn)
        except _Unsupported:
            core.count("unsupported")
            await settle_turn(core, turn, "failed", "unsupported_media", fence)
            await turn_notice(core, route, turn, UNSUPPORTED_MEDIA_TEXT, fence)
            return
        if route.session_id is None:
            route.session_id, route.leaf_id = await core.derive_session(
                route, identity, route.generation
            )
        if active.cancelled or core.stopped:
            # ``/cancel`` or ``stop()`` arrived before the claim (while resolving the agent,
            # fetching media, deriving the session): no agent call at all.
            await _cancelled_before_claim(core, route, turn, active, fence)
            return
        if core.leasing:
            # The claim is written only under a live lease fence. Lost meanwhile (renewal
            # failed, taken over)? The turn goes back to the head of the queue, still
            # ``accepted``, and the pump waits for the lease again (SPEC difference 8).
            lease = None
            try:
                lease = await core.ensure_lease(route)
            except Exception:
                core.count("storage_failures")
            if lease is None:
                route.queue.appendleft(turn)
                return
            fence = lease.fencing_token
        claimed = await claim(core, route, turn, fence)
        if claimed == "retry" and turn.claim_failures < MAX_CLAIM_RETRIES and not core.stopped:
            # A store error, not a lost CAS: the acknowledged record is still ours to
            # run. Back to the head of the queue; the pump backs off (bounded).
            turn.claim_failures += 1
            route.queue.appendleft(turn)
            return
        if claimed != "claimed":
            return
        request = RunRequest(
            session_id=route.session_id,
            input=agent_input,
            identity=identity,
            idempotency_key=turn.operation_id,
            leaf_id=route.leaf_id,
        )
        sink = preview_sink(core, route, active)
        result: RunResult | None = None
        in_agent = True
        with run_scope:
            try:
                result = await _run_agent(core, route, agent, request, sink)
            except RunFailedError as exc:
                result = exc.result
        if result is None:
            result = RunResult(status="aborted", text="", run_id="", session_id=request.session_id)
    except Exception as exc:
        core.count("failed")
        code = "runtime_error"
        await settle_turn(core, turn, "failed", code, fence)
        # Only the agent's own error message is shown (redacted); a host seam's
        # (resolve_agent, fetch_attachment, resolve_binding) may carry URLs or paths.
        detail = str(exc) if in_agent else None
        await turn_notice(core, route, turn, core.failure_text(detail), fence)
        return
    await finish_run(core, route, turn, agent, result, fence)


async def _run_agent(
    core: Core, route: Route, agent: Agent, request: RunRequest, sink: EventSink | None
) -> RunResult:
    """``agent.run``, with the host's typing indicator in a child task while it runs.

    The indicator task lives in the runtime nursery under its own cancel scope (not a
    nested nursery, which would wrap the run's exceptions in an ExceptionGroup); it is
    cancelled however the run ends.
    """
    if core.on_typing is None:
        return await agent.run(request, on_event=sink)
    scope = trio.CancelScope()
    core.nursery.start_soon(_typing_task, core, route, scope)
    try:
        return await agent.run(request, on_event=sink)
    finally:
        scope.cancel()


async def _typing_task(core: Core, route: Route, scope: trio.CancelScope) -> None:
    with scope:
        await typing_loop(core, route)


async def typing_loop(core: Core, route: Route) -> None:
    """Call ``on_typing`` now and every :data:`TYPING_INTERVAL_S` until cancelled.

    Runs in a child task of the turn, cancelled when the run ends. A failing
    callback is logged by exception type only (never its text, which may carry
    ids or tokens) and swallowed; each call is bounded by the interval so a hung
    callback cannot pile up or outlive the run's cancellation check.
    """
    on_typing = core.on_typing
    if on_typing is None:
        return
    next_at = trio.current_time()
    while True:
        next_at += TYPING_INTERVAL_S
        with trio.move_on_at(next_at):
            try:
                await on_typing(route.connection_id, route.conversation_id, route.thread_id)
            except Exception as exc:
                log.warning("typing callback failed: %s", type(exc).__name__)
        await trio.sleep_until(next_at)


async def claim(core: Core, route: Route, turn: Turn, fence: int | None) -> str:
    """CAS ``accepted → executing`` (attempts + 1) under the lease fence, before any run.

    ``"claimed"``; ``"lost"`` (the record is no longer ``accepted``: someone else's);
    ``"retry"`` (a store error: whether the write landed is unknown, so the caller may
    retry — the retry is again a CAS from ``accepted``, never a second run).
    """
    if core.journal is None:
        return "claimed"

    def claimed(record: OperationRecord) -> OperationRecord:
        return attrs.evolve(
            record,
            state="executing",
            attempts=record.attempts + 1,
            session_id=route.session_id,
            updated_at_ms=core.now_ms(),
        )

    try:
        saved = None
        known = turn.op
        if known is not None and known.record.state == "accepted":
            saved = await core.journal.save_operation(
                turn.ownership, claimed(known.record), known.version, fence
            )
        if saved is None:
            loaded = await core.journal.load_operation(
                turn.ownership, turn.event.connection_id, turn.operation_id
            )
            if loaded is None or loaded.record.state != "accepted":
                core.count("storage_failures")
                return "lost"
            saved = await core.journal.save_operation(
                turn.ownership, claimed(loaded.record), loaded.version, fence
            )
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
    """Settle the operation, persist the binding, then answer (§9.1 steps 9–11)."""
    if turn.settled_by_stop:
        # stop() already settled this operation ``cancelled`` after its deadline.
        return
    status = result.status
    if status == "suspended":
        route.suspended = True
        route.suspended_run = SuspendedRun(turn.operation_id, result.run_id, result.session_id)
    elif result.leaf_id is not None:
        route.leaf_id = result.leaf_id
    state = {
        "succeeded": "succeeded",
        "aborted": "cancelled",
        "suspended": "suspended",
    }.get(status, "failed")
    error_code = None
    if state == "failed":
        error_code = (
            str(result.error.code)
            if result.error is not None and result.error.code
            else "run_failed"
        )
    await settle_turn(
        core,
        turn,
        state,
        error_code,
        fence,
        run_id=result.run_id or None,
        session_id=result.session_id or None,
    )
    with trio.CancelScope(shield=True), trio.move_on_after(10):
        await core.persist_binding(route, fence)
    if status == "succeeded":
        core.count("completed")
        text = core.redact(result.text)
        if not text.strip():
            await turn_notice(core, route, turn, EMPTY_ANSWER_TEXT, fence)
        else:
            await turn_notice(core, route, turn, text, fence, kind="final")
    elif status == "aborted":
        core.count("cancelled")
        await turn_notice(core, route, turn, CANCELLED_TEXT, fence)
    elif status == "suspended":
        core.count("suspended")
        from ._approvals import send_approval_notice

        await send_approval_notice(
            core,
            route,
            agent,
            grant=turn.grant,
            operation_id=turn.operation_id,
            in_reply_to=turn.event.event_id,
            run_id=result.run_id,
            session_id=result.session_id,
            fence=fence,
        )
    else:
        core.count("failed")
        message = result.error.message if result.error is not None else None
        await turn_notice(core, route, turn, core.failure_text(message), fence)


def preview_sink(core: Core, route: Route, active: ActiveTurn) -> EventSink | None:
    """Previews (§9.3): cumulative redacted text of the current assistant message."""
    on_preview = core.on_preview
    if on_preview is None:
        return None
    acc: list[str] = []
    current: list[str] = [""]

    def sink(event: StreamEvent) -> None:
        if event.kind == "message_started":
            acc.clear()
            current[0] = event.run_id
            return
        if event.kind != "message_delta":
            return
        if current[0] and event.run_id and event.run_id != current[0]:
            return
        acc.append(event.text)
        text = core.redact("".join(acc))
        if not text.strip() or active.cancelled or core.stopped:
            return
        try:
            on_preview(
                Preview(
                    connection_id=route.connection_id,
                    external_conversation_id=route.conversation_id,
                    text=text,
                    thread_id=route.thread_id,
                )
            )
        except Exception:
            # The host's preview callback must never break a turn.
            pass

    return sink


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
