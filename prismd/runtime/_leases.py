"""Route (binding) leases: who may write a conversation's records (SPEC differences 1, 2, 8).

The lease key is the binding key (it includes the thread and the ownership scope). A
route acquires its lease for its first turn, keeps it across back-to-back turns (renewed
below a third of the TTL while it works) and releases it once it stayed idle for
``lease_idle_ms``, or at once when the runtime stops. Fail-closed: a lease whose release
failed is kept in memory and released again later, never treated as free.

:class:`LoggedLeases` writes a DEBUG line for each binding lease decision: every binding
lease call of the runtime goes through it (``Core.leases``), logging each outcome:
``acquired`` / ``held elsewhere``, ``renewed`` / ``lost``, ``released``. A lease that expired
before its renewal was due is never renewed (the runtime acquires again): the wrapper
remembers the keys it saw acquired, so that re-acquisition is logged ``lost`` first. Routes
are named by :func:`route_tag` (a hash): keys hold chat and actor ids, tokens are never
logged.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio

from stores import LeaseRecord, LeaseStore

from ..journal import NS_BINDING
from ..limits import Limits
from ._routes import Route

log = logging.getLogger("prismd.runtime")

LEASE_BACKOFF_START_S = 0.05
LEASE_BACKOFF_MAX_S = 2.0
DEFAULT_LEASE_IDLE_MS = 1_000


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


class LeaseHeldElsewhereError(Exception):
    """The route's binding lease is held by another owner right now."""


@attrs.define(eq=False)
class RouteLeases:
    """The binding leases of one runtime (``store=None``: leasing is off)."""

    store: LeaseStore | None
    limits: Limits
    owner_id: str
    nursery: trio.Nursery
    now_ms: Callable[[], int]
    count: Callable[[str], None]
    adopt: bool = False
    lease_idle_ms: int = DEFAULT_LEASE_IDLE_MS
    on_released: Callable[[Route], None] | None = None
    """Told of each route whose lease was released (the route table: a route left with a
    parked turn alone is released too, :meth:`~._routes.Routes.release`)."""

    @property
    def enabled(self) -> bool:
        return self.store is not None

    async def ensure(self, route: Route) -> LeaseRecord | None:
        """The route's binding lease, acquired or renewed; ``None`` when held elsewhere.

        Store errors propagate. The lease key is the binding key, so it includes the
        thread and the ownership scope (SPEC difference 2).
        """
        assert self.store is not None
        await acquire_promptly(route.lease_lock)
        try:
            lease = route.lease
            ttl = self.limits.lease_ttl_ms
            if lease is not None:
                remaining = lease.expires_at_ms - self.now_ms()
                if remaining >= ttl / 3:
                    return lease
                renewed = None
                if remaining > 0:
                    renewed = await self.store.renew_lease(
                        namespace=NS_BINDING,
                        key=route.binding_key,
                        scope=route.scope,
                        owner_id=self.owner_id,
                        token=lease.token,
                        ttl_ms=ttl,
                    )
                if renewed is not None:
                    route.lease = renewed
                    return renewed
                route.lease = None
                self.count("lease_losses")
            acquired = await self.store.try_acquire_lease(
                namespace=NS_BINDING,
                key=route.binding_key,
                scope=route.scope,
                owner_id=self.owner_id,
                ttl_ms=ttl,
                adopt=self.adopt,
            )
            route.lease = acquired
            if acquired is not None:
                route.lease_fresh = True
            if acquired is not None and route.renewer is None:
                route.renewer = trio.CancelScope()
                self.nursery.start_soon(self._renewer, route, route.renewer)
            return acquired
        finally:
            route.lease_lock.release()

    async def _renewer(self, route: Route, scope: trio.CancelScope) -> None:
        """Keep the route lease alive while the route has work (renew below ttl/3)."""
        ttl = self.limits.lease_ttl_ms
        try:
            with scope:
                await self._renew(route, ttl)
        finally:
            if route.renewer is scope:
                route.renewer = None

    async def _renew(self, route: Route, ttl: int) -> None:
        while route.lease is not None and (route.working or route.lease_users > 0):
            lease = route.lease
            wait_ms = lease.expires_at_ms - self.now_ms() - ttl / 3
            await trio.sleep(max(0.01, wait_ms / 1000))
            if route.lease is not lease or not (route.working or route.lease_users > 0):
                continue
            try:
                await self.ensure(route)
            except Exception:
                self.count("storage_failures")
                await trio.sleep(min(1.0, ttl / 10_000))

    async def release_when_idle(self, route: Route) -> None:
        """Release the route lease once the route has stayed idle for ``lease_idle_ms`` (at
        most a third of the TTL, so the idle lease never needs a renewal): a busy
        conversation keeps its lease across turns instead of releasing and re-acquiring it
        around each message. ``stop()`` releases at once."""
        if self.store is None or route.lease is None:
            return
        grace = min(self.lease_idle_ms, self.limits.lease_ttl_ms / 3) / 1000
        scheduled = route.release_at is not None
        route.release_at = trio.current_time() + grace
        if grace <= 0:
            route.release_at = None
            await self.release_if_idle(route)
        elif not scheduled:
            self.nursery.start_soon(self._release_later, route)

    async def _release_later(self, route: Route) -> None:
        try:
            # Each new idle moment moves ``release_at``: sleep until the latest one.
            while True:
                due = route.release_at
                if due is None or trio.current_time() >= due:
                    break
                await trio.sleep_until(due)
        finally:
            # Also when the runtime is torn down meanwhile (shielded, bounded inside).
            route.release_at = None
            await self.release_if_idle(route)

    async def release_if_idle(self, route: Route, *, force: bool = False) -> None:
        """Release the route lease when nothing uses it (``force``: at stop, whatever still
        runs); fail-closed on a store error."""
        if self.store is None or route.lease is None:
            return
        # Under the lease lock, so a turn admitted meanwhile cannot pick up the lease
        # that is being released (it waits, then acquires a fresh one).
        with trio.CancelScope(shield=True, relative_deadline=5):
            async with route.lease_lock:
                lease = route.lease
                if lease is None or (not force and (route.working or route.lease_users > 0)):
                    return
                try:
                    await self.store.release_lease(
                        namespace=NS_BINDING,
                        key=route.binding_key,
                        scope=route.scope,
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
                    # Idle now: the copy kept to skip unchanged binding writes goes too
                    # (the next turn writes the binding in its terminal transaction).
                    route.binding_stored = None
                    if route.renewer is not None:
                        route.renewer.cancel()
                        route.renewer = None
            route.shed_locks()
            if self.on_released is not None and route.lease is None:
                self.on_released(route)

    @asynccontextmanager
    async def fence(self, route: Route, *, wait_s: float = 0.0) -> AsyncIterator[int | None]:
        """Hold the route lease for writes made outside a queued turn; yields its fence.

        Without leases yields ``None``. When the lease is held elsewhere it retries with
        bounded backoff for up to ``wait_s`` seconds, then raises
        :class:`LeaseHeldElsewhereError`.
        """
        if self.store is None:
            yield None
            return
        route.lease_users += 1
        try:
            delay = LEASE_BACKOFF_START_S
            waited = 0.0
            while True:
                lease = await self.ensure(route)
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

    def fence_now(self, route: Route) -> int | None:
        return None if route.lease is None else route.lease.fencing_token

    def holding(self, route: Route, fence: int | None) -> Callable[[], bool] | None:
        """For writes and sends made under ``fence``: a check that the route still holds
        the lease it came from, unexpired by this process's clock (``None`` without leases
        or without a fence). A process stopped past its lease's expiry (SIGSTOP, a long
        pause) fails it on waking, whatever it was doing; the store's fence check alone
        would still accept writes to rows no newer holder touched."""
        if self.store is None or fence is None:
            return None

        def held() -> bool:
            lease = route.lease
            return (
                lease is not None
                and lease.fencing_token == fence
                and lease.expires_at_ms > self.now_ms()
            )

        return held


# --------------------------------------------------------------------------- lease log


def route_tag(binding_key: str) -> str:
    """12 hex of SHA-256 of a binding key: names a route in logs."""
    return hashlib.sha256(binding_key.encode("utf-8", "surrogatepass")).hexdigest()[:12]


@attrs.define(eq=False)
class LoggedLeases:
    """A :class:`~stores.LeaseStore` that logs each binding lease decision at DEBUG."""

    inner: LeaseStore
    _held: set[str] = attrs.field(factory=set, init=False)

    # Each call takes the lease store's keyword arguments unchanged.

    async def try_acquire_lease(self, **call: Any) -> LeaseRecord | None:
        lease = await self.inner.try_acquire_lease(**call)
        key = call["key"]
        if key in self._held:
            self._lost(key, "expired before renewal")
        if lease is not None:
            self._held.add(key)
        log.debug(
            "binding lease %s: route %s",
            "acquired" if lease is not None else "held elsewhere",
            route_tag(key),
        )
        return lease

    async def renew_lease(self, **call: Any) -> LeaseRecord | None:
        lease = await self.inner.renew_lease(**call)
        if lease is None:
            self._lost(call["key"], "not renewable")
        else:
            log.debug("binding lease renewed: route %s", route_tag(call["key"]))
        return lease

    async def release_lease(self, **call: Any) -> bool:
        released = await self.inner.release_lease(**call)
        self._held.discard(call["key"])
        log.debug(
            "binding lease %s: route %s",
            "released" if released else "already gone at release",
            route_tag(call["key"]),
        )
        return released

    async def get_lease(self, **call: Any) -> LeaseRecord | None:
        return await self.inner.get_lease(**call)

    def _lost(self, key: str, why: str) -> None:
        self._held.discard(key)
        log.debug("binding lease lost (%s): route %s", why, route_tag(key))
