"""Sends that end while others are on their way return together (adapters/discord/_together):
the runtime's marks of their replies then share one commit."""

from __future__ import annotations

import trio
import trio.lowlevel
import trio.testing

from adapters.discord._together import ReturnTogether
from stores import OwnershipScope, Store
from tests.fakes.discord_api import FakeDiscord

from .conftest import DM, USER, AdapterFactory
from .test_send import reply_to

SCOPE = OwnershipScope(tenant_id="t")


async def _send(
    together: ReturnTogether, takes: float, returned: dict[str, float], name: str
) -> None:
    together.started()
    await trio.sleep(takes)
    await together.finished()
    returned[name] = trio.current_time()


async def test_a_send_waits_for_the_others_on_their_way_and_the_last_never_waits(
    autojump_clock: trio.testing.MockClock,
) -> None:
    together = ReturnTogether(hold_s=1.0)
    returned: dict[str, float] = {}
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for name, takes in (("a", 0.01), ("b", 0.03), ("c", 0.05)):
            nursery.start_soon(_send, together, takes, returned, name)
    # "c" finished last, with nobody left on the way: it did not wait, and the two that
    # finished before it returned with it.
    assert {name: round(at - start, 6) for name, at in returned.items()} == {
        "a": 0.05,
        "b": 0.05,
        "c": 0.05,
    }
    assert together.on_the_way == 0
    # A send alone returns at once.
    await _send(together, 0.0, returned, "alone")
    assert returned["alone"] == returned["c"]


async def test_the_wait_is_bounded_by_the_hold_and_by_the_batch_size(
    autojump_clock: trio.testing.MockClock,
) -> None:
    together = ReturnTogether(hold_s=0.1, max_together=3)
    returned: dict[str, float] = {}
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_send, together, 0.0, returned, "early")
        nursery.start_soon(_send, together, 10.0, returned, "slow")
    # "early" waited for "slow" no longer than the hold.
    assert round(returned["early"] - start, 6) == 0.1
    assert round(returned["slow"] - start, 6) == 10.0

    returned.clear()
    start = trio.current_time()
    async with trio.open_nursery() as nursery:
        for n in range(3):
            nursery.start_soon(_send, together, 0.001 * n, returned, f"s{n}")
        nursery.start_soon(_send, together, 10.0, returned, "slow")
    # The third to finish filled the batch: all three returned then, not after the hold.
    assert {round(returned[f"s{n}"] - start, 6) for n in range(3)} == {0.002}


async def test_a_send_that_raised_releases_the_batch_waiting_for_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    together = ReturnTogether(hold_s=5.0)
    returned: dict[str, float] = {}
    start = trio.current_time()

    async def failing() -> None:
        together.started()
        try:
            await trio.sleep(0.02)
            raise ValueError("no outcome")
        except BaseException:
            together.abandoned()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(_send, together, 0.01, returned, "held")
        nursery.start_soon(failing)
    assert round(returned["held"] - start, 6) == 0.02
    assert together.on_the_way == 0


async def test_the_wait_is_shielded_a_cancelled_caller_still_gets_its_outcome(
    autojump_clock: trio.testing.MockClock,
) -> None:
    together = ReturnTogether(hold_s=0.5)
    outcome: list[str] = []

    async def held() -> None:
        together.started()
        with trio.CancelScope() as scope:
            scope.cancel()
            await together.finished()  # the reply was posted: its outcome is not dropped
            outcome.append("returned")
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        together.started()  # another send on its way, never finishing in time
        nursery.start_soon(held)
    assert outcome == ["returned"]


async def test_a_cancelled_send_held_behind_the_first_still_returns_with_the_batch(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Only the batch's first send keeps a timer; a later one, parked without a cancel
    scope of its own, is not cut short by a cancellation either: it returns its outcome
    with the batch, at the first one's time, and the cancellation lands afterwards."""
    together = ReturnTogether(hold_s=0.5)
    returned: dict[str, float] = {}
    start = trio.current_time()

    async def held_and_cancelled() -> None:
        together.started()
        await trio.sleep(0.1)
        with trio.CancelScope() as scope:
            scope.cancel()
            await together.finished()
            returned["cancelled"] = trio.current_time()
            await trio.lowlevel.checkpoint()
        assert scope.cancelled_caught

    async with trio.open_nursery() as nursery:
        together.started()  # another send on its way, never finishing in time
        nursery.start_soon(_send, together, 0.0, returned, "first")
        nursery.start_soon(held_and_cancelled)
    assert round(returned["first"] - start, 6) == 0.5
    assert round(returned["cancelled"] - start, 6) == 0.5


async def test_a_backlog_holds_a_batch_longer(autojump_clock: trio.testing.MockClock) -> None:
    """With as many sends on their way as a batch may hold, the batch begun waits the
    backlog's hold (they are paced: each waits longer for its place anyway); with fewer,
    the short hold."""
    returned: dict[str, float] = {}
    for on_the_way, waited in ((3, 0.025), (16, 0.1)):
        together = ReturnTogether(hold_s=0.025, backlog_hold_s=0.1, max_together=16)
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            for _ in range(on_the_way - 1):
                together.started()  # on their way, not finishing within the hold
            nursery.start_soon(_send, together, 0.0, returned, "first")
        assert round(returned["first"] - start, 6) == waited


async def test_the_writes_after_a_batch_returns_share_one_commit(
    autojump_clock: trio.testing.MockClock, store: Store
) -> None:
    """What the wait is for: the runtime marks each reply as soon as ``send`` returns, and
    the marks of one batch reach the store in the same scheduler pass (one transaction),
    whichever of them Trio runs first."""
    statistics = getattr(store, "statistics")  # noqa: B009 - the SQLite store's counters
    for attempt in range(8):
        together = ReturnTogether(hold_s=1.0)
        before = statistics().commits

        async def send_and_mark(
            n: int, together: ReturnTogether = together, attempt: int = attempt
        ) -> None:
            together.started()
            await trio.sleep(0.01 * n)
            await together.finished()
            await store.checkpoints.save_checkpoint(
                namespace="prism.test.marks",
                key=f"{attempt}:{n}",
                scope=SCOPE,
                version=1,
                expected_version=0,
                value={"n": n},
            )

        async with trio.open_nursery() as nursery:
            for n in range(5):
                nursery.start_soon(send_and_mark, n)
        assert statistics().commits - before == 1


async def test_replies_sent_at_once_through_the_adapter_are_all_delivered(
    fake: FakeDiscord, make_adapter: AdapterFactory
) -> None:
    inbound = [fake.user_message(DM, USER, f"q{n}") for n in range(6)]
    adapter = make_adapter()
    results = []

    async def send(n: int) -> None:
        results.append(await adapter.send(reply_to(inbound[n]["id"], f"a{n}", f"op-{n}")))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for n in range(6):
                nursery.start_soon(send, n)
    await adapter.aclose()
    assert len(results) == 6 and all(r.delivered for r in results)
    assert sorted(m["content"] for m in fake.bot_messages(DM)) == [f"a{n}" for n in range(6)]
