"""Due polls on PostgreSQL (``stores/postgres/_polls.py``, :class:`~stores.PollStore`): a
reservation is granted only when the row is due (or hurried) and no unexpired lease is held;
concurrent reservers get one winner; an expired lease is taken over and its old holder is
fenced (renew, settle and finish answer ``None``/``False`` and change nothing)."""

from __future__ import annotations

import attrs
import trio

from stores import PollLease, PollStore, PollWait, Store, open_store
from tests.support import pgserver


@attrs.define
class ManualClock:
    now: int = 1_000_000

    def now_ms(self) -> int:
        return self.now


def _polls(store: Store) -> PollStore:
    polls = store.polls
    assert polls is not None
    return polls


async def test_a_due_poll_is_reserved_by_one_and_an_expired_lease_taken_over() -> None:
    url = pgserver.fresh_url("polls")
    clock = ManualClock()
    try:
        with trio.fail_after(30):
            async with open_store(url, clock=clock) as store:
                polls = _polls(store)
                assert await polls.reserve("a/t1", owner_id="A", ttl_ms=1000) is None
                await polls.track("a/t1")
                first = await polls.reserve("a/t1", owner_id="A", ttl_ms=1000)
                assert isinstance(first, PollLease) and first.fence == 1
                # Held: another is told to come back when the lease ends, even hurried.
                assert await polls.reserve("a/t1", owner_id="B", ttl_ms=1000) == PollWait(1000)
                got = await polls.reserve("a/t1", owner_id="B", ttl_ms=1000, hurry=True)
                assert got == PollWait(1000)
                await polls.track("a/t1")  # tracking again changes nothing
                clock.now += 400
                renewed = await polls.renew(first, ttl_ms=1000)
                assert renewed is not None and renewed.expires_at_ms == clock.now + 1000
                # Released with the next due time: not due before it, unless hurried.
                assert await polls.settle(first, delay_ms=5000)
                assert await polls.reserve("a/t1", owner_id="B", ttl_ms=1000) == PollWait(5000)
                hurried = await polls.reserve("a/t1", owner_id="B", ttl_ms=1000, hurry=True)
                assert isinstance(hurried, PollLease) and hurried.fence == 2
                # B's lease expires unrenewed: A takes it over; B is fenced.
                clock.now += 1001
                assert await polls.settle(hurried, delay_ms=0) is True  # not taken yet
                again = await polls.reserve("a/t1", owner_id="B", ttl_ms=1000)
                assert isinstance(again, PollLease) and again.fence == 3
                clock.now += 1001
                taken = await polls.reserve("a/t1", owner_id="A", ttl_ms=1000)
                assert isinstance(taken, PollLease) and taken.fence == 4
                assert await polls.renew(again, ttl_ms=1000) is None
                assert await polls.settle(again, delay_ms=0) is False
                assert await polls.finish(again) is False
                # The holder ends it: the row is gone for everyone.
                assert await polls.finish(taken) is True
                assert await polls.reserve("a/t1", owner_id="B", ttl_ms=1000) is None
                await polls.track("a/t2")
                await polls.forget("a/t2")
                assert await polls.reserve("a/t2", owner_id="B", ttl_ms=1000) is None
    finally:
        pgserver.drop_schema(url)


async def test_concurrent_reservers_get_one_winner() -> None:
    """Twenty reservations of one due row at once (two stores: two pools, as two
    instances): exactly one lease; every other is told to wait (a lease held, or a row
    locked by the winner's reservation: ``SKIP LOCKED``, never blocked)."""
    url = pgserver.fresh_url("polls")
    try:
        with trio.fail_after(30):
            async with open_store(url) as one, open_store(url) as two:
                await _polls(one).track("a/t")
                results: list[PollLease | PollWait | None] = []

                async def reserve(polls: PollStore, n: int) -> None:
                    results.append(await polls.reserve("a/t", owner_id=f"o{n}", ttl_ms=60_000))

                async with trio.open_nursery() as nursery:
                    for n in range(20):
                        nursery.start_soon(reserve, _polls(one if n % 2 else two), n)
                leases = [r for r in results if isinstance(r, PollLease)]
                assert len(leases) == 1, results
                assert all(isinstance(r, PollWait) for r in results if r is not leases[0])
    finally:
        pgserver.drop_schema(url)
