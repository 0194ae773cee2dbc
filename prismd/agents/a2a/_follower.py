"""Following parked remote tasks: one :class:`Follower` per agent and runtime, no task per
followed task while it waits.

When a run knows its remote task and the task is not answered yet, the run *parks* its turn
(:meth:`~prismd.agents.RunHooks.park`) and returns: the operation stays ``following``, the
route stays held by the runtime, and no coroutine waits for the task. What is left of it in
memory is one :class:`Followed` record (``__slots__``: the task id, the operation's key and
scope, when it is due, its backoff, its deadline and the runtime's wake) in a heap ordered
by the next poll.

The follower's loop pops the due records and hands them to a fixed number of workers
(:data:`POLLERS`: the polls in flight are bounded, whatever the number of tasks); a worker
reads the task (``GetTask``) and either schedules the next poll (exponential backoff with
±20 % jitter up to ``max_poll_interval_ms``, ``Retry-After`` honoured, slowed by
:data:`PUSH_SLOWDOWN` while push is registered) or, when the task is terminal, needs input,
is lost or ran out of ``task_timeout_ms``, keeps what it read for the run and *wakes* the
turn: the runtime runs the agent again for the same operation, which answers from the task
read here (:meth:`Follower.take`) — or, after a restart, reads it once itself.

A push (:meth:`Follower.wake_task`) makes its record due at once. Streaming (previews) is
kept for at most :data:`MAX_STREAMS` tasks at once; the others are polled. When the follower
ends (its runtime stops) its records are dropped: the operations are ``following`` in the
journal and the next runtime follows them again.

**Several instances** (PostgreSQL: the agent's :attr:`~._agent.A2AAgent.polls`): every
instance may have the same task parked (another instance's tasks are taken up when it
died), but each due poll is made by one of them. The task has one row in the store's
:class:`~stores.PollStore` — its next due time and a poll lease — and a worker reserves it
(``FOR UPDATE SKIP LOCKED``) before it reads the task: granted only when the row is due (or
a push hurries it) and no unexpired lease is held. The lease is held only while the call is
in flight (renewed every third of :data:`~._gate.POLL_LEASE_MS`), released with the next due time;
a worker refused is told when to ask again and waits in the heap, costing nothing. A lease
that outlives its instance expires and the next instance takes it (fence + 1); the old
holder, fenced, drops what it read (no state journaled, no wake). A task whose row is gone
(answered, or settled by another instance) wakes its turn here: its run finds the operation
settled, or reads the task. SQLite and memory have no ``polls``: one instance polls alone,
with no store call.
"""

from __future__ import annotations

import heapq
import math
import random
import sys
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol, overload

import trio

from stores import ANY_SCOPE, OwnershipScope, PollLease, PollStore, PollWait

from .. import EventSink, RunHooks, RunResult
from ._book import Stored
from ._client import A2AClient, A2AError, OutcomeUnknown, Refused, RemoteError
from ._gate import PollGate, holding
from ._relay import ends_turn, relay_interrupt, relay_key
from ._steps import CANCEL_BUDGET_S, PUSH_SLOWDOWN, answer, failed, preview, stream
from ._steps import A2AAgent as StepsAgent
from ._wire import TASK_NOT_FOUND, TERMINAL_STATES, Task, moves_forward


class A2AAgent(StepsAgent, Protocol):
    """What the follower uses of the agent (:class:`._agent.A2AAgent`)."""

    followers: dict[object, Follower]
    polls: PollStore | None
    poll_lease_ms: int

    async def cancel_followed(
        self, client: A2AClient, scope: OwnershipScope, key: str
    ) -> Task | None: ...


POLLERS: Final = 32
"""Polls in flight at once, per follower."""
MAX_STREAMS: Final = 64
"""Tasks followed by their stream at once, per follower; the others are polled."""

LOST: Final = "lost"
TIMEOUT: Final = "timeout"
ELSEWHERE: Final = "elsewhere"
Finding = Task | str
"""What the follower read for a woken run: the task, :data:`LOST`, :data:`TIMEOUT` or
:data:`ELSEWHERE` (its poll row is gone: answered or settled by another instance — the run
reads the task when its operation is still ``following``)."""


class HasFlags(Protocol):
    flags: int


class Bit:
    """``name = Bit(4)`` in a class with a ``flags: int`` slot: a boolean kept as that bit."""

    __slots__ = ("mask",)

    def __init__(self, mask: int) -> None:
        self.mask = mask

    @overload
    def __get__(self, obj: None, owner: Any = None) -> Bit: ...

    @overload
    def __get__(self, obj: HasFlags, owner: Any = None) -> bool: ...

    def __get__(self, obj: HasFlags | None, owner: Any = None) -> Bit | bool:
        if obj is None:
            return self
        return bool(obj.flags & self.mask)

    def __set__(self, obj: HasFlags, value: bool) -> None:
        obj.flags = obj.flags | self.mask if value else obj.flags & ~self.mask


class Followed:
    """One parked task: what the follower needs between polls (nothing else is kept: eleven
    slots, the booleans in one small int; the operation's scope is not kept — a state
    change finds the record by its key). It is its own entry in the follower's heap."""

    __slots__ = (
        "deadline_ms",
        "delay",
        "due",
        "flags",
        "key",
        "notes",
        "on_event",
        "queued_at",
        "state",
        "task_id",
        "wake",
    )

    pushed = Bit(1)
    """Push is registered for it: polled more slowly."""
    hurry = Bit(2)
    """A push said it moved: polled as soon as no other instance polls it."""
    streaming = Bit(4)
    """Followed by its stream now."""
    may_stream = Bit(8)
    """Followed by its stream (previews) while the peer lets it."""
    restream = Bit(16)
    """Its next due time subscribes again instead of polling (a stream that ended while the
    task works: read once, then streamed again after the pause)."""

    def __init__(
        self,
        *,
        key: str,
        task_id: str,
        state: str | None,
        deadline_ms: int,
        delay: float,
        pushed: bool,
        wake: Callable[[], None],
        on_event: EventSink | None,
    ) -> None:
        self.key = key
        self.task_id = task_id
        self.state = None if state is None else sys.intern(state)  # one "working" for all
        self.deadline_ms = deadline_ms
        self.delay = delay
        self.flags = 1 if pushed else 0
        self.wake: Callable[[], None] | None = wake
        self.on_event = on_event
        self.notes: tuple[str | None, str | None] | None = None
        """:attr:`shown` and :attr:`relayed`, when either is set (one slot for both)."""
        self.due = math.inf
        """When it is read next (Trio time); infinite while it is read or streamed."""
        self.queued_at: float | None = None
        """Its place in the follower's heap (the record itself is the entry: no tuple per
        record), ``None`` when it is not there; may be later than :attr:`due` (then it is
        also in the heap of sooner dues) or earlier (then it is put back at :attr:`due`)."""

    @property
    def shown(self) -> str | None:
        """The preview text shown last."""
        notes = self.notes
        return None if notes is None else notes[0]

    @shown.setter
    def shown(self, text: str | None) -> None:
        relayed = self.relayed
        self.notes = None if text is None and relayed is None else (text, relayed)

    @property
    def relayed(self) -> str | None:
        """The key of the last interrupted status this turn has seen to (:mod:`._relay`):
        the ``auth-required`` status relayed, or a continuation's question."""
        notes = self.notes
        return None if notes is None else notes[1]

    @relayed.setter
    def relayed(self, key: str | None) -> None:
        shown = self.shown
        self.notes = None if key is None and shown is None else (shown, key)

    def __lt__(self, other: Followed) -> bool:
        """The heap's order (an entry's place does not change while it is there)."""
        return _place(self) < _place(other)


def _place(record: Followed) -> float:
    queued_at = record.queued_at
    return math.inf if queued_at is None else queued_at


class Schedule:
    """The parked records by their next due time: a heap of the records themselves (each
    once, at :attr:`Followed.queued_at`; no tuple per record) and a small heap of the few
    made due sooner than their place (a push hurried them)."""

    __slots__ = ("heap", "sooner")

    def __init__(self) -> None:
        self.heap: list[Followed] = []
        self.sooner: list[tuple[float, Followed]] = []

    def clear(self) -> None:
        self.heap.clear()
        self.sooner.clear()

    def first(self) -> float:
        """The earliest due time it holds (stale ones included)."""
        sooner = self.sooner[0][0] if self.sooner else math.inf
        return min(_place(self.heap[0]) if self.heap else math.inf, sooner)

    def put(self, record: Followed, due: float) -> bool:
        """``record`` is due at ``due``, sooner than it was; whether it comes first now."""
        record.due = due
        queued_at = record.queued_at
        if queued_at is None:
            self._queue(record)
            return self.heap[0] is record
        if due < queued_at:
            heapq.heappush(self.sooner, (due, record))
            return self.sooner[0][1] is record
        return False  # its place comes first: put back at ``due`` then

    def pop(self, now: float) -> Followed | None:
        """A record due by ``now`` (its :attr:`~Followed.due` still set), or ``None``."""
        heap, sooner = self.heap, self.sooner
        while True:
            if sooner and sooner[0][0] <= now:
                due, record = heapq.heappop(sooner)
                if record.due == due:
                    return record
                continue  # rescheduled, or taken from the heap already: stale
            if not heap or _place(heap[0]) > now:
                return None
            record = heapq.heappop(heap)
            due, record.queued_at = _place(record), None
            if record.due == due:
                return record
            if record.due != math.inf and record.due > due:
                self._queue(record)  # due later now: back in at its due
            # else being read, or due sooner (in ``sooner``)

    def _queue(self, record: Followed) -> None:
        record.queued_at = record.due
        heapq.heappush(self.heap, record)


class Follower:
    """The parked tasks of one agent in one runtime (see the module docstring)."""

    def __init__(self, agent: A2AAgent, client: A2AClient) -> None:
        self.agent = agent
        self.client = client
        polls = agent.polls
        self.gate = None if polls is None else PollGate(polls, agent.alias, agent.poll_lease_ms)
        """Several instances: this follower's poll leases."""
        self.records: dict[str, Followed] = {}
        """By task id."""
        self.found: dict[str, Finding] = {}
        """What was read for a woken run, by task id (taken once by the run)."""
        self._schedule_of = Schedule()
        self._kick = trio.Event()
        self._streams = 0
        self._to_stream: list[tuple[Followed, PollLease | None]] = []
        self._nursery: trio.Nursery | None = None
        self._send, self._receive = trio.open_memory_channel[Followed](0)

    def __len__(self) -> int:
        return len(self.records)

    # ------------------------------------------------------------------ the run's side

    def add(self, record: Followed) -> None:
        """Follow ``record`` (a parked turn): by its stream when the card and ``stream``
        allow (and :data:`MAX_STREAMS` is not reached), else read at once (the task may be
        over already), then polled. Several instances: the stream, like a poll, waits for
        the task's poll lease."""
        old = self.records.get(record.task_id)
        if old is not None:
            old.wake = None
        self.records[record.task_id] = record
        if self.agent.options.stream and self.client.card.streaming:
            if self.gate is not None:
                record.may_stream = record.restream = True
            elif self._streams < MAX_STREAMS:
                record.may_stream = True
                self._start_stream(record, None)
                return
        self._schedule(record, 0.0)

    def take(self, task_id: str) -> Finding | None:
        return self.found.pop(task_id, None)

    def drop(self, task_id: str) -> None:
        """Follow ``task_id`` no more (its turn is over: ``/cancel``); a read or a stream
        in flight for it ends without a wake."""
        record = self.records.pop(task_id, None)
        if record is not None:
            record.wake = None
        self.found.pop(task_id, None)

    def wake_task(self, task_id: str) -> bool:
        """A push said something about ``task_id``: read it now. ``False`` when it is not
        followed here."""
        record = self.records.get(task_id)
        if record is None:
            return False
        if not record.streaming:
            record.hurry = True
            self._schedule(record, 0.0)
        return True

    def next_poll_ms(self, task_id: str) -> int | None:
        """When ``task_id`` is read next (the agent's clock), for ``listRemoteTasks``."""
        record = self.records.get(task_id)
        if record is None:
            return None
        if record.due == math.inf:  # being read or streamed now
            return self.agent.clock.now_ms()
        left = max(0.0, record.due - trio.current_time())
        return self.agent.clock.now_ms() + int(left * 1000)

    # ------------------------------------------------------------------ the loop

    async def run(self) -> None:
        """Until cancelled (the runtime stops): the records are dropped then."""
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                for _ in range(POLLERS):
                    nursery.start_soon(self._poller)
                for record, lease in self._to_stream:
                    nursery.start_soon(self._stream, record, lease)
                self._to_stream.clear()
                await self._dispatch()
        finally:
            self._nursery = None
            self.records.clear()
            self._schedule_of.clear()
            self.found.clear()

    async def _dispatch(self) -> None:
        schedule = self._schedule_of
        while True:
            now = trio.current_time()
            while (record := schedule.pop(now)) is not None:
                if self.records.get(record.task_id) is not record:
                    continue  # gone
                record.due = math.inf
                await self._send.send(record)
            self._kick = trio.Event()
            with trio.move_on_at(schedule.first()):
                await self._kick.wait()

    def _schedule(self, record: Followed, seconds: float) -> None:
        due = trio.current_time() + seconds
        if due >= record.due:
            return  # already due sooner
        if self._schedule_of.put(record, due):
            self._kick.set()

    def _pause(self, record: Followed) -> float:
        options = self.agent.options
        cap = options.max_poll_s
        pause = self.agent.backoff(None, record.delay) * (PUSH_SLOWDOWN if record.pushed else 1)
        left = max(0.0, (record.deadline_ms - self.agent.clock.now_ms()) / 1000)
        return min(pause, cap, left)

    async def _reserve(self, gate: PollGate, record: Followed) -> PollLease | None:
        """The task's poll lease, or ``None`` when it is not this instance's to poll now
        (rescheduled for when to ask again; or the task's row is gone: its turn is woken)."""
        got = await gate.reserve(record.task_id, record.hurry)
        if self.records.get(record.task_id) is not record:
            if isinstance(got, PollLease):
                await gate.release(got, 0.0)  # woken or dropped meanwhile
            return None
        if got is None:
            self._finish(record, ELSEWHERE)
            return None
        if isinstance(got, PollWait):
            # A little later than asked, so that the instance that polled last goes first;
            # hurried, within a second (the poll in flight elsewhere is likely over by then).
            wait = got.wait_ms / 1000 * random.uniform(1.0, 1.1) + 0.01
            self._schedule(record, min(wait, 1.0) if record.hurry else wait)
            return None
        record.hurry = False
        return got

    async def _poller(self) -> None:
        async for record in self._receive:
            if self.records.get(record.task_id) is not record:
                continue
            lease: PollLease | None = None
            try:
                if self.gate is not None:
                    lease = await self._reserve(self.gate, record)
                    if lease is None:
                        continue
                if record.restream and self._nursery is not None and self._streams < MAX_STREAMS:
                    record.restream = False
                    self._start_stream(record, lease)
                    continue
                await self._poll(record, lease)
            except Exception as exc:
                # Never lose a record to an unexpected error: poll it again later (a lease
                # held expires).
                self.agent.count("poll_errors")
                del exc
                if self.records.get(record.task_id) is record:
                    self._schedule(record, self._pause(record))

    async def _get(self, task_id: str, lease: PollLease | None) -> Task | None:
        """``GetTask`` under ``lease`` (renewed meanwhile); ``None`` when the lease was
        lost during the call."""
        task: Task | None = None
        async with holding(self.gate, lease):
            task = await self.client.get_task(task_id)
        return task

    async def _release(self, lease: PollLease | None, seconds: float) -> bool:
        return self.gate is None or await self.gate.release(lease, seconds)

    async def _poll(self, record: Followed, lease: PollLease | None) -> None:
        agent = self.agent
        options = agent.options
        if agent.clock.now_ms() >= record.deadline_ms:
            await self._end(record, lease, TIMEOUT)
            return
        retry_after: float | None = None
        try:
            task: Task | None = await self._get(record.task_id, lease)
            agent.count("polls")
        except RemoteError as exc:
            if exc.code == TASK_NOT_FOUND:
                await self._end(record, lease, LOST)
                return
            task = None
        except Refused as exc:
            task, retry_after = None, exc.retry_after
        except OutcomeUnknown:
            task = None
        if self.records.get(record.task_id) is not record:
            await self._release(lease, 0.0)
            return  # woken or dropped meanwhile
        first, cap = options.poll_s, options.max_poll_s  # shared: no float per task
        if task is not None and (
            ends_turn(task, record.relayed)  # a continuation: relayed holds the question's key
            or (task.state == "auth-required" and relay_key(task) != record.relayed)
        ):
            await self._end(record, lease, task)  # auth-required: relayed, then parked again
            return
        record.restream = record.may_stream
        if task is not None and task.state != record.state:
            record.delay = first
        pause = self._pause(record)
        if retry_after is not None:
            pause = max(pause, min(retry_after, 3600.0))
        if not await self._release(lease, pause):
            # Taken over while it was read: another instance applies what it reads.
            self._schedule(record, pause)
            return
        if task is not None:
            if task.state != record.state:
                record.state = sys.intern(task.state)
                await note_state(agent, record.key, task.state)
            if record.on_event is not None:
                shown = [record.shown]
                preview(record.on_event, record.task_id, task.status_text, shown)
                record.shown = shown[0]
        record.delay = min(record.delay * 2, cap)
        self._schedule(record, pause + (0.01 if lease is not None else 0.0))

    async def _end(self, record: Followed, lease: PollLease | None, finding: Finding) -> None:
        """The task is over for its parked turn: end its poll row (several instances) and
        wake the turn — unless the lease was taken over meanwhile (polled again later)."""
        if self.gate is not None and not await self.gate.end(lease):
            if self.records.get(record.task_id) is record:
                self._schedule(record, self._pause(record))
            return
        self._finish(record, finding)

    def _finish(self, record: Followed, finding: Finding) -> None:
        """Keep what was read for the run and wake the parked turn."""
        if self.records.get(record.task_id) is not record:
            return
        del self.records[record.task_id]
        self.found[record.task_id] = finding
        wake, record.wake = record.wake, None
        if wake is not None:
            wake()

    def _start_stream(self, record: Followed, lease: PollLease | None) -> None:
        self._streams += 1
        record.streaming = True
        if self._nursery is None:
            self._to_stream.append((record, lease))  # started with the loop
        else:
            self._nursery.start_soon(self._stream, record, lease)

    async def _stream(self, record: Followed, lease: PollLease | None) -> None:
        """Follow ``record`` by its stream (previews), under ``lease`` (several instances:
        renewed meanwhile), then read it at once."""
        try:
            shown = [record.shown]
            async with holding(self.gate, lease):
                again = await stream(
                    self.agent,
                    self.client,
                    record.task_id,
                    record.on_event,
                    shown,
                    record.deadline_ms,
                    record.key,  # an artifact seen appended to is noted in its record
                )
                record.shown = shown[0]
                record.may_stream = record.may_stream and again  # not after a refusal
            await self._release(lease, 0.0)
        finally:
            self._streams -= 1
            record.streaming = False
            if self.records.get(record.task_id) is record:
                self._schedule(record, 0.0)


# ---------------------------------------------------------------------- the run's steps


async def park_or_answer(
    agent: A2AAgent,
    client: A2AClient,
    stored: Stored,
    just_sent: bool,
    hooks: RunHooks,
    on_event: EventSink | None,
    session: str,
    *,
    answered: Task | None = None,
) -> RunResult:
    """A run whose task is known: answer when the task is over (read by the follower that
    woke this run, or once here after a restart or when the send's answer — ``answered`` —
    showed it over already), else park the turn with the follower and return
    ``following``. ``/cancel`` (a parked turn woken to cancel): ``CancelTask``."""
    record = stored.record
    task_id = record.task_id
    assert task_id is not None
    run_id = f"a2a:{task_id}"
    if hooks.cancelling:
        over = await agent.cancel_followed(client, stored.scope, stored.key)
        await _forget(agent, task_id)
        # Not polled on: a peer that refuses CancelTask may work on for hours.
        follower = agent.followers.get(hooks.runtime)
        if follower is not None:
            follower.drop(task_id)
        if over is not None and ends_turn(over, record.prompt):
            # Over before the cancel could land (the reference: -32002, GetTask): the
            # work is done and its answer is the turn's, not dropped.
            return await answer(agent, stored, over, session)
        return RunResult("aborted", "", run_id, session)
    follower = _follower(agent, hooks, client)
    finding = follower.take(task_id)
    if finding is None and answered is not None and ends_turn(answered, record.prompt):
        # Over in the send's answer: replied at once — from the task read once more, as
        # every answer is, else (the peer keeps no finished task, restarted, or cannot be
        # reached now) from the task the send returned: not lost to a poll.
        read = await _read(agent, client, task_id)
        finding = read if isinstance(read, Task) else answered
    if finding == ELSEWHERE or (
        finding is None
        and not just_sent
        and (agent.polls is None or record.state in TERMINAL_STATES)
    ):
        # Read once here: after a restart; several instances: its poll row was gone, or a
        # push already said the task ended (taken over after its follower died: the row's
        # next due time may be a whole interval away).
        finding = await _read(agent, client, task_id)
    relayed: str | None = None
    if isinstance(finding, Task):
        if ends_turn(finding, record.prompt):
            await _forget(agent, task_id)
            return await answer(agent, stored, finding, session)
        if finding.state == "auth-required":
            if await relay_interrupt(hooks, finding, [None]):
                agent.count("relays")
            relayed = relay_key(finding)
        if moves_forward(record.state, finding.state):
            stored = await agent.book.update(
                stored, state=finding.state, observed_ms=agent.clock.now_ms()
            )
    elif finding == LOST:
        await _forget(agent, task_id)
        await agent.book.update(stored, phase="done", state="lost")
        return failed("lost", session, run_id)
    deadline_ms = record.created_ms + agent.options.task_timeout_ms
    if finding == TIMEOUT or agent.clock.now_ms() >= deadline_ms:
        with trio.move_on_after(CANCEL_BUDGET_S, shield=True):
            try:
                await client.cancel_task(task_id)
            except A2AError:
                pass
        await _forget(agent, task_id)
        await agent.book.update(stored, phase="done", state="timeout")
        return failed("timeout", session, run_id)
    parked = Followed(
        key=stored.key,
        task_id=task_id,
        state=stored.record.state,
        deadline_ms=deadline_ms,
        delay=agent.options.poll_s,
        pushed=record.token_hash is not None,
        wake=hooks.park(),
        on_event=on_event,
    )
    parked.relayed = relayed or record.prompt  # a continuation: its question is no news
    if agent.polls is not None:
        await agent.polls.track(f"{agent.alias}/{task_id}")  # due now unless polled already
    follower.add(parked)
    return RunResult("following", "", run_id, session)


async def _read(agent: A2AAgent, client: A2AClient, task_id: str) -> Finding | None:
    """The task once (a resumed run that nothing read for): ``None`` when the peer could
    not answer now (the follower tries again)."""
    try:
        task = await client.get_task(task_id)
    except RemoteError as exc:
        return LOST if exc.code == TASK_NOT_FOUND else None
    except A2AError:
        return None
    agent.count("polls")
    return task


async def _forget(agent: A2AAgent, task_id: str) -> None:
    """The task is answered: its poll row (several instances) is dropped; the other
    instances that have it parked wake their turns, which find the operation settled."""
    if agent.polls is not None:
        await agent.polls.forget(f"{agent.alias}/{task_id}")


def _follower(agent: A2AAgent, hooks: RunHooks, client: A2AClient) -> Follower:
    """The agent's follower in the hooks' runtime, started with its first parked turn."""
    key = hooks.runtime
    follower = agent.followers.get(key)
    if follower is None:
        follower = agent.followers[key] = Follower(agent, client)

        async def follow_parked() -> None:
            try:
                await follower.run()
            finally:
                if agent.followers.get(key) is follower:
                    del agent.followers[key]

        hooks.spawn(follow_parked)
    return follower


def next_poll(agents: Mapping[str, A2AAgent], alias: str, task_id: str) -> int | None:
    """When ``alias``'s ``task_id`` is read next in this process (Unix ms; ``None``: not
    followed here): ``listRemoteTasks``' next poll."""
    agent = agents.get(alias)
    if agent is None:
        return None
    for follower in agent.followers.values():
        due = follower.next_poll_ms(task_id)
        if due is not None:
            return due
    return None


async def note_state(agent: A2AAgent, key: str, state: str) -> None:
    """A followed task's new (not final) state, journaled for operators."""
    stored = await agent.book.find_operation(ANY_SCOPE, key)
    if stored is None or stored.record.phase != "following":
        return
    if moves_forward(stored.record.state, state):
        await agent.book.update(stored, state=state, observed_ms=agent.clock.now_ms())
