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
  :data:`MAX_UNADMITTED` journaled events wait for admission, reading pauses (signal-cli's writes
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

The parts: :mod:`._held` (the events read and not yet admitted, and the stop),
:mod:`._subscription` (one subscription: subscribe, intake, wind down) and this module (the
lease, the probe, reconnecting).

Log lines name the connection and cause classes, never the account number, a sender or
message text.
"""

from __future__ import annotations

import random as _random

import attrs
import trio

from prismd.channel import Admit
from stores import CheckpointStore, Clock, OwnershipScope

from ..toolkit import Backoff, Interrupts, LeaseLostError, ReceiverLease
from ._client import Endpoint, SignalUnreachableError
from ._filter import NotificationFilter
from ._held import UnadmittedEvents
from ._inbox import Inbox
from ._readiness import write_readiness
from ._status import SignalStatus, log
from ._subscription import Ended, Subscription

__all__ = ["Receiver"]

STOP_BUDGET_S = 5.0
"""A stop ends the receiver within this long, whatever signal-cli or the store do."""

_WHY: dict[Ended, str] = {
    "unreachable": "signal-cli is unreachable",
    "subscribe_failed": "subscribeReceive failed",
    "eof": "signal-cli closed the connection",
    "broken": "the connection broke",
    "oversized": "signal-cli sent an oversized frame",
    "malformed": "signal-cli sent a malformed frame",
    "writer_lost": "the journal does not take writes; not receiving meanwhile",
}


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
    _stop: Interrupts = attrs.field(factory=Interrupts, init=False)
    _unadmitted: UnadmittedEvents = attrs.field(init=False)
    _subscription: Subscription = attrs.field(init=False)
    _failures: int = attrs.field(default=0, init=False)

    def __attrs_post_init__(self) -> None:
        self._unadmitted = UnadmittedEvents(
            connection_id=self.connection_id,
            admit=self.admit,
            inbox=self.inbox,
            status=self.status,
            stop=self._stop,
            random=self.random,
            reconnect_delay_s=self.reconnect_delay_s,
            max_reconnect_delay_s=self.max_reconnect_delay_s,
        )
        self._subscription = Subscription(
            connection_id=self.connection_id,
            lease=self.lease,
            filter=self.filter,
            unadmitted=self._unadmitted,
            status=self.status,
            stop=self._stop,
            timeout_s=self.timeout_s,
            max_frame_bytes=self.max_frame_bytes,
            max_pending_requests=self.max_pending_requests,
            max_pending_events=self.max_pending_events,
        )

    # ------------------------------------------------------------------ run

    async def run(self, task_status: trio.TaskStatus[None]) -> bool:
        """Receive until cancelled; True when it stopped for an account mismatch.

        Cancellation is turned into a graceful stop (see the module docstring), bounded by
        :data:`STOP_BUDGET_S`.
        """
        started = _Started(task_status)
        self._stop.stopped = False
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
            self._stop.stop()
            hard.deadline = min(hard.deadline, trio.current_time() + STOP_BUDGET_S)

    async def _run(self, started: _Started) -> None:
        self.status.state = "starting"
        try:
            while not self._stop.stopped and not self.filter.mismatched:
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
            with self._stop.interruptible() as scope:
                try:
                    await self.lease.acquire(on_standby=standby)
                    return True
                except Exception as exc:
                    await trio.sleep(
                        self._back_off(backoff, "acquiring the receiver lease failed", exc)
                    )
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
        await self._unadmitted.replay()
        while not self._stop.stopped:
            await self._unadmitted.settle()
            if self._stop.stopped or self.filter.mismatched:
                return
            self.lease.check()
            if not await self._probe_or_wait(backoff):
                continue
            ended, stable = await self._session(started)
            if ended == "account_mismatch" or self.filter.mismatched:
                self.filter.mismatched = True
                await self._unadmitted.settle()
                return
            if ended == "stopped":
                return
            if stable:
                backoff.reset()
            if ended == "admission":
                continue  # UnadmittedEvents.settle paces the retries
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
            with self._stop.interruptible():
                await self.lease.sleep(delay)

    async def _finish(self) -> None:
        with trio.move_on_after(STOP_BUDGET_S, shield=True):
            await self._unadmitted.persist()
            await self._unadmitted.flush_removals()
            await self.lease.release()
        self.status.bridge = "unavailable"
        self.status.subscription = "inactive"
        self.status.state = "account_mismatch" if self.filter.mismatched else "stopped"

    # ------------------------------------------------------------------ readiness

    def _back_off(self, backoff: Backoff, what: str, exc: Exception, then: str = "") -> float:
        """Wait ``backoff``'s next delay after ``what`` failed with ``exc`` (its type named
        in the log, never its text): the state is ``backoff``; the delay."""
        delay = backoff.next_delay()
        self.status.state = "backoff"
        log.warning(
            "signal %s: %s (%s); %sretry in %.1f s",
            self.connection_id,
            what,
            type(exc).__name__,
            then,
            delay,
        )
        return delay

    async def _probe_or_wait(self, backoff: Backoff) -> bool:
        """True once the probe was written; False after a failure (waited) or a stop."""
        try:
            with self._stop.interruptible() as scope, self.lease.guard():
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
            delay = self._back_off(backoff, "readiness probe failed", exc, "not subscribing; ")
            with self._stop.interruptible():
                await self.lease.sleep(delay)
            return False

    # ------------------------------------------------------------------ one connection

    async def _connect(self) -> trio.abc.Stream | None:
        stream: trio.abc.Stream | None = None
        self.status.state = "connecting"
        try:
            with self._stop.interruptible(), self.lease.guard():
                stream = await self.endpoint.connect(self.timeout_s)
        except SignalUnreachableError as exc:
            log.debug("signal %s: connect failed (%s)", self.connection_id, exc.cause_name)
            return None
        except LeaseLostError:
            if stream is not None:
                await trio.aclose_forcefully(stream)
            raise
        if stream is not None and self._stop.stopped:
            await trio.aclose_forcefully(stream)
            return None
        return stream

    async def _session(self, started: _Started) -> tuple[Ended, bool]:
        """Connect and run one subscription: why it ended, and whether it was stable."""
        stream = await self._connect()
        if stream is None:
            return ("stopped" if self._stop.stopped else "unreachable"), False
        return await self._subscription.run(stream, lambda: self._subscribed(started))

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
