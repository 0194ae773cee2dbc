"""``DeliveryLocks``: one send at a time per conversation, the table empty when unused."""

from __future__ import annotations

import trio
import trio.testing

from prismd.runtime._core import DeliveryLocks


async def test_one_holder_per_conversation_others_in_parallel(
    autojump_clock: trio.abc.Clock,
) -> None:
    locks = DeliveryLocks()
    inside: list[str] = []
    peak: dict[str, int] = {}

    async def send(conversation: str, name: str) -> None:
        async with locks.lock("conn", conversation):
            inside.append(conversation)
            peak[conversation] = max(peak.get(conversation, 0), inside.count(conversation))
            await trio.sleep(1)
            inside.remove(conversation)

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(send, "a", f"a{i}")
                nursery.start_soon(send, "b", f"b{i}")
            await trio.testing.wait_all_tasks_blocked()
            assert sorted(inside) == ["a", "b"]
            assert len(locks) == 2
    assert peak == {"a": 1, "b": 1}
    assert len(locks) == 0


async def test_a_waiter_cancelled_or_a_block_that_raises_leaves_nothing_behind(
    autojump_clock: trio.abc.Clock,
) -> None:
    locks = DeliveryLocks()
    release = trio.Event()

    async def holder() -> None:
        async with locks.lock("conn", "a"):
            await release.wait()

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(holder)
            await trio.testing.wait_all_tasks_blocked()
            with trio.move_on_after(1) as waited:
                async with locks.lock("conn", "a"):
                    raise AssertionError("entered while held")
            assert waited.cancelled_caught
            release.set()
    assert len(locks) == 0
    try:
        async with locks.lock("conn", "a"):
            raise KeyError("boom")
    except KeyError:
        pass
    assert len(locks) == 0
    async with locks.lock("conn", "a"):  # free again
        assert len(locks) == 1
    assert len(locks) == 0
