"""Conformance: the durable inbox (``store.inbox``, :class:`stores.InboxStore`) on every backend.

Deduplication on ``(source, key)``, claims that exclude each other (two stores on one
database too), a partition handed out in order and held for its owner, fenced claims,
bounded retries ending in a dead letter an operator settles, pruning, depth.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from stores import InboxReservation, InvalidInboxError, Store
from tests.support.backends import Backend
from tests.support.clocks import EPOCH_MS

SRC = "tg-main"
TTL = 30_000


def now_ms() -> int:
    return EPOCH_MS + int(trio.current_time() * 1000)


async def put(store: Store, n: int, partition: str = "chat-1", **kw: Any) -> bool:
    args: dict[str, Any] = {
        "source": SRC,
        "key": str(n),
        "partition": partition,
        "order": n,
        "payload": {"update_id": n, "text": f"t{n}"},
    }
    args.update(kw)
    return await store.inbox.put(**args)


async def reserve(
    store: Store, owner: str = "a", limit: int = 10, max_attempts: int = 5, **kw: Any
) -> list[InboxReservation]:
    got = await store.inbox.reserve(
        owner_id=owner, ttl_ms=kw.pop("ttl_ms", TTL), limit=limit, max_attempts=max_attempts, **kw
    )
    return list(got)


def keys(reservations: list[InboxReservation]) -> list[str]:
    return sorted(c.key for c in reservations)


async def test_put_deduplicates_on_source_and_key(store: Store, autojump_clock: Any) -> None:
    assert await put(store, 1)
    assert not await put(store, 1)  # a redelivery: acknowledged, no second row
    assert not await put(store, 1, payload={"other": True}, partition="elsewhere")
    assert await put(store, 1, source="tg-other")  # another connection's update 1
    item = await store.inbox.get(source=SRC, key="1")
    assert item is not None
    assert (item.state, item.attempts, item.partition, item.order) == ("pending", 0, "chat-1", 1)
    assert item.payload == {"update_id": 1, "text": "t1"}
    assert item.created_at_ms == item.available_at_ms == now_ms()
    (got,) = await reserve(store, sources=[SRC])
    assert await store.inbox.complete(got)
    assert not await put(store, 1)  # redelivered after it was processed: still no new row
    done = await store.inbox.get(source=SRC, key="1")
    assert done is not None and done.state == "done" and done.payload is None


async def test_reserve_hands_out_each_partition_in_order(store: Store, autojump_clock: Any) -> None:
    for key in (5, 3, 4):
        assert await put(store, key)
    assert await put(store, 9, partition="chat-2")
    first = await reserve(store)
    assert keys(first) == ["3", "9"]  # the head of each partition, never two of one
    (head,) = [c for c in first if c.key == "3"]
    assert head.item.state == "claimed" and head.item.attempts == 1
    assert head.item.owner_id == "a" and head.expires_at_ms == now_ms() + TTL
    assert head.item.payload == {"update_id": 3, "text": "t3"}
    assert await reserve(store) == []  # nothing else is ready while the heads are worked on
    assert await reserve(store, "b") == []
    assert await store.inbox.complete(head)
    (nxt,) = await reserve(store, "b")  # no hold: anyone may take the next one
    assert nxt.key == "4"
    assert await store.inbox.complete(nxt)
    (last,) = await reserve(store)
    assert last.key == "5"


async def test_a_hold_keeps_the_partition_for_its_owner(store: Store, autojump_clock: Any) -> None:
    for key in (1, 2, 3):
        await put(store, key)
    (one,) = await reserve(store, "a")
    assert await store.inbox.complete(one, keep_partition_ms=5_000)
    assert await reserve(store, "b") == []  # held for a
    (two,) = await reserve(store, "a")  # a itself takes the next one
    assert two.key == "2"
    assert await store.inbox.complete(two, keep_partition_ms=5_000)
    assert await store.inbox.release(one)  # a's first hold ends; the second still holds
    assert await reserve(store, "b") == []
    extended = await store.inbox.extend(two, ttl_ms=20_000)
    assert extended is not None and extended.expires_at_ms == now_ms() + 20_000
    await trio.sleep(10)
    assert await reserve(store, "b") == []  # extended past the first keep_partition_ms
    await trio.sleep(11)
    (three,) = await reserve(store, "b")  # the hold expired: b may go on
    assert three.key == "3"
    assert await store.inbox.release(two)  # ending an expired hold is harmless


async def test_release_ends_the_hold_now(store: Store, autojump_clock: Any) -> None:
    await put(store, 1)
    await put(store, 2)
    (one,) = await reserve(store, "a")
    assert not await store.inbox.release(one)  # not done yet: nothing to release
    assert await store.inbox.complete(one, keep_partition_ms=60_000)
    assert await store.inbox.release(one)
    (two,) = await reserve(store, "b")
    assert two.key == "2"


async def test_an_expired_claim_is_taken_over_and_the_old_one_fenced(
    store: Store, autojump_clock: Any
) -> None:
    await put(store, 1)
    (old,) = await reserve(store, "a", ttl_ms=1_000)
    assert await reserve(store, "b") == []
    await trio.sleep(1.5)
    (new,) = await reserve(store, "b")
    assert new.key == "1" and new.token != old.token
    assert new.item.attempts == 2 and new.item.owner_id == "b"
    assert new.item.payload == {"update_id": 1, "text": "t1"}
    # The first worker woke up: every call on its claim is refused and changes nothing.
    assert not await store.inbox.complete(old)
    assert await store.inbox.extend(old, ttl_ms=TTL) is None
    assert await store.inbox.retry(old, delay_ms=0, error="late", max_attempts=5) is None
    item = await store.inbox.get(source=SRC, key="1")
    assert item is not None and item.state == "claimed" and item.owner_id == "b"
    assert await store.inbox.complete(new)


async def test_an_owner_starting_again_takes_up_its_own_claims_at_once(
    store: Store, autojump_clock: Any
) -> None:
    """What owner "a" held when it died is claimable now (by anyone: "a" restarted claims
    it first, in practice); "b"'s claims, "a"'s on another source and "a"'s partition holds
    are left as they are, and the dead process's claims are fenced once claimed again."""
    await put(store, 1, partition="p1")
    await put(store, 2, partition="p2")
    await put(store, 3, partition="p3")
    await put(store, 4, partition="p4", source="tg-other")
    await put(store, 5, partition="p5")
    await put(store, 6, partition="p5")
    old = {c.key: c for c in await reserve(store, "a", sources=[SRC], limit=2)}
    assert sorted(old) == ["1", "2"]
    (b_claim,) = await reserve(store, "b", sources=[SRC], limit=1)
    assert b_claim.key == "3"
    (other,) = await reserve(store, "a", sources=["tg-other"])
    (held,) = await reserve(store, "a", sources=[SRC])
    assert held.key == "5"
    assert await store.inbox.complete(held, keep_partition_ms=TTL)  # 6 waits for "a" (its hold)

    assert await store.inbox.expire_own_reservations(owner_id="a", sources=[SRC]) == 2
    assert await store.inbox.expire_own_reservations(owner_id="a", sources=[SRC]) == 0
    assert await store.inbox.expire_own_reservations(owner_id="a", sources=[]) == 0
    again = await reserve(store, "a", sources=[SRC])
    assert keys(again) == ["1", "2", "6"]  # 6: "a"'s hold still holds for "a"
    assert all(c.item.attempts == 2 for c in again if c.key in ("1", "2"))
    assert not await store.inbox.complete(old["1"])  # the dead process's claim: fenced
    for current in again:
        assert await store.inbox.complete(current)
    assert await store.inbox.complete(b_claim)
    assert await store.inbox.complete(other)
    with pytest.raises(InvalidInboxError):
        await store.inbox.expire_own_reservations(owner_id="")
    with pytest.raises(InvalidInboxError):
        await store.inbox.expire_own_reservations(owner_id="a", sources="tg-main")


async def test_an_expired_claim_not_taken_over_still_works(
    store: Store, autojump_clock: Any
) -> None:
    await put(store, 1)
    (slow,) = await reserve(store, "a", ttl_ms=1_000)
    await trio.sleep(5)
    assert await store.inbox.extend(slow, ttl_ms=1_000) is not None
    assert await store.inbox.complete(slow)


async def test_retry_backs_off_then_ends_in_a_dead_letter(
    store: Store, autojump_clock: Any
) -> None:
    await put(store, 1)
    await put(store, 2)
    (first,) = await reserve(store, max_attempts=3)
    waiting = await store.inbox.retry(first, delay_ms=2_000, error="unavailable", max_attempts=3)
    assert waiting is not None
    assert (waiting.state, waiting.error, waiting.attempts) == ("pending", "unavailable", 1)
    assert waiting.available_at_ms == now_ms() + 2_000
    assert await reserve(store, max_attempts=3) == []  # not due, and it blocks its partition
    await trio.sleep(2)
    (second,) = await reserve(store, max_attempts=3)
    assert second.key == "1" and second.item.attempts == 2
    await store.inbox.retry(second, delay_ms=0, error="unavailable", max_attempts=3)
    (third,) = await reserve(store, max_attempts=3)
    dead = await store.inbox.retry(third, delay_ms=0, error="capacity", max_attempts=3)
    assert dead is not None and (dead.state, dead.attempts, dead.error) == ("dead", 3, "capacity")
    # A dead letter is kept (with its payload, for a retry) and listed, and no longer holds
    # up its partition.
    kept = await store.inbox.get(source=SRC, key="1")
    assert kept is not None and kept.payload == {"update_id": 1, "text": "t1"}
    listed = await store.inbox.list_items(state="dead")
    assert [i.key for i in listed.items] == ["1"] and listed.items[0].payload is None
    assert (await store.inbox.depth()).dead == 1
    (nxt,) = await reserve(store, max_attempts=3)
    assert nxt.key == "2"


async def test_a_worker_killed_each_time_ends_in_a_dead_letter(
    store: Store, autojump_clock: Any
) -> None:
    """Claims that expire (the worker died mid-way) count as attempts too."""
    await put(store, 1)
    for attempt in (1, 2):
        (got,) = await reserve(store, ttl_ms=1_000, max_attempts=2)
        assert got.item.attempts == attempt
        await trio.sleep(1.5)
    assert await reserve(store, max_attempts=2) == []
    item = await store.inbox.get(source=SRC, key="1")
    assert item is not None and item.state == "dead" and item.attempts == 2


async def test_an_operator_settles_a_dead_letter(store: Store, autojump_clock: Any) -> None:
    await put(store, 1)
    await put(store, 2)
    for key in (1, 2):
        (got,) = await reserve(store, max_attempts=1)
        assert got.key == str(key)
        await store.inbox.retry(got, delay_ms=0, error="failed", max_attempts=1)
    assert await store.inbox.settle(source=SRC, key="3", action="retry") is None
    retried = await store.inbox.settle(source=SRC, key="1", action="retry")
    assert retried is not None and (retried.state, retried.attempts) == ("pending", 0)
    assert await store.inbox.settle(source=SRC, key="1", action="discard") is None  # not dead
    discarded = await store.inbox.settle(source=SRC, key="2", action="discard")
    assert discarded is not None and discarded.state == "discarded"
    gone = await store.inbox.get(source=SRC, key="2")
    assert gone is not None and gone.payload is None
    (again,) = await reserve(store, max_attempts=1)
    assert again.key == "1" and again.item.payload == {"update_id": 1, "text": "t1"}
    with pytest.raises(InvalidInboxError):
        await store.inbox.settle(source=SRC, key="1", action="drop")  # type: ignore[arg-type]


async def test_prune_deletes_settled_items_only(store: Store, autojump_clock: Any) -> None:
    for key in range(1, 7):
        await put(store, key, partition=f"chat-{key}")
    reservations = {c.key: c for c in await reserve(store)}
    assert await store.inbox.complete(reservations["1"])
    assert await store.inbox.complete(reservations["2"], keep_partition_ms=60_000)  # still held
    await store.inbox.retry(reservations["3"], delay_ms=0, error="x", max_attempts=1)  # dead
    await store.inbox.retry(reservations["4"], delay_ms=0, error="x", max_attempts=1)
    assert await store.inbox.settle(source=SRC, key="4", action="discard") is not None
    assert await store.inbox.complete(reservations["5"])
    # "6" stays claimed.
    await trio.sleep(10)
    assert await store.inbox.prune(before_ms=now_ms() - 20_000) == 0  # nothing that old
    assert await store.inbox.prune(before_ms=now_ms(), limit=1) == 1  # bounded per call
    assert await store.inbox.prune(before_ms=now_ms()) == 2
    left = await store.inbox.list_items()
    assert [i.key for i in left.items] == ["2", "3", "6"]
    await trio.sleep(60)
    assert await store.inbox.prune(before_ms=now_ms()) == 1  # the hold is over: "2" goes


async def test_depth_and_listing(store: Store, autojump_clock: Any) -> None:
    for key in range(1, 8):
        await put(store, key, partition=f"chat-{key % 3}")
    await put(store, 1, source="tg-other")
    got = await reserve(store, limit=2, sources=[SRC])
    assert len(got) == 2
    await store.inbox.retry(got[0], delay_ms=0, error="x", max_attempts=1)
    depth = await store.inbox.depth(sources=[SRC])
    assert (depth.pending, depth.claimed, depth.dead) == (5, 1, 1)
    assert (await store.inbox.depth()).pending == 6
    assert (await store.inbox.depth(sources=[])).pending == 0
    assert await reserve(store, sources=[]) == []
    walked: list[tuple[str, str]] = []
    cursor = None
    for _ in range(10):
        page = await store.inbox.list_items(cursor=cursor, limit=3)
        assert all(i.payload is None for i in page.items)
        walked += [(i.source, i.key) for i in page.items]
        cursor = page.next_cursor
        if cursor is None:
            break
    assert walked == [(SRC, str(k)) for k in range(1, 8)] + [("tg-other", "1")]
    only = await store.inbox.list_items(source="tg-other")
    assert [i.key for i in only.items] == ["1"] and only.next_cursor is None


async def test_reserve_limit_and_age_order(store: Store, autojump_clock: Any) -> None:
    for key in range(1, 6):
        await put(store, key, partition=f"chat-{key}")
        await trio.sleep(1)
    first = await reserve(store, limit=2)
    assert keys(first) == ["1", "2"]  # oldest first
    assert keys(await reserve(store, "b", limit=500)) == ["3", "4", "5"]


async def test_bad_input_is_refused_and_writes_nothing(store: Store) -> None:
    bad: list[dict[str, Any]] = [
        {"source": ""},
        {"key": ""},
        {"key": 1},
        {"partition": ""},
        {"order": -1},
        {"order": True},
        {"order": 2**53},
        {"payload": {"x": float("nan")}},
        {"payload": {1: "int key"}},
        {"source": "\ud800"},
    ]
    for change in bad:
        with pytest.raises(InvalidInboxError):
            await put(store, 1, **change)
    with pytest.raises(InvalidInboxError, match="larger than max_value_bytes"):
        await put(store, 1, payload={"x": "y" * (2 << 20)})
    for change in ({"owner_id": ""}, {"ttl_ms": 0}, {"max_attempts": 0}, {"sources": "tg"}):
        args: dict[str, Any] = {"owner_id": "a", "ttl_ms": TTL, "max_attempts": 3} | change
        with pytest.raises(InvalidInboxError):
            await store.inbox.reserve(**args)
    with pytest.raises(InvalidInboxError):
        await store.inbox.complete("not a claim")  # type: ignore[arg-type]
    with pytest.raises(InvalidInboxError):
        await store.inbox.list_items(state="lost")  # type: ignore[arg-type]
    with pytest.raises(InvalidInboxError):
        await store.inbox.list_items(cursor="!!")
    assert (await store.inbox.list_items()).items == ()


async def test_concurrent_claimers_never_share_an_item(store: Store) -> None:
    """Many workers on one store, many partitions: every item is claimed exactly once."""
    total = 60
    for key in range(total):
        await put(store, key, partition=f"chat-{key % 12}")
    seen: list[str] = []

    async def worker(owner: str) -> None:
        idle = 0
        while idle < 20:
            got = await reserve(store, owner, limit=3)
            if not got:
                idle += 1
                await trio.sleep(0.01)
                continue
            idle = 0
            for c in got:
                seen.append(c.key)
                assert await store.inbox.complete(c)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for n in range(6):
                nursery.start_soon(worker, f"w{n}")
    assert sorted(seen, key=int) == [str(k) for k in range(total)]


async def test_two_stores_on_one_database_claim_disjoint_items(durable_backend: Backend) -> None:
    """Two independent stores (two connection pools / two SQLite connections) compete for the
    same rows: no item is handed to both, and a partition is never worked on by both."""
    total = 40
    async with durable_backend.open() as one, durable_backend.open() as two:
        for key in range(total):
            await put(one, key, partition=f"chat-{key % 5}")
        seen: dict[str, str] = {}
        busy: set[str] = set()

        async def worker(store: Store, owner: str) -> None:
            idle = 0
            while idle < 30:
                got = await reserve(store, owner, limit=2)
                if not got:
                    idle += 1
                    await trio.sleep(0.01)
                    continue
                idle = 0
                for c in got:
                    assert c.key not in seen, "an item was claimed twice"
                    assert c.item.partition not in busy, "a partition was worked on twice"
                    seen[c.key] = owner
                    busy.add(c.item.partition)
                    await trio.sleep(0.002)
                    busy.discard(c.item.partition)
                    assert await store.inbox.complete(c)

        with trio.fail_after(90):
            async with trio.open_nursery() as nursery:
                for n in range(3):
                    nursery.start_soon(worker, one, f"one-{n}")
                    nursery.start_soon(worker, two, f"two-{n}")
        assert sorted(seen, key=int) == [str(k) for k in range(total)]


async def test_the_inbox_survives_a_reopen(durable_backend: Backend) -> None:
    async with durable_backend.open() as store:
        await put(store, 1)
        await put(store, 2, partition="chat-2")
        (got, _) = await reserve(store, limit=2)
        assert await store.inbox.complete(got)
    async with durable_backend.open() as store:
        assert not await put(store, 1)
        assert not await put(store, 2, partition="chat-2")
        states = {i.key: i.state for i in (await store.inbox.list_items()).items}
        assert sorted(states.values()) == ["claimed", "done"]


async def test_last_event_seq_is_where_the_stream_ends(store: Store) -> None:
    from stores import OwnershipScope

    assert await store.checkpoints.last_event_seq() == 0
    scope = OwnershipScope("t")
    for n in range(3):
        await store.checkpoints.save_checkpoint(
            namespace="ns", key=f"k{n}", scope=scope, version=1, value={}
        )
    last = await store.checkpoints.last_event_seq()
    page = await store.checkpoints.list_events(after=0)
    assert last == page.last_seq == page.items[-1].seq
    assert (await store.checkpoints.list_events(after=last)).items == ()
