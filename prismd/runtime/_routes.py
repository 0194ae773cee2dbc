"""The route table: one in-memory route per binding, hydrated once from the durable binding,
with the turns queued on it and the actor's ``/agent`` choice.

A route is created on the first event of a (connection, conversation, thread, actor,
alias, scope); an idle, unleased route is evicted when the table is full (the journal
keeps everything it held). Its binding is read once per process and written back only
when it changed (:meth:`Routes.binding_write`). An actor's ``/agent`` choice is the
binding with the newest selection stamp (:meth:`Routes.current_selection`).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, Literal, Protocol, TypeAlias, TypeVar

import attrs
import trio

from stores import LeaseRecord

from ..channel import Action, InboundEvent
from ..grants import AgentIdentity, Grant
from ..journal import (
    NS_BINDING,
    BindingRecord,
    ChannelJournal,
    Loaded,
    OperationRecord,
    OperationRef,
    OwnershipScope,
    SuspendedRun,
    Write,
    binding_actor_prefix,
    binding_key,
    default_session_id,
    finish,
)
from ..limits import Limits
from .api import BindingInput, ResolveBinding

MAX_ID_BYTES = 256
MEMO_LIMIT = 1024
"""Per-actor selections and per-scope cursors remembered to save a store read each: the
most recently used this many (with a journal, which holds the truth)."""

RouteKey: TypeAlias = tuple[str, str, str | None, str, str, str | None, str | None, str | None]
ActorKey: TypeAlias = tuple[str, str, str | None, str, str | None, str | None, str | None]


@attrs.define(eq=False)
class Turn:
    """One admitted event waiting in (or popped from) a route queue."""

    operation_id: str
    event: InboundEvent
    action: Action
    grant: Grant
    scope: OwnershipScope
    alias: str
    op: Loaded[OperationRecord] | None = None
    """The operation record as last written by this runtime (saves a load per CAS)."""
    cancelled: bool = False
    cancel_counted: bool = False
    settled: bool = False
    claim_failures: int = 0
    finishing: bool = False
    """The turn is writing its own end (settlement + answer): ``stop()`` leaves it alone."""
    settled_by_stop: bool = False
    """``stop()`` settled this turn ``cancelled`` after its deadline while the agent still
    ran: a late result is discarded (no second terminal write, no reply)."""
    following: bool = False
    """Its operation is ``following`` a remote task (SPEC difference 9): a stop leaves it
    (and the turns queued behind it) as they are, to be followed again after a restart."""
    woken: bool = False
    """Its wake came before its run returned ``following`` (:mod:`._following`)."""
    cancel_remote: bool = False
    """``/cancel`` woke it while parked: its run cancels the remote task."""


class ParkedTurn(Protocol):
    """A turn parked while its remote task is followed, in the small form its wake keeps
    (:class:`._following.Wake`)."""

    @property
    def operation_id(self) -> str: ...

    @property
    def folded(self) -> bool: ...

    def cancel(self) -> None:
        """``/cancel``: wake it to cancel its remote task."""


ActiveState: TypeAlias = Literal["waiting", "running", "resuming"]


@attrs.define(eq=False)
class ActiveTurn:
    """The route's current work: a turn waiting for a slot or running, or a resume."""

    state: ActiveState
    cancel_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    turn: Turn | None = None
    cancelled: bool = False
    stopping: bool = False
    ended: trio.Event = attrs.field(factory=trio.Event)
    """Set once the route is free again (the turn's last journal write and send are done)."""

    def cancel(self, *, stopping: bool = False) -> None:
        self.cancelled = True
        self.stopping = self.stopping or stopping
        self.cancel_scope.cancel()


@attrs.define(eq=False)
class QueueTally:
    """The turns queued on all the routes of one runtime, kept as they are queued and
    taken: the process-wide capacity check reads it instead of walking the routes."""

    queued: int = 0


class TurnQueue:
    """A route's FIFO of turns (at most ``max_pending_per_binding``), counted into the
    runtime's :class:`QueueTally` by every change. A list rather than a deque (56 bytes
    empty against ~600), and only while something is queued: ten thousand idle (or
    parked) routes pay nothing for it."""

    __slots__ = ("_locks", "_tally")

    def __init__(self, tally: QueueTally) -> None:
        self._tally = tally
        self._locks: list[Turn] | None = None

    def __len__(self) -> int:
        return len(self._locks) if self._locks else 0

    def __bool__(self) -> bool:
        return bool(self._locks)

    def __iter__(self) -> Iterator[Turn]:
        return iter(self._locks or ())

    @property
    def head(self) -> Turn | None:
        return self._locks[0] if self._locks else None

    def append(self, turn: Turn) -> None:
        if self._locks is None:
            self._locks = [turn]
        else:
            self._locks.append(turn)
        self._tally.queued += 1

    def push_front(self, turn: Turn) -> None:
        """Put a popped turn back at the head (its claim must wait)."""
        if self._locks is None:
            self._locks = [turn]
        else:
            self._locks.insert(0, turn)
        self._tally.queued += 1

    def pop_head(self) -> Turn:
        if not self._locks:
            raise IndexError("pop from an empty turn queue")
        turn = self._locks.pop(0)
        if not self._locks:
            self._locks = None
        self._tally.queued -= 1
        return turn

    def take_all(self) -> list[Turn]:
        """Empty the queue; returns what it held, oldest first."""
        turns, self._locks = self._locks or [], None
        self._tally.queued -= len(turns)
        return turns


def _unused(lock: trio.Lock | None) -> bool:
    return lock is not None and not lock.locked() and not lock.statistics().tasks_waiting


_Part = TypeVar("_Part")


class _KeyPart(Generic[_Part]):
    """A read-only attribute of a :class:`Route` that is one place of its ``key``."""

    __slots__ = ("place",)

    def __init__(self, place: int) -> None:
        self.place = place

    def __get__(self, route: Route, owner: type[Route] | None = None) -> _Part:
        return route.key[self.place]  # type: ignore[return-value]


@attrs.define(eq=False, weakref_slot=False)
class Route:
    """In-memory state of one binding (connection, conversation, thread, actor, alias, scope).

    Hydrated once per process from the durable binding; afterwards authoritative. Nothing
    refers to a route weakly: no ``__weakref__`` slot (224 bytes, not 240, per route).
    """

    key: RouteKey
    """(connection, conversation, thread, actor, alias, tenant, account, user): the first
    five are read from it (the :class:`_KeyPart` attributes below) rather than kept twice,
    and the scope is built from the last three (:attr:`scope`)."""
    queue: TurnQueue
    hydrated: bool = False
    binding_version: int = 0
    binding_stored: BindingRecord | None = None
    """The binding as last read or written: a turn writes it again only when it changed."""
    session_id: str | None = None
    leaf_id: str | None = None
    generation: int = 0
    suspended: bool = False
    suspended_run: SuspendedRun | None = None
    selected_at_ms: int | None = None
    active: ActiveTurn | None = None
    pumping: bool = False
    lease: LeaseRecord | None = None
    lease_users: int = 0
    renewer: trio.CancelScope | None = None
    """The scope of the task keeping the lease alive while the route works; cancelled
    when the lease is released, so an idle route leaves no sleeping task behind."""
    release_at: float | None = None
    """When the idle route's lease is due for release (Trio time); ``None``: no release is
    scheduled. Back-to-back turns keep the lease instead of releasing and re-acquiring it."""
    lease_fresh: bool = False
    """The lease was newly acquired (not renewed): another runtime may have written the
    binding since this process hydrated it; the pump re-reads it before the next turn."""
    parked: ParkedTurn | None = None
    """The turn parked while its remote task is followed (:mod:`._following`): the route
    is held (later turns wait) but nothing runs, and no lease is kept for it."""
    pins: int = 0
    """Entry points holding this route object across an await (admit, commands): the
    route must not be evicted meanwhile, or a second route object for the same binding
    could be created and both would pump it."""
    outbox: deque[Any] | None = None
    """Replies its turns staged and did not send yet, oldest first: sent one after another
    by the route's sender task while the pump goes on (:func:`~._core.send_from_route`);
    ``None`` while there are none."""
    _lease_lock: trio.Lock | None = None
    _hydrate_lock: trio.Lock | None = None

    connection_id = _KeyPart[str](0)
    external_conversation_id = _KeyPart[str](1)
    thread_id = _KeyPart[str | None](2)
    actor_id = _KeyPart[str](3)
    alias = _KeyPart[str](4)

    @property
    def scope(self) -> OwnershipScope:
        """The route's owner, built from its key when asked (a few times per turn) rather
        than kept: 64 bytes per route, and ten thousand parked routes hold nothing else
        that refers to it."""
        key = self.key
        return OwnershipScope(key[5], key[6], key[7])

    @property
    def binding_key(self) -> str:
        """The binding's journal key (also its lease key), built when needed rather than
        kept: ~180 bytes per route, for a few f-string joins per turn."""
        return binding_key(
            self.connection_id,
            self.scope,
            self.external_conversation_id,
            self.thread_id,
            self.actor_id,
            self.alias,
        )

    # The locks are created on first use: an idle route that never needed one does not
    # carry two locks and their parking lots (~700 bytes).
    @property
    def lease_lock(self) -> trio.Lock:
        if self._lease_lock is None:
            self._lease_lock = trio.Lock()
        return self._lease_lock

    @property
    def hydrate_lock(self) -> trio.Lock:
        if self._hydrate_lock is None:
            self._hydrate_lock = trio.Lock()
        return self._hydrate_lock

    def hydrating(self) -> bool:
        return self._hydrate_lock is not None and self._hydrate_lock.locked()

    def shed_locks(self) -> None:
        """Forget the locks nobody holds or waits for (they are made again on next use).

        Safe because ``async with route.lease_lock`` takes a free lock without yielding:
        no task can hold a reference to a lock it has not yet acquired or queued on.
        """
        if _unused(self._lease_lock):
            self._lease_lock = None
        if _unused(self._hydrate_lock):
            self._hydrate_lock = None

    @property
    def busy(self) -> bool:
        return self.working or bool(self.queue) or self.parked is not None

    @property
    def working(self) -> bool:
        """Busy with something that needs the binding lease now (not a parked turn and the
        turns waiting behind it)."""
        return (
            self.active is not None
            or self.pumping
            or (bool(self.queue) and self.parked is None)
            or self.outbox is not None
        )

    def status_text(self) -> str:
        if self.active is not None and self.active.state == "resuming":
            return "resuming"
        if self.active is not None:
            return "running"
        if self.parked is not None:
            return "following a remote task"
        if self.suspended:
            return "awaiting decision"
        if self.queue:
            return f"queued ({len(self.queue)})"
        return "idle"


@attrs.define(eq=False)
class Routes:
    """The table of routes and their bindings (journal may be ``None``: no journal)."""

    journal: ChannelJournal | None
    limits: Limits
    now_ms: Callable[[], int]
    count: Callable[[str], None]
    resolve_binding: ResolveBinding | None = None
    tally: QueueTally = attrs.field(init=False, factory=QueueTally)
    """The turns queued on all routes (every route's queue counts into it)."""
    _table: dict[RouteKey, Route] = attrs.field(init=False, factory=dict)
    _parked: dict[RouteKey, ParkedTurn] = attrs.field(init=False, factory=dict)  # released

    def values(self) -> Iterator[Route]:
        """The routes in memory (not the released ones of :meth:`released`)."""
        return iter(list(self._table.values()))

    def __len__(self) -> int:
        return len(self._table) + len(self._parked)

    def get(self, key: RouteKey) -> Route | None:
        return self._table.get(key)

    def released(self) -> list[tuple[RouteKey, ParkedTurn]]:
        return list(self._parked.items())

    def release(self, route: Route) -> None:
        """Forget ``route`` while a folded parked turn is all it holds (with a journal, not
        leased or in use), keeping that turn by the route's key: still held, the route is
        made again with it (:meth:`route`) for the next message or the wake."""
        parked = route.parked
        if (
            parked is not None
            and parked.folded
            and self.journal is not None
            and not (route.working or route.queue or route.lease or route.lease_users)
            and not (route.pins or route.renewer or route.hydrating())
            and route.release_at is None
            and self._table.get(route.key) is route
        ):
            del self._table[route.key]
            self._parked[route.key] = parked

    def forget_released(self) -> list[ParkedTurn]:
        """``stop()``: drop the released routes' parked turns; returns them."""
        parked, self._parked = list(self._parked.values()), {}
        return parked

    def route(self, key: RouteKey) -> Route | None:
        """The route of ``key`` (:func:`route_key`), created when absent; ``None`` when the
        table is full of busy routes."""
        route = self._table.get(key)
        if route is not None:
            return route
        parked = self._parked.pop(key, None) if self._parked else None
        if parked is None and len(self) >= self.limits.max_routes and not self._evict_idle_route():
            return None
        route = Route(key=key, queue=TurnQueue(self.tally), parked=parked)
        self._table[key] = route
        return route

    def _evict_idle_route(self) -> bool:
        # An idle, hydrated, unleased route holds nothing the journal does not: forget it.
        for key, route in self._table.items():
            if (
                not route.busy
                and route.lease is None
                and route.lease_users == 0
                and route.pins == 0
                and not route.hydrating()
            ):
                if route.suspended and self.journal is None:
                    continue
                del self._table[key]
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
                    external_conversation_id=route.external_conversation_id,
                    external_actor_id=route.actor_id,
                    identity=identity,
                    scope=route.scope,
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
            route.external_conversation_id,
            route.thread_id,
            route.actor_id,
            route.scope,
            route.alias,
            generation,
        )
        return sid, None

    def binding_record(self, route: Route, updated_at_ms: int | None = None) -> BindingRecord:
        return BindingRecord(
            session_id=route.session_id or "",
            agent_alias=route.alias,
            generation=route.generation,
            suspended=route.suspended,
            leaf_id=route.leaf_id,
            suspended_run=route.suspended_run,
            updated_at_ms=self.now_ms() if updated_at_ms is None else updated_at_ms,
            connection_id=route.connection_id,
            external_conversation_id=route.external_conversation_id,
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
        try:
            async with route.hydrate_lock:
                return await self._hydrate_once(route, identity, create)
        finally:
            route.shed_locks()

    async def _hydrate_once(self, route: Route, identity: AgentIdentity, create: bool) -> bool:
        if route.hydrated:
            return True
        if self.journal is None:
            route.hydrated = True
            return True
        loaded = await self.journal.load_binding(route.scope, route.binding_key)
        if loaded is None:
            if not create:
                return False
            sid, leaf = await self.derive_session(route, identity, 0)
            route.session_id, route.leaf_id = sid, leaf
            record = self.binding_record(route)
            created = await self.journal.create_binding(route.scope, route.binding_key, record)
            if created is None:
                loaded = await self.journal.load_binding(route.scope, route.binding_key)
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
        stored = route.binding_stored
        if stored is not None and _unchanged(route, stored):
            return None
        record = self.binding_record(route)
        return Write(
            NS_BINDING, route.scope, record, route.binding_version, fence, key=route.binding_key
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
                OperationRef(route.scope, route.connection_id, ""),
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


def route_key(event: InboundEvent, alias: str, scope: OwnershipScope) -> RouteKey:
    """The key of the route of ``event``'s conversation, thread and actor to ``alias`` in
    ``scope``."""
    return (
        event.connection_id,
        event.external_conversation_id,
        event.thread_id,
        event.external_actor_id,
        alias,
        scope.tenant_id,
        scope.account_id,
        scope.user_id,
    )


def actor_key(event: InboundEvent, scope: OwnershipScope) -> ActorKey:
    return (
        event.connection_id,
        event.external_conversation_id,
        event.thread_id,
        event.external_actor_id,
        scope.tenant_id,
        scope.account_id,
        scope.user_id,
    )


@attrs.define(eq=False)
class Selections:
    """The actors' ``/agent`` choices: a memory of the actors in use over the journal's
    bindings (SPEC difference 3, durable across restarts), or the only record of them
    without a journal."""

    journal: ChannelJournal | None
    limits: Limits
    count: Callable[[str], None]
    _memo: OrderedDict[ActorKey, str | None] = attrs.field(init=False, factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._memo)

    async def current(self, event: InboundEvent, scope: OwnershipScope) -> str | None:
        """The actor's ``/agent`` choice: memory first, else the binding with the newest
        selection stamp."""
        key = actor_key(event, scope)
        memo = self._memo
        if key in memo:
            memo.move_to_end(key)
            return memo[key]
        selected: str | None = None
        if self.journal is not None:
            prefix = binding_actor_prefix(
                event.connection_id,
                scope,
                event.external_conversation_id,
                event.thread_id,
                event.external_actor_id,
            )
            try:
                bindings = await self.journal.records(
                    scope, NS_BINDING, key_prefix=prefix, max_pages=1
                )
            except Exception:
                self.count("storage_failures")
                return None
            best = -1
            for loaded in bindings:
                record: BindingRecord = loaded.record
                if (
                    record.external_actor_id == event.external_actor_id
                    and record.external_conversation_id == event.external_conversation_id
                    and record.thread_id == event.thread_id
                    and record.selected_at_ms is not None
                    and record.selected_at_ms > best
                ):
                    best = record.selected_at_ms
                    selected = record.agent_alias
        self.remember(key, selected)
        return selected

    def remember(self, key: ActorKey, alias: str | None) -> bool:
        """False when the table is full and ``key`` is new (``/agent`` answers ``capacity``)."""
        memo = self._memo
        if key in memo:
            memo[key] = alias
            memo.move_to_end(key)
            return True
        if self.journal is not None:
            # The journal has the truth: this is a memory of the actors in use (the least
            # recently used forgotten first, and read again when they come back).
            if len(memo) >= min(self.limits.max_routes, MEMO_LIMIT):
                memo.popitem(last=False)
        elif len(memo) >= self.limits.max_routes:
            # Without a journal the table is the truth: only "no selection" entries can go.
            for old_key, old_alias in memo.items():
                if old_alias is None:
                    del memo[old_key]
                    break
            else:
                return False
        memo[key] = alias
        return True


def _unchanged(route: Route, stored: BindingRecord) -> bool:
    """``route``'s binding is ``stored`` but for its time: field by field what
    :meth:`Routes.binding_record` would write (no record built to compare)."""
    return (
        stored.session_id == (route.session_id or "")
        and stored.agent_alias == route.alias
        and stored.generation == route.generation
        and stored.suspended == route.suspended
        and stored.leaf_id == route.leaf_id
        and stored.suspended_run == route.suspended_run
        and stored.connection_id == route.connection_id
        and stored.external_conversation_id == route.external_conversation_id
        and stored.external_actor_id == route.actor_id
        and stored.thread_id == route.thread_id
        and stored.selected_at_ms == route.selected_at_ms
    )
