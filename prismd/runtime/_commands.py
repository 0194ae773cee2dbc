"""Commands (contract §8): ``/help /status /new /agent /cancel``.

Commands bypass the turn queue and answer even while a run is active. Every answer is
a ``notice`` reply to the command event, sent in the background (tracked for ``drain``)
after the command's operation record is settled. Handlers return the admission without
touching the admission counters (``admit`` counts them).
"""

from __future__ import annotations

import re

from ..channel import Admission
from ._approvals import cancel_suspended
from ._core import AdmitContext, Core
from ._following import cancel_parked
from ._leases import LeaseHeldElsewhereError
from ._routes import Route, Turn, actor_key, route_key


async def cancel_queued(core: Core, turn: Turn, error_code: str) -> None:
    """Settle a queued turn's operation ``cancelled`` with ``error_code`` (only while it is
    still ``accepted``), and the turn with it."""
    await core.settle_operation(
        turn.scope,
        turn.event.connection_id,
        turn.operation_id,
        "cancelled",
        error_code=error_code,
        only_from=frozenset({"accepted"}),
    )
    turn.settled = True


COMMAND_RE = re.compile(r"^/([A-Za-z0-9_]+)(?:\s+(.*))?$", re.DOTALL)
KNOWN = frozenset({"help", "status", "new", "agent", "cancel"})
HELP_TEXT = "Commands: /help, /status, /new, /agent <alias>, /cancel."
USAGE_AGENT = "Usage: /agent <alias>."
UNKNOWN_ALIAS = "That agent alias is not available to this account."
NEW_SUSPENDED = "Resolve or cancel the suspended request before starting a new conversation."
NEW_BUSY = "Finish or cancel the current request before starting a new conversation."
NEW_FAILED = "Could not start a new conversation. Try again."
NEW_OK = "Started a new conversation."
NOTHING_TO_CANCEL = "Nothing to cancel."
UNKNOWN_COMMAND_HINT = "Unknown command. Send /help for the list of commands."
"""Carried on the ``unknown_command`` admission for adapters that show admissions (the web
chat); never sent as a notice (§8: an unknown command gets no notice — in a group it may be
meant for another bot)."""


def parse_command(text: str) -> tuple[str, str] | None:
    match = COMMAND_RE.match(text.strip())
    if match is None:
        return None
    name = match.group(1).lower()
    if name not in KNOWN:
        return None
    return name, (match.group(2) or "").strip()


def notice(core: Core, ctx: AdmitContext, text: str) -> None:
    """The command's answer: committed with its operation's ``succeeded`` state by
    admission, then sent (``core`` is kept for the callers' symmetry)."""
    ctx.notices.append(text)


def _route(core: Core, ctx: AdmitContext, alias: str | None = None) -> Route | None:
    return core.routes.route(route_key(ctx.event, alias or ctx.alias, ctx.scope))


async def admit_command(core: Core, ctx: AdmitContext) -> Admission:
    parsed = parse_command(ctx.event.text)
    if parsed is None:
        return Admission("unsupported", "unknown_command", hint=UNKNOWN_COMMAND_HINT)
    name, arg = parsed
    if name == "help":
        notice(core, ctx, HELP_TEXT)
        return Admission("accepted")
    if name == "agent":
        return await _agent(core, ctx, arg)
    route = _route(core, ctx)
    if route is None:
        return Admission("denied", "capacity")
    with core.routes.pinned(route):
        return await _route_command(core, ctx, route, name)


async def _route_command(core: Core, ctx: AdmitContext, route: Route, name: str) -> Admission:
    try:
        await core.routes.hydrate(route, ctx.grant.identity)
    except Exception:
        core.count("storage_failures")
        return Admission("denied", "unavailable")
    if name == "status":
        notice(core, ctx, f"Agent: {route.alias}; state: {route.status_text()}.")
        return Admission("accepted")
    if name == "new":
        return await _new(core, ctx, route)
    return await _cancel(core, ctx, route)


async def _agent(core: Core, ctx: AdmitContext, arg: str) -> Admission:
    if not arg:
        notice(core, ctx, USAGE_AGENT)
        return Admission("unsupported", "invalid_argument")
    if arg not in ctx.grant.agent_aliases:
        notice(core, ctx, UNKNOWN_ALIAS)
        return Admission("unsupported", "unknown_alias")
    key = actor_key(ctx.event, ctx.scope)
    if not core.selections.remember(key, arg):
        return Admission("denied", "capacity")
    if core.journal is not None:
        # SPEC difference 3: the selection is stamped on the alias's binding, durably.
        route = _route(core, ctx, arg)
        if route is not None:
            with core.routes.pinned(route):
                await _stamp_selection(core, ctx, route)
    notice(core, ctx, f"Agent set to {arg}.")
    return Admission("accepted")


async def _stamp_selection(core: Core, ctx: AdmitContext, route: Route) -> None:
    try:
        await core.routes.hydrate(route, ctx.grant.identity)
        route.selected_at_ms = core.now_ms()
        async with core.leases.fence(route, wait_s=1.0) as fence:
            await core.routes.persist_binding(route, fence)
    except LeaseHeldElsewhereError:
        pass
    except Exception:
        core.count("storage_failures")


async def _new(core: Core, ctx: AdmitContext, route: Route) -> Admission:
    if route.suspended:
        notice(core, ctx, NEW_SUSPENDED)
        return Admission("accepted")
    if route.busy:
        notice(core, ctx, NEW_BUSY)
        return Admission("accepted")
    generation = route.generation + 1
    if core.journal is not None:
        old = (route.generation, route.session_id, route.leaf_id, route.suspended_run)
        try:
            session_id, leaf_id = await core.routes.derive_session(
                route, ctx.grant.identity, generation
            )
            route.generation, route.session_id, route.leaf_id = generation, session_id, leaf_id
            route.suspended, route.suspended_run = False, None
            # SPEC difference 1: the binding was written under a fence; take the lease again.
            async with core.leases.fence(route, wait_s=1.0) as fence:
                ok = await core.routes.persist_binding(route, fence)
        except Exception:
            ok = False
            core.count("storage_failures")
        if not ok:
            route.generation, route.session_id, route.leaf_id, route.suspended_run = old
            notice(core, ctx, NEW_FAILED)
            return Admission("denied", "unavailable")
    else:
        route.generation = generation
        route.session_id = None
        route.leaf_id = None
    notice(core, ctx, NEW_OK)
    return Admission("accepted")


async def _cancel(core: Core, ctx: AdmitContext, route: Route) -> Admission:
    active = route.active
    if route.suspended and (active is None or active.state != "resuming"):
        return await cancel_suspended(core, ctx, route)
    has_active = active is not None and not active.cancelled
    queued = [t for t in route.queue if not t.cancelled]
    if active is not None and has_active:
        active.cancel()
    elif cancel_parked(core, route):
        # A parked remote task (:mod:`._following`): woken to cancel it; it is the head.
        has_active = True
        queued = [t for t in queued if not t.cancel_remote]
    for turn in queued:
        turn.cancelled = True
    for turn in queued:
        await cancel_queued(core, turn, "cancelled_while_queued")
    n = len(queued)
    plural = "request" if n == 1 else "requests"
    if has_active and n:
        text = f"Cancelling the current request and {n} queued {plural}."
    elif has_active:
        text = "Cancelling the current request."
    elif n:
        text = f"Cancelled {n} queued {plural}."
    else:
        text = NOTHING_TO_CANCEL
    notice(core, ctx, text)
    return Admission("accepted")
