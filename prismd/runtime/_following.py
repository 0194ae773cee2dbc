"""A turn whose agent hands its work to a remote peer (the ``a2a`` kind): the runtime's side
of :class:`~prismd.agents.RunHooks` (SPEC difference 9).

Once the agent has journaled the remote task, :meth:`TurnHooks.following` moves the
operation ``executing → following`` under the turn's lease fence. From then on:

* the turn stays the route's active turn (messages arriving meanwhile wait in order), but
  the typing indicator stops and the concurrency slot is given back — a remote task may run
  for hours and must not hold a local run's place;
* ``stop()`` cancels the run without settling it: the operation stays ``following`` and the
  turns queued behind it stay ``accepted``; the restart's recovery queues both again, oldest
  first, and the agent follows the same task instead of sending again;
* ``list-unresolved`` does not list it (nothing needs a decision) and prune keeps it.

Once the remote task is known and not yet answered, the run *parks* its turn
(:meth:`TurnHooks.park`) and returns ``following``: :func:`park` keeps the turn in
``route.parked`` — the route stays held, later turns wait behind it in order — but no
coroutine waits for it, no slot and no binding lease are held (the pump ends and the lease
is released once the route is idle): the agent's follower polls the task with a handful of
tasks for all of them. Its *wake* (:func:`wake`) puts the turn back at the head of its
route's queue: the pump takes the lease again, reads the operation (still ``following``;
its answer is staged by compare-and-swap on that version under the new fence) and runs the
agent, which answers — reply staged with the terminal state, delivered, the next queued
turn started — or parks again. ``/cancel`` wakes it with
:attr:`~._routes.Turn.cancel_remote` (:func:`cancel_parked`); ``stop()`` forgets it
(:func:`unpark_at_stop`): the operation stays ``following`` for the next runtime.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any

import attrs
import trio

from ..channel import InboundEvent
from ..grants import Grant, ownership_from_identity
from ..journal import (
    FOLLOWING_STATE,
    Change,
    Loaded,
    OperationRecord,
    OperationRef,
    OwnershipScope,
    transition,
)
from ._core import Core, authorize_input, check_grant
from ._leases import LEASE_BACKOFF_MAX_S, LEASE_BACKOFF_START_S
from ._relay import relay
from ._routes import ActiveTurn, Route, Turn

NO_CLAIMS: Mapping[str, Any] = MappingProxyType({})
"""The claims of every parked turn's event that had none (one shared, read-only)."""


def _ref(turn: Turn) -> OperationRef:
    return OperationRef(turn.scope, turn.event.connection_id, turn.operation_id)


@attrs.define(eq=False)
class TurnHooks:
    core: Core
    route: Route
    turn: Turn
    active: ActiveTurn
    fence: int | None = None
    stop_typing: Callable[[], None] | None = None
    """Ends the turn's typing indicator (set while the agent runs)."""
    slot_held: bool = False
    start_pump: Callable[[Core, Route], None] | None = None
    """The pump starter (:func:`._turn.start_pump`), for the wake of a parked turn."""
    parked: Wake | None = None
    """The wake :meth:`park` gave the agent: the turn parks as it (:func:`park`)."""

    async def following(self) -> bool:
        core, turn = self.core, self.turn
        if not turn.following:
            if core.journal is not None:
                saved = await _move(core, turn, "executing", FOLLOWING_STATE, self.fence)
                if saved is not None:
                    turn.op = saved
                elif not await _still_following(core, turn):
                    return False
            turn.following = True
        if self.stop_typing is not None:
            self.stop_typing()
        self.release_slot()
        return True

    def stopping(self) -> bool:
        return self.core.stopped or self.active.stopping

    @property
    def owner(self) -> str | None:
        return self.core.owner_id

    def waiting(self) -> None:
        self.release_slot()

    async def relay(self, key: str, text: str) -> bool:
        return await relay(self.core, self.turn, self.fence, key, text)

    def release_slot(self) -> None:
        if self.slot_held:
            self.slot_held = False
            self.core.slots.release()

    def park(self) -> Callable[[], None]:
        assert self.start_pump is not None
        self.turn.woken = False
        self.parked = Wake(self.core, self.route, self.turn, self.start_pump)
        return self.parked

    @property
    def cancelling(self) -> bool:
        return self.turn.cancel_remote

    @property
    def runtime(self) -> object:
        return self.core

    def spawn(self, fn: Callable[[], Awaitable[None]]) -> None:
        self.core.nursery.start_soon(_background, self.core, fn)


class Wake:
    """A parked turn's wake (:func:`wake`), kept by the agent's follower while the task is
    followed; once the turn is parked (:func:`park`), the turn itself as well: the
    operation id and the route's key (six references, 80 bytes) instead of the
    :class:`Turn`, its :class:`InboundEvent` and its grant. Folded so, its route is
    released while it waits (:meth:`~._routes.Routes.release`: the route's own state, its
    binding included, is read again from the journal when it runs); when it wakes
    (:func:`_rewake`) the event is rebuilt from the route's key and the operation's record
    (its event id), and the grant is asked of ``authorize`` again, as after a restart."""

    __slots__ = ("cancelling", "core", "key", "operation_id", "start_pump", "turn")

    def __init__(
        self, core: Core, route: Route, turn: Turn, start_pump: Callable[[Core, Route], None]
    ) -> None:
        self.core = core
        self.key = route.key
        self.turn: Turn | None = turn
        """The turn until it is parked in this form (kept whole when it cannot be)."""
        self.start_pump = start_pump
        self.operation_id = turn.operation_id
        self.cancelling = False
        """``/cancel`` woke it folded: the rebuilt turn cancels the remote task."""

    @property
    def folded(self) -> bool:
        return self.turn is None

    def __call__(self) -> None:
        wake(self.core, self)

    def fold(self, route: Route, turn: Turn) -> None:
        """Keep ``turn`` as its ids and grant only, when the route's key and the journal
        rebuild it as it is (:func:`_rewake`); else keep it whole — also without a
        journal, where the relays sent are remembered per turn object (:mod:`._relay`)."""
        if self.turn is not turn or self.core.journal is None or not _foldable(route, turn):
            return
        self.turn = None

    def cancel(self) -> None:
        """``/cancel``: wake the turn to cancel its remote task."""
        if self.turn is not None:
            self.turn.cancel_remote = True
        else:
            self.cancelling = True
        self()


def _foldable(route: Route, turn: Turn) -> bool:
    """``turn`` is a followed message with nothing of its own beyond its ids and grant
    (see :meth:`Wake.unfold`): its event and scope are the route's, its flags are as a
    freshly parked turn's."""
    event = turn.event
    return (
        turn.action == "message"
        and turn.following
        and not (turn.cancelled or turn.settled or turn.finishing or turn.settled_by_stop)
        and not (turn.cancel_counted or turn.claim_failures or turn.cancel_remote)
        and event.claims is NO_CLAIMS
        and not event.text
        and not event.attachments
        and event.approval is None
        and event.received_at_ms is None
        and turn.alias == route.alias
        and turn.scope == route.scope
        and (event.connection_id, event.external_conversation_id, event.thread_id) == route.key[:3]
        and event.external_actor_id == route.actor_id
    )


async def _background(core: Core, fn: Callable[[], Awaitable[None]]) -> None:
    try:
        await fn()
    except Exception:
        core.count("storage_failures")


# --------------------------------------------------------------------------- parking


def _hold(core: Core) -> None:
    """A parked turn counts as in-flight work (``drain`` waits for it, as for a run)."""
    core.inflight += 1
    if core.idle.is_set():
        core.idle = trio.Event()


def _unhold(core: Core) -> None:
    core.inflight -= 1
    if core.inflight == 0:
        core.idle.set()


def park(core: Core, route: Route, turn: Turn, parked: Wake) -> None:
    """The run returned ``following``: keep ``turn`` parked on ``route`` as its wake
    ``parked`` (see above)."""
    if core.stopped:
        return  # left ``following`` for the next runtime
    # Kept small while it waits: the record is loaded again when it runs, and the text
    # was sent (a recovered turn never has it).
    turn.op = None
    event = turn.event
    empty_claims = not event.claims and event.claims is not NO_CLAIMS
    if event.text or event.attachments or empty_claims or event.received_at_ms is not None:
        # Neither is read again after admission: no text, no per-event empty claims dict
        # (64 bytes), no arrival time.
        turn.event = attrs.evolve(
            event,
            text="",
            attachments=(),
            claims=event.claims or NO_CLAIMS,
            received_at_ms=None,
        )
    if not turn.woken:
        parked.fold(route, turn)
    route.parked = parked
    _hold(core)
    if turn.woken:
        parked()


def _parked_route(core: Core, parked: Wake) -> Route | None:
    """The route ``parked`` is parked on, made again when it was released; ``None`` when it
    is parked no longer (woken, or forgotten by ``stop()``)."""
    key = parked.key
    route = core.routes.route(key)
    return route if route is not None and route.parked is parked else None


def wake(core: Core, parked: Wake) -> None:
    """The agent's follower wakes a parked turn: back to the head of its route's queue
    (a folded one once rebuilt: :func:`_rewake`)."""
    turn = parked.turn
    if turn is None:
        if not core.stopped:
            core.spawn(_rewake, core, parked)
        return
    route = core.routes.get(parked.key)
    if route is None or route.parked is not parked:
        if not turn.settled:
            turn.woken = True  # its run has not returned yet: woken as it parks
        return
    parked.turn = None
    _resume(core, route, parked, turn)


def _resume(core: Core, route: Route, parked: Wake, turn: Turn | None) -> None:
    route.parked = None
    _unhold(core)
    if core.stopped:
        return
    if turn is not None:
        route.queue.push_front(turn)
    parked.start_pump(core, route)


async def _rewake(core: Core, parked: Wake) -> None:
    """Wake a folded parked turn: its route made again and hydrated (when it was released),
    the operation's record read, the grant asked again (``authorize``, as after a restart),
    the turn rebuilt from those and put back at the head of the route's queue. A store or
    ``authorize`` error is retried (the route stays held meanwhile); an operation no longer
    ``following`` (settled meanwhile) frees the route, as its run would
    (:func:`claim_following`)."""
    delay = LEASE_BACKOFF_START_S
    while not core.stopped:
        route = _parked_route(core, parked)
        if route is None:
            return
        try:
            with core.routes.pinned(route):
                turn = await _rebuild(core, route, parked)
        except Exception:
            core.count("storage_failures")
            await trio.sleep(delay)
            delay = min(delay * 2, LEASE_BACKOFF_MAX_S)
            continue
        if route.parked is parked and not core.stopped:
            _resume(core, route, parked, turn)
        return


async def _rebuild(core: Core, route: Route, parked: Wake) -> Turn | None:
    """The parked turn as it was parked, from its route's key, its operation's record and
    a grant asked again; ``None`` when the operation is no longer ``following``, or is
    settled here because the grant is refused now (``failed``, as a turn whose identity
    was revoked: :func:`._turn.execute_turn`)."""
    assert core.journal is not None
    key = parked.key
    loaded = await core.journal.load_operation(route.scope, key[0], parked.operation_id)
    if loaded is None or loaded.record.state != FOLLOWING_STATE:
        return None
    event = InboundEvent(
        connection_id=key[0],
        external_conversation_id=key[1],
        external_actor_id=key[3],
        event_id=loaded.record.event_id,
        thread_id=key[2],
        claims=NO_CLAIMS,
    )
    grant = await core.authorize(authorize_input(event, "message", core.now_ms()))
    reason = check_grant(core, grant)
    if reason is None:
        assert isinstance(grant, Grant)
        if ownership_from_identity(grant.identity) != route.scope or key[4] not in (
            grant.agent_aliases
        ):
            reason = "rejected"  # another owner now, or the agent no longer allowed
    if reason is not None:
        core.count("denied")
        code = "identity_revoked" if reason == "revoked" else "rejected"
        async with core.leases.fence(route) as fence:
            settled = await core.settle_operation(
                route.scope,
                key[0],
                parked.operation_id,
                "failed",
                fence=fence,
                error_code=code,
                only_from=frozenset({FOLLOWING_STATE}),
            )
        if settled:
            await release_agent(core, key[4], route.scope, parked.operation_id)
        return None
    assert isinstance(grant, Grant)
    await core.routes.hydrate(route, grant.identity)
    return Turn(
        parked.operation_id,
        event,
        "message",
        grant,
        route.scope,
        key[4],
        following=True,
        cancel_remote=parked.cancelling,
    )


async def release_agent(core: Core, alias: str, scope: OwnershipScope, operation_id: str) -> None:
    """A ``following`` operation was settled without its agent run again (its sender's
    grant refused when its task ended, or at a restart): the agent closes what it keeps for
    it (:meth:`~prismd.agents._base.AgentBase.release_operation`; the ``a2a`` kind: its task
    record, no longer listed nor counted against the tenant's limit, and its follower's
    record). Never raises: a failure is counted."""
    agent = None if core.agents is None else core.agents.get(alias)
    release = getattr(agent, "release_operation", None)
    if release is None:
        return
    try:
        await release(scope, operation_id)
    except Exception:
        core.count("storage_failures")


def cancel_parked(core: Core, route: Route) -> bool:
    """``/cancel`` on a route whose turn is parked: run it to cancel the remote task."""
    parked = route.parked
    if parked is None:
        return False
    parked.cancel()
    return True


def unpark_at_stop(core: Core, route: Route) -> bool:
    """``stop()``: forget the parked turn (its operation stays ``following``); whether
    there was one."""
    if route.parked is None:
        return False
    route.parked = None
    _unhold(core)
    return True


def forget_released(core: Core) -> None:
    """``stop()``: forget the parked turns of the released routes, as :func:`unpark_at_stop`
    (their operations stay ``following``)."""
    for _parked in core.routes.forget_released():
        _unhold(core)


async def claim_following(core: Core, turn: Turn, fence: int | None) -> bool:
    """The claim of a ``following`` operation before its run. False when the record is no
    longer ``following`` (settled meanwhile).

    Recovered after a restart (or from another instance, :func:`._resume.follow_orphans`):
    the state is kept (the remote task is followed, not run again), ``attempts`` + 1, under
    the lease fence. A turn parked here and woken by its follower (``turn.following``) was
    claimed when it first ran: its record is read, not written — one journal write fewer per
    answered task. Its answer is staged by compare-and-swap on the version read here, under
    the fence of the lease its pump holds now, so a claim by anyone else meanwhile (another
    instance that took the conversation over) makes that answer's commit fail: never two
    answers."""
    if core.journal is None:
        return True
    if turn.following:
        return await _still_following(core, turn)

    def claimed(record: OperationRecord) -> dict[str, int]:
        return {"attempts": record.attempts + 1}

    saved = await _move(core, turn, FOLLOWING_STATE, None, fence, claimed)
    if saved is None:
        return False
    turn.op = saved
    turn.following = True
    return True


async def _move(
    core: Core,
    turn: Turn,
    from_state: str,
    to: str | None,
    fence: int | None,
    change: Change | None = None,
) -> Loaded[OperationRecord] | None:
    """CAS the turn's operation from ``from_state`` to ``to`` (``None``: keep the state)
    under ``fence``; the stored record, or ``None`` when it was not in ``from_state``."""
    assert core.journal is not None
    return await transition(
        core.journal,
        _ref(turn),
        to,
        now_ms=core.now_ms(),
        known=turn.op,
        fence=fence,
        change=change,
        allowed=lambda record: record.state == from_state,
    )


async def _still_following(core: Core, turn: Turn) -> bool:
    """Whether the turn's operation is ``following`` as stored now (then ``turn.op`` is
    that record)."""
    assert core.journal is not None
    current = await core.journal.load_operation(
        turn.scope, turn.event.connection_id, turn.operation_id
    )
    if current is None or current.record.state != FOLLOWING_STATE:
        return False
    turn.op = current
    return True


def left_for_restart(core: Core, turn: Turn, stopping: bool) -> bool:
    """A followed turn cancelled by a stop: leave its operation ``following``."""
    return turn.following and (core.stopped or stopping)
