"""Shared runtime state: counters, routes, hydration, binding leases, journal writes, replies.

Everything that more than one entry point needs lives here; the entry points (admit, turns,
commands, approvals, notify, recovery, resume) are plain functions over :class:`Core`.

Write order is the protocol (contract §0): operation record before anything runs, claim before
any agent call, terminal state before the binding, reply staged before ``deliver``. A record
once written under a lease fence is only written again under a lease (SPEC difference 1): the
route lease is re-acquired (:meth:`Core.route_fence`) for writes outside a queued turn.
"""

from __future__ import annotations

import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import attrs
import trio

from stores import (
    SYSTEM_CLOCK,
    Clock,
    LeaseRecord,
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
    NS_BINDING,
    ApprovalStore,
    BindingRecord,
    ChannelJournal,
    CursorRecord,
    GrantRecord,
    GrantStore,
    Loaded,
    OperationRecord,
    OperationRef,
    PairingStore,
    Write,
    binding_key,
    finish,
    transition,
)
from ..limits import Limits
from ..redact import Redactor, bound_detail
from ._ids import default_session_id
from ._ids import notify_operation_id as notify_operation_id
from ._ids import operation_id_for as operation_id_for
from ._types import (
    ActorKey,
    Authorize,
    BindingInput,
    DeliveryTurns,
    ResolveAgent,
    ResolveAgentInput,
    ResolveBinding,
    Route,
    RouteKey,
)
from .api import Diagnostics

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
MAX_ID_BYTES = 256
LEASE_BACKOFF_START_S = 0.05
LEASE_BACKOFF_MAX_S = 2.0
DEFAULT_LEASE_IDLE_MS = 1_000

OnTyping = Callable[[str, str, str | None], Awaitable[None]]


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
    on_preview: Callable[[Preview], None] | None = None
    resolve_binding: ResolveBinding | None = None
    pairing_scope: Callable[[str], OwnershipScope | None] | None = None
    on_paired: Callable[[GrantRecord], Awaitable[None]] | None = None
    on_typing: OnTyping | None = None

    journal: ChannelJournal | None = attrs.field(init=False, default=None)
    leases: LeaseStore | None = attrs.field(init=False, default=None)
    approvals: ApprovalStore | None = attrs.field(init=False, default=None)
    pairings: PairingStore | None = attrs.field(init=False, default=None)
    grants: GrantStore | None = attrs.field(init=False, default=None)
    counters: dict[str, int] = attrs.field(
        init=False, factory=lambda: dict.fromkeys(COUNTER_NAMES, 0)
    )
    routes: dict[RouteKey, Route] = attrs.field(init=False, factory=dict)
    selections: OrderedDict[ActorKey, str | None] = attrs.field(init=False, factory=OrderedDict)
    seen: dict[str, OrderedDict[str, None]] = attrs.field(init=False, factory=dict)
    cursors: dict[tuple[str, OwnershipScope], Loaded[CursorRecord]] = attrs.field(
        init=False, factory=dict
    )
    slots: trio.Semaphore = attrs.field(init=False)
    stopped: bool = attrs.field(init=False, default=False)
    inflight: int = attrs.field(init=False, default=0)
    idle: trio.Event = attrs.field(init=False, factory=trio.Event)
    resume_gate: trio.Event | None = attrs.field(init=False, default=None)
    delivery_turns: DeliveryTurns = attrs.field(init=False, factory=DeliveryTurns)

    def __attrs_post_init__(self) -> None:
        self.slots = trio.Semaphore(self.limits.max_active_sessions)
        self.idle.set()
        if self.store is not None:
            cps = self.store.checkpoints
            self.journal = ChannelJournal(cps, self.limits.max_journal_record_bytes)
            if self.use_leases:
                self.leases = self.store.leases
            self.approvals = ApprovalStore(
                cps, clock=self.clock, max_record_bytes=self.limits.max_journal_record_bytes
            )
            self.pairings = PairingStore(cps, clock=self.clock)
            self.grants = GrantStore(cps, clock=self.clock)

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
        queued = sum(len(r.queue) for r in self.routes.values())
        held = self.limits.max_active_sessions - self.slots.value
        return Diagnostics(queued=queued, active=held, **self.counters)

    def pending_total(self) -> int:
        return sum(len(r.queue) for r in self.routes.values())

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

    # ------------------------------------------------------------------ routes

    def route_key(
        self,
        connection_id: str,
        conversation_id: str,
        thread_id: str | None,
        actor_id: str,
        alias: str,
        ownership: OwnershipScope,
    ) -> RouteKey:
        return (
            connection_id,
            conversation_id,
            thread_id,
            actor_id,
            alias,
            ownership.tenant_id,
            ownership.account_id,
            ownership.user_id,
        )

    def get_route(
        self,
        connection_id: str,
        conversation_id: str,
        thread_id: str | None,
        actor_id: str,
        alias: str,
        ownership: OwnershipScope,
    ) -> Route | None:
        """The route, created when absent; ``None`` when the table is full of busy routes."""
        key = self.route_key(connection_id, conversation_id, thread_id, actor_id, alias, ownership)
        route = self.routes.get(key)
        if route is not None:
            return route
        if len(self.routes) >= self.limits.max_routes and not self._evict_idle_route():
            return None
        route = Route(
            key=key,
            connection_id=connection_id,
            conversation_id=conversation_id,
            thread_id=thread_id,
            actor_id=actor_id,
            alias=alias,
            ownership=ownership,
            binding_key=binding_key(
                connection_id, ownership, conversation_id, thread_id, actor_id, alias
            ),
        )
        self.routes[key] = route
        return route

    def _evict_idle_route(self) -> bool:
        # An idle, hydrated, unleased route holds nothing the journal does not: forget it.
        for key, route in self.routes.items():
            if (
                not route.busy
                and route.lease is None
                and route.lease_users == 0
                and route.pins == 0
                and not route.hydrate_lock.locked()
            ):
                if route.suspended and self.journal is None:
                    continue
                del self.routes[key]
                return True
        return False

    @contextmanager
    def pinned(self, route: Route) -> Iterator[Route]:
        """Keep ``route`` in the table (not evictable) for the duration of the block."""
        route.pins += 1
        try:
            yield route
        finally:
            route.pins -= 1

    async def derive_session(
        self, route: Route, identity: AgentIdentity, generation: int
    ) -> tuple[str, str | None]:
        if self.resolve_binding is not None:
            resolved = await self.resolve_binding(
                BindingInput(
                    connection_id=route.connection_id,
                    external_conversation_id=route.conversation_id,
                    external_actor_id=route.actor_id,
                    identity=identity,
                    ownership=route.ownership,
                    agent_alias=route.alias,
                    generation=generation,
                    thread_id=route.thread_id,
                )
            )
            sid = resolved.session_id
            if not isinstance(sid, str) or not sid or len(sid.encode("utf-8")) > MAX_ID_BYTES:
                raise TypeError("resolve_binding returned an invalid session id")
            return sid, resolved.leaf_id
        sid = default_session_id(
            route.connection_id,
            route.conversation_id,
            route.thread_id,
            route.actor_id,
            route.ownership,
            route.alias,
            generation,
        )
        return sid, None

    def binding_record(self, route: Route) -> BindingRecord:
        return BindingRecord(
            session_id=route.session_id or "",
            agent_alias=route.alias,
            generation=route.generation,
            suspended=route.suspended,
            leaf_id=route.leaf_id,
            suspended_run=route.suspended_run,
            updated_at_ms=self.now_ms(),
            connection_id=route.connection_id,
            external_conversation_id=route.conversation_id,
            external_actor_id=route.actor_id,
            thread_id=route.thread_id,
            selected_at_ms=route.selected_at_ms,
        )

    def apply_binding(self, route: Route, version: int, record: BindingRecord) -> None:
        route.binding_version = version
        route.binding_stored = record
        route.session_id = record.session_id or None
        route.leaf_id = record.leaf_id
        route.generation = record.generation
        route.suspended = record.suspended
        route.suspended_run = record.suspended_run
        route.selected_at_ms = record.selected_at_ms

    async def hydrate(self, route: Route, identity: AgentIdentity, *, create: bool = True) -> bool:
        """Load the durable binding once per process, creating it when absent and ``create``.

        Returns False when there is no binding and ``create`` is False. Store errors and
        corrupt records propagate (callers answer ``unavailable``).
        """
        if route.hydrated:
            return True
        async with route.hydrate_lock:
            if route.hydrated:
                return True
            if self.journal is None:
                route.hydrated = True
                return True
            loaded = await self.journal.load_binding(route.ownership, route.binding_key)
            if loaded is None:
                if not create:
                    return False
                sid, leaf = await self.derive_session(route, identity, 0)
                route.session_id, route.leaf_id = sid, leaf
                record = self.binding_record(route)
                created = await self.journal.create_binding(
                    route.ownership, route.binding_key, record
                )
                if created is None:
                    loaded = await self.journal.load_binding(route.ownership, route.binding_key)
                    if loaded is None:
                        raise RuntimeError("binding vanished during hydration")
                else:
                    loaded = created
            self.apply_binding(route, loaded.version, loaded.record)
            route.hydrated = True
            return True

    def binding_write(self, route: Route, fence: int | None) -> Write | None:
        """The write that stores the route's binding, or ``None`` when it has not changed
        since it was last read or written (or there is no journal)."""
        if self.journal is None:
            return None
        record = self.binding_record(route)
        stored = route.binding_stored
        if stored is not None and attrs.evolve(stored, updated_at_ms=0) == attrs.evolve(
            record, updated_at_ms=0
        ):
            return None
        return Write(
            NS_BINDING, route.ownership, record, route.binding_version, fence, key=route.binding_key
        )

    def binding_written(self, route: Route, stored: Loaded[Any] | None) -> None:
        if stored is not None:
            self.apply_binding(route, stored.version, stored.record)

    async def persist_binding(self, route: Route, fence: int | None) -> bool:
        """Store the route's binding when it changed (a stale version is re-read and the
        write retried: this runtime's binding is the newer truth). False on a failure."""
        write = self.binding_write(route, fence)
        if write is None or self.journal is None:
            return True
        try:
            finished = await finish(
                self.journal,
                OperationRef(route.ownership, route.connection_id, ""),
                None,
                now_ms=self.now_ms(),
                binding=write,
                settle=False,
            )
        except Exception:
            finished = None
        if finished is None or finished.binding is None:
            self.count("storage_failures")
            return False
        self.binding_written(route, finished.binding)
        return True

    # ------------------------------------------------------------------ leases

    @property
    def leasing(self) -> bool:
        return self.leases is not None

    async def ensure_lease(self, route: Route) -> LeaseRecord | None:
        """The route's binding lease, acquired or renewed; ``None`` when held elsewhere.

        Store errors propagate. The lease key is the binding key, so it includes the
        thread and the ownership scope (SPEC difference 2).
        """
        assert self.leases is not None
        async with route.lease_lock:
            lease = route.lease
            ttl = self.limits.lease_ttl_ms
            if lease is not None:
                remaining = lease.expires_at_ms - self.now_ms()
                if remaining >= ttl / 3:
                    return lease
                renewed = None
                if remaining > 0:
                    renewed = await self.leases.renew_lease(
                        namespace=NS_BINDING,
                        key=route.binding_key,
                        scope=route.ownership,
                        owner_id=self.owner_id,
                        token=lease.token,
                        ttl_ms=ttl,
                    )
                if renewed is not None:
                    route.lease = renewed
                    return renewed
                route.lease = None
                self.count("lease_losses")
            acquired = await self.leases.try_acquire_lease(
                namespace=NS_BINDING,
                key=route.binding_key,
                scope=route.ownership,
                owner_id=self.owner_id,
                ttl_ms=ttl,
                reclaim=self.reclaim_own_leases,
            )
            route.lease = acquired
            if acquired is not None:
                route.lease_fresh = True
            if acquired is not None and not route.renewing:
                route.renewing = True
                self.nursery.start_soon(self._renewer, route)
            return acquired

    async def _renewer(self, route: Route) -> None:
        """Keep the route lease alive while the route has work (renew below ttl/3)."""
        ttl = self.limits.lease_ttl_ms
        try:
            while route.lease is not None and (route.busy or route.lease_users > 0):
                lease = route.lease
                wait_ms = lease.expires_at_ms - self.now_ms() - ttl / 3
                await trio.sleep(max(0.01, wait_ms / 1000))
                if route.lease is not lease or not (route.busy or route.lease_users > 0):
                    continue
                try:
                    await self.ensure_lease(route)
                except Exception:
                    self.count("storage_failures")
                    await trio.sleep(min(1.0, ttl / 10_000))
        finally:
            route.renewing = False

    async def release_when_idle(self, route: Route) -> None:
        """Release the route lease once the route has stayed idle for ``lease_idle_ms`` (at
        most a third of the TTL, so the idle lease never needs a renewal): a busy
        conversation keeps its lease across turns instead of releasing and re-acquiring it
        around each message. ``stop()`` releases at once."""
        if self.leases is None or route.lease is None:
            return
        grace = min(self.lease_idle_ms, self.limits.lease_ttl_ms / 3) / 1000
        scheduled = route.release_at is not None
        route.release_at = trio.current_time() + grace
        if grace <= 0:
            route.release_at = None
            await self.release_if_idle(route)
        elif not scheduled:
            self.nursery.start_soon(self._release_later, route)

    async def _release_later(self, route: Route) -> None:
        try:
            # Each new idle moment moves ``release_at``: sleep until the latest one.
            while True:
                due = route.release_at
                if due is None or trio.current_time() >= due:
                    break
                await trio.sleep_until(due)
        finally:
            # Also when the runtime is torn down meanwhile (shielded, bounded inside).
            route.release_at = None
            await self.release_if_idle(route)

    async def release_if_idle(self, route: Route) -> None:
        """Release the route lease when nothing uses it; fail-closed on a store error."""
        if self.leases is None or route.lease is None:
            return
        # Under the lease lock, so a turn admitted meanwhile cannot pick up the lease
        # that is being released (it waits, then acquires a fresh one).
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            async with route.lease_lock:
                lease = route.lease
                if lease is None or route.busy or route.lease_users > 0:
                    return
                try:
                    await self.leases.release_lease(
                        namespace=NS_BINDING,
                        key=route.binding_key,
                        scope=route.ownership,
                        owner_id=self.owner_id,
                        token=lease.token,
                    )
                except Exception:
                    # Keep the in-memory lease: the same token is retried at the next idle
                    # point or at stop (fail-closed: never treat the binding as free).
                    self.count("storage_failures")
                    return
                if route.lease is lease:
                    route.lease = None

    @asynccontextmanager
    async def route_fence(self, route: Route, *, wait_s: float = 0.0) -> AsyncIterator[int | None]:
        """Hold the route lease for writes made outside a queued turn; yields its fence.

        Without leases yields ``None``. When the lease is held elsewhere it retries with
        bounded backoff for up to ``wait_s`` seconds, then raises
        :class:`~._types.LeaseHeldElsewhereError`.
        """
        if self.leases is None:
            yield None
            return
        from ._types import LeaseHeldElsewhereError

        route.lease_users += 1
        try:
            delay = LEASE_BACKOFF_START_S
            waited = 0.0
            while True:
                lease = await self.ensure_lease(route)
                if lease is not None:
                    break
                if waited >= wait_s:
                    self.count("lease_losses")
                    raise LeaseHeldElsewhereError()
                await trio.sleep(delay)
                waited += delay
                delay = min(delay * 2, LEASE_BACKOFF_MAX_S)
            yield lease.fencing_token
        finally:
            route.lease_users -= 1
            await self.release_if_idle(route)

    def route_fence_now(self, route: Route) -> int | None:
        return None if route.lease is None else route.lease.fencing_token

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

        def change(record: OperationRecord) -> OperationRecord:
            return attrs.evolve(
                record,
                error_code=error_code if error_code is not None else record.error_code,
                run_id=run_id if run_id is not None else record.run_id,
                session_id=session_id if session_id is not None else record.session_id,
            )

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
        with trio.CancelScope(shield=True), trio.move_on_after(5):
            try:
                await self.journal.remove_operation(ownership, connection_id, operation_id)
            except Exception:
                self.count("storage_failures")

    def failure_text(self, message: str | None) -> str:
        detail = bound_detail(self.redact(message or "").strip())
        if not detail:
            return "The request failed before it produced an answer."
        return f"Request failed: {detail}"
