"""Receiving: one manual ``subscribeReceive`` subscription under the receiver lease.

Contract §12.3–12.4, with the differences that keep every message signal-cli handed over:

* **One receiver per account.** Receiving runs only while
  :class:`~adapters.toolkit.ReceiverLease` holds ``prism.channels.v1.signal.receiver`` /
  ``r1:<connection>`` (service scope), renewed at half its TTL; a daemon that does not get
  it stands by (``standby``) and takes over when it frees; a restarted daemon takes over
  its own predecessor's lease at once (SPEC difference 8).
* **Readiness probe.** Before every ``subscribeReceive`` the readiness record (§5.7, the
  same namespace and key in the journal's store) is rewritten by compare-and-swap at
  version + 1, fenced by the lease: signal-cli is asked for messages only when the store
  takes a write from this holder now. A probe that fails (the store is down, a newer
  holder's fence) means no subscription: back off and try again.
* **Accept only ours.** A ``receive`` notification counts only for the current
  subscription id; one naming another account pauses the receiver for good (health
  ``account: mismatch``, an :class:`~prismd.channel.AdapterFatalError`: the operator
  fixes the config or the daemon, reconnecting cannot).
* **Journal on receipt.** signal-cli forgets a message once it has written it, so the first
  thing done with what was read is to write it to the durable inbox
  (:mod:`adapters.signal._inbox`, the store's inbox): every notification available at that
  moment, together (one transaction on SQLite). A second task admits the journaled events
  one at a time, in order, and completes their inbox items in batches. The loss window a
  SIGKILL can hit is therefore the read plus one inbox transaction (measured in
  ``tests/signal/test_killloop_signal.py``), not the admissions; it holds at most the
  notifications already read (``max_pending_events`` in the client's queue, one batch of
  :data:`MAX_BATCH` being written) plus what sat in the socket buffers. While
  :data:`MAX_HELD` journaled events wait for admission, reading pauses (signal-cli's writes
  then block).
* **Pause, never drop.** On a retryable admission, a lost lease, writer loss (the store
  refused an inbox write), a connection that ended, or a stop: stop taking notifications,
  ``unsubscribeReceive`` (a request, so its answer says that everything sent before it has
  been read), take what was already sent, drop the socket. Events already received stay
  journaled and are admitted before the next subscription, with backoff; a receiver that
  takes over the lease (this daemon restarted, or a standby) takes them back from the inbox
  first. Reconnecting waits a jittered delay doubling from ``reconnect_delay_s`` to
  ``max_reconnect_delay_s`` (no hot loop while signal-cli is down).
* **A graceful stop.** Cancelling :meth:`Receiver.run` (the supervisor stopping the daemon)
  ends waiting, not the wind-down: it unsubscribes, keeps what was sent meanwhile in the
  inbox and releases the lease, within :data:`STOP_BUDGET_S`.

Log lines name the connection and cause classes, never the account number, a sender or
message text.
"""

from __future__ import annotations

import collections
import contextlib
import random as _random
from collections.abc import Iterator
from typing import Literal, TypeAlias

import attrs
import trio

from prismd.channel import Admit, InboundEvent
from prismd.jsonrpc import Incoming
from stores import CheckpointStore, Clock, OwnershipScope

from ..toolkit import (
    Backoff,
    JsonRpcClient,
    JsonRpcConnectionError,
    JsonRpcTimeoutError,
    LeaseLostError,
    ReceiverLease,
    RpcError,
    open_jsonrpc_client,
)
from ._client import Endpoint, SignalUnreachableError
from ._filter import NotificationFilter
from ._inbox import Inbox
from ._parse import read_notification
from ._readiness import write_readiness
from ._status import SignalStatus, log

__all__ = ["Receiver"]

STOP_BUDGET_S = 5.0
"""A stop ends the receiver within this long, whatever signal-cli or the store do."""
WIND_DOWN_S = 2.0
"""Bound on unsubscribing and taking what was already sent."""
PERSIST_S = 2.0
"""Bound on writing held events to the inbox during a stop."""
STABLE_S = 30.0
"""A subscription that lasted this long resets the reconnect backoff."""
MAX_BATCH = 64
"""At most this many notifications are journaled in one transaction (and removed in one)."""
MAX_HELD = 256
"""Journaled events waiting for admission beyond which reading pauses."""

Ended: TypeAlias = Literal[
    "stopped",
    "unreachable",
    "subscribe_failed",
    "eof",
    "broken",
    "oversized",
    "malformed",
    "closed",
    "open",
    "admission",
    "account_mismatch",
    "lease_lost",
    "writer_lost",
]
_WHY = {
    "unreachable": "signal-cli is unreachable",
    "subscribe_failed": "subscribeReceive failed",
    "eof": "signal-cli closed the connection",
    "broken": "the connection broke",
    "oversized": "signal-cli sent an oversized frame",
    "malformed": "signal-cli sent a malformed frame",
    "writer_lost": "the journal does not take writes; not receiving meanwhile",
}


@attrs.define(eq=False)
class _Held:
    event: InboundEvent
    durable: bool = False


@attrs.define(eq=False)
class _Intake:
    """What the two intake tasks of one subscription share: why it ends (the first reason
    wins), the read waits to cut short then, and the wake-ups between them."""

    ended: Ended | None = None
    admitted: trio.Event = attrs.field(factory=trio.Event)
    """Set (and replaced) whenever an event was admitted, or when the intake ends."""
    _work: trio.Event = attrs.field(factory=trio.Event)
    _reading: set[trio.CancelScope] = attrs.field(factory=set)

    def end(self, reason: Ended) -> None:
        if self.ended is None:
            self.ended = reason
        for scope in self._reading:
            scope.cancel()
        self._work.set()
        self.admitted.set()

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """A wait for signal-cli that :meth:`end` cuts short."""
        scope = trio.CancelScope()
        if self.ended is not None:
            scope.cancel()
        self._reading.add(scope)
        try:
            with scope:
                yield
        finally:
            self._reading.discard(scope)

    def work(self) -> None:
        self._work.set()

    async def wait_for_work(self) -> None:
        await self._work.wait()
        self._work = trio.Event()

    def progress(self) -> None:
        self.admitted.set()
        self.admitted = trio.Event()


@attrs.define(eq=False)
class _Started:
    """``task_status.started()`` once: when receiving or standing by, whichever is first."""

    task_status: trio.TaskStatus[None]
    fired: bool = False

    def fire(self) -> None:
        if not self.fired:
            self.fired = True
            self.task_status.started()


@attrs.define(eq=False, kw_only=True)
class Receiver:
    connection_id: str
    endpoint: Endpoint
    admit: Admit
    lease: ReceiverLease
    checkpoints: CheckpointStore
    service_scope: OwnershipScope
    inbox: Inbox
    status: SignalStatus
    filter: NotificationFilter
    clock: Clock
    random: _random.Random
    timeout_s: float
    max_frame_bytes: int
    max_pending_requests: int
    max_pending_events: int
    reconnect_delay_s: float
    max_reconnect_delay_s: float
    _held: collections.deque[_Held] = attrs.field(factory=collections.deque, init=False)
    _stopping: bool = attrs.field(default=False, init=False)
    _interruptible_scopes: set[trio.CancelScope] = attrs.field(factory=set, init=False)
    _failures: int = attrs.field(default=0, init=False)
    _to_remove: list[InboundEvent] = attrs.field(factory=list, init=False)
    """Admitted events whose inbox records are still to be deleted (in one batch)."""

    # ------------------------------------------------------------------ run

    async def run(self, task_status: trio.TaskStatus[None]) -> bool:
        """Receive until cancelled; True when it stopped for an account mismatch.

        Cancellation is turned into a graceful stop (see the module docstring), bounded by
        :data:`STOP_BUDGET_S`.
        """
        started = _Started(task_status)
        self._stopping = False
        hard = trio.CancelScope(shield=True)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch_stop, hard)
            try:
                with hard:
                    await self._run(started)
            finally:
                nursery.cancel_scope.cancel()
        return self.filter.mismatched

    async def _watch_stop(self, hard: trio.CancelScope) -> None:
        try:
            await trio.sleep_forever()
        finally:
            self._stopping = True
            for scope in self._interruptible_scopes:
                scope.cancel()
            hard.deadline = min(hard.deadline, trio.current_time() + STOP_BUDGET_S)

    @contextlib.contextmanager
    def _interruptible(self) -> Iterator[trio.CancelScope]:
        """A wait that a stop ends (check ``cancelled_caught`` or :attr:`_stopping`)."""
        scope = trio.CancelScope()
        if self._stopping:
            scope.cancel()
        self._interruptible_scopes.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._interruptible_scopes.discard(scope)

    async def _run(self, started: _Started) -> None:
        self.status.state = "starting"
        try:
            while not self._stopping and not self.filter.mismatched:
                if not await self._acquire(started):
                    return
                await self._hold_and_receive(started)
        finally:
            await self._finish()

    async def _acquire(self, started: _Started) -> bool:
        """Hold the lease (standing by while another receiver has it); False on a stop."""

        def standby() -> None:
            self.status.state = "standby"
            self.status.subscription = "inactive"
            started.fire()

        backoff = Backoff(
            self.random, base_s=self.reconnect_delay_s, cap_s=self.max_reconnect_delay_s
        )
        while True:
            with self._interruptible() as scope:
                try:
                    await self.lease.acquire(on_standby=standby)
                    return True
                except Exception as exc:
                    delay = backoff.next_delay()
                    self.status.state = "backoff"
                    log.warning(
                        "signal %s: acquiring the receiver lease failed (%s); retry in %.1f s",
                        self.connection_id,
                        type(exc).__name__,
                        delay,
                    )
                    await trio.sleep(delay)
            if scope.cancelled_caught:
                return False

    async def _hold_and_receive(self, started: _Started) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.lease.keep)
            try:
                await self._while_held(started)
            except LeaseLostError:
                self.status.state = "paused"
                log.info(
                    "signal %s: receiver lease lost; not receiving until it is ours again",
                    self.connection_id,
                )
            finally:
                nursery.cancel_scope.cancel()
        await self.lease.release()

    async def _while_held(self, started: _Started) -> None:
        backoff = Backoff(
            self.random, base_s=self.reconnect_delay_s, cap_s=self.max_reconnect_delay_s
        )
        await self._replay_inbox()
        while not self._stopping:
            await self._settle_held()
            if self._stopping or self.filter.mismatched:
                return
            self.lease.check()
            if not await self._probe_or_wait(backoff):
                continue
            ended, stable = await self._session(started)
            if ended == "account_mismatch" or self.filter.mismatched:
                self.filter.mismatched = True
                await self._settle_held()
                return
            if ended == "stopped":
                return
            if stable:
                backoff.reset()
            if ended == "admission":
                continue  # _settle_held paces the retries
            self._failures += 1
            delay = backoff.next_delay()
            self.status.state = "backoff"
            log.warning(
                "signal %s: %s; reconnecting in %.1f s (attempt %d)",
                self.connection_id,
                _WHY.get(ended, "the subscription ended"),
                delay,
                self._failures,
            )
            with self._interruptible():
                await self.lease.sleep(delay)

    async def _finish(self) -> None:
        with trio.move_on_after(STOP_BUDGET_S, shield=True):
            await self._persist_held()
            await self._flush_removals()
            await self.lease.release()
        self.status.bridge = "unavailable"
        self.status.subscription = "inactive"
        self.status.state = "account_mismatch" if self.filter.mismatched else "stopped"

    # ------------------------------------------------------------------ readiness

    async def _probe_or_wait(self, backoff: Backoff) -> bool:
        """True once the probe was written; False after a failure (waited) or a stop."""
        try:
            with self._interruptible() as scope, self.lease.guard():
                self.status.state = "probing"
                await write_readiness(
                    self.checkpoints,
                    connection_id=self.connection_id,
                    scope=self.service_scope,
                    fencing_token=self.lease.fencing_token,
                    clock=self.clock,
                )
                self.status.probes += 1
            return not scope.cancelled_caught
        except LeaseLostError:
            raise
        except Exception as exc:
            delay = backoff.next_delay()
            self.status.state = "backoff"
            log.warning(
                "signal %s: readiness probe failed (%s); not subscribing; retry in %.1f s",
                self.connection_id,
                type(exc).__name__,
                delay,
            )
            with self._interruptible():
                await self.lease.sleep(delay)
            return False

    # ------------------------------------------------------------------ one connection

    async def _connect(self) -> trio.abc.Stream | None:
        stream: trio.abc.Stream | None = None
        self.status.state = "connecting"
        try:
            with self._interruptible(), self.lease.guard():
                stream = await self.endpoint.connect(self.timeout_s)
        except SignalUnreachableError as exc:
            log.debug("signal %s: connect failed (%s)", self.connection_id, exc.cause_name)
            return None
        except LeaseLostError:
            if stream is not None:
                await trio.aclose_forcefully(stream)
            raise
        if stream is not None and self._stopping:
            await trio.aclose_forcefully(stream)
            return None
        return stream

    async def _session(self, started: _Started) -> tuple[Ended, bool]:
        """Connect, subscribe, take notifications, wind down: why it ended, and whether the
        subscription lasted :data:`STABLE_S`."""
        stream = await self._connect()
        if stream is None:
            return ("stopped" if self._stopping else "unreachable"), False
        self.status.connects += 1
        ended: Ended = "stopped"
        since: float | None = None
        async with open_jsonrpc_client(
            stream,
            timeout_s=self.timeout_s,
            max_pending=self.max_pending_requests,
            max_frame_bytes=self.max_frame_bytes,
            max_notifications=self.max_pending_events,
            close_on_bad_frame=True,
        ) as client:
            self.status.bridge = "connected"
            subscription = await self._subscribe(client)
            if subscription is None:
                ended = "subscribe_failed"
                # signal-cli may have subscribed (and sent) before the answer was lost.
                await self._wind_down(client, None)
            else:
                since = trio.current_time()
                self._subscribed(started)
                try:
                    ended = await self._intake(client, subscription)
                finally:
                    await self._wind_down(client, subscription)
        self.status.bridge = "unavailable"
        self.status.subscription = "paused"
        if ended in ("oversized", "malformed"):
            self.status.bad_frames += 1
        if ended == "lease_lost":
            raise LeaseLostError()
        stable = since is not None and trio.current_time() - since >= STABLE_S
        return ended, stable

    async def _subscribe(self, client: JsonRpcClient) -> int | None:
        """The new subscription id, or ``None`` (logged). Not cut short by a stop or a lost
        lease: signal-cli may already have subscribed, and a subscription whose id is not
        known could not be wound down."""
        try:
            result = await client.call("subscribeReceive")
        except RpcError as error:
            log.warning(
                "signal %s: subscribeReceive refused (code %d)", self.connection_id, error.code
            )
            return None
        except (JsonRpcTimeoutError, JsonRpcConnectionError) as exc:
            log.debug(
                "signal %s: subscribeReceive failed (%s)", self.connection_id, type(exc).__name__
            )
            return None
        if isinstance(result, bool) or not isinstance(result, int) or result < 0:
            log.warning(
                "signal %s: subscribeReceive answered no subscription id", self.connection_id
            )
            return None
        return result

    def _subscribed(self, started: _Started) -> None:
        status = self.status
        status.subscriptions += 1
        status.subscription = "active"
        status.state = "receiving"
        if status.account == "unverified":
            status.account = "ready"
        if self._failures:
            log.info(
                "signal %s: receiving again after %d failed attempt(s)",
                self.connection_id,
                self._failures,
            )
            self._failures = 0
        elif not started.fired:
            log.info("signal %s: receiving (manual subscription)", self.connection_id)
        started.fire()

    async def _intake(self, client: JsonRpcClient, subscription: int) -> Ended:
        """Two tasks until the subscription should end: one journals what signal-cli sends
        the moment it is read (:meth:`_journal_loop`), one admits the journaled events in
        order (:meth:`_admit_loop`). Neither is cut short in the middle of a write; the
        first reason to end (a retryable admission, the connection, the lease, a stop, an
        account mismatch) ends both."""
        intake = _Intake()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._journal_loop, client, subscription, intake)
            await self._admit_loop(intake)
            intake.end("stopped")
        assert intake.ended is not None
        return intake.ended

    async def _journal_loop(
        self, client: JsonRpcClient, subscription: int, intake: _Intake
    ) -> None:
        while intake.ended is None:
            first: Incoming | None = None
            lease_lost = False
            try:
                with self._interruptible(), intake.reading(), self.lease.guard():
                    try:
                        first = await client.notifications.receive()
                    except trio.EndOfChannel:
                        intake.end(client.closed_reason)
                        return
            except LeaseLostError:
                # The guard may raise after the receive returned: journal what was taken.
                lease_lost = True
            if first is None:
                intake.end("lease_lost" if lease_lost else "stopped")
                return
            notes = [first]
            while len(notes) < MAX_BATCH:
                try:
                    notes.append(client.notifications.receive_nowait())
                except (trio.WouldBlock, trio.EndOfChannel):
                    break
            journaled = await self._journal(notes, subscription)
            if lease_lost:
                intake.end("lease_lost")
                return
            if not journaled:
                # Writer loss: what cannot be journaled must not be taken from signal-cli.
                intake.end("writer_lost")
                return
            if self.filter.mismatched:
                intake.end("account_mismatch")
                return
            intake.work()
            while len(self._held) >= MAX_HELD and intake.ended is None:
                # Admission is behind: stop reading (signal-cli's writes then block) rather
                # than hold without bound.
                with self._interruptible(), intake.reading():
                    await intake.admitted.wait()

    async def _admit_loop(self, intake: _Intake) -> None:
        while intake.ended is None:
            if self._stopping:
                intake.end("stopped")
                return
            if not self._held:
                await self._flush_removals()
                with self._interruptible():
                    await intake.wait_for_work()
                continue
            item = self._held[0]
            if not await self._admit_once(item.event):
                intake.end("admission")
                return
            self._admitted(item)
            intake.progress()
            if len(self._to_remove) >= MAX_BATCH:
                await self._flush_removals()
            try:
                self.lease.check()
            except LeaseLostError:
                intake.end("lease_lost")
                return

    async def _journal(self, notes: list[Incoming], subscription: int) -> bool:
        """Classify ``notes`` and keep their events, written to the inbox in one
        transaction (journal on receipt: nothing else happens to them before). False when
        the store did not take the write (the events are kept in memory, and retried)."""
        events = [
            verdict
            for note in notes
            if isinstance(verdict := self.filter.classify(note, subscription), InboundEvent)
        ]
        if not events:
            return True
        durable = await self.inbox.put(events)
        for event, ok in zip(events, durable, strict=True):
            self._held.append(_Held(event, durable=ok))
        self.status.held = len(self._held)
        return all(durable)

    # ------------------------------------------------------------------ admission

    async def _admit_once(self, event: InboundEvent) -> bool:
        """True when ``admit`` gave a final answer (accepted, duplicate, a final refusal)."""
        try:
            admission = await self.admit(event)
        except Exception as exc:
            self.status.retried += 1
            log.warning(
                "signal %s: admitting a message failed (%s); it is kept and retried",
                self.connection_id,
                type(exc).__name__,
            )
            return False
        if admission.retryable:
            self.status.retried += 1
            log.debug(
                "signal %s: admission answered %s; the message is kept and retried",
                self.connection_id,
                admission.reason,
            )
            return False
        self.status.admitted += 1
        return True

    def _admitted(self, item: _Held) -> None:
        self._held.popleft()
        self.status.held = len(self._held)
        if item.durable:
            self._to_remove.append(item.event)

    async def _flush_removals(self) -> None:
        done, self._to_remove = self._to_remove, []
        await self.inbox.remove(done)

    async def _settle_held(self) -> None:
        """Admit the held events in order, with backoff; returns when none is left (or on a
        stop, after making them durable)."""
        backoff = Backoff(
            self.random, base_s=self.reconnect_delay_s, cap_s=self.max_reconnect_delay_s
        )
        while self._held:
            if self._stopping:
                await self._persist_held()
                return
            await self._persist_held()
            item = self._held[0]
            if await self._admit_once(item.event):
                self._admitted(item)
                backoff.reset()
                continue
            self.status.state = "paused"
            self.status.subscription = "paused"
            delay = backoff.next_delay()
            log.info(
                "signal %s: %d received message(s) wait for admission; next try in %.1f s",
                self.connection_id,
                len(self._held),
                delay,
            )
            with self._interruptible():
                await trio.sleep(delay)
        await self._flush_removals()

    async def _persist_held(self) -> None:
        """Write the held events not yet in the inbox (bounded, also during a stop)."""
        missing = [item for item in self._held if not item.durable]
        if not missing:
            return
        with trio.move_on_after(PERSIST_S, shield=True):
            durable = await self.inbox.put([item.event for item in missing])
            for item, ok in zip(missing, durable, strict=True):
                item.durable = ok

    async def _replay_inbox(self) -> None:
        try:
            events = await self.inbox.load()
        except Exception as exc:
            log.warning(
                "signal %s: reading the inbox failed (%s); retried at the next start",
                self.connection_id,
                type(exc).__name__,
            )
            return
        known = {item.event.event_id for item in self._held}
        for event in events:
            if event.event_id not in known:
                self._held.append(_Held(event, durable=True))
                self.status.replayed += 1
        self.status.held = len(self._held)
        if events:
            log.info(
                "signal %s: %d received message(s) taken back from the inbox",
                self.connection_id,
                len(events),
            )

    # ------------------------------------------------------------------ pausing

    async def _wind_down(self, client: JsonRpcClient, subscription: int | None) -> None:
        """Unsubscribe, take every notification sent before that was answered, and journal
        their events (bounded by :data:`WIND_DOWN_S` and :data:`PERSIST_S`; the socket
        closes after). The ``unsubscribeReceive`` is a request, not the reference's
        notification: its answer proves that nothing more is on the way.

        ``subscription`` ``None``: ``subscribeReceive`` got no usable answer, yet signal-cli
        may have subscribed this connection; ``unsubscribeReceive`` without an id ends the
        connection's subscription, and the one id its notifications carry is taken as it
        (this connection never had another)."""
        self.status.subscription = "paused"
        self.status.state = "paused"
        notes: list[Incoming] = []
        with trio.move_on_after(WIND_DOWN_S, shield=True):
            if not client.closed:
                async with trio.open_nursery() as nursery:

                    async def unsubscribe() -> None:
                        params = None if subscription is None else {"subscription": subscription}
                        try:
                            await client.call(
                                "unsubscribeReceive",
                                params,
                                timeout_s=min(self.timeout_s, WIND_DOWN_S),
                            )
                        except (RpcError, JsonRpcTimeoutError, JsonRpcConnectionError):
                            pass
                        nursery.cancel_scope.cancel()

                    nursery.start_soon(unsubscribe)
                    async for note in client.notifications:
                        notes.append(note)
                    nursery.cancel_scope.cancel()
        while True:
            try:
                notes.append(client.notifications.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel):
                break
        if subscription is None:
            subscription = _first_subscription(notes)
            if subscription is None:
                return
        with trio.move_on_after(PERSIST_S, shield=True):
            await self._journal(notes, subscription)
        await self._persist_held()


def _first_subscription(notes: list[Incoming]) -> int | None:
    for note in notes:
        parsed = read_notification(note.params) if note.method == "receive" else None
        if parsed is not None and parsed.subscription is not None:
            return parsed.subscription
    return None
