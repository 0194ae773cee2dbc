"""Runtime-internal records: routes, turns, active runs, and the host callback inputs."""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import Literal, TypeAlias

import attrs
import trio

from stores import LeaseRecord, OwnershipScope

from ..agents import Agent
from ..channel import Action, AuthorizeInput, Grant, InboundEvent
from ..identity import AgentIdentity
from ..journal import BindingRecord, Loaded, OperationRecord, SuspendedRun, binding_key


@attrs.frozen
class ResolveAgentInput:
    """What ``resolve_agent`` is called with on every turn (and status/resume)."""

    agent_alias: str
    identity: AgentIdentity
    ownership: OwnershipScope
    connection_id: str
    external_conversation_id: str


@attrs.frozen
class BindingInput:
    """What an optional host ``resolve_binding`` gets to map a route to a session (§2.4)."""

    connection_id: str
    external_conversation_id: str
    external_actor_id: str
    identity: AgentIdentity
    ownership: OwnershipScope
    agent_alias: str
    generation: int
    thread_id: str | None = None


@attrs.frozen
class BindingResolution:
    session_id: str
    leaf_id: str | None = None


Authorize: TypeAlias = Callable[[AuthorizeInput], Awaitable[Grant | None]]
ResolveAgent: TypeAlias = Callable[[ResolveAgentInput], Awaitable[Agent]]
ResolveBinding: TypeAlias = Callable[[BindingInput], Awaitable[BindingResolution]]

RouteKey: TypeAlias = tuple[str, str, str | None, str, str, str | None, str | None, str | None]
ActorKey: TypeAlias = tuple[str, str, str | None, str, str | None, str | None, str | None]


@attrs.define(eq=False)
class Turn:
    """One admitted event waiting in (or popped from) a route queue."""

    operation_id: str
    event: InboundEvent
    action: Action
    grant: Grant
    ownership: OwnershipScope
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
    empty against ~600), which ten thousand idle routes would pay for nothing."""

    __slots__ = ("_tally", "_turns")

    def __init__(self, tally: QueueTally) -> None:
        self._tally = tally
        self._turns: list[Turn] = []

    def __len__(self) -> int:
        return len(self._turns)

    def __bool__(self) -> bool:
        return bool(self._turns)

    def __iter__(self) -> Iterator[Turn]:
        return iter(self._turns)

    @property
    def head(self) -> Turn | None:
        return self._turns[0] if self._turns else None

    def append(self, turn: Turn) -> None:
        self._turns.append(turn)
        self._tally.queued += 1

    def push_front(self, turn: Turn) -> None:
        """Put a popped turn back at the head (its claim must wait)."""
        self._turns.insert(0, turn)
        self._tally.queued += 1

    def pop_head(self) -> Turn:
        turn = self._turns.pop(0)
        self._tally.queued -= 1
        return turn

    def take_all(self) -> list[Turn]:
        """Empty the queue; returns what it held, oldest first."""
        turns, self._turns = self._turns, []
        self._tally.queued -= len(turns)
        return turns


def _unused(lock: trio.Lock | None) -> bool:
    return lock is not None and not lock.locked() and not lock.statistics().tasks_waiting


@attrs.define(eq=False)
class Route:
    """In-memory state of one binding (connection, conversation, thread, actor, alias, scope).

    Hydrated once per process from the durable binding; afterwards authoritative.
    """

    key: RouteKey
    connection_id: str
    conversation_id: str
    thread_id: str | None
    actor_id: str
    alias: str
    ownership: OwnershipScope
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
    parked: Turn | None = None
    """The turn parked while its remote task is followed (:mod:`._following`): the route
    is held (later turns wait) but nothing runs, and no lease is kept for it."""
    pins: int = 0
    """Entry points holding this route object across an await (admit, commands): the
    route must not be evicted meanwhile, or a second route object for the same binding
    could be created and both would pump it."""
    _lease_lock: trio.Lock | None = None
    _hydrate_lock: trio.Lock | None = None

    @property
    def binding_key(self) -> str:
        """The binding's journal key (also its lease key), built when needed rather than
        kept: ~180 bytes per route, for a few f-string joins per turn."""
        return binding_key(
            self.connection_id,
            self.ownership,
            self.conversation_id,
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
        return self.active is not None or self.pumping or (bool(self.queue) and self.parked is None)

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


class LeaseHeldElsewhereError(Exception):
    """The route's binding lease is held by another owner right now."""


@attrs.define(eq=False)
class _Turn:
    lock: trio.Lock = attrs.field(factory=trio.Lock)
    users: int = 0


class _Holding:
    __slots__ = ("_key", "_turn", "_turns")

    def __init__(self, turns: dict[tuple[str, str], _Turn], key: tuple[str, str]) -> None:
        self._turns = turns
        self._key = key

    async def __aenter__(self) -> None:
        turn = self._turns.get(self._key)
        if turn is None:
            turn = self._turns[self._key] = _Turn()
        turn.users += 1
        self._turn = turn
        try:
            await acquire_promptly(self._turn.lock)
        except BaseException:
            self._leave()
            raise

    async def __aexit__(self, *_exc: object) -> None:
        self._turn.lock.release()
        self._leave()

    def _leave(self) -> None:
        self._turn.users -= 1
        if self._turn.users == 0:
            del self._turns[self._key]


async def acquire_promptly(
    lock: trio.Lock | trio.Semaphore, *, wait_within: trio.CancelScope | None = None
) -> bool:
    """``await lock.acquire()``, without its pass through the scheduler when ``lock`` is
    free: Trio's ``acquire`` yields even then, and on a turn's way from admission to its
    reply each such yield waits for every other runnable task to take its step. A
    cancelled caller still raises :class:`trio.Cancelled` here, and a lock with waiters
    still goes to them first (``acquire_nowait`` refuses it).

    ``wait_within``: a wait for the lock, if there is one, runs inside that scope (entered
    only then: a free lock costs no scope); False when the scope was cancelled before the
    lock was taken. True when it is held."""
    await trio.lowlevel.checkpoint_if_cancelled()
    try:
        lock.acquire_nowait()
        return True
    except trio.WouldBlock:
        pass
    if wait_within is None:
        await lock.acquire()
        return True
    with wait_within:
        await lock.acquire()
        return True
    return False


@attrs.define(eq=False)
class DeliveryTurns:
    """One send (deliver + mark) at a time per conversation, within this process.

    A channel may hold a reply (no live connection) and ask for its held replies when the
    conversation reconnects. Without this a reconnect's re-drive could read the journal
    after ``deliver`` said "hold" but before that mark was written, and the reply would
    wait for the next reconnect. Sends hold the turn across deliver and mark, and the
    re-drive takes it too, so it sees every hold. Entries are dropped when unused: the
    table is bounded by the sends in flight.
    """

    _turns: dict[tuple[str, str], _Turn] = attrs.field(factory=dict)

    def hold(self, connection_id: str, conversation_id: str) -> _Holding:
        """``async with turns.hold(connection_id, conversation_id):`` the conversation's turn
        for the block (an object, not a generator: every send takes one)."""
        return _Holding(self._turns, (connection_id, conversation_id))

    def __len__(self) -> int:
        return len(self._turns)


@attrs.define(eq=False)
class KnownOperations:
    """Operation record keys (id and owner) this runtime knows exist in the journal (it
    created them, or its create-only write found them): a redelivery of such an event is a
    duplicate without a store round trip. Bounded (oldest forgotten first); a miss asks the
    store as before, so another runtime's records are still deduplicated by the create-only
    write."""

    limit: int = 20_000
    _ids: set[bytes] = attrs.field(factory=set)
    """128-bit digests of the record keys (49 bytes instead of ~150): a false "known" would
    answer a new event as a duplicate, and at 2**-128 per pair it does not."""
    _order: deque[bytes] = attrs.field(factory=deque)
    """Insertion order, oldest first (a set and a deque: half an OrderedDict's memory)."""

    @staticmethod
    def _digest(key: str) -> bytes:
        return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()

    def has(self, key: str) -> bool:
        return self._digest(key) in self._ids

    def add(self, key: str) -> None:
        digest = self._digest(key)
        if digest in self._ids:
            return
        self._ids.add(digest)
        self._order.append(digest)
        while len(self._order) > self.limit:
            # A discarded key re-added is in the order twice: forgetting it at the first is
            # early, which only costs a store read.
            self._ids.discard(self._order.popleft())

    def discard(self, key: str) -> None:
        self._ids.discard(self._digest(key))

    def __len__(self) -> int:
        return len(self._ids)
