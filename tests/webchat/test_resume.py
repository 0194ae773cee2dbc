"""Resume tokens: which browser owns an actor id (adapter against a real checkpoint store)."""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import pytest
import trio
import trio_websocket

from adapters.webchat import _tokens as webchat
from adapters.webchat._tokens import RESUME_NAMESPACE
from stores import CheckpointStore, OwnershipScope, StoreUnavailableError
from stores.memory import MemoryStore
from tests.support.clocks import ManualClock

from ._support import FIXED_NOW_MS, connect, hello, recv, send, start

ACTOR = "resume-actor-0001"
DAY_MS = 24 * 60 * 60 * 1000
REFUSED = {
    "type": "error",
    "message": "this chat belongs to another browser; start a new one",
    "code": "resume_refused",
}


async def stored_records(checkpoints: CheckpointStore) -> list[Any]:
    page = await checkpoints.list_checkpoints(namespace=RESUME_NAMESPACE)
    return list(page.items)


async def refused(ws: trio_websocket.WebSocketConnection, frame: dict[str, Any]) -> None:
    await send(ws, frame)
    assert await recv(ws) == REFUSED
    with pytest.raises(trio_websocket.ConnectionClosed) as info:
        await ws.get_message()
    assert info.value.reason is not None and info.value.reason.code == 1008


async def test_first_hello_issues_a_token_that_is_stored_only_as_a_hash(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(10):
        async with MemoryStore() as store:
            adapter, recorder = await start(nursery, checkpoints=store.checkpoints)
            async with connect(adapter) as ws:
                resume = await hello(ws, ACTOR)
            [row] = await stored_records(store.checkpoints)
            assert row.scope == OwnershipScope("prismd-service", "web", ACTOR)
            assert row.value == {
                "tokenHash": hashlib.sha256(resume.encode()).hexdigest()[:40],
                "lastSeenAtMs": FIXED_NOW_MS,
            }
            assert resume not in json.dumps(row.value)
            # the same browser comes back: accepted, not sent the token again
            async with connect(adapter) as ws:
                assert await hello(ws, ACTOR, resume) == resume
                await send(ws, {"type": "message", "id": "m1", "text": "back"})
                assert (await recv(ws))["status"] == "accepted"
            # without it, or with another one, the id is refused and nothing is admitted
            for frame in (
                {"type": "hello", "actor": ACTOR},
                {"type": "hello", "actor": ACTOR, "resume": "Z" * 43},
            ):
                async with connect(adapter) as ws:
                    await refused(ws, frame)
    assert [e.text for e in recorder.events] == ["back"]
    stats = adapter.statistics()
    assert (stats.hellos_refused, stats.open_sockets) == (2, 0)


async def test_a_malformed_token_is_bad_input_and_the_socket_stays_open(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(10):
        adapter, _ = await start(nursery)
        async with connect(adapter) as ws:
            for bad in ("short", 42, "x" * 43 + "!", "A" * 44):
                await send(ws, {"type": "hello", "actor": ACTOR, "resume": bad})
                assert await recv(ws) == {"type": "error", "message": "invalid resume token"}
            await hello(ws, ACTOR)  # still waiting for a valid hello
        assert adapter.statistics().rejected_frames == 4


async def test_two_browsers_claiming_a_fresh_id_at_once_one_wins(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        async with MemoryStore() as store:
            adapter, _ = await start(nursery, checkpoints=store.checkpoints)
            answers: list[dict[str, Any]] = []
            async with connect(adapter) as one, connect(adapter) as two:

                async def claim(ws: trio_websocket.WebSocketConnection) -> None:
                    await send(ws, {"type": "hello", "actor": ACTOR})
                    answers.append(await recv(ws))

                async with trio.open_nursery() as both:
                    both.start_soon(claim, one)
                    both.start_soon(claim, two)
            kinds = sorted(a["type"] for a in answers)
            assert kinds == ["error", "ready"], answers
            [winner] = [a for a in answers if a["type"] == "ready"]
            assert len(await stored_records(store.checkpoints)) == 1
            async with connect(adapter) as ws:
                await hello(ws, ACTOR, winner["resume"])


async def test_an_id_unused_past_its_ttl_is_free_again_and_swept(nursery: trio.Nursery) -> None:
    clock = ManualClock(FIXED_NOW_MS)
    with trio.fail_after(10):
        async with MemoryStore(clock=clock) as store:
            adapter, _ = await start(
                nursery, checkpoints=store.checkpoints, clock=clock, resume_ttl_days=2
            )
            async with connect(adapter) as ws:
                old = await hello(ws, ACTOR)
            clock.ms += DAY_MS + 1
            async with connect(adapter) as ws:
                await hello(ws, ACTOR, old)  # used: last seen moves on (written daily)
            [row] = await stored_records(store.checkpoints)
            assert row.value["lastSeenAtMs"] == clock.ms
            clock.ms += 2 * DAY_MS + 1
            async with connect(adapter) as ws:
                new = await hello(ws, ACTOR)  # expired: a new browser may take the id
            assert new != old
            async with connect(adapter) as ws:
                await refused(ws, {"type": "hello", "actor": ACTOR, "resume": old})
            # the sweep deletes records unused past the TTL (and keeps live ones)
            async with connect(adapter) as ws:
                await hello(ws, "other-actor-0002")
            clock.ms += 2 * DAY_MS + 1
            async with connect(adapter) as ws:
                await hello(ws, "fresh-actor-0003")
            assert await adapter._tokens.sweep() == 2
            assert [r.key for r in await stored_records(store.checkpoints)] == [
                "w1:web:fresh-actor-0003"
            ]


class FailingCheckpoints:
    """A store whose every call fails as an unreachable backend does."""

    async def load_checkpoint(self, **_kwargs: Any) -> None:
        await trio.lowlevel.checkpoint()
        raise StoreUnavailableError("backend down at resume-token-check")

    list_checkpoints = load_checkpoint


async def test_a_store_failure_is_unavailable_and_never_logs_the_token(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with trio.fail_after(10):
        adapter, recorder = await start(nursery, checkpoints=FailingCheckpoints())
        presented = "R" * 43
        async with connect(adapter) as ws:
            await send(ws, {"type": "hello", "actor": ACTOR, "resume": presented})
            assert await recv(ws) == {
                "type": "error",
                "message": "the chat is unavailable; try again later",
                "code": "unavailable",
            }
            with pytest.raises(trio_websocket.ConnectionClosed) as info:
                await ws.get_message()
            assert info.value.reason is not None and info.value.reason.code == 1011
    assert recorder.events == []
    assert "resume check failed: StoreUnavailableError" in caplog.text
    assert presented not in caplog.text and "backend down" not in caplog.text


async def test_the_sweep_is_bounded_and_goes_on_where_it_stopped(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(webchat, "SWEEP_PAGES", 1)
    monkeypatch.setattr(webchat, "SWEEP_PAGE_SIZE", 2)
    clock = ManualClock(FIXED_NOW_MS)
    with trio.fail_after(10):
        async with MemoryStore(clock=clock) as store:
            adapter, _ = await start(
                nursery, checkpoints=store.checkpoints, clock=clock, resume_ttl_days=2
            )
            for name in ("old-actor-000a", "old-actor-000b", "old-actor-000c"):
                clock.ms += 1
                async with connect(adapter) as ws:
                    await hello(ws, name)
            clock.ms += 3 * DAY_MS
            for name in ("new-actor-000d", "new-actor-000e"):
                clock.ms += 1
                async with connect(adapter) as ws:
                    await hello(ws, name)
            # newest first, two rows a call: the live ones, then the oldest in two steps
            assert [await adapter._tokens.sweep() for _ in range(4)] == [0, 2, 1, 0]
            keys = sorted(r.key for r in await stored_records(store.checkpoints))
            assert keys == ["w1:web:new-actor-000d", "w1:web:new-actor-000e"]
