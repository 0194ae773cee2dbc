"""``acquire_promptly``: a free lock or slot is taken without a pass through the scheduler;
everything else is as ``acquire``: a cancelled caller raises, and waiters go first."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
import trio
import trio.testing

from prismd.runtime._leases import acquire_promptly


class _Yields(trio.abc.Instrument):
    """Counts the times ``task`` gave the scheduler a turn (ended a step)."""

    def __init__(self, task: trio.lowlevel.Task) -> None:
        self.task = task
        self.count = 0

    def after_task_step(self, task: trio.lowlevel.Task) -> None:
        if task is self.task:
            self.count += 1


async def _yields_of(acquire: Awaitable[object]) -> int:
    yields = _Yields(trio.lowlevel.current_task())
    trio.lowlevel.add_instrument(yields)
    try:
        await acquire
    finally:
        trio.lowlevel.remove_instrument(yields)
    return yields.count


@pytest.mark.parametrize("make", [trio.Lock, lambda: trio.Semaphore(1)])
async def test_a_free_lock_is_taken_without_a_pass_through_the_scheduler(
    make: Callable[[], trio.Lock | trio.Semaphore],
) -> None:
    lock = make()
    assert await _yields_of(acquire_promptly(lock)) == 0
    assert lock.locked() if isinstance(lock, trio.Lock) else lock.value == 0
    lock.release()
    # Trio's own acquire, for contrast, yields even when the lock is free.
    assert await _yields_of(lock.acquire()) == 1
    lock.release()


async def test_a_cancelled_caller_raises_and_holds_nothing() -> None:
    lock = trio.Lock()
    with trio.CancelScope() as scope:
        scope.cancel()
        await acquire_promptly(lock)
        pytest.fail("acquire_promptly returned in a cancelled scope")
    assert not lock.locked()


async def test_waiters_go_first(autojump_clock: trio.testing.MockClock) -> None:
    lock = trio.Lock()
    order: list[str] = []

    async def waiter(name: str) -> None:
        await acquire_promptly(lock)
        order.append(name)
        await trio.sleep(1)
        lock.release()

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            await acquire_promptly(lock)
            nursery.start_soon(waiter, "first")
            await trio.testing.wait_all_tasks_blocked()
            lock.release()
            # Released to the parked waiter: a newcomer does not jump the queue.
            await acquire_promptly(lock)
            order.append("newcomer")
            lock.release()
    assert order == ["first", "newcomer"]


async def test_only_a_wait_runs_within_the_given_scope(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A free slot is taken with no scope entered (cancelling the scope afterwards changes
    nothing); a wait is inside it: cancelled, the caller gets False and holds nothing, and
    the slot goes to the next waiter."""
    slots = trio.Semaphore(1)
    unused = trio.CancelScope()
    assert await _yields_of(acquire_promptly(slots, wait_within=unused)) == 0
    assert slots.value == 0
    unused.cancel()  # never entered: nothing happens
    answers: list[bool] = []

    async def wait(scope: trio.CancelScope) -> None:
        answers.append(await acquire_promptly(slots, wait_within=scope))

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            cancelled, kept = trio.CancelScope(), trio.CancelScope()
            nursery.start_soon(wait, cancelled)
            await trio.testing.wait_all_tasks_blocked()
            nursery.start_soon(wait, kept)
            await trio.testing.wait_all_tasks_blocked()
            cancelled.cancel()
            await trio.testing.wait_all_tasks_blocked()
            assert answers == [False] and slots.value == 0
            slots.release()
    assert answers == [False, True] and slots.value == 0
