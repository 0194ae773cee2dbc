"""The runtime facade and ``open_messaging_runtime`` (the daemon's entry point)."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any, Concatenate, ParamSpec, TypeVar

import attrs
import trio

from stores import SYSTEM_CLOCK, Clock, OwnershipScope, Store

from ..agents import Agent
from ..channel import (
    AdapterRegistry,
    PastReply,
    Preview,
    Redactor,
    Reply,
    SendResult,
)
from ..grants import AgentIdentity
from ..journal import GrantRecord
from ..limits import Limits
from . import _admit, _delivery, _notify, _recovery, _resume, _unanswered, _unconfirmed
from ._commands import cancel_queued
from ._core import Core, FetchAttachment
from ._counting import UnresolvedCounter
from ._following import forget_released, unpark_at_stop
from ._leases import DEFAULT_LEASE_IDLE_MS, LoggedLeases
from .api import (
    Authorize,
    Diagnostics,
    DrainResult,
    ResolveAgent,
    ResolveBinding,
)

log = logging.getLogger("prismd.runtime")

DEFAULT_LIMITS = Limits()


P = ParamSpec("P")
R = TypeVar("R")


def _on_open(
    step: Callable[Concatenate[Core, P], Awaitable[R]],
) -> Callable[Concatenate[Runtime, P], Coroutine[Any, Any, R]]:
    """A method of :class:`Runtime` that is ``step`` on the open runtime's state (its
    arguments and answer are ``step``'s; ``RuntimeError`` before the runtime is opened)."""

    async def method(self: Runtime, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return await step(self._core, *args, **kwargs)

    method.__name__ = method.__qualname__ = step.__name__
    method.__doc__ = step.__doc__
    # What inspect (and the surface test) reads: step's parameters, self for its core.
    signature = inspect.signature(step)
    _core, *rest = signature.parameters.values()
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_ONLY)
    method.__signature__ = signature.replace(parameters=[self_parameter, *rest])  # type: ignore[attr-defined]
    return method


@attrs.define(eq=False)
class Runtime(_admit.Entrance):
    """Satisfies :class:`prismd.runtime.api.MessagingRuntime`; every method is safe to call
    from any task.

    :func:`open_messaging_runtime` opens one and runs it for the duration of its block.
    ``Runtime()`` is one not opened yet, which the adapters can be built with (their
    ``admit`` and history) before ``open_messaging_runtime(runtime=…, adapters=…)`` opens
    it: until then it admits nothing (``denied/unavailable``, retryable) and knows no
    history; the operator's methods need it open."""

    _open: Core | None = None
    """The running runtime's state; ``None`` until it is opened."""
    _stop_done: bool = False
    _opened_at_ms: int = 0
    """When it was opened: replies staged since are this process's own sends."""
    _counter: UnresolvedCounter | None = attrs.field(default=None, init=False)
    """What :meth:`count_unresolved` remembers between counts (of the open runtime)."""

    @property
    def _core(self) -> Core:
        core = self._open
        if core is None:
            raise RuntimeError("the runtime is not open")
        return core

    def leases_held(self) -> int:
        """Binding leases this runtime holds now (for metrics)."""
        return sum(1 for route in self._core.routes.values() if route.lease is not None)

    def busy_conversations(self, connection_id: str) -> frozenset[str]:
        """The conversations of ``connection_id`` this runtime still works on: a turn queued,
        running or ending, or their route lease still held. A durable inbox keeps such a
        conversation's next messages for this instance, so they run after the earlier ones
        (one pass over the route table, no store call); none before it is opened."""
        core = self._open
        if core is None:
            return frozenset()
        return frozenset(
            route.external_conversation_id
            for route in core.routes.values()
            if route.connection_id == connection_id
            and (route.busy or route.lease is not None or route.lease_users > 0)
        ).union(key[1] for key, _parked in core.routes.released() if key[0] == connection_id)

    async def count_unresolved(
        self, *, identities: Sequence[AgentIdentity], limit: int
    ) -> tuple[int, bool]:
        """``(entries, capped)``: how many entries ``list_unresolved_page`` lists for each
        of ``identities`` (every page), summed, counting stopped at ``limit`` (``capped``:
        there may be more). Cheap enough to ask every few seconds: it does not load each
        pending reply's operation again (:mod:`prismd.runtime._counting`). Store errors
        propagate."""
        core = self._core
        counter = self._counter
        if counter is None or counter.core is not core:
            counter = self._counter = UnresolvedCounter(core)
        return await counter.count(identities, limit)

    # The operator's calls: each is its module's step on the open runtime's state.
    notify = _on_open(_notify.notify)
    list_unresolved = _on_open(_recovery.list_unresolved)
    list_unresolved_page = _on_open(_recovery.list_unresolved_page)
    reconcile = _on_open(_recovery.reconcile)
    prune = _on_open(_recovery.prune)
    create_pairing = _on_open(_notify.create_pairing)

    async def redeliver_pending(
        self,
        *,
        connection_id: str,
        external_conversation_id: str,
        external_actor_id: str,
        thread_id: str | None = None,
    ) -> int:
        """The conversation has a live connection again: deliver the replies its channel
        held (``SendResult.hold()``), oldest first, each reopened by CAS so none is sent
        twice. Returns how many were delivered; never raises. See
        :mod:`prismd.runtime._delivery`."""
        if self._open is None:
            return 0
        return await _delivery.redeliver_pending(
            self._core,
            connection_id=connection_id,
            external_conversation_id=external_conversation_id,
            actor_id=external_actor_id,
            thread_id=thread_id,
        )

    async def resend_unconfirmed(
        self, connection_id: str, *, taken_over: bool = False
    ) -> dict[str, int]:
        """The connection's adapter is up and declares ``features.idempotent_send``: re-drive
        its ``pending`` replies whose first send's outcome is unknown (a daemon killed
        mid-send), oldest first, each reopened by CAS; the adapter decides resend, proof or
        ``delivery_unknown``. Only replies staged before this runtime was opened (those
        staged since are its own turns' sends) — or, ``taken_over`` (its receiver lease
        was just taken over from a dead instance), before now. Returns the count per end
        state; never raises. See :mod:`prismd.runtime._unconfirmed`."""
        if self._open is None:
            return {}
        before = self._core.now_ms() if taken_over else self._opened_at_ms
        return await _unconfirmed.resend_unconfirmed(
            self._core, connection_id, staged_before_ms=before
        )

    async def recent_replies(
        self,
        *,
        connection_id: str,
        external_conversation_id: str,
        external_actor_id: str,
        thread_id: str | None = None,
        limit: int = 20,
    ) -> list[PastReply]:
        """The conversation's last ``limit`` delivered replies within retention, oldest
        first (the agent's side only: inbound text is not kept). Never raises."""
        if self._open is None:
            return []
        return await _delivery.past_replies(
            self._core,
            _delivery.delivered_replies,
            _delivery.MAX_HISTORY,
            connection_id,
            external_conversation_id,
            external_actor_id,
            thread_id,
            limit,
        )

    async def unanswered_notices(
        self,
        *,
        connection_id: str,
        external_conversation_id: str,
        external_actor_id: str,
        thread_id: str | None = None,
        limit: int = 20,
    ) -> list[PastReply]:
        """Notices for the conversation's messages an operator settled unanswered within
        retention, oldest first, as past replies (see :mod:`prismd.runtime._unanswered`);
        ``[]`` for a connection without ``tells_unanswered``. Never raises."""
        if self._open is None or not _unanswered.tells_unanswered(self._core, connection_id):
            return []
        return await _delivery.past_replies(
            self._core,
            _unanswered.unanswered_notices,
            _unanswered.MAX_NOTICES,
            connection_id,
            external_conversation_id,
            external_actor_id,
            thread_id,
            limit,
        )

    def health(self) -> dict[str, str]:
        """Bounded enums: ``store`` is ``ok``, ``failing`` (the last store call raised; the
        next one that answers clears it) or ``none`` (no journal)."""
        journal = self._core.journal
        return {"store": "none" if journal is None else journal.health.state}

    def diagnostics(self) -> Diagnostics:
        """The §13.6 counters; never text, ids, tokens or keys."""
        return self._core.diagnostics()

    async def drain(self, *, deadline_ms: int | None = None) -> DrainResult:
        """Wait for in-flight work (pumps, notices, resumes), up to ``deadline_ms``."""
        core = self._core
        settled = await core.wait_idle(None if deadline_ms is None else deadline_ms / 1000)
        c = core.counters
        return DrainResult(
            settled=settled,
            pending=core.inflight,
            completed=c["completed"],
            failed=c["failed"],
            cancelled=c["cancelled"],
        )

    async def stop(self) -> None:
        """§13.5: refuse new work, settle queued and claimed work ``cancelled`` durably
        within ``stop_deadline_ms``, release binding leases. Idempotent.

        Runs that do not end when cancelled (an agent shielding itself) are waited for
        until shortly before the deadline; their operations are then settled ``cancelled``
        / ``cancelled_at_shutdown`` by ``stop`` itself, and their late results discarded.
        """
        core = self._open
        if core is None:
            return
        core.stopped = True
        if self._stop_done:
            return
        self._stop_done = True
        deadline_s = core.limits.stop_deadline_ms / 1000
        end = trio.current_time() + deadline_s
        reserve = min(1.0, deadline_s / 4)
        # Cleanup is shielded but bounded by the deadline: a caller cancelled mid-stop
        # must not leave queued work unsettled, and nothing may outlive the deadline.
        with trio.CancelScope(shield=True, deadline=end):
            forget_released(core)  # parked turns of released routes (as unpark_at_stop)
            for route in list(core.routes.values()):
                current = route.active.turn if route.active is not None else None
                behind_following = unpark_at_stop(core, route) or (
                    current is not None and current.following
                )
                for turn in route.queue.take_all():
                    if turn.cancelled:
                        continue
                    if behind_following:
                        # Queued behind a followed remote task (SPEC difference 9): left
                        # ``accepted``; the restart's recovery runs it after that task.
                        turn.cancelled = True
                        turn.settled = True
                        continue
                    turn.cancelled = True
                    turn.cancel_counted = True
                    core.count("cancelled")
                    await cancel_queued(core, turn, "cancelled_at_shutdown")
                active = route.active
                if active is not None:
                    if active.state == "waiting" and active.turn is not None:
                        active.turn.cancelled = True
                        if not active.turn.cancel_counted:
                            active.turn.cancel_counted = True
                            core.count("cancelled")
                    active.cancel(stopping=True)
        await core.wait_idle(max(0.0, end - reserve - trio.current_time()))
        with trio.CancelScope(shield=True, deadline=end):
            await _settle_stragglers(core)
        for route in list(core.routes.values()):
            route.lease_users = 0
            # Also a route whose run ignores cancellation: its record is settled by now and
            # its late writes are discarded, so nothing of this runtime needs the lease.
            await core.leases.release_if_idle(route, force=True)


async def _settle_stragglers(core: Core) -> None:
    """Settle turns whose run outlived cancellation: ``cancelled_at_shutdown``."""
    for route in list(core.routes.values()):
        active = route.active
        turn = None if active is None else active.turn
        if turn is None or turn.settled or turn.settled_by_stop or turn.finishing:
            # A turn writing its own end already settles it (shielded, bounded).
            continue
        turn.settled_by_stop = True
        log.warning(
            "the run of %s did not end by the stop deadline; settled"
            " cancelled_at_shutdown (a late result is discarded)",
            turn.operation_id,
        )
        ok = await core.settle_operation(
            turn.scope,
            turn.event.connection_id,
            turn.operation_id,
            "cancelled",
            fence=core.leases.fence_now(route),
            error_code="cancelled_at_shutdown",
            only_from=frozenset({"accepted", "executing"}),
        )
        if ok:
            turn.settled = True
            if not turn.cancel_counted:
                turn.cancel_counted = True
                core.count("cancelled")


@asynccontextmanager
async def open_messaging_runtime(
    *,
    authorize: Authorize,
    resolve_agent: ResolveAgent | None = None,
    deliver: Callable[[Reply], Awaitable[SendResult]] | None = None,
    adapters: AdapterRegistry | None = None,
    agents: Mapping[str, Agent] | None = None,
    runtime: Runtime | None = None,
    store: Store | None = None,
    use_leases: bool = True,
    limits: Limits = DEFAULT_LIMITS,
    redactor: Redactor | None = None,
    clock: Clock = SYSTEM_CLOCK,
    owner_id: str | None = None,
    adopt_own_leases: bool = False,
    fetch_attachment: FetchAttachment | None = None,
    tells_unanswered: Callable[[str], bool] | None = None,
    on_preview: Callable[[Preview], None] | None = None,
    resolve_binding: ResolveBinding | None = None,
    pairing_scope: Callable[[str], OwnershipScope | None] | None = None,
    on_paired: Callable[[GrantRecord], Awaitable[None]] | None = None,
    on_typing: Callable[[str, str, str | None], Awaitable[None]] | None = None,
    typing_delay_ms: Callable[[str], int] | None = None,
    idempotent_send: Callable[[str], bool] | None = None,
    resume_accepted: bool = False,
    lease_idle_ms: int = DEFAULT_LEASE_IDLE_MS,
) -> AsyncIterator[Runtime]:
    """Run a messaging runtime for the duration of the block; leaving it calls ``stop()``.

    The runtime is opened with its adapters and agents: ``adapters`` (the connections'
    adapters, by connection id) carry its replies out — ``deliver``, previews, typing
    indicators, file fetches and ``tells_unanswered`` are theirs, each as the adapter's
    features declare — and ``agents`` (by alias) run its turns. A host without adapters
    passes those seams as callbacks instead (``deliver``, ``resolve_agent``, ``on_preview``
    …); a callback given explicitly wins. ``runtime``: a :class:`Runtime` built unopened
    (the adapters were built with it), opened here.

    The runtime owns its nursery (route pumps, lease renewers, notices, resumes).
    Constructing it calls none of the callbacks. ``store=None`` runs without a journal
    (in-memory dedup, restart-unsafe). ``on_typing(connection_id, external_conversation_id,
    thread_id)`` is awaited once a turn's agent run has lasted ``typing_delay_ms(connection_id)``
    (default :data:`~prismd.channel.DEFAULT_TYPING_DELAY_MS` for every connection; an answer
    ready sooner sends none) and every 4.5 s after that while the run lasts (a child task
    cancelled when the run ends; its failures are logged by type and swallowed, and a hung
    call is abandoned after 4.5 s).

    ``tells_unanswered(connection_id)``: that connection's users are told, by a notice,
    when an operator's ``reconcile`` settles one of their messages unanswered
    (``execution_unknown``, ``abandoned``), and :meth:`Runtime.unanswered_notices` reads those
    notices back (see :mod:`prismd.runtime._unanswered`). Default: no connection's.

    ``idempotent_send(connection_id)``: that connection's adapter declares
    ``features.idempotent_send`` (a send repeated after an unknown outcome is deduplicated
    or proven by the channel), so a reply's ``delivered`` mark there may wait up to
    :data:`~._core.MARK_LINGER_S` to share a commit. Default: the adapters' declarations.

    ``resume_accepted=True`` (with a store): right after start, every ``accepted`` message
    record carrying its journaled input (acknowledged by a previous process that died
    before running it) is queued on its route, oldest first, re-authorized, and run once
    (SPEC difference 8; see :mod:`prismd.runtime._resume`). Default False: such records
    are only listed as unresolved, as before.

    ``lease_idle_ms``: a route keeps its binding lease this long after its last turn (at
    most a third of ``lease_ttl_ms``), so a conversation's next message reuses it instead
    of acquiring a new one; ``0`` releases as soon as the queue is empty.
    """
    if adapters is not None:
        deliver = deliver or adapters.send
        tells_unanswered = tells_unanswered or adapters.tells_unanswered
        typing_delay_ms = typing_delay_ms or adapters.typing_delay_ms
        # The connections' ids, asked per reply (a set's own lookup: no call of ours).
        idempotent_send = (
            idempotent_send
            or frozenset(
                cid for cid, adapter in adapters.items() if adapter.features.idempotent_send
            ).__contains__
        )
        if on_preview is None and adapters.any_offers("previews"):
            on_preview = adapters.send_draft
        if on_typing is None and adapters.any_offers("typing"):
            on_typing = adapters.send_typing
        if fetch_attachment is None and adapters.any_offers("attachments"):
            fetch_attachment = adapters.fetch_attachment
    if deliver is None:
        raise TypeError("open_messaging_runtime needs adapters or deliver")
    if resolve_agent is None and agents is None:
        raise TypeError("open_messaging_runtime needs agents or resolve_agent")
    if runtime is None:
        runtime = Runtime()
    elif runtime._open is not None:
        raise RuntimeError("the runtime was opened already")
    async with trio.open_nursery() as nursery:
        extra = {} if owner_id is None else {"owner_id": owner_id}
        core = Core(
            authorize=authorize,
            resolve_agent_cb=resolve_agent,
            agents=agents,
            deliver=deliver,
            nursery=nursery,
            store=store,
            use_leases=use_leases,
            limits=limits,
            redactor=redactor,
            clock=clock,
            adopt_own_leases=adopt_own_leases,
            lease_idle_ms=lease_idle_ms,
            fetch_attachment=fetch_attachment,
            tells_unanswered=tells_unanswered,
            on_preview=on_preview,
            resolve_binding=resolve_binding,
            pairing_scope=pairing_scope,
            on_paired=on_paired,
            on_typing=on_typing,
            typing_delay_ms=typing_delay_ms,
            idempotent_send=idempotent_send,
            **extra,
        )
        core.resend_one = functools.partial(_unconfirmed.resend_one, core)
        if core.leases.store is not None:
            # Every binding lease decision at DEBUG.
            core.leases.store = LoggedLeases(core.leases.store)
        runtime._open = core
        runtime._opened_at_ms = core.now_ms()
        if resume_accepted and core.journal is not None:
            core.resume_gate = trio.Event()
            core.spawn(_resume.resume_accepted, core, core.now_ms())
            if use_leases:
                # Not tracked by drain(): it never ends while the runtime runs.
                every_s = max(1.0, limits.lease_ttl_ms / 1000)
                nursery.start_soon(_resume.follow_orphans, core, every_s)
        try:
            yield runtime
        finally:
            # Bounded, shielded: stop must settle durably even when we leave by cancellation.
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(limits.stop_deadline_ms / 1000 + 5),
            ):
                await runtime.stop()
            nursery.cancel_scope.cancel()
