"""adapters.toolkit.Interrupts: interrupt() cuts the regions open now and lets later ones
run; stop() cuts them and every region opened after it, until ``stopped`` is reset."""

from __future__ import annotations

from collections.abc import Callable

import trio
import trio.testing

from adapters.toolkit import Interrupts


async def _cut_open(interrupts: Interrupts, cut_now: Callable[[], None], waits: int) -> list[bool]:
    """Open ``waits`` long regions, call ``cut_now`` once all wait: whether each was cut."""
    cut: list[bool] = []

    async def wait() -> None:
        with interrupts.interruptible() as scope:
            await trio.sleep(3600)
        cut.append(scope.cancelled_caught)

    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            for _ in range(waits):
                nursery.start_soon(wait)
            await trio.testing.wait_all_tasks_blocked()
            cut_now()
    return cut


async def _region_cut(interrupts: Interrupts) -> bool:
    """Whether a region opened now is cut (before a one-second wait ends)."""
    with interrupts.interruptible() as scope:
        await trio.sleep(1)
    return scope.cancelled_caught


async def test_interrupt_cuts_open_regions_only(autojump_clock: trio.testing.MockClock) -> None:
    interrupts = Interrupts()
    assert await _cut_open(interrupts, interrupts.interrupt, 2) == [True, True]
    assert not interrupts.stopped
    assert not await _region_cut(interrupts)  # opened after the interrupt: runs to its end


async def test_stop_latches_until_reset(autojump_clock: trio.testing.MockClock) -> None:
    interrupts = Interrupts()
    assert await _cut_open(interrupts, interrupts.stop, 1) == [True]
    assert interrupts.stopped
    assert await _region_cut(interrupts)  # cut as it opens
    interrupts.stopped = False
    assert not await _region_cut(interrupts)
