"""adapters.toolkit.ReceiverLease on a memory store in virtual time: acquire, renew at half
the TTL, take over our own predecessor's lease, stand by, fail closed, report loss."""

from __future__ import annotations

import itertools
import logging
import random
from typing import Any

import attrs
import pytest
import trio
from trio.testing import MockClock

from adapters.toolkit import LeaseLostError, LeaseWatch, ReceiverLease
from stores import OwnershipScope, StoreUnavailableError
from stores.memory import MemoryStore
from tests.support.clocks import TrioClock

NS = "prism.test.receiver"
KEY = "r1:conn"
SCOPE = OwnershipScope(tenant_id="prismd-service", account_id="conn")
LABEL = "test conn"
log = logging.getLogger("prismd.test.lease")


@attrs.define(eq=False)
class FlakyLeases:
    """The store's leases, with renewals that fail while ``failing`` is set (a store outage)."""

    inner: Any
    failing: bool = False
    renewals: list[float] = attrs.field(factory=list)

    async def try_acquire_lease(self, **kwargs: Any) -> Any:
        return await self.inner.try_acquire_lease(**kwargs)

    async def renew_lease(self, **kwargs: Any) -> Any:
        self.renewals.append(trio.current_time())
        if self.failing:
            await trio.sleep(0.5)
            raise StoreUnavailableError("store unreachable")
        return await self.inner.renew_lease(**kwargs)

    async def release_lease(self, **kwargs: Any) -> Any:
        if self.failing:
            raise StoreUnavailableError("store unreachable")
        return await self.inner.release_lease(**kwargs)

    async def get_lease(self, **kwargs: Any) -> Any:
        return await self.inner.get_lease(**kwargs)


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore(clock=TrioClock())


def make(leases: Any, owner: str = "daemon-a", **kwargs: Any) -> ReceiverLease:
    return ReceiverLease(
        leases=leases,
        namespace=NS,
        key=KEY,
        scope=SCOPE,
        owner_id=owner,
        ttl_ms=kwargs.pop("ttl_ms", 60_000),
        label=LABEL,
        log=log,
        random=random.Random(3),
        **kwargs,
    )


async def stored(store: MemoryStore) -> Any:
    return await store.leases.get_lease(namespace=NS, key=KEY, scope=SCOPE)


async def test_acquire_then_renew_at_half_the_ttl(
    autojump_clock: MockClock, store: MemoryStore
) -> None:
    leases = FlakyLeases(store.leases)
    lease = make(leases)
    assert not lease.held and lease.fencing_token is None
    assert await lease.acquire() is False  # got it at once: no standby
    assert lease.held and lease.fencing_token == 1
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lease.keep)
        await trio.sleep(125)
        nursery.cancel_scope.cancel()
    assert leases.renewals == [30.0, 60.0, 90.0, 120.0]
    row = await stored(store)
    assert row.owner_id == "daemon-a" and row.fencing_token == 1
    assert row.expires_at_ms == TrioClock().now_ms() - 5_000 + 60_000  # renewed at 120 s
    lease.check()  # still ours


async def test_our_predecessors_lease_is_taken_over_at_once(
    autojump_clock: MockClock, store: MemoryStore
) -> None:
    """SPEC difference 8: a restarted daemon (same stable owner id) does not wait the TTL,
    and the takeover still bumps the fencing token."""
    left = await store.leases.try_acquire_lease(
        namespace=NS, key=KEY, scope=SCOPE, owner_id="daemon-a", ttl_ms=60_000
    )
    assert left is not None
    successor = make(store.leases)
    assert await successor.acquire() is False
    assert trio.current_time() == 0
    assert successor.fencing_token == left.fencing_token + 1
    # without adopt (or another owner) it is a standby receiver
    for other in (make(store.leases, adopt=False), make(store.leases, owner="daemon-b")):
        assert not await other.try_acquire()


async def test_standby_takes_over_when_the_holder_releases(
    autojump_clock: MockClock, store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=log.name)
    holder, standby = make(store.leases), make(store.leases, owner="daemon-b")
    assert await holder.try_acquire()
    stood_by: list[float] = []
    got: list[float] = []

    async def wait_for_it() -> None:
        assert await standby.acquire(on_standby=lambda: stood_by.append(trio.current_time()))
        got.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(holder.keep)
        nursery.start_soon(wait_for_it)
        await trio.sleep(100)
        assert stood_by == [0.0] and got == []  # waiting, called back once
        await holder.release()
        released = trio.current_time()
    assert not holder.held and standby.held
    assert 0 < got[0] - released <= 20  # within a third of the TTL
    assert standby.fencing_token == 2
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert (logging.INFO, f"{LABEL}: another receiver holds the lease; standing by") in messages
    assert (logging.DEBUG, f"{LABEL}: receiver lease held by another receiver") in messages
    assert (logging.DEBUG, f"{LABEL}: receiver lease released") in messages
    assert (logging.DEBUG, f"{LABEL}: receiver lease acquired") in messages


async def test_the_watch_is_told_when_the_lease_is_taken_lost_and_released(
    autojump_clock: MockClock, store: MemoryStore
) -> None:
    """Whoever waits for the lease to be held (or not) wakes the moment it changes."""
    watch = LeaseWatch()
    holder, lease = make(store.leases), make(store.leases, owner="daemon-b", watch=watch)
    assert await holder.try_acquire()
    woke: list[tuple[bool, float]] = []

    async def waiter() -> None:
        for want in (True, False, True, False):
            await watch.wait(lambda: lease.held, want)
            woke.append((want, trio.current_time()))

    taken: list[float] = []

    async def standby() -> None:
        assert await lease.acquire()  # stood by first
        taken.append(trio.current_time())
        await lease.keep()  # until lost

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        nursery.start_soon(holder.keep)
        nursery.start_soon(standby)
        await trio.sleep(100)
        assert woke == []  # standing by: nothing told
        await holder.release()
        await trio.sleep(25)
        assert lease.held and woke == [(True, taken[0])]
        # Taken over behind its back: lost at the next renewal.
        row = await stored(store)
        await store.leases.release_lease(
            namespace=NS, key=KEY, scope=SCOPE, owner_id="daemon-b", token=row.token
        )
        assert await holder.try_acquire()
        await trio.sleep(60)
        assert not lease.held
        await holder.release()
        assert await lease.try_acquire()
        taken.append(trio.current_time())
        await trio.sleep(1)
        await lease.release()
        released = trio.current_time()
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    lost = taken[0] + 30  # the first renewal, half the TTL after it was taken
    assert woke == [(True, taken[0]), (False, lost), (True, taken[1]), (False, released)]


async def test_a_standby_takes_over_as_soon_as_a_dead_holders_lease_expires(
    autojump_clock: MockClock, store: MemoryStore
) -> None:
    """The holder stops renewing (killed): the standby tries right after the lease's expiry,
    not up to a third of the TTL later — within the TTL of the holder's last renewal."""
    clock = TrioClock()
    holder = make(store.leases)
    standby = make(store.leases, owner="daemon-b", clock=clock)
    assert await holder.try_acquire()
    record = await stored(store)
    expiry_s = (record.expires_at_ms - clock.now_ms()) / 1000
    with trio.fail_after(120):
        assert await standby.acquire()
    took = trio.current_time()
    assert expiry_s <= took <= expiry_s + 0.1, (expiry_s, took)
    assert standby.held and standby.fencing_token == 2


async def test_a_standby_whose_clock_differs_from_the_stores_backs_off_only(
    autojump_clock: MockClock, store: MemoryStore
) -> None:
    @attrs.frozen
    class Elsewhere:
        def now_ms(self) -> int:
            return 0  # decades away from the store's clock

    holder = make(store.leases)
    standby = make(store.leases, owner="daemon-b", clock=Elsewhere())
    assert await holder.try_acquire()
    with trio.fail_after(200):
        assert await standby.acquire()
    # Taken by the backoff (at most a third of the TTL apart), never before the expiry.
    assert 60 <= trio.current_time() <= 60 + 20


async def test_a_lease_taken_over_is_lost_guarded_waits_are_cut_short(
    autojump_clock: MockClock, store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=log.name)
    lease = make(store.leases)
    assert await lease.try_acquire()
    row = await stored(store)
    cut_at: list[float] = []
    unguarded_done: list[float] = []

    async def receiver() -> None:
        with pytest.raises(LeaseLostError), lease.guard():
            await trio.sleep(1000)  # a long poll
        cut_at.append(trio.current_time())

    async def processing() -> None:
        await trio.sleep(50)  # an admission in flight is never cut short by a loss
        unguarded_done.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receiver)
        nursery.start_soon(processing)
        nursery.start_soon(lease.keep)
        await trio.sleep(5)
        # ours expires behind our back (a paused process) and another daemon takes it
        await store.leases.release_lease(
            namespace=NS, key=KEY, scope=SCOPE, owner_id="daemon-a", token=row.token
        )
        assert await store.leases.try_acquire_lease(
            namespace=NS, key=KEY, scope=SCOPE, owner_id="intruder", ttl_ms=600_000
        )
    assert cut_at == [30.0]  # noticed at the first renewal, half the TTL in
    assert unguarded_done == [50.0]
    assert not lease.held and lease.fencing_token is None
    with pytest.raises(LeaseLostError):
        lease.check()
    with pytest.raises(LeaseLostError):
        await lease.sleep(1)
    lost = [(r.levelno, r.getMessage()) for r in caplog.records if "lost" in r.getMessage()]
    assert lost == [(logging.WARNING, f"{LABEL}: receiver lease lost (expired or taken over)")]
    assert row.token not in caplog.text and "daemon-a" not in caplog.text


async def test_a_store_outage_is_ridden_out_while_the_lease_is_surely_valid(
    autojump_clock: MockClock, store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    leases = FlakyLeases(store.leases)
    lease = make(leases)
    assert await lease.try_acquire()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lease.keep)
        await trio.sleep(29)
        leases.failing = True
        await trio.sleep(10)  # a few failed renewals, retried with backoff
        leases.failing = False
        await trio.sleep(30)
        nursery.cancel_scope.cancel()
    assert lease.held
    failed = [r for r in leases.renewals if 30 <= r < 39]
    assert len(failed) >= 3 and all(b > a for a, b in itertools.pairwise(failed))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings and all(
        w.startswith(f"{LABEL}: renewing the receiver lease failed (StoreUnavailableError)")
        for w in warnings
    )


async def test_fail_closed_a_lease_that_cannot_be_renewed_is_lost_before_it_expires(
    autojump_clock: MockClock, store: MemoryStore
) -> None:
    leases = FlakyLeases(store.leases)
    lease = make(leases)
    assert await lease.try_acquire()
    expires_ms = (await stored(store)).expires_at_ms
    leases.failing = True
    cut_at: list[float] = []

    async def receiver() -> None:
        with pytest.raises(LeaseLostError), lease.guard():
            await trio.sleep_forever()
        cut_at.append(TrioClock().now_ms())

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(receiver)
            await lease.keep()  # returns: lost
    assert not lease.held and cut_at and cut_at[0] < expires_ms
    # an intruder can take it only once it expired, by which time we stopped
    assert cut_at[0] <= TrioClock().now_ms() < expires_ms


async def test_check_fails_closed_even_if_keep_never_ran(
    autojump_clock: MockClock, store: MemoryStore
) -> None:
    lease = make(store.leases)
    assert await lease.try_acquire()
    await trio.sleep(59)
    lease.check()
    await trio.sleep(1)
    with pytest.raises(LeaseLostError):
        lease.check()


async def test_release_never_raises_and_a_failed_release_only_logs(
    autojump_clock: MockClock, store: MemoryStore, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=log.name)
    leases = FlakyLeases(store.leases)
    lease = make(leases)
    await lease.release()  # not held: nothing
    assert await lease.try_acquire()
    leases.failing = True
    await lease.release()
    assert not lease.held
    assert f"{LABEL}: releasing the receiver lease failed (StoreUnavailableError)" in caplog.text
    assert (await stored(store)).owner_id == "daemon-a"  # it expires on its own


def test_a_ttl_below_a_second_is_refused(store: MemoryStore) -> None:
    with pytest.raises(ValueError, match="ttl_ms"):
        make(store.leases, ttl_ms=999)
