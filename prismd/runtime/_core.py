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

from ..agents._base import Agent
from ..channel import (
    AttachmentRef,
    Control,
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
    PairingStore,
    ReplyRecord,
    StoredControl,
    binding_key,
)
from ..limits import Limits
from ..redact import Redactor, bound_detail, truncate_utf8
from ._ids import control_kind, default_session_id
from ._ids import notify_operation_id as notify_operation_id
from ._ids import operation_id_for as operation_id_for
from ._replies import DeliveryTurns, fit_record, scrub_surrogates
from ._types import (
    ActorKey,
    Authorize,
    BindingInput,
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

    async def persist_binding(self, route: Route, fence: int | None) -> bool:
        """CAS-save the route's binding; one re-load and retry on a lost CAS."""
        if self.journal is None:
            return True
        for _attempt in range(2):
            try:
                saved = await self.journal.save_binding(
                    route.ownership,
                    route.binding_key,
                    self.binding_record(route),
                    route.binding_version,
                    fence,
                )
                if saved is not None:
                    route.binding_version = saved.version
                    return True
                loaded = await self.journal.load_binding(route.ownership, route.binding_key)
            except Exception:
                self.count("storage_failures")
                return False
            if loaded is None:
                break
            route.binding_version = loaded.version
        self.count("storage_failures")
        return False

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
        """Load the operation and CAS it to ``state`` (re-load and retry once on a lost CAS).

        With ``only_from``, nothing is written unless the stored state is one of those.
        Failures count ``storage_failures`` and return False.
        """
        if self.journal is None:
            return True
        for _attempt in range(2):
            try:
                loaded = await self.journal.load_operation(ownership, connection_id, operation_id)
                if loaded is None:
                    return False
                record: OperationRecord = loaded.record
                if only_from is not None and record.state not in only_from:
                    return False
                updated = attrs.evolve(
                    record,
                    state=state,
                    error_code=error_code if error_code is not None else record.error_code,
                    run_id=run_id if run_id is not None else record.run_id,
                    session_id=session_id if session_id is not None else record.session_id,
                    updated_at_ms=self.now_ms(),
                )
                use_fence = fence if fence is not None else loaded.fencing_token
                saved = await self.journal.save_operation(
                    ownership, updated, loaded.version, use_fence
                )
            except Exception:
                self.count("storage_failures")
                return False
            if saved is not None:
                return True
        self.count("storage_failures")
        return False

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

    # ------------------------------------------------------------------ replies

    async def send_reply(
        self,
        *,
        identity: AgentIdentity | None,
        ownership: OwnershipScope | None,
        operation_id: str,
        connection_id: str,
        conversation_id: str,
        thread_id: str | None,
        text: str,
        kind: str,
        in_reply_to: str | None,
        controls: tuple[Control, ...] = (),
        fence: int | None = None,
        approval: dict[str, Any] | None = None,
        known_op: Loaded[OperationRecord] | None = None,
    ) -> str | None:
        """§9.2: check identity, bound the text, stage ``pending``, deliver, mark.

        ``text`` must already be redacted. Returns the final reply state (``None`` when
        nothing was sent). A reply whose record is settled is never sent again; a
        staging failure means nothing is sent (persist before send). ``ownership=None``
        sends without journaling (pairing answers, which have no owner yet).
        """
        if identity is not None and not self.active(identity):
            self.count("failed")
            return None
        bounded, cut = truncate_utf8(scrub_surrogates(text), self.limits.max_response_bytes)
        if cut:
            self.count("truncated")
        journal = self.journal if ownership is not None else None
        staged = None
        if journal is not None and ownership is not None:
            # Shielded, bounded: the operation may already be terminal, so a cancellation
            # here (runtime torn down) would lose the answer with nothing listed.
            now = self.now_ms()
            record = ReplyRecord(
                operation_id=operation_id,
                connection_id=connection_id,
                external_conversation_id=conversation_id,
                kind=kind,
                text=bounded,
                state="pending",
                created_at_ms=now,
                updated_at_ms=now,
                thread_id=thread_id,
                controls=tuple(StoredControl(c.label, control_kind(c.value)) for c in controls),
                approval=approval,
            )
            fitted = fit_record(record, self.limits.max_journal_record_bytes)
            if fitted is not record:
                record, bounded = fitted, fitted.text
                if not cut:
                    self.count("truncated")
            with trio.CancelScope(shield=True), trio.move_on_after(10) as bound:
                staged = await self._stage(journal, ownership, record)
            if staged is None:
                if bound.cancelled_caught:
                    self.count("storage_failures")
                return None
        reply = Reply(
            connection_id=connection_id,
            external_conversation_id=conversation_id,
            text=bounded,
            kind="final" if kind == "final" else "notice",
            controls=controls,
            thread_id=thread_id,
            in_reply_to=in_reply_to,
            operation_id=operation_id,
        )
        from ._delivery import deliver_and_mark  # imported late: _delivery builds on Core

        marked = staged if journal is not None and ownership is not None else None
        state = await deliver_and_mark(self, reply, marked, ownership, fence)
        if journal is not None and ownership is not None and staged is not None:
            await self.flag_reply_staged(ownership, connection_id, operation_id, fence, known_op)
        return state

    async def _stage(
        self, journal: ChannelJournal, ownership: OwnershipScope, record: ReplyRecord
    ) -> Loaded[ReplyRecord] | None:
        """Stage the reply ``pending`` (create-only); an existing record is used only while
        still ``pending`` (never resent after it settled). ``None`` means do not send."""
        try:
            staged = await journal.stage(ownership, record)
            if staged is None:
                existing = await journal.load_reply(
                    ownership, record.connection_id, record.operation_id
                )
                if existing is None or existing.record.state != "pending":
                    return None
                staged = existing
        except Exception:
            self.count("storage_failures")
            return None
        return staged

    async def send_reply_kw(self, kwargs: dict[str, Any]) -> None:
        """``send_reply`` for :meth:`spawn` (which passes positional arguments only)."""
        await self.send_reply(**kwargs)

    async def mark_reply(
        self,
        ownership: OwnershipScope,
        version: int,
        record: ReplyRecord,
        state: str,
        message_id: str | None,
        reason: str | None,
        fence: int | None,
        stored_fence: int | None = None,
    ) -> bool:
        assert self.journal is not None
        updated = attrs.evolve(
            record,
            state=state,
            attempts=record.attempts + 1,
            message_id=message_id,
            reason=reason,
            updated_at_ms=self.now_ms(),
        )
        try:
            with trio.CancelScope(shield=True), trio.move_on_after(10):
                saved = await self.journal.mark(
                    ownership, updated, version, fence if fence is not None else stored_fence
                )
                if saved is not None:
                    return True
        except Exception:
            pass
        self.count("storage_failures")
        return False

    async def flag_reply_staged(
        self,
        ownership: OwnershipScope,
        connection_id: str,
        operation_id: str,
        fence: int | None,
        known: Loaded[OperationRecord] | None = None,
    ) -> None:
        assert self.journal is not None
        with trio.CancelScope(shield=True), trio.move_on_after(10):
            if known is not None and known.record.operation_id == operation_id:
                if known.record.reply_staged:
                    return
                updated = attrs.evolve(known.record, reply_staged=True, updated_at_ms=self.now_ms())
                try:
                    saved = await self.journal.save_operation(
                        ownership,
                        updated,
                        known.version,
                        fence if fence is not None else known.fencing_token,
                    )
                except Exception:
                    saved = None
                if saved is not None:
                    return
            for _attempt in range(2):
                try:
                    loaded = await self.journal.load_operation(
                        ownership, connection_id, operation_id
                    )
                    if loaded is None or loaded.record.reply_staged:
                        return
                    updated = attrs.evolve(
                        loaded.record, reply_staged=True, updated_at_ms=self.now_ms()
                    )
                    use_fence = fence if fence is not None else loaded.fencing_token
                    if use_fence is not None and loaded.fencing_token is not None:
                        use_fence = max(use_fence, loaded.fencing_token)
                    saved = await self.journal.save_operation(
                        ownership, updated, loaded.version, use_fence
                    )
                except Exception:
                    self.count("storage_failures")
                    return
                if saved is not None:
                    return
            self.count("storage_failures")

    def failure_text(self, message: str | None) -> str:
        detail = bound_detail(self.redact(message or "").strip())
        if not detail:
            return "The request failed before it produced an answer."
        return f"Request failed: {detail}"
