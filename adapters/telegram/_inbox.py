"""The durable webhook inbox: updates committed before the 2xx, admitted by leased workers.

With ``webhook_inbox`` on, every instance serving a bot's webhook hands each valid update to
:func:`put_update` — one row in the store's inbox (:class:`stores.InboxStore`), deduplicated
on (connection, ``update_id``) — and answers 2xx only once that row is committed. An
:class:`InboxWorker` on every instance then reserves rows and admits them through the runtime:

* **Reservations are leases.** A reservation holds its row for ``reservation_ttl_ms`` and is
  renewed at a third of that while the update is processed; a worker that dies lets its
  reservations expire and
  another instance's worker takes them over — or the same instance restarted (``adopt``:
  its owner id is its state directory's), which takes them up at once. Concurrent workers
  never get the same row (``FOR UPDATE SKIP LOCKED`` on PostgreSQL).
* **Acknowledged only after the journal.** A row is settled ``done`` only after ``admit``
  returned a final answer, i.e. after the operation record was committed (or the update was
  a duplicate, or nothing to admit). A crash between that commit and the settle redelivers
  the row: the operation's create-only record makes the second admission a duplicate.
* **Per-conversation order.** The rows of one chat form one partition, handed out in
  ``update_id`` order, one at a time. While this instance's runtime still works on the chat
  (a turn queued or running, or its route lease held — :meth:`Runtime.busy_conversations`),
  the settled row keeps the partition for this worker, so the chat's next updates
  are admitted here, behind the earlier ones, instead of racing them on another instance.
  Once the runtime lets the conversation go, the partition is released and any instance may take
  the next update. (After a crash, a message acknowledged but never started waits for a
  restart — see docs/operating.md — while later ones go on: order is kept while instances live.)
* **Bounded retries.** A retryable admission (``capacity``, ``unavailable``) or a failure
  puts the row back with exponential backoff and jitter (1 s … 60 s); after
  :data:`MAX_ATTEMPTS` attempts (reservations that expired with their worker count too) it is a
  dead letter, kept with its update and listed by ``prismctl list-inbox`` until an operator
  retries or discards it. Never retried forever, never dropped.

Nothing here logs an update's content or a user's or chat's id; an update id and a reason
code are all a log line carries.
"""

from __future__ import annotations

import logging
import random as _random
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import trio

from prismd.channel import AdapterFatalError
from stores import InboxReservation, InboxStore

from ..toolkit import Backoff
from ._updates import UpdateHandler, conversation_of, update_id_of

log = logging.getLogger("prismd.telegram")

MAX_ATTEMPTS = 10
"""Attempts before a row becomes a dead letter (reservations count, so a row that keeps killing
its worker ends there too)."""
RETRY_BASE_S = 1.0
RETRY_CAP_S = 60.0
IDLE_POLL_S = 0.25
"""How often an idle worker looks for ready rows (an update this instance received wakes
it at once; another instance's wakes it within this)."""
KEPT_POLL_S = 0.1
"""How often held conversations are checked for being let go."""
CONCURRENCY = 16
"""Rows one worker processes at once (different chats; one chat is one at a time)."""
STORE_BACKOFF_CAP_S = 5.0
LOG_EVERY_S = 30.0
CLOSE_BUDGET_S = 2.0

BusyConversations = Callable[[str], frozenset[str]]


def partition_of(update: Mapping[str, Any]) -> str:
    """The chat whose order the update keeps, or a partition of its own when it has none."""
    conversation = conversation_of(update)
    if conversation is not None:
        return f"chat:{conversation}"
    return f"update:{update_id_of(update)}"


async def put_update(inbox: InboxStore, connection_id: str, update: Mapping[str, Any]) -> bool:
    """Commit ``update`` (already validated: an object with an ``update_id``) to the inbox;
    ``False`` when it was there already (a redelivery). Store errors propagate."""
    update_id = update_id_of(update)
    assert update_id is not None
    return await inbox.put(
        source=connection_id,
        key=str(update_id),
        partition=partition_of(update),
        order=update_id,
        payload=dict(update),
    )


@attrs.define(eq=False)
class _KeptPartition:
    reservation: InboxReservation
    conversation: str
    renew_at: float


@attrs.frozen
class InboxStatistics:
    admitted: int
    retried: int
    dead: int
    store_failures: int


@attrs.define(eq=False, kw_only=True)
class InboxWorker:
    """Reserves this connection's inbox rows and admits them (see the module docstring)."""

    connection_id: str
    inbox: InboxStore
    updates: UpdateHandler
    owner_id: str = attrs.field(repr=False)
    reservation_ttl_ms: int
    busy_conversations: BusyConversations | None = None
    """This instance's runtime: the conversations it still works on (``None``: none kept)."""
    adopt: bool = False
    """``owner_id`` is this instance's alone (its state directory's lock): rows it still has
    reserved when ``run`` starts were reserved by a process (or a ``run``) that is gone, and
    are taken up at once instead of after their reservations' time."""
    random: _random.Random = attrs.field(factory=_random.Random, repr=False)
    concurrency: int = CONCURRENCY
    max_attempts: int = MAX_ATTEMPTS
    retry_base_s: float = RETRY_BASE_S
    retry_cap_s: float = RETRY_CAP_S
    idle_poll_s: float = IDLE_POLL_S
    _wake: trio.Event = attrs.field(factory=trio.Event, init=False)
    _kept: dict[str, _KeptPartition] = attrs.field(factory=dict, init=False)
    _stopping: bool = attrs.field(default=False, init=False)
    _admitted: int = attrs.field(default=0, init=False)
    _retried: int = attrs.field(default=0, init=False)
    _dead: int = attrs.field(default=0, init=False)
    _store_failures: int = attrs.field(default=0, init=False)
    _quiet_until: float = attrs.field(default=float("-inf"), init=False)

    def wake(self) -> None:
        """A row was just committed here: look for work now instead of at the next poll."""
        self._wake.set()

    def statistics(self) -> InboxStatistics:
        return InboxStatistics(self._admitted, self._retried, self._dead, self._store_failures)

    @property
    def held(self) -> int:
        """Conversations whose next updates are kept for this worker now."""
        return len(self._kept)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Reserve and process rows until cancelled; on the way out, hand back what is held."""
        self._stopping = False
        slots = trio.Semaphore(self.concurrency)
        if self.adopt:
            await self._expire_own_reservations()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._renew_kept)
                task_status.started()
                await self._reserve_loop(nursery, slots)
        finally:
            with trio.move_on_after(CLOSE_BUDGET_S, shield=True):
                await self._release_all()

    async def _expire_own_reservations(self) -> None:
        try:
            expired = await self.inbox.expire_own_reservations(
                owner_id=self.owner_id, sources=[self.connection_id]
            )
        except Exception as exc:
            # Not needed for correctness: those reservations run out by themselves.
            self._store_failure("taking up this instance's earlier reservations", exc)
            return
        if expired:
            log.info(
                "telegram %s: %d inbox row(s) reserved before a restart taken up again",
                self.connection_id,
                expired,
            )

    async def _reserve_loop(self, nursery: trio.Nursery, slots: trio.Semaphore) -> None:
        failures = Backoff(self.random, base_s=0.2, cap_s=STORE_BACKOFF_CAP_S)
        while True:
            if self._stopping:
                await trio.sleep_forever()  # the runtime stopped: the daemon is going down
            free = slots.value
            if free == 0:
                async with slots:  # wait until one row is done
                    pass
                continue
            self._wake = trio.Event()
            try:
                reservations = await self.inbox.reserve(
                    owner_id=self.owner_id,
                    ttl_ms=self.reservation_ttl_ms,
                    limit=free,
                    max_attempts=self.max_attempts,
                    sources=[self.connection_id],
                )
            except Exception as exc:
                self._store_failure("reserving inbox rows", exc)
                await trio.sleep(failures.next_delay())
                continue
            failures.reset()
            for reservation in reservations:
                await slots.acquire()
                nursery.start_soon(self._process, reservation, slots)
            if not reservations:
                with trio.move_on_after(self.idle_poll_s):
                    await self._wake.wait()

    # ------------------------------------------------------------------ one row

    async def _process(self, reservation: InboxReservation, slots: trio.Semaphore) -> None:
        try:
            update = reservation.item.payload
            if not isinstance(update, Mapping) or update_id_of(update) is None:
                # Never admissible: straight to the dead letters (kept for the operator).
                await self._retry(reservation, "malformed", dead=True)
                return
            reason: str | None = "stopped"
            try:
                async with trio.open_nursery() as keeper:
                    keeper.start_soon(self._keep_reservation, reservation)
                    try:
                        reason = await self.updates.admit_update(update, strict=True)
                    except AdapterFatalError:
                        raise
                    except Exception as exc:
                        reason = f"failed ({type(exc).__name__})"
                    keeper.cancel_scope.cancel()
            except trio.Cancelled:
                # The worker is stopping: hand the row back at once (an admission that
                # committed meanwhile makes the next one a duplicate) rather than leave it
                # reserved until its reservation expires.
                with trio.move_on_after(CLOSE_BUDGET_S, shield=True):
                    await self._retry(reservation, "stopped", delay_s=0.0)
                raise
            if reason is None:
                await self._complete(reservation, update)
            elif reason == "stopped":
                # The runtime is stopping: hand the row back for whoever runs next.
                self._stopping = True
                await self._retry(reservation, reason, delay_s=0.0)
            else:
                await self._retry(reservation, reason)
        finally:
            slots.release()

    async def _keep_reservation(self, reservation: InboxReservation) -> None:
        """Renew the reservation at a third of its TTL while its update is being admitted."""
        period = self.reservation_ttl_ms / 3000
        while True:
            await trio.sleep(period)
            try:
                renewed = await self.inbox.extend(reservation, ttl_ms=self.reservation_ttl_ms)
            except Exception as exc:
                self._store_failure("renewing an inbox reservation", exc)
                continue
            if renewed is None:
                return  # taken over: the admission is a duplicate for the new holder anyway

    def _still_busy(self, conversation: str | None) -> bool:
        busy = self.busy_conversations
        return (
            conversation is not None
            and busy is not None
            and conversation in busy(self.connection_id)
        )

    async def _complete(self, reservation: InboxReservation, update: Mapping[str, Any]) -> None:
        conversation = conversation_of(update)
        kept = self._still_busy(conversation)
        try:
            done = await self.inbox.complete(
                reservation, keep_partition_ms=self.reservation_ttl_ms if kept else 0
            )
        except Exception as exc:
            # Still reserved: it expires and is admitted again, as a duplicate.
            self._store_failure("settling an inbox row", exc)
            return
        if not done:
            return  # taken over meanwhile; the new holder settles it
        self._admitted += 1
        if kept:
            assert conversation is not None
            partition = reservation.item.partition
            previous = self._kept.get(partition)
            self._kept[partition] = _KeptPartition(
                reservation, conversation, trio.current_time() + self.reservation_ttl_ms / 3000
            )
            if previous is not None:
                await self._release(previous.reservation)

    async def _retry(
        self,
        reservation: InboxReservation,
        reason: str,
        *,
        delay_s: float | None = None,
        dead: bool = False,
    ) -> None:
        if delay_s is None:
            exponent = min(max(reservation.item.attempts - 1, 0), 16)
            delay_s = min(self.retry_cap_s, self.retry_base_s * 2.0**exponent)
            delay_s *= 0.5 + self.random.random() / 2
        most = reservation.item.attempts if dead else self.max_attempts
        try:
            item = await self.inbox.retry(
                reservation, delay_ms=int(delay_s * 1000), error=reason, max_attempts=most
            )
        except Exception as exc:
            self._store_failure("retrying an inbox row", exc)
            return
        if item is None:
            return
        if item.state == "dead":
            self._dead += 1
            log.warning(
                "telegram %s: update %s is a dead letter after %d attempt(s) (%s);"
                " `prismctl inbox` lists it",
                self.connection_id,
                item.key,
                item.attempts,
                reason,
            )
            return
        self._retried += 1
        log.debug(
            "telegram %s: update %s not admitted (%s); retry in %.1f s",
            self.connection_id,
            item.key,
            reason,
            delay_s,
        )

    # ------------------------------------------------------------------ kept partitions

    async def _renew_kept(self) -> None:
        """Release a held conversation once the runtime let it go; renew the others."""
        while True:
            await trio.sleep(KEPT_POLL_S)
            if not self._kept or self.busy_conversations is None:
                continue
            busy = self.busy_conversations(self.connection_id)
            for partition, kept in list(self._kept.items()):
                if kept.conversation not in busy:
                    if self._kept.get(partition) is kept:
                        del self._kept[partition]
                    await self._release(kept.reservation)
                elif trio.current_time() >= kept.renew_at:
                    await self._renew(partition, kept)

    async def _renew(self, partition: str, kept: _KeptPartition) -> None:
        try:
            renewed = await self.inbox.extend(kept.reservation, ttl_ms=self.reservation_ttl_ms)
        except Exception as exc:
            self._store_failure("renewing a kept partition", exc)
            kept.renew_at = trio.current_time() + 1.0
            return
        if renewed is None:
            self._kept.pop(partition, None)
            return
        kept.reservation = renewed
        kept.renew_at = trio.current_time() + self.reservation_ttl_ms / 3000

    async def _release(self, reservation: InboxReservation) -> None:
        try:
            await self.inbox.release(reservation)
        except Exception as exc:
            # The kept partition is released on its own after reservation_ttl_ms.
            self._store_failure("releasing a kept partition", exc)

    async def _release_all(self) -> None:
        kept_now, self._kept = self._kept, {}
        for kept in kept_now.values():
            await self._release(kept.reservation)

    def _store_failure(self, what: str, exc: BaseException) -> None:
        """Counted always, logged at most once per :data:`LOG_EVERY_S` (an outage fails every
        call of every worker)."""
        self._store_failures += 1
        now = trio.current_time()
        if now < self._quiet_until:
            return
        self._quiet_until = now + LOG_EVERY_S
        log.warning(
            "telegram %s: %s failed (%s); %d inbox store failure(s) so far",
            self.connection_id,
            what,
            type(exc).__name__,
            self._store_failures,
        )
