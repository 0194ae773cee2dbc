"""What every receiver needs around its transport: its lease, paced retries, waits that one
call cuts short, and what it last saw.

* :class:`ReceiverLease` — one receiver per bot or account, whichever daemon runs it (below);
* :class:`Backoff` — the one bounded exponential backoff with jitter every adapter retries by;
* :class:`Interrupts` — waits (a long poll, a backoff) that one call cancels: a lost lease,
  a stop;
* :class:`Activity` — when a message last reached the adapter and the last error of its
  receiving side, for ``health()`` and ``prismctl health`` (a cause class, never a URL, a
  token or a message's text).

**The receiver lease.** A receiver (Telegram's poller or webhook server, Signal's client,
a Discord shard) may consume its transport only while it holds a service-owned lease in the
store. :class:`ReceiverLease` does what every receiver needs around that lease:

* **acquire** — :meth:`~ReceiverLease.try_acquire` once, or :meth:`~ReceiverLease.acquire`
  until it is ours (standing by with bounded exponential backoff while another receiver
  holds it). With ``adopt=True`` a lease left by this daemon's own predecessor (same
  stable owner id) is taken over at once instead of after its TTL (SPEC difference 8);
  every acquisition bumps the fencing token all the same.
* **renew at half the TTL** — :meth:`~ReceiverLease.keep` runs beside the receiver. A renewal
  the store refuses means the lease is gone; a renewal that fails (a store error) is retried
  with backoff, but only while the lease is still surely valid.
* **fail closed** — once the lease is refused, or can no longer be proven ours before its
  expiry (counted from the start of the last successful write, so never late), it is lost:
  :attr:`~ReceiverLease.held` turns false, every :meth:`~ReceiverLease.guard` region is
  cancelled, :meth:`~ReceiverLease.check` raises :class:`LeaseLostError` and
  :meth:`~ReceiverLease.keep` returns. The caller stops receiving; what it wrote is fenced
  by :attr:`~ReceiverLease.fencing_token`, so a write after a takeover is refused anyway.
* **release** — :meth:`~ReceiverLease.release` when the receiver stops, so a standby
  daemon takes over without waiting for the TTL; a failed release is only logged (the
  lease expires on its own).
* **tell** — each time the lease becomes ours or stops being ours (acquired, lost,
  released) the :class:`LeaseWatch` it was given is told, so whoever waits for the adapter
  to hold its lease (or to lose it) wakes then, without polling ``held``.

Log lines (``<label>: receiver lease acquired | held by another receiver | renewed |
released`` at DEBUG, standing by at INFO, a failed renewal and the loss at WARNING) carry
the label and exception type names only: never the lease token or an owner id.

Typical use::

    await lease.acquire(on_standby=lambda: task_status.started())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lease.keep)
        while True:
            with lease.guard():          # cancelled when the lease is lost
                batch = await receive()
            for item in batch:
                await process(item)      # never cut short by a loss...
                lease.check()            # ...which is noticed before acknowledging
                await acknowledge(item, fencing_token=lease.fencing_token)
"""

from __future__ import annotations

import contextlib
import logging
import random as _random
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Protocol, TypeVar

import attrs
import trio

from stores import SYSTEM_CLOCK, Clock, LeaseRecord, LeaseStore, OwnershipScope, Store, ms_to_iso

__all__ = [
    "ACTIVITY_FIELDS",
    "Activity",
    "Backoff",
    "Interrupts",
    "LeaseLostError",
    "LeaseWatch",
    "ReceiverLease",
    "ReceivingAdapter",
    "connection_service_scope",
]

_E = TypeVar("_E")
_R = TypeVar("_R")


@attrs.define(eq=False)
class Backoff:
    """``base_s``, twice that, four times … up to ``cap_s``; each delay scaled by a random
    factor in [0.5, 1] so receivers that failed together do not retry together.

    :meth:`next_delay` counts a failure and returns the wait before the next try;
    :meth:`reset` after a success starts over at ``base_s``. Never a hot loop: every delay
    is at least ``base_s / 2``.

    >>> backoff = Backoff(_random.Random(1), base_s=1.0, cap_s=30.0)
    >>> [round(backoff.next_delay(), 2) for _ in range(3)]
    [0.57, 1.85, 3.53]
    """

    random: _random.Random = attrs.field(factory=_random.Random)
    base_s: float = attrs.field(default=1.0)
    cap_s: float = 30.0
    failures: int = attrs.field(default=0, init=False)

    @base_s.validator
    def _check(self, _a: object, value: float) -> None:
        if not 0 < value <= self.cap_s:
            raise ValueError("base_s must be positive and at most cap_s")

    def next_delay(self, minimum: float = 0.0) -> float:
        """The wait after one more failure (at least ``minimum``: a server's own spacing)."""
        delay = min(self.cap_s, self.base_s * 2.0**self.failures)
        # 2**16 times the base is past any sensible cap; stop counting there.
        self.failures = min(self.failures + 1, 16)
        return max(minimum, delay * (0.5 + self.random.random() / 2))

    def reset(self) -> None:
        self.failures = 0


@attrs.define(eq=False)
class Interrupts:
    """The regions (waits, mostly) open now that one call cancels all at once.

    :meth:`interrupt` cancels the regions open now; a region opened later runs. :meth:`stop`
    does the same and latches: a region opened after it is cancelled as it opens, until
    :attr:`stopped` is set back to ``False``. A region's scope says whether it was cut
    (``cancelled_caught``).
    """

    stopped: bool = False
    _open: set[trio.CancelScope] = attrs.field(factory=set, repr=False)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[trio.CancelScope]:
        """A region that :meth:`interrupt` and :meth:`stop` cancel."""
        scope = trio.CancelScope()
        if self.stopped:
            scope.cancel()
        self._open.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._open.discard(scope)

    def interrupt(self) -> None:
        for scope in self._open:
            scope.cancel()

    def stop(self) -> None:
        self.stopped = True
        self.interrupt()


MIN_TTL_MS = 1_000
EXPIRY_MARGIN_S = 0.05
"""A standby tries this long after the holder's lease is due to expire."""


class LeaseLostError(Exception):
    """The receiver lease was lost (expired or taken over); receiving must stop."""

    def __init__(self, message: str = "receiver lease lost") -> None:
        super().__init__(message)


def connection_service_scope(connection_id: str) -> OwnershipScope:
    """The scope a connection's own records (its receiver lease, offsets, inbox) live under
    when the adapter is given none."""
    return OwnershipScope(tenant_id="prismd-service", account_id=connection_id)


@attrs.define(eq=False)
class LeaseWatch:
    """Wakes the tasks waiting for an adapter's receiver leases to be held, or not: each
    :class:`ReceiverLease` given it calls :meth:`changed` when its lease is acquired,
    lost or released. One per adapter (a Discord adapter has a lease per shard)."""

    _changed: trio.Event = attrs.field(factory=trio.Event, init=False, repr=False)

    def changed(self) -> None:
        """A lease was acquired, lost or released: wake every waiter."""
        self._changed.set()
        self._changed = trio.Event()

    async def wait(self, held: Callable[[], bool], want: bool) -> None:
        """Return once ``held()`` is ``want`` (at once when it is now), asked again at
        each change."""
        await trio.lowlevel.checkpoint()
        while held() != want:
            await self._changed.wait()


class ReceivingAdapter(Protocol):
    """What :meth:`ReceiverLease.for_adapter` reads of an adapter (its own fields)."""

    connection_id: str
    store: Store
    owner_id: str
    lease_ttl_ms: int
    adopt: bool
    clock: Clock

    @property
    def service_scope(self) -> OwnershipScope: ...


@attrs.define(eq=False, kw_only=True)
class ReceiverLease:
    """One receiver lease (see the module docstring). Not reentrant: one receiver uses it."""

    leases: LeaseStore
    namespace: str
    key: str
    scope: OwnershipScope
    owner_id: str = attrs.field(repr=False)
    ttl_ms: int = attrs.field()
    adopt: bool = True
    label: str
    """Prefix of every log line, e.g. ``telegram tg-main`` (no secrets)."""
    log: logging.Logger = attrs.field(repr=False)
    random: _random.Random = attrs.field(factory=_random.Random, repr=False)
    clock: Clock = attrs.field(default=SYSTEM_CLOCK, repr=False)
    """The store's clock (lease expiry is its wall-clock time): a standby wakes when the
    holder's lease is due to expire."""
    _record: LeaseRecord | None = attrs.field(default=None, init=False, repr=False)
    _expires_at: float = attrs.field(default=0.0, init=False)
    """Local (Trio clock) moment by which the lease surely expired, if not renewed."""
    _renew_at: float = attrs.field(default=0.0, init=False)
    watch: LeaseWatch | None = attrs.field(default=None, repr=False)
    """Told each time :attr:`held` changes."""
    _lost: bool = attrs.field(default=False, init=False)
    _guards: Interrupts = attrs.field(factory=Interrupts, init=False, repr=False)

    @classmethod
    def for_adapter(
        cls,
        adapter: ReceivingAdapter,
        *,
        kind: str,
        namespace: str,
        log: logging.Logger,
        random: _random.Random,
        shard: tuple[int, int] | None = None,
        watch: LeaseWatch | None = None,
    ) -> ReceiverLease:
        """The receiver lease of ``adapter``'s connection: key ``r1:<connection id>`` in
        ``namespace``, under its service scope, logged as ``<kind> <connection id>``; for
        ``shard`` ``(index, count)``, one lease per shard: key ``r1:<connection id>:<index>``,
        logged as ``<kind> <connection id> shard <index>/<count>``; ``watch`` told when it
        is taken or lost."""
        index = "" if shard is None else f":{shard[0]}"
        of = "" if shard is None else f" shard {shard[0]}/{shard[1]}"
        return cls(
            leases=adapter.store.leases,
            namespace=namespace,
            key=f"r1:{adapter.connection_id}{index}",
            scope=adapter.service_scope,
            owner_id=adapter.owner_id,
            ttl_ms=adapter.lease_ttl_ms,
            adopt=adapter.adopt,
            label=f"{kind} {adapter.connection_id}{of}",
            log=log,
            random=random,
            clock=adapter.clock,
            watch=watch,
        )

    @ttl_ms.validator
    def _check_ttl(self, _a: object, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < MIN_TTL_MS:
            raise ValueError("ttl_ms must be an integer of at least 1000")

    @property
    def held(self) -> bool:
        """The lease is ours now (acquired, not lost, not released)."""
        return self._record is not None

    @property
    def fencing_token(self) -> int | None:
        """The fencing token of the held lease, for writes it guards (``None`` if not held)."""
        return None if self._record is None else self._record.fencing_token

    @property
    def _ttl_s(self) -> float:
        return self.ttl_ms / 1000

    # ------------------------------------------------------------------ acquire

    async def try_acquire(self) -> bool:
        """One attempt; True when the lease is ours now. Store errors propagate."""
        started = trio.current_time()
        record = await self.leases.try_acquire_lease(
            namespace=self.namespace,
            key=self.key,
            scope=self.scope,
            owner_id=self.owner_id,
            ttl_ms=self.ttl_ms,
            adopt=self.adopt,
        )
        self.log.debug(
            "%s: receiver lease %s",
            self.label,
            "acquired" if record is not None else "held by another receiver",
        )
        if record is None:
            return False
        self._hold(record, started)
        self._lost = False
        return True

    async def acquire(self, *, on_standby: Callable[[], None] | None = None) -> bool:
        """Wait until the lease is ours. Returns False when the first attempt got it, True
        when it had to stand by; ``on_standby`` is called once, when standing by begins.

        While another receiver holds it, retries with jittered exponential backoff from
        1 s up to a third of the TTL (so a released lease is taken within that), and right
        after the holder's lease is due to expire (so a dead holder is replaced within the
        TTL of its last renewal, not up to a third of a TTL later).
        """
        if await self.try_acquire():
            return False
        self.log.info("%s: another receiver holds the lease; standing by", self.label)
        if on_standby is not None:
            on_standby()
        backoff = Backoff(self.random, base_s=min(1.0, self._ttl_s / 3), cap_s=self._ttl_s / 3)
        while True:
            await trio.sleep(await self._standby_delay(backoff.next_delay()))
            if await self.try_acquire():
                return True

    async def _standby_delay(self, delay: float) -> float:
        """``delay``, or less: until just after the holder's lease is due to expire."""
        holder = await self.leases.get_lease(
            namespace=self.namespace, key=self.key, scope=self.scope
        )
        if holder is None:
            return delay  # gone meanwhile (or not ours to see): the backoff decides
        left = (holder.expires_at_ms - self.clock.now_ms()) / 1000
        if not 0 < left <= self._ttl_s:
            return delay  # a clock that does not match the store's: back off only
        return min(delay, left + EXPIRY_MARGIN_S)

    # ------------------------------------------------------------------ keep

    async def keep(self) -> None:
        """Renew at half the TTL while held; return once the lease is lost (or was never
        held). Runs beside the receiver, normally until cancelled."""
        backoff = Backoff(
            self.random, base_s=min(1.0, self._ttl_s / 20), cap_s=max(self._ttl_s / 10, 0.1)
        )
        while self._record is not None:
            await trio.sleep_until(self._renew_at)
            try:
                renewed = await self.renew()
            except Exception as exc:
                delay = backoff.next_delay()
                if trio.current_time() + delay >= self._expires_at:
                    # Not provable before it expires: behave as if it already had.
                    self._mark_lost()
                    return
                self.log.warning(
                    "%s: renewing the receiver lease failed (%s); retry in %.1f s",
                    self.label,
                    type(exc).__name__,
                    delay,
                )
                self._renew_at = trio.current_time() + delay
                continue
            if not renewed:
                return
            backoff.reset()

    async def renew(self) -> bool:
        """Renew now; False (and the lease lost) when the store refused. Store errors
        propagate with the lease still counted held until its expiry."""
        record = self._record
        if record is None:
            return False
        started = trio.current_time()
        renewed = await self.leases.renew_lease(
            namespace=self.namespace,
            key=record.key,
            scope=self.scope,
            owner_id=self.owner_id,
            token=record.token,
            ttl_ms=self.ttl_ms,
        )
        if self._record is not record:
            return self._record is not None  # released or lost meanwhile
        if renewed is None:
            self._mark_lost()
            return False
        self._hold(renewed, started)
        self.log.debug("%s: receiver lease renewed", self.label)
        return True

    # ------------------------------------------------------------------ guarding

    def check(self) -> None:
        """Raise :class:`LeaseLostError` unless the lease is held and surely valid."""
        if self._record is not None and trio.current_time() >= self._expires_at:
            self._mark_lost()  # keep() was not scheduled in time (a blocked loop)
        if self._record is None:
            raise LeaseLostError()

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """A region that may be cut short when the lease is lost (waiting for the
        transport, a backoff sleep); raises :class:`LeaseLostError` then."""
        self.check()
        with self._guards.interruptible():
            yield
        self.check()

    async def sleep(self, seconds: float) -> None:
        """``trio.sleep`` inside :meth:`guard`."""
        with self.guard():
            await trio.sleep(seconds)

    # ------------------------------------------------------------------ release

    async def release(self) -> None:
        """Give the lease back (nothing when not held). Never raises ``Exception``."""
        record, self._record = self._record, None
        if record is None:
            return
        self._tell()
        try:
            await self.leases.release_lease(
                namespace=self.namespace,
                key=record.key,
                scope=self.scope,
                owner_id=self.owner_id,
                token=record.token,
            )
        except Exception as exc:
            # it expires on its own; a release failure must not mask the exit reason
            self.log.debug(
                "%s: releasing the receiver lease failed (%s); it expires on its own",
                self.label,
                type(exc).__name__,
            )
            return
        self.log.debug("%s: receiver lease released", self.label)

    # ------------------------------------------------------------------ internals

    def _hold(self, record: LeaseRecord, started: float) -> None:
        taken = self._record is None
        self._record = record
        self._expires_at = started + self._ttl_s
        self._renew_at = started + self._ttl_s / 2
        if taken:
            self._tell()

    def _mark_lost(self) -> None:
        if self._record is None and self._lost:
            return
        self._record = None
        self._lost = True
        self.log.warning("%s: receiver lease lost (expired or taken over)", self.label)
        self._guards.interrupt()
        self._tell()

    def _tell(self) -> None:
        if self.watch is not None:
            self.watch.changed()


ACTIVITY_FIELDS = frozenset({"lastUpdateAt", "lastError", "lastErrorAt"})
"""The health fields :meth:`Activity.health_fields` adds: times and a cause, never metric
labels (their values would grow without bound)."""


@attrs.define(eq=False)
class Activity:
    """What a receiving adapter last saw: when a message last reached it, and the last
    error of its receiving side (a fixed word or an exception class)."""

    last_update_ms: int | None = None
    """When a message last reached the adapter (Unix ms)."""
    last_error: str | None = None
    last_error_ms: int | None = None

    def health_fields(self) -> Mapping[str, str]:
        """``lastUpdateAt``, ``lastError`` and ``lastErrorAt`` (ISO 8601), those known."""
        fields: dict[str, str] = {}
        if self.last_update_ms is not None:
            fields["lastUpdateAt"] = ms_to_iso(self.last_update_ms)
        if self.last_error is not None and self.last_error_ms is not None:
            fields["lastError"] = self.last_error
            fields["lastErrorAt"] = ms_to_iso(self.last_error_ms)
        return fields

    def seeing(self, admit: Callable[[_E], Awaitable[_R]]) -> Callable[[_E], Awaitable[_R]]:
        """``admit``, noting the time of each message handed to it (``lastUpdateAt``)."""

        async def noted(event: _E) -> _R:
            self.last_update_ms = time.time_ns() // 1_000_000
            return await admit(event)

        return noted

    def note_error(self, cause: str) -> None:
        """The receiving side failed: ``cause`` is a fixed word or an exception class."""
        self.last_error = cause
        self.last_error_ms = time.time_ns() // 1_000_000
