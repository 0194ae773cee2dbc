"""Shared runtime state: counters, routes, binding leases, the operations known to exist, one
send at a time per conversation, journal writes; what every entry point decides about an
event before it touches a route (the grant check, the denied and duplicate answers); and the
send of a staged reply (deliver, mark; a route's outbox).

Everything that more than one entry point needs lives here; the entry points (admit, turns,
commands, approvals, notify, recovery, resume) are plain functions over :class:`Core`.

Write order is the protocol (contract §0): operation record before anything runs, claim before
any agent call, terminal state before the binding, reply staged before ``deliver``. A record
once written under a lease fence is only written again under a lease (SPEC difference 1): the
route lease is re-acquired (:meth:`Core.route_fence`) for writes outside a queued turn.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from stores import SYSTEM_CLOCK, Clock, LeaseStore, OwnershipScope, Store

from ..agents import Agent
from ..channel import (
    Action,
    Admission,
    AttachmentRef,
    DeliveryOutcomeUnknownError,
    InboundEvent,
    Preview,
    Redactor,
    Reply,
    SendResult,
    bound_detail,
)
from ..grants import AgentIdentity, AuthorizeInput, Grant, identity_is_active
from ..journal import (
    ApprovalStore,
    ChannelJournal,
    CursorRecord,
    GrantRecord,
    GrantStore,
    Loaded,
    OperationRef,
    PairingStore,
    ReplyRecord,
    mark,
    operation_key,
    transition,
)
from ..limits import Limits
from ._leases import DEFAULT_LEASE_IDLE_MS, RouteLeases, acquire_promptly
from ._routes import Route, Routes, Selections
from .api import Authorize, Diagnostics, ResolveAgent, ResolveAgentInput, ResolveBinding

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
class _ConversationLock:
    lock: trio.Lock = attrs.field(factory=trio.Lock)
    users: int = 0


class _Locked:
    __slots__ = ("_entry", "_key", "_locks")

    def __init__(
        self, locks: dict[tuple[str, str], _ConversationLock], key: tuple[str, str]
    ) -> None:
        self._locks = locks
        self._key = key

    async def __aenter__(self) -> None:
        entry = self._locks.get(self._key)
        if entry is None:
            entry = self._locks[self._key] = _ConversationLock()
        entry.users += 1
        self._entry = entry
        try:
            await acquire_promptly(self._entry.lock)
        except BaseException:
            self._leave()
            raise

    async def __aexit__(self, *_exc: object) -> None:
        self._entry.lock.release()
        self._leave()

    def _leave(self) -> None:
        self._entry.users -= 1
        if self._entry.users == 0:
            del self._locks[self._key]


@attrs.define(eq=False)
class DeliveryLocks:
    """One send (deliver + mark) at a time per conversation, within this process.

    A channel may hold a reply (no live connection) and ask for its held replies when the
    conversation reconnects. Without this a reconnect's re-drive could read the journal
    after ``deliver`` said "hold" but before that mark was written, and the reply would
    wait for the next reconnect. Sends hold the turn across deliver and mark, and the
    re-drive takes it too, so it sees every hold. Entries are dropped when unused: the
    table is bounded by the sends in flight.
    """

    _locks: dict[tuple[str, str], _ConversationLock] = attrs.field(factory=dict)

    def lock(self, connection_id: str, external_conversation_id: str) -> _Locked:
        """The conversation's lock for an ``async with`` block (an object, not a generator:
        every send takes one)."""
        return _Locked(self._locks, (connection_id, external_conversation_id))

    def __len__(self) -> int:
        return len(self._locks)


@attrs.define(eq=False)
class KnownOperations:
    """Operation record keys (id and owner) this runtime knows exist in the journal (it
    created them, or its create-only write found them): a redelivery of such an event is a
    duplicate without a store round trip. Bounded (oldest forgotten first); a miss asks the
    store as before, so another runtime's records are still deduplicated by the create-only
    write."""

    limit: int = 20_000
    _ids: dict[int, None] = attrs.field(factory=dict)
    """128-bit digests of the record keys, as ints (48 bytes each instead of ~150): a false
    "known" would answer a new event as a duplicate, and at 2**-128 per pair it does not. A
    dict of them rather than a set: ~30 bytes per entry against ~52 at ten thousand."""
    _order: deque[int] = attrs.field(factory=deque)
    """Insertion order, oldest first (a dict and a deque: half an OrderedDict's memory)."""

    @staticmethod
    def _digest(key: str) -> int:
        digest = hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=16).digest()
        return int.from_bytes(digest, "little")

    def has(self, key: str) -> bool:
        return self._digest(key) in self._ids

    def add(self, key: str) -> None:
        digest = self._digest(key)
        if digest in self._ids:
            return
        self._ids[digest] = None
        self._order.append(digest)
        while len(self._order) > self.limit:
            # A discarded key re-added is in the order twice: forgetting it at the first is
            # early, which only costs a store read.
            self._ids.pop(self._order.popleft(), None)

    def discard(self, key: str) -> None:
        self._ids.pop(self._digest(key), None)

    def __len__(self) -> int:
        return len(self._ids)


@attrs.define(eq=False)
class Core:
    """The runtime's state and the primitives every entry point shares."""

    authorize: Authorize
    resolve_agent_cb: ResolveAgent | None
    agents: Mapping[str, Agent] | None
    """The agents by alias (a host without them resolves each with ``resolve_agent_cb``)."""
    deliver: Callable[[Reply], Awaitable[SendResult]]
    nursery: trio.Nursery
    store: Store | None = None
    use_leases: bool = True
    limits: Limits = attrs.field(factory=Limits)
    redactor: Redactor | None = None
    clock: Clock = SYSTEM_CLOCK
    owner_id: str = attrs.field(factory=lambda: f"channel-runtime-{uuid.uuid4()}")
    adopt_own_leases: bool = False
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
    idempotent_send: Callable[[str], bool] | None = None
    """Whether a connection id's adapter declares ``features.idempotent_send`` (its
    replies' delivery marks may linger: :data:`MARK_LINGER_S`); ``None``: no connection's."""
    typing_timer: Any = attrs.field(init=False, default=None)
    """The turns' typing indicators (``_replies.TypingTimer``), made at the first run."""
    resend_one: Callable[[ReplyRecord, OwnershipScope], Awaitable[object]] | None = attrs.field(
        init=False, default=None
    )
    """Re-drive one pending reply by CAS (``_unconfirmed.resend_one``; :func:`fence_lost`)."""

    journal: ChannelJournal | None = attrs.field(init=False, default=None)
    routes: Routes = attrs.field(init=False)
    leases: RouteLeases = attrs.field(init=False)
    approvals: ApprovalStore | None = attrs.field(init=False, default=None)
    pairings: PairingStore | None = attrs.field(init=False, default=None)
    grants: GrantStore | None = attrs.field(init=False, default=None)
    counters: dict[str, int] = attrs.field(
        init=False, factory=lambda: dict.fromkeys(COUNTER_NAMES, 0)
    )
    selections: Selections = attrs.field(init=False)
    seen: dict[str, OrderedDict[str, None]] = attrs.field(init=False, factory=dict)
    cursors: OrderedDict[tuple[str, OwnershipScope], Loaded[CursorRecord]] = attrs.field(
        init=False, factory=OrderedDict
    )
    slots: trio.Semaphore = attrs.field(init=False)
    stopped: bool = attrs.field(init=False, default=False)
    inflight: int = attrs.field(init=False, default=0)
    idle: trio.Event = attrs.field(init=False, factory=trio.Event)
    resume_gate: trio.Event | None = attrs.field(init=False, default=None)
    delivery_locks: DeliveryLocks = attrs.field(init=False, factory=DeliveryLocks)
    known: KnownOperations = attrs.field(init=False, factory=KnownOperations)

    def __attrs_post_init__(self) -> None:
        self.slots = trio.Semaphore(self.limits.max_active_sessions)
        self.idle.set()
        lease_store = self._open_stores()
        self.selections = Selections(self.journal, self.limits, self.count)
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
            adopt=self.adopt_own_leases,
            lease_idle_ms=self.lease_idle_ms,
            on_released=self.routes.release,
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
        if self.resolve_agent_cb is None:
            agent = None if self.agents is None else self.agents.get(route.alias)
            if agent is None:
                raise LookupError(f"no agent is configured for alias {route.alias!r}")
            return agent
        return await self.resolve_agent_cb(
            ResolveAgentInput(
                agent_alias=route.alias,
                identity=identity,
                scope=route.scope,
                connection_id=route.connection_id,
                external_conversation_id=route.external_conversation_id,
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
        scope: OwnershipScope,
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
                OperationRef(scope, connection_id, operation_id),
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
        self, scope: OwnershipScope, connection_id: str, operation_id: str
    ) -> None:
        if self.journal is None:
            return
        with trio.CancelScope(shield=True, relative_deadline=5):
            try:
                await self.journal.remove_operation(scope, connection_id, operation_id)
            except Exception:
                self.count("storage_failures")
        self.known.discard(operation_key(connection_id, scope, operation_id))

    def failure_text(self, message: str | None) -> str:
        detail = bound_detail(self.redact(message or "").strip())
        if not detail:
            return "The request failed before it produced an answer."
        return f"Request failed: {detail}"


# ------------------------------------------------------------------ admission answers


@attrs.frozen
class AdmitContext:
    """An authorized event on its way through admission."""

    event: InboundEvent
    action: Action
    grant: Grant
    scope: OwnershipScope
    alias: str
    operation_id: str
    notices: list[str] = attrs.field(factory=list, eq=False)
    """What a command answers: committed with its ``succeeded`` state, then sent."""


def authorize_input(event: InboundEvent, action: Action, received_at_ms: int) -> AuthorizeInput:
    """What ``authorize`` is asked about an inbound event (admission, re-checks, resume)."""
    return AuthorizeInput(
        connection_id=event.connection_id,
        external_conversation_id=event.external_conversation_id,
        external_actor_id=event.external_actor_id,
        event_id=event.event_id,
        text=event.text,
        action=action,
        received_at_ms=received_at_ms,
        thread_id=event.thread_id,
        claims=event.claims,
    )


def check_grant(core: Core, grant: object) -> str | None:
    """The denial reason for a grant, or None when usable (§2.2 order)."""
    if not isinstance(grant, Grant) or grant.identity is None:
        return "rejected"
    if not core.active(grant.identity):
        return "revoked"
    aliases = grant.agent_aliases
    if (
        not isinstance(aliases, tuple)
        or not aliases
        or not all(isinstance(a, str) and a for a in aliases)
    ):
        return "rejected"
    if not isinstance(grant.grant_revision, str) or not grant.grant_revision:
        return "rejected"
    return None


def denied(core: Core, reason: str, hint: str | None = None) -> Admission:
    core.count("denied")
    return Admission("denied", reason, hint=hint)


def duplicate(core: Core, operation_id: str) -> Admission:
    """An event already admitted: acknowledged again, never run twice."""
    core.count("duplicates")
    core.count("admitted")
    return Admission("accepted", operation_id=operation_id, duplicate=True)


def seen_before(core: Core, connection_id: str, event_key: str) -> bool:
    """No-journal dedup (§7 step 7): a bounded per-connection FIFO of event ids."""
    seen = core.seen.get(connection_id)
    if seen is None:
        if len(core.seen) >= core.limits.max_routes:
            return False
        seen = OrderedDict()
        core.seen[connection_id] = seen
    if event_key in seen:
        return True
    seen[event_key] = None
    while len(seen) > core.limits.max_seen_events_per_connection:
        seen.popitem(last=False)
    return False


# --------------------------------------------------------------------------- sending a reply
# A staged reply's send: deliver it, mark its outcome (the one send of a staged reply; its
# resends go through :mod:`._delivery`, which reopens the record first); and a route's
# outbox, which sends its turns' replies in order while the route goes on with its next turn.

JOURNAL_BUDGET_S = 10.0
"""Bound of the shielded journal writes of the reply path: the operation may already be
settled, so a cancellation there (runtime torn down) would lose the answer unlisted."""


MARK_LINGER_S = 0.05
"""How long a route's outbox lets a reply's ``delivered`` mark wait for another journal write
to share a commit with (the next message's admission, another reply's mark), when none is
in flight — on a connection whose adapter declares ``features.idempotent_send`` only. The
reply is out already; what waits is the route's next reply, at most this long. A crash
before the mark is durable leaves the reply ``pending``, which such a channel re-drives
after the restart and proves or repeats safely (Discord's nonce): nothing is listed for it.
Elsewhere (and for every other outcome: a held reply's mark is what lets its conversation's
reconnect re-drive it) the mark commits at once, as before."""


HELD_REASON = "held"
"""The ``reason`` of a ``pending`` reply whose channel answered ``SendResult.hold()``: proven
not sent (no live connection took it), so it may be re-driven automatically when its
conversation reconnects (:mod:`prismd.runtime._delivery`). Every other ``pending`` reply
may have been sent (staged, then the daemon died) and waits for an operator."""


def is_held(record: ReplyRecord) -> bool:
    """``record`` is ``pending`` because its channel held it (see :data:`HELD_REASON`)."""
    return record.state == "pending" and record.reason == HELD_REASON


async def send_staged(
    core: Core,
    reply: Reply,
    staged: Loaded[ReplyRecord] | None,
    scope: OwnershipScope | None,
    fence: int | None,
) -> None:
    """:func:`deliver_and_mark`, for a task of its own (``answer(send_later=True)``)."""
    await deliver_and_mark(core, reply, staged, scope, fence)


@attrs.frozen
class Outgoing:
    """A staged reply waiting in its route's outbox (what :func:`deliver_and_mark` takes)."""

    reply: Reply
    staged: Loaded[ReplyRecord] | None
    scope: OwnershipScope | None
    fence: int | None
    fenced: Callable[[], bool] | None


def send_from_route(core: Core, route: Route, outgoing: Outgoing) -> None:
    """Queue a staged reply in ``route``'s outbox; its sender task delivers and marks the
    outbox's replies one after another, in the order staged (started here when idle).

    The pump does not wait for the send: its next turn's claim commits while the reply
    is on its way, and the reply's mark commits with whatever the route writes next.
    While the outbox holds a reply the route is working (:attr:`Route.working`): its
    lease is kept and renewed, and the lease fence is checked right before each send as
    it would be in the pump. A crash before a mark leaves the reply ``pending`` (listed
    for ``reconcile``), as a crash between a send and its mark always did.
    """
    box = route.outbox
    if box is None:
        route.outbox = deque((outgoing,))
        core.spawn(_send_route_replies, core, route)
    else:
        box.append(outgoing)


async def _send_route_replies(core: Core, route: Route) -> None:
    box = route.outbox
    assert box is not None
    torn_down = False
    try:
        while box:
            item = box[0]
            if item.fenced is not None and not item.fenced():
                await fence_lost(core, item.reply, item.staged)
            else:
                linger_s = MARK_LINGER_S if _idempotent(core, item.reply) else 0.0
                await deliver_and_mark(
                    core, item.reply, item.staged, item.scope, item.fence, linger_s=linger_s
                )
            box.popleft()
    except trio.Cancelled:
        # The runtime is torn down: what is left stays ``pending`` (listed).
        torn_down = True
        raise
    finally:
        route.outbox = None
        if not route.working:
            if torn_down or core.stopped:
                await core.leases.release_if_idle(route)
            else:
                await core.leases.release_when_idle(route)


def _idempotent(core: Core, reply: Reply) -> bool:
    return core.idempotent_send is not None and core.idempotent_send(reply.connection_id)


async def fence_lost(core: Core, reply: Reply, staged: Loaded[ReplyRecord] | None) -> None:
    """A staged reply's route lease ran out before its send (a stalled process). On a channel
    whose sends are idempotent (Discord) it is re-driven as after a takeover, reopened by
    CAS (:attr:`Core.resend_one`: of this process and a new lease holder one sends);
    elsewhere it stays ``pending``, listed for ``reconcile``."""
    core.count("lease_losses")
    if staged is not None and core.resend_one is not None and _idempotent(core, reply):
        try:
            await core.resend_one(staged.record, staged.scope)
        except Exception:
            core.count("storage_failures")


async def deliver_once(core: Core, reply: Reply) -> tuple[str, str | None, str | None]:
    """Call ``deliver``: ``(state, message_id, reason)`` for :func:`mark_outcome`.

    A raise is ambiguous (``delivery_unknown``, neither counter moves; the reason is an
    adapter's :class:`DeliveryOutcomeUnknownError` words, fixed texts, else none). A hold
    (``SendResult.hold()``) is neither delivered nor failed: the reply stays ``pending``
    with reason :data:`HELD_REASON`, and no counter moves.
    """
    try:
        result = await core.deliver(reply)
    except DeliveryOutcomeUnknownError as unknown:
        return "delivery_unknown", None, bound_detail(str(unknown))
    except Exception:
        return "delivery_unknown", None, None
    if result.held:
        return "pending", None, HELD_REASON
    if result.delivered:
        core.count("deliveries")
        return "delivered", result.message_id, None
    core.count("delivery_failures")
    reason = None if result.reason is None else bound_detail(str(result.reason))
    return "delivery_failed", result.message_id, reason


async def deliver_and_mark(
    core: Core,
    reply: Reply,
    staged: Loaded[ReplyRecord] | None,
    scope: OwnershipScope | None,
    fence: int | None,
    *,
    linger_s: float = 0.0,
) -> str:
    """Deliver a staged reply and mark its record (when journaled); returns the state.

    Keeps the conversation's delivery lock across both, so a re-drive started by a
    reconnect meanwhile sees this reply's hold once it is marked. ``linger_s``: how long
    a ``delivered`` mark may wait to share a commit (:data:`MARK_LINGER_S`); any other
    outcome is marked at once.
    """
    async with core.delivery_locks.lock(reply.connection_id, reply.external_conversation_id):
        state, message_id, reason = await deliver_once(core, reply)
        if staged is not None and scope is not None:
            linger = linger_s if state == "delivered" else 0.0
            await mark_outcome(
                core, scope, staged, state, message_id, reason, fence, linger_s=linger
            )
    return state


async def mark_outcome(
    core: Core,
    scope: OwnershipScope,
    staged: Loaded[ReplyRecord],
    state: str,
    message_id: str | None,
    reason: str | None,
    fence: int | None,
    *,
    linger_s: float = 0.0,
) -> Loaded[ReplyRecord] | None:
    """Record a send's outcome (shielded, bounded); ``None`` and ``storage_failures`` when
    it could not be written. ``linger_s``: see :func:`deliver_and_mark`."""
    assert core.journal is not None
    saved = None
    with trio.CancelScope(shield=True, relative_deadline=JOURNAL_BUDGET_S):
        try:
            saved = await mark(
                core.journal,
                scope,
                staged,
                state,
                now_ms=core.now_ms(),
                message_id=message_id,
                reason=reason,
                fence=fence,
                linger_s=linger_s,
            )
        except Exception:
            saved = None
    if saved is None:
        core.count("storage_failures")
    return saved
