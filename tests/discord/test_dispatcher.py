"""A connection's dispatches (adapters/discord/_dispatcher.py): handled in the reader's task
only when nothing waits, else queued in order; the watermark saved after it moved."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast

import trio

from adapters.discord import _protocol as proto
from adapters.discord._cursor import SessionState, ShardCursor
from adapters.discord._dispatcher import SAVE_EVERY_S, Dispatcher
from adapters.discord._lanes import MAX_IN_FLIGHT
from adapters.discord._status import ShardStatus
from adapters.toolkit import ReceiverLease
from stores import SYSTEM_CLOCK, OwnershipScope, Store

from .conftest import CONN

BOT = "999"


class _Lease:
    """What the dispatcher uses of the shard's lease: held throughout."""

    fencing_token = None

    def check(self) -> None:
        pass


def message(seq: int, channel: str, author: str = "1") -> proto.Frame:
    d = {"id": str(1000 + seq), "channel_id": channel, "author": {"id": author}}
    return proto.Frame(proto.DISPATCH, d, seq, "MESSAGE_CREATE")


async def cursor_on(store: Store) -> ShardCursor:
    scope = OwnershipScope(tenant_id="prismd-service", account_id=CONN, user_id="shard:0/1")
    cursor = ShardCursor(
        checkpoints=store.checkpoints, connection_id=CONN, scope=scope, clock=SYSTEM_CLOCK
    )
    await cursor.load()
    cursor.state.session = SessionState("session", "ws://127.0.0.1:1", 0)
    cursor.state.bot_user_id = BOT
    return cursor


def dispatcher_on(
    cursor: ShardCursor, handle: Callable[[Mapping[str, Any]], Awaitable[None]]
) -> Dispatcher:
    async def ready(_frame: proto.Frame) -> None:
        raise AssertionError("no READY here")

    return Dispatcher(
        cursor=cursor,
        lease=cast(ReceiverLease, _Lease()),
        status=ShardStatus(),
        handle_message=handle,
        ready=ready,
    )


async def stored_seq(store: Store, cursor: ShardCursor) -> int | None:
    record = await store.checkpoints.load_checkpoint(
        namespace="prism.channels.v1.cursor", key=cursor.key, scope=cursor.scope
    )
    if record is None:
        return None
    value = cast(Mapping[str, Any], record.value)
    return int(value["discord"]["session"]["seq"])


async def test_a_full_set_of_lanes_queues_what_follows_in_order(store: Store) -> None:
    cursor = await cursor_on(store)
    started: list[str] = []
    first_done, b_done = trio.Event(), trio.Event()

    async def handle(d: Mapping[str, Any]) -> None:
        started.append(str(d["id"]))
        if d["id"] == "1001":
            await first_done.wait()
        if d["channel_id"] == "B":
            await b_done.wait()

    dispatcher = dispatcher_on(cursor, handle)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(dispatcher.run)
            await trio.sleep(0.01)
            # Channel A's first admission blocks: it and the 63 behind it hold every lane.
            for seq in range(1, MAX_IN_FLIGHT + 1):
                await dispatcher.put(message(seq, "A"))
            full = MAX_IN_FLIGHT
            await dispatcher.put(message(full + 1, "B"))  # no room: queued
            await dispatcher.put(message(full + 2, "C", author=BOT))  # our own, behind it
            await dispatcher.put(message(full + 3, "C"))
            await trio.sleep(0.2)
            assert started == ["1001"]
            assert cursor.state.session is not None and cursor.state.session.seq == 0
            first_done.set()
            await trio.sleep(0.5)
            # Our own message and C's came after B: handled, but the watermark waits for B.
            assert cursor.state.session.seq == full
            b_done.set()
            await trio.sleep(0.2)
            assert cursor.state.session.seq == full + 3
            dispatcher.close()
    # Channel A in order; B and C once there was room; our own message never admitted.
    in_a = [n for n in started if int(n) <= 1000 + full]
    assert in_a == [str(1000 + seq) for seq in range(1, full + 1)]
    assert sorted(set(started) - set(in_a)) == [str(1000 + full + 1), str(1000 + full + 3)]
    assert len(started) == full + 2


async def test_the_watermark_is_saved_a_second_after_it_moved(store: Store) -> None:
    cursor = await cursor_on(store)
    admitted: list[str] = []

    async def handle(d: Mapping[str, Any]) -> None:
        admitted.append(str(d["id"]))

    dispatcher = dispatcher_on(cursor, handle)
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(dispatcher.run)
            await trio.sleep(SAVE_EVERY_S * 1.5)
            assert await stored_seq(store, cursor) is None  # nothing moved: nothing written
            await dispatcher.put(message(1, "A"))
            await dispatcher.put(message(2, "A"))
            await dispatcher.put(message(3, "B"))
            await trio.sleep(SAVE_EVERY_S / 4)
            await dispatcher.put(message(2, "A"))  # a duplicate of a handled dispatch
            await trio.sleep(SAVE_EVERY_S / 4)
            assert await stored_seq(store, cursor) is None  # moved, not yet saved
            await trio.sleep(SAVE_EVERY_S)
            assert await stored_seq(store, cursor) == 3
            dispatcher.close()
    assert sorted(admitted) == ["1001", "1002", "1003"]
