"""Suspension and approvals (contract §10): issuing controls, consuming them, resuming.

Tokens are never journaled: reply records keep each control's label and kind only
(SPEC difference 4), and the approval record is keyed by the token's hash. A resume is
background work on the route (state ``resuming``) that re-acquires the route lease before
it writes anything (SPEC difference 1).
"""

from __future__ import annotations

from typing import Any

import attrs
import trio

from ..agents import Agent, Decision, RunFailedError, RunResult, RunState
from ..channel import Admission, ApprovalInput, Button, InboundEvent, bound_detail
from ..grants import AgentIdentity, Grant, ownership_from_identity
from ..journal import ApprovalRecord, ApprovalTarget, LoadedApproval, OperationRef, OwnershipScope
from ._core import AdmitContext, Core, authorize_input, check_grant
from ._leases import LeaseHeldElsewhereError
from ._replies import Draft, Settle, answer, outcome_of, preview_sink
from ._routes import ActiveTurn, Route, route_key

FINISHING_WAIT_S = 10.0
"""How long an approval waits for the turn that asked for it to finish writing."""
GENERIC_DECISION_TEXT = "This request requires an authenticated host decision."
NOT_AWAITING_TEXT = "This request is no longer awaiting a decision."
DENIED_TEXT = "Approval denied. The request will not continue."


async def issue_buttons(
    core: Core,
    route: Route,
    agent: Agent,
    grant: Grant,
    run_id: str,
    session_id: str,
) -> tuple[str, tuple[Button, ...], dict[str, Any] | None]:
    """§10.2: the notice text, its controls and the non-secret target to journal."""
    if (
        core.approvals is None
        or not agent.supports_approvals
        or not agent.definition_revision
        or not agent.agent_id
    ):
        return GENERIC_DECISION_TEXT, (), None
    try:
        state = await agent.status(run_id=run_id, session_id=session_id, scope=route.scope)
    except Exception:
        core.count("storage_failures")
        return GENERIC_DECISION_TEXT, (), None
    if state is None or state.status != "suspended":
        return NOT_AWAITING_TEXT, (), None
    pending = next((p for p in state.pending if p.kind == "tool_approval"), None)
    if pending is None:
        return GENERIC_DECISION_TEXT, (), None
    identity = grant.identity
    target = ApprovalTarget(
        connection_id=route.connection_id,
        external_conversation_id=route.external_conversation_id,
        external_actor_id=route.actor_id,
        thread_id=route.thread_id,
        principal_kind=identity.principal.kind,
        principal_id=identity.principal.id,
        grant_revision=grant.grant_revision,
        agent_alias=route.alias,
        definition_revision=agent.definition_revision,
        session_id=session_id,
        run_id=run_id,
        approval_id=pending.approval_id,
        expected_version=state.version,
    )
    try:
        issued = await core.approvals.issue(route.scope, target, core.limits.approval_ttl_ms)
    except Exception:
        core.count("storage_failures")
        return GENERIC_DECISION_TEXT, (), None
    tool = f"tool {pending.tool_name}" if pending.tool_name else "a tool action"
    reason = bound_detail(core.redact(pending.reason or "")).strip()
    text = f"Approval required for {tool}: {reason}" if reason else f"Approval required for {tool}"
    # Every outbound text is redacted, the tool name included.
    text = core.redact(text)
    meta = attrs.asdict(target)
    return text, issued.buttons, meta


async def send_approval_notice(
    core: Core,
    route: Route,
    agent: Agent,
    *,
    grant: Grant,
    operation_id: str,
    in_reply_to: str | None,
    run_id: str,
    session_id: str,
    fence: int | None,
    with_binding: bool = False,
) -> None:
    """Issue fresh controls for the suspended run and send the approval notice (with the
    route's binding in the same transaction when ``with_binding``)."""
    text, buttons, meta = await issue_buttons(core, route, agent, grant, run_id, session_id)
    draft = Draft.for_route(
        route, grant.identity, operation_id, text, in_reply_to, buttons=buttons, approval=meta
    )
    answered = await answer(
        core,
        draft,
        scope=route.scope,
        fence=fence,
        binding=core.routes.binding_write(route, fence) if with_binding else None,
    )
    if with_binding:
        core.routes.binding_written(route, answered.binding)


async def reissue_buttons(
    core: Core, scope: OwnershipScope, approval: dict[str, Any]
) -> tuple[Button, ...]:
    """Fresh controls for a resent approval notice (the stored reply has no tokens)."""
    if core.approvals is None:
        return ()
    try:
        target = ApprovalTarget(**approval)
        issued = await core.approvals.issue(scope, target, core.limits.approval_ttl_ms)
    except Exception:
        core.count("storage_failures")
        return ()
    return issued.buttons


def _record_matches(rec: ApprovalRecord, event: InboundEvent, grant: Grant, outcome: str) -> bool:
    identity = grant.identity
    return (
        rec.state == "pending"
        and rec.outcome == outcome
        and rec.connection_id == event.connection_id
        and rec.external_conversation_id == event.external_conversation_id
        and rec.external_actor_id == event.external_actor_id
        and rec.thread_id == event.thread_id
        and rec.principal_kind == identity.principal.kind
        and rec.principal_id == identity.principal.id
        and rec.grant_revision == grant.grant_revision
        and rec.agent_alias in grant.agent_aliases
    )


async def admit_approval(core: Core, ctx: AdmitContext, approval: ApprovalInput) -> Admission:
    """§10.3: every check passes or ``rejected``; then consume by CAS and resume."""
    if core.approvals is None:
        return Admission("denied", "unavailable")
    event = ctx.event
    try:
        loaded = await core.approvals.load(ctx.scope, event.connection_id, approval.token)
    except Exception:
        core.count("storage_failures")
        return Admission("denied", "unavailable")
    if loaded is None:
        return Admission("denied", "rejected")
    rec = loaded.record
    if rec.expires_at_ms <= core.now_ms() or not _record_matches(
        rec, event, ctx.grant, approval.outcome
    ):
        return Admission("denied", "rejected")
    route = core.routes.route(route_key(event, rec.agent_alias, ctx.scope))
    if route is None:
        return Admission("denied", "capacity")
    with core.routes.pinned(route):
        return await _approve_on_route(core, ctx, approval, loaded, route)


async def _approve_on_route(
    core: Core,
    ctx: AdmitContext,
    approval: ApprovalInput,
    loaded: LoadedApproval,
    route: Route,
) -> Admission:
    assert core.approvals is not None
    event = ctx.event
    rec = loaded.record
    try:
        await core.routes.hydrate(route, ctx.grant.identity)
    except Exception:
        core.count("storage_failures")
        return Admission("denied", "unavailable")
    active = route.active
    if active is not None and active.turn is not None and active.turn.finishing:
        # The approval notice can reach the user while its turn still writes its last
        # record: wait for the route to be free instead of refusing a valid decision.
        with trio.move_on_after(FINISHING_WAIT_S):
            await active.ended.wait()
    run = route.suspended_run
    if (
        not route.suspended
        or route.active is not None
        or run is None
        or run.run_id != rec.run_id
        or run.session_id != rec.session_id
    ):
        return Admission("denied", "rejected")
    try:
        agent = await core.resolve_agent(route, ctx.grant.identity)
        if agent.definition_revision != rec.definition_revision:
            return Admission("denied", "rejected")
        state = await agent.status(run_id=rec.run_id, session_id=rec.session_id, scope=route.scope)
        if not _still_pending(state, rec.expected_version, rec.approval_id):
            return Admission("denied", "rejected")
        if core.stopped:
            # stop() began while we awaited: keep the token unconsumed (retryable).
            return Admission("denied", "stopped")
        status = await core.approvals.consume(
            ctx.scope, event.connection_id, approval.token, loaded.version
        )
    except Exception:
        core.count("storage_failures")
        return Admission("denied", "unavailable")
    if status != "consumed":
        return Admission("denied", "rejected")
    route.active = ActiveTurn(state="resuming")
    core.spawn(
        resume,
        core,
        route,
        ctx,
        rec.expected_version,
        (Decision(rec.approval_id, approval.outcome),),
        False,
        rec,
    )
    return Admission("accepted")


def _still_pending(state: RunState | None, version: int, approval_id: str | None) -> bool:
    if state is None or state.status != "suspended" or state.version != version:
        return False
    return approval_id is None or any(p.approval_id == approval_id for p in state.pending)


async def cancel_suspended(core: Core, ctx: AdmitContext, route: Route) -> Admission:
    """``/cancel`` on a suspended route: a terminal deny through a resume (§8)."""
    run = route.suspended_run
    if run is None:
        return Admission("denied", "rejected")
    try:
        agent = await core.resolve_agent(route, ctx.grant.identity)
        state = await agent.status(run_id=run.run_id, session_id=run.session_id, scope=route.scope)
    except Exception:
        core.count("storage_failures")
        return Admission("denied", "unavailable")
    if state is None or state.status != "suspended":
        return Admission("denied", "rejected")
    if core.stopped:
        return Admission("denied", "stopped")
    route.active = ActiveTurn(state="resuming")
    core.spawn(resume, core, route, ctx, state.version, (), True, None)
    return Admission("accepted")


async def _reauthorized(core: Core, ctx: AdmitContext, rec: ApprovalRecord | None) -> Grant | None:
    event = ctx.event
    try:
        grant = await core.authorize(authorize_input(event, ctx.action, core.now_ms()))
    except Exception:
        return None
    if check_grant(core, grant) is not None or not isinstance(grant, Grant):
        return None
    if ownership_from_identity(grant.identity) != ctx.scope:
        return None
    if rec is not None and not (
        grant.grant_revision == rec.grant_revision
        and grant.identity.principal.kind == rec.principal_kind
        and grant.identity.principal.id == rec.principal_id
        and rec.agent_alias in grant.agent_aliases
    ):
        return None
    return grant


async def resume(
    core: Core,
    route: Route,
    ctx: AdmitContext,
    expected_version: int,
    decisions: tuple[Decision, ...],
    deny: bool,
    rec: ApprovalRecord | None,
) -> None:
    """§10.4: continue the suspended run; the reply goes under the approval/command op."""
    active = route.active or ActiveTurn(state="resuming")
    route.active = active
    try:
        await _resume(core, route, ctx, active, expected_version, decisions, deny, rec)
    finally:
        if route.active is active:
            route.active = None
        await core.leases.release_if_idle(route)


async def _resume(
    core: Core,
    route: Route,
    ctx: AdmitContext,
    active: ActiveTurn,
    expected_version: int,
    decisions: tuple[Decision, ...],
    deny: bool,
    rec: ApprovalRecord | None,
) -> None:
    grant = await _reauthorized(core, ctx, rec)
    run = route.suspended_run
    if grant is None or run is None:
        return
    identity = grant.identity
    try:
        agent = await core.resolve_agent(route, identity)
        if rec is not None and agent.definition_revision != rec.definition_revision:
            return
        state = await agent.status(run_id=run.run_id, session_id=run.session_id, scope=route.scope)
        if not _still_pending(state, expected_version, None):
            return
    except Exception:
        core.count("storage_failures")
        return
    try:
        async with core.leases.fence(route, wait_s=5.0) as fence:
            # Like a turn's claim: while the agent continues (and may call a tool), the
            # original operation is ``executing``, so a crash leaves it listed for
            # ``reconcile`` instead of a quiet ``suspended``.
            claimed = not deny and await core.settle_operation(
                route.scope,
                route.connection_id,
                run.operation_id,
                "executing",
                fence=fence,
                only_from=_SUSPENDED,
            )

            async def offer_again(*, with_binding: bool) -> None:
                """A new approval notice for the suspended run (bound like the first one
                when it suspended again), its claim undone."""
                assert run is not None
                await _unclaim(core, route, run.operation_id, fence, claimed)
                await send_approval_notice(
                    core,
                    route,
                    agent,
                    grant=grant,
                    operation_id=ctx.operation_id,
                    in_reply_to=ctx.event.event_id,
                    run_id=run.run_id,
                    session_id=run.session_id,
                    fence=fence,
                    with_binding=with_binding,
                )

            try:
                result: RunResult | None = None
                with active.cancel_scope:
                    try:
                        result = await agent.resume(
                            run_id=run.run_id,
                            session_id=run.session_id,
                            scope=route.scope,
                            identity=identity,
                            expected_version=expected_version,
                            decisions=decisions,
                            deny=deny,
                            on_event=preview_sink(core, route, active),
                        )
                    except RunFailedError as exc:
                        result = exc.result
                if result is None:
                    result = RunResult("aborted", "", run.run_id, run.session_id)
                after = await agent.status(
                    run_id=run.run_id, session_id=run.session_id, scope=route.scope
                )
            except Exception:
                core.count("failed")
                await offer_again(with_binding=False)
                return
            if after is not None and after.status == "suspended" and result.status == "suspended":
                await offer_again(with_binding=True)
                return
            await _finish_resume(core, route, ctx, identity, run.operation_id, result, fence)
    except LeaseHeldElsewhereError:
        return


_SUSPENDED = frozenset({"suspended"})


async def _unclaim(
    core: Core, route: Route, operation_id: str, fence: int | None, claimed: bool
) -> None:
    """The run is suspended again (another decision, or the resume failed): so is its
    operation."""
    if claimed:
        with trio.CancelScope(shield=True, relative_deadline=10):
            await core.settle_operation(
                route.scope,
                route.connection_id,
                operation_id,
                "suspended",
                fence=fence,
                only_from=frozenset({"executing"}),
            )


async def _finish_resume(
    core: Core,
    route: Route,
    ctx: AdmitContext,
    identity: AgentIdentity,
    original_operation_id: str,
    result: RunResult,
    fence: int | None,
) -> None:
    """Settle the suspended run's own operation as :func:`~._replies.outcome_of` says, clear
    the suspension on the binding and answer under the approval's (or ``/cancel``'s)
    operation — one transaction, then the send."""
    outcome = outcome_of(core, result)
    route.suspended = False
    route.suspended_run = None
    if result.leaf_id is not None:
        route.leaf_id = result.leaf_id
    if outcome.counter is not None:
        core.count(outcome.counter)

    change: dict[str, Any] = {}
    if outcome.error_code is not None:
        change["error_code"] = outcome.error_code
    if result.run_id:
        change["run_id"] = result.run_id

    assert outcome.text is not None
    draft = Draft.for_route(
        route, identity, ctx.operation_id, outcome.text, ctx.event.event_id, kind=outcome.kind
    )
    answered = await answer(
        core,
        draft,
        scope=route.scope,
        fence=fence,
        settle=Settle(
            OperationRef(route.scope, route.connection_id, original_operation_id),
            outcome.state,
            change=change,
        ),
        binding=core.routes.binding_write(route, fence),
    )
    core.routes.binding_written(route, answered.binding)
