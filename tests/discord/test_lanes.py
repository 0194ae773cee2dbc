"""A session's messages admitted across channels at once, in order within each, behind the
contiguous watermark (adapters/discord/_lanes.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio
import trio.testing

from adapters.discord._lanes import Lanes


async def test_watermark_passes_only_the_handled_prefix_and_channels_keep_their_order(
    autojump_clock: trio.testing.MockClock,
) -> None:
    marks: list[int] = []
    started: list[str] = []
    gates = {name: trio.Event() for name in ("a1", "a2", "b1")}

    def admission(name: str) -> Callable[[], Awaitable[None]]:
        async def handle() -> None:
            started.append(name)
            await gates[name].wait()

        return handle

    lanes = Lanes(marks.append)
    async with trio.open_nursery() as nursery:
        await lanes.admit(nursery, 1, "A", admission("a1"))
        await lanes.admit(nursery, 2, "A", admission("a2"))
        await lanes.admit(nursery, 3, "B", admission("b1"))
        lanes.passed(4)  # nothing to admit (our own reply, another dispatch type)
        await trio.sleep(1)
        # Channel A's second message waits for its first; channel B does not.
        assert sorted(started) == ["a1", "b1"] and marks == [] and lanes.busy
        gates["b1"].set()
        await trio.sleep(1)
        assert marks == []  # 3 is handled, 1 and 2 are not: the watermark stays
        gates["a1"].set()
        await trio.sleep(1)
        assert len(started) == 3 and started[-1] == "a2" and marks == [1]
        gates["a2"].set()
        await trio.sleep(1)
        assert marks == [1, 4] and not lanes.busy


async def test_a_failed_admission_stops_its_channel_and_the_watermark(
    autojump_clock: trio.testing.MockClock,
) -> None:
    marks: list[int] = []
    started: list[int] = []

    async def fails() -> None:
        started.append(1)
        await trio.sleep(1)
        raise RuntimeError("lease lost")

    async def after() -> None:
        started.append(2)

    lanes = Lanes(marks.append)
    try:
        async with trio.open_nursery() as nursery:
            await lanes.admit(nursery, 1, "A", fails)
            await lanes.admit(nursery, 2, "A", after)
            await trio.sleep(5)
    except BaseExceptionGroup as group:
        assert group.subgroup(RuntimeError) is not None
    else:
        raise AssertionError("the failure was not raised")
    assert started == [1] and marks == []


async def test_admissions_in_flight_are_bounded(autojump_clock: trio.testing.MockClock) -> None:
    running: list[int] = []
    release = trio.Event()

    async def handle() -> None:
        running.append(1)
        await release.wait()

    lanes = Lanes(lambda _seq: None, limit=3)
    async with trio.open_nursery() as nursery:
        for seq in range(3):
            await lanes.admit(nursery, seq, f"c{seq}", handle)
        with trio.move_on_after(5) as waited:
            await lanes.admit(nursery, 3, "c3", handle)
        assert waited.cancelled_caught and len(running) == 3
        release.set()
        await lanes.admit(nursery, 4, "c4", handle)
        await trio.sleep(1)
        assert len(running) == 4
