"""One subscription on one connection to signal-cli: subscribe, take what it sends (journal
on receipt, then admit in order), wind down. See :mod:`._receive` for the whole story."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Literal, TypeAlias

import attrs
import trio

from prismd.channel import InboundEvent
from prismd.jsonrpc import Incoming

from ..toolkit import (
    Interrupts,
    JsonRpcClient,
    JsonRpcConnectionError,
    JsonRpcTimeoutError,
    LeaseLostError,
    ReceiverLease,
    RpcError,
    open_jsonrpc_client,
)
from ._filter import NotificationFilter
from ._held import PERSIST_S, UnadmittedEvents
from ._parse import read_notification
from ._status import SignalStatus, log

__all__ = ["MAX_BATCH", "MAX_UNADMITTED", "Ended", "Subscription"]

WIND_DOWN_S = 2.0
"""Bound on unsubscribing and taking what was already sent."""
STABLE_S = 30.0
"""A subscription that lasted this long resets the reconnect backoff."""
MAX_BATCH = 64
"""At most this many notifications are journaled together (and removed together)."""
MAX_UNADMITTED = 256
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


@attrs.define(eq=False)
class _Intake:
    """What the two intake tasks of one subscription share: why it ends (the first reason
    wins), the read waits to cut short then, and the wake-ups between them."""

    ended: Ended | None = None
    admitted: trio.Event = attrs.field(factory=trio.Event)
    """Set (and replaced) whenever an event was admitted, or when the intake ends."""
    _work: trio.Event = attrs.field(factory=trio.Event)
    _reading: Interrupts = attrs.field(factory=Interrupts)

    def end(self, reason: Ended) -> None:
        if self.ended is None:
            self.ended = reason
        self._reading.stop()
        self._work.set()
        self.admitted.set()

    def reading(self) -> contextlib.AbstractContextManager[trio.CancelScope]:
        """A wait for signal-cli that :meth:`end` cuts short (at once once it ended)."""
        return self._reading.interruptible()

    def work(self) -> None:
        self._work.set()

    async def wait_for_work(self) -> None:
        await self._work.wait()
        self._work = trio.Event()

    def progress(self) -> None:
        self.admitted.set()
        self.admitted = trio.Event()


@attrs.define(eq=False, kw_only=True)
class Subscription:
    """The receiver's parts a subscription works with; :meth:`run` is one subscription."""

    connection_id: str
    lease: ReceiverLease
    filter: NotificationFilter
    unadmitted: UnadmittedEvents
    status: SignalStatus
    stop: Interrupts
    timeout_s: float
    max_frame_bytes: int
    max_pending_requests: int
    max_pending_events: int

    async def run(
        self, stream: trio.abc.Stream, on_subscribed: Callable[[], None]
    ) -> tuple[Ended, bool]:
        """Subscribe on ``stream``, take notifications, wind down: why it ended, and
        whether the subscription lasted :data:`STABLE_S`. Raises
        :class:`~adapters.toolkit.LeaseLostError` when it ended for a lost lease."""
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
                on_subscribed()
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
                with self.stop.interruptible(), intake.reading(), self.lease.guard():
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
            while len(self.unadmitted) >= MAX_UNADMITTED and intake.ended is None:
                # Admission is behind: stop reading (signal-cli's writes then block) rather
                # than hold without bound.
                with self.stop.interruptible(), intake.reading():
                    await intake.admitted.wait()

    async def _admit_loop(self, intake: _Intake) -> None:
        while intake.ended is None:
            if self.stop.stopped:
                intake.end("stopped")
                return
            if not self.unadmitted:
                await self.unadmitted.flush_removals()
                with self.stop.interruptible():
                    await intake.wait_for_work()
                continue
            item = self.unadmitted.head
            if not await self.unadmitted.admit_once(item.event):
                intake.end("admission")
                return
            self.unadmitted.admitted(item)
            intake.progress()
            if self.unadmitted.removals >= MAX_BATCH:
                await self.unadmitted.flush_removals()
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
        return await self.unadmitted.keep(events)

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
        await self.unadmitted.persist()


def _first_subscription(notes: list[Incoming]) -> int | None:
    for note in notes:
        parsed = read_notification(note.params) if note.method == "receive" else None
        if parsed is not None and parsed.subscription is not None:
            return parsed.subscription
    return None
