"""The control socket's multi-instance additions: ``events {fromNow}``, the inbox's dead
letters (``listInbox`` / ``settleInbox``), its depth in ``health``, its rows in ``prune``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import trio

from prismd.control import ControlConfig, Operator
from stores import OwnershipScope
from stores.memory import MemoryStore
from tests.support.clocks import ManualClock

from .test_control_support import connect, running_server

DEADLINE = 10
SECRET_TEXT = "the update's own words"


def control(tmp_path: Path, **kwargs: Any) -> ControlConfig:
    return ControlConfig(socket=str(tmp_path / "run" / "control.sock"), **kwargs)


async def _save(store: MemoryStore, key: str) -> None:
    await store.checkpoints.save_checkpoint(
        namespace="test.ns",
        key=key,
        scope=OwnershipScope("default", "web", "u1"),
        version=1,
        value={"n": 1},
        metadata={"kind": "operation", "state": "accepted"},
    )


async def test_events_from_now_start_at_the_end_and_follow_from_there(tmp_path: Path) -> None:
    store = MemoryStore()
    await _save(store, "a")
    await _save(store, "b")
    config = control(tmp_path)
    with trio.fail_after(DEADLINE):
        async with running_server(config, store=store), connect(config.socket) as client:
            everything = await client.result("events", {})
            end = everything["events"][-1]["seq"]
            now = await client.result("events", {"fromNow": True})
            assert now == {"events": [], "cursor": end}
            refused = await client.call("events", {"fromNow": True, "after": 0})
            assert refused["error"]["code"] == -32602
            assert "fromNow" in refused["error"]["message"]
            await client.send_raw(
                b'{"jsonrpc":"2.0","id":7,"method":"events",'
                b'"params":{"follow":true,"fromNow":true}}\n'
            )
            first = await client.read_message()
            assert first["result"] == {"events": [], "cursor": end}
            await _save(store, "c")
            later = await client.read_message()
            assert [e["key"] for e in later["result"]["events"]] == ["c"]
            assert later["result"]["events"][0]["metadata"]["state"] == "accepted"


async def _dead_letters(store: MemoryStore, source: str, keys: list[str]) -> None:
    """Items of ``source`` that failed their only attempt."""
    for order, key in enumerate(keys):
        assert await store.inbox.put(
            source=source, key=key, partition=f"chat-{key}", order=order, payload=SECRET_TEXT
        )
    reservations = await store.inbox.reserve(
        owner_id="worker", ttl_ms=60_000, limit=len(keys), max_attempts=1, sources=[source]
    )
    assert len(reservations) == len(keys)
    for reservation in reservations:
        item = await store.inbox.retry(
            reservation, delay_ms=0, error="admit_failed", max_attempts=1
        )
        assert item is not None and item.state == "dead"


async def test_dead_letters_are_listed_paged_and_settled_without_their_content(
    tmp_path: Path,
) -> None:
    store = MemoryStore()
    await _dead_letters(store, "tg", ["10", "11", "12"])
    await _dead_letters(store, "tg2", ["20"])
    assert await store.inbox.put(source="tg", key="13", partition="p", order=9, payload=1)
    config = control(tmp_path)
    with trio.fail_after(DEADLINE):
        async with (
            running_server(config, store=store, inbox_sources=("tg", "tg2")),
            connect(config.socket) as client,
        ):
            listed = await client.call("listInbox", {})
            assert SECRET_TEXT not in json.dumps(listed)
            items = listed["result"]["items"]
            assert [(i["connectionId"], i["updateId"]) for i in items] == [
                ("tg", "10"),
                ("tg", "11"),
                ("tg", "12"),
                ("tg2", "20"),
            ]
            assert {i["state"] for i in items} == {"dead"}
            assert items[0]["attempts"] == 1
            assert items[0]["error"] == "admit_failed"
            assert items[0]["createdAt"].endswith("Z")
            assert listed["result"]["nextCursor"] is None

            pending = await client.result("listInbox", {"state": "pending"})
            assert [i["updateId"] for i in pending["items"]] == ["13"]

            first = await client.result("listInbox", {"connectionId": "tg", "limit": 2})
            assert [i["updateId"] for i in first["items"]] == ["10", "11"]
            rest = await client.result(
                "listInbox", {"connectionId": "tg", "limit": 2, "after": first["nextCursor"]}
            )
            assert [i["updateId"] for i in rest["items"]] == ["12"]
            assert rest["nextCursor"] is None

            for params, says in [
                ({"state": "lost"}, "param 'state'"),
                ({"after": first["nextCursor"]}, "needs param 'connectionId'"),
                ({"connectionId": "tg", "after": "not-a-cursor"}, "nextCursor"),
                ({"limit": 0}, "param 'limit'"),
            ]:
                refused = await client.call("listInbox", params)
                assert refused["error"]["code"] == -32602, params
                assert says in refused["error"]["message"]

            retried = await client.result(
                "settleInbox", {"connectionId": "tg", "updateId": "11", "action": "retry"}
            )
            assert retried["status"] == "settled"
            assert retried["item"]["state"] == "pending"
            discarded = await client.result(
                "settleInbox", {"connectionId": "tg", "updateId": "10", "action": "discard"}
            )
            assert discarded["item"]["state"] == "discarded"
            again = await client.result(
                "settleInbox", {"connectionId": "tg", "updateId": "10", "action": "retry"}
            )
            assert again["status"] == "not_found"
            assert "list-inbox" in again["hint"]
            bad = await client.call(
                "settleInbox", {"connectionId": "tg", "updateId": "12", "action": "drop"}
            )
            assert bad["error"]["code"] == -32602
            dead = await client.result("listInbox", {"connectionId": "tg"})
            assert [i["updateId"] for i in dead["items"]] == ["12"]
            depth = (await client.result("health"))["inbox"]
            assert depth == {"pending": 2, "claimed": 0, "dead": 2}


async def test_an_operator_scoped_to_a_user_or_another_account_sees_no_inbox_rows(
    tmp_path: Path,
) -> None:
    store = MemoryStore()
    await _dead_letters(store, "tg", ["10"])
    config = control(
        tmp_path,
        operators=(Operator(uid=os.getuid(), tenant="default", account="web", user="u1"),),
    )
    with trio.fail_after(DEADLINE):
        async with (
            running_server(config, store=store, inbox_sources=("tg",)),
            connect(config.socket) as client,
        ):
            assert (await client.result("listInbox", {}))["items"] == []
            assert (await client.result("listInbox", {"connectionId": "tg"}))["items"] == []
            refused = await client.result(
                "settleInbox", {"connectionId": "tg", "updateId": "10", "action": "discard"}
            )
            assert refused["status"] == "not_found"
    item = (await store.inbox.list_items(source="tg")).items[0]
    assert item.state == "dead"


async def test_health_without_an_inbox_has_no_depth_and_prune_deletes_old_inbox_rows(
    tmp_path: Path,
) -> None:
    clock = ManualClock(1_800_000_000_000)
    store = MemoryStore(clock=clock)
    for order in range(3):
        assert await store.inbox.put(
            source="tg", key=str(order), partition="p", order=order, payload=order
        )
        (reservation,) = await store.inbox.reserve(owner_id="w", ttl_ms=1000, max_attempts=3)
        assert await store.inbox.complete(reservation)
    await _dead_letters(store, "tg", ["9"])
    day = 86_400_000
    clock.ms += 3 * day
    config = control(tmp_path)
    with trio.fail_after(DEADLINE):
        async with running_server(config, store=store), connect(config.socket) as client:
            assert "inbox" not in await client.result("health")
        async with (
            running_server(config, store=store, retention_ms=2 * day),
            connect(config.socket) as client,
        ):
            # The recording runtime's own totals (4 scanned, 2 deleted) plus three rows.
            moment = "2027-01-18T08:00:00Z"  # the clock: three days on
            pruned = await client.result("prune", {"now": moment})
            assert (pruned["scanned"], pruned["deleted"]) == (7, 5)
            again = await client.result("prune", {"now": moment})
            assert again["deleted"] == 2
    left = (await store.inbox.list_items(source="tg")).items
    assert [(i.key, i.state) for i in left] == [("9", "dead")]
