"""Shared runtime state: counters, routes, hydration, binding leases, journal writes, replies.

Everything that more than one entry point needs lives here; the entry points (admit, turns,
commands, approvals, notify, recovery, resume) are plain functions over :class:`Core`.

Write order is the protocol (contract §0): operation record before anything runs, claim before
any agent call, terminal state before the binding, reply staged before ``deliver``. A record
once written under a lease fence is only written again under a lease (SPEC difference 1): the
route lease is re-acquired (:meth:`Core.route_fence`) for writes outside a queued turn.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from stores import (
    SYSTEM_CLOCK,
    Clock,
    LeaseStore,
    OwnershipScope,
    Store,
)

from ..agents import Agent
from ..channel import (
    AttachmentRef,
    Preview,
    Reply,
    SendResult,
)
from ..identity import AgentIdentity, identity_is_active
from ..journal import (
    ApprovalStore,
    ChannelJournal,
    CursorRecord,
    GrantRecord,
    GrantStore,
    Loaded,
    OperationRef,
    PairingStore,
    operation_key,
    transition,
)
from ..limits import Limits
from ..redact import Redactor, bound_detail
from ._leases import DEFAULT_LEASE_IDLE_MS, RouteLeases
from ._routes import Routes
from ._types import (
    ActorKey,
    Authorize,
    DeliveryTurns,
    KnownOperations,
    ResolveAgent,
    ResolveAgentInput,
    ResolveBinding,
    Route,
)
from .api import Diagnostics

MEMO_LIMIT = 1024
"""Per-actor selections and per-scope cursors remembered to save a store read each: the
most recently used this many (with a journal, which holds the truth)."""
COUNTER_NAMES = (
    "admitted",
    "denied",
    "unsupported",
    "duplicates",
    "completed",
    "failed",
    "cancelled",
    "suspended",
    "deliveries",
    "delivery_failures",
    "truncated",
    "storage_failures",
    "lease_losses",
)

FetchAttachment = Callable[[AttachmentRef], Awaitable[Any]]

OnTyping = Callable[[str, str, str | None], Awaitable[None]]


_last_stamp_us = 0


def stamp_us() -> int:
    """Now in microseconds of the wall clock, and later than the last call's in this
    process: orders the records a route writes within one millisecond (admissions,
    staged replies), where ``created_at_ms`` ties and the operation id is a hash."""
    global _last_stamp_us
    _last_stamp_us = max(time.time_ns() // 1000, _last_stamp_us + 1)
    return _last_stamp_us


@attrs.define(eq=False)
class Core:
    """The runtime's state and the primitives every entry point shares."""

    authorize: Authorize
    resolve_agent_cb: ResolveAgent
    deliver: Callable[[Reply], Awaitable[SendResult]]
    nursery: trio.Nursery
    store: Store | None = None
    use_leases: bool = True
    limits: Limits = attrs.field(factory=Limits)
    redactor: Redactor | None = None
    clock: Clock = SYSTEM_CLOCK
    owner_id: str = attrs.field(factory=lambda: f"channel-runtime-{uuid.uuid4()}")
    reclaim_own_leases: bool = False
    lease_idle_ms: int = DEFAULT_LEASE_IDLE_MS
    fetch_attachment: FetchAttachment | None = None
    tells_unanswered: Callable[[str], bool] | None = None
    """Whether a connection id's users are told when an operator settles one of their
    messages unanswered (:mod:`._unanswered`); ``None``: no connection's."""
    on_preview: Callable[[Preview], None] | None = None
    resolve_binding: ResolveBinding | None = None
    pairing_scope: Callable[[str], OwnershipScope | None] | None = None
    on_paired: Callable[[GrantRecord], Awaitable[None]] | None = None
    on_typing: OnTyping | None = None
    typing_delay_ms: Callable[[str], int] | None = None
    """The typing delay of a connection id (``None``: ``DEFAULT_TYPING_DELAY_MS`` for all)."""
    typing_timer: Any = attrs.field(init=False, default=None)
    """The turns' typing indicators (``_typing.TypingTimer``), made at the first run."""

    journal: ChannelJournal | None = attrs.field(init=False, default=None)
    routes: Routes = attrs.field(init=False)
    leases: RouteLeases = attrs.field(init=False)
    approvals: ApprovalStore | None = attrs.field(init=False, default=None)
    pairings: PairingStore | None = attrs.field(init=False, default=None)
    grants: GrantStore | None = attrs.field(init=False, default=None)
    counters: dict[str, int] = attrs.field(
        init=False, factory=lambda: dict.fromkeys(COUNTER_NAMES, 0)
    )
    selections: OrderedDict[ActorKey, str | None] = attrs.field(init=False, factory=OrderedDict)
    seen: dict[str, OrderedDict[str, None]] = attrs.field(init=False, factory=dict)
    cursors: OrderedDict[tuple[str, OwnershipScope], Loaded[CursorRecord]] = attrs.field(
        init=False, factory=OrderedDict
    )
    slots: trio.Semaphore = attrs.field(init=False)
    stopped: bool = attrs.field(init=False, default=False)
    inflight: int = attrs.field(init=False, default=0)
    idle: trio.Event = attrs.field(init=False, factory=trio.Event)
    resume_gate: trio.Event | None = attrs.field(init=False, default=None)
    delivery_turns: DeliveryTurns = attrs.field(init=False, factory=DeliveryTurns)
    known: KnownOperations = attrs.field(init=False, factory=KnownOperations)

    def __attrs_post_init__(self) -> None:
        self.slots = trio.Semaphore(self.limits.max_active_sessions)
        self.idle.set()
        lease_store = self._open_stores()
        self.routes = Routes(
            self.journal, self.limits, self.now_ms, self.count, self.resolve_binding
        )
        self.leases = RouteLeases(
            lease_store,
            self.limits,
            self.owner_id,
            self.nursery,
            self.now_ms,
            self.count,
            reclaim=self.reclaim_own_leases,
            lease_idle_ms=self.lease_idle_ms,
        )

    def _open_stores(self) -> LeaseStore | None:
        """The journal and access stores over ``store``; returns its lease store when
        binding leases are used."""
        if self.store is None:
            return None
        cps = self.store.checkpoints
        self.journal = ChannelJournal(cps, self.limits.max_journal_record_bytes)
        self.approvals = ApprovalStore(
            cps, clock=self.clock, max_record_bytes=self.limits.max_journal_record_bytes
        )
        self.pairings = PairingStore(cps, clock=self.clock)
        self.grants = GrantStore(cps, clock=self.clock)
        return self.store.leases if self.use_leases else None

    # ------------------------------------------------------------------ basics

    def count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n

    def now_ms(self) -> int:
        return self.clock.now_ms()

    def active(self, identity: AgentIdentity) -> bool:
        return identity_is_active(identity, self.now_ms())

    def redact(self, text: str) -> str:
        return text if self.redactor is None else self.redactor.redact(text)

    def diagnostics(self) -> Diagnostics:
        queued = self.pending_total()
        held = self.limits.max_active_sessions - self.slots.value
        return Diagnostics(queued=queued, active=held, **self.counters)

    def pending_total(self) -> int:
        # Kept by the route queues as they change: no walk over the routes per admission.
        return self.routes.tally.queued

    async def resolve_agent(self, route: Route, identity: AgentIdentity) -> Agent:
        return await self.resolve_agent_cb(
            ResolveAgentInput(
                agent_alias=route.alias,
                identity=identity,
                ownership=route.ownership,
                connection_id=route.connection_id,
                external_conversation_id=route.conversation_id,
            )
        )

    # ------------------------------------------------------------------ tasks

    def spawn(self, fn: Callable[..., Awaitable[None]], *args: Any) -> None:
        """Run ``fn`` in the runtime nursery, tracked for ``drain``; errors never escape."""
        self.inflight += 1
        if self.idle.is_set():
            self.idle = trio.Event()
        self.nursery.start_soon(self._tracked, fn, args)

    async def _tracked(self, fn: Callable[..., Awaitable[None]], args: tuple[Any, ...]) -> None:
        try:
            await fn(*args)
        except Exception:
            # A bug or an unexpected store failure in background work: counted, never fatal.
            self.count("storage_failures")
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self.idle.set()

    async def wait_idle(self, deadline_s: float | None) -> bool:
        if deadline_s is None:
            while self.inflight:
                await self.idle.wait()
            return True
        with trio.move_on_after(deadline_s):
            while self.inflight:
                await self.idle.wait()
        return self.inflight == 0

    # ------------------------------------------------------------------ operations

    async def settle_operation(
        self,
        ownership: OwnershipScope,
        connection_id: str,
        operation_id: str,
        state: str,
        *,
        fence: int | None = None,
        error_code: str | None = None,
        run_id: str | None = None,
        session_id: str | None = None,
        only_from: frozenset[str] | None = None,
    ) -> bool:
        """Move the operation to ``state`` (:func:`prismd.journal.transition`) with no reply.

        With ``only_from``, nothing is written unless the stored state is one of those.
        False when nothing was written; store failures also count ``storage_failures``.
        """
        if self.journal is None:
            return True

        given = {"error_code": error_code, "run_id": run_id, "session_id": session_id}
        change = {name: value for name, value in given.items() if value is not None}

        try:
            saved = await transition(
                self.journal,
                OperationRef(ownership, connection_id, operation_id),
                state,
                now_ms=self.now_ms(),
                fence=fence,
                change=change,
                allowed=None if only_from is None else (lambda r: r.state in only_from),
            )
        except Exception:
            self.count("storage_failures")
            return False
        return saved is not None

    async def remove_operation(
        self, ownership: OwnershipScope, connection_id: str, operation_id: str
    ) -> None:
        if self.journal is None:
            return
        with trio.CancelScope(shield=True, relative_deadline=5):
            try:
                await self.journal.remove_operation(ownership, connection_id, operation_id)
            except Exception:
                self.count("storage_failures")
        self.known.discard(operation_key(connection_id, ownership, operation_id))

    def failure_text(self, message: str | None) -> str:
        detail = bound_detail(self.redact(message or "").strip())
        if not detail:
            return "The request failed before it produced an answer."
        return f"Request failed: {detail}"
