"""The Identifies of one connection's shards are spaced as they are sent (Discord counts
``max_concurrency`` per window where it receives them), whatever each shard's connection
took to open."""

from __future__ import annotations

import itertools

import trio
import trio.testing

from adapters.discord._identify import IDENTIFY_MARGIN_S, IdentifyGate


async def test_one_key_is_spaced_as_sent_and_other_keys_are_not(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = IdentifyGate()
    sent: list[tuple[str, float]] = []

    def sender(name: str) -> object:
        async def send() -> None:
            sent.append((name, trio.current_time()))

        return send

    async def shard(name: str, key: int, opened_after_s: float) -> None:
        await trio.sleep(opened_after_s)  # the connection's own time to open
        await gate.send(key, 5.0, sender(name))  # type: ignore[arg-type]

    start = trio.current_time()
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(shard, "a", 0, 1.0)
            nursery.start_soon(shard, "b", 0, 0.5)  # faster to open: goes first
            nursery.start_soon(shard, "c", 0, 0.7)
            nursery.start_soon(shard, "d", 1, 0.9)  # another key: not held back
    at = {name: when - start for name, when in sent}
    assert [name for name, _ in sent][:2] == ["b", "d"]  # then a and c, one window apart
    assert sorted(name for name, _ in sent) == ["a", "b", "c", "d"]
    assert at["b"] == 0.5 and at["d"] == 0.9
    same_key = sorted(at[n] for n in "abc")
    gaps = [later - earlier for earlier, later in itertools.pairwise(same_key)]
    assert all(gap >= 5.0 + IDENTIFY_MARGIN_S for gap in gaps), gaps
