"""Whatever signal-cli (or something pretending to be it) sends, the receiver neither
crashes nor admits junk: random notifications are ignored and counted, random bytes end the
connection and it reconnects with backoff, and a real message afterwards still arrives."""

from __future__ import annotations

import json
import random
from typing import Any

import trio
from trio.testing import MockClock

from tests.fakes.signal_cli import ACCOUNT, FakeSignalCli, text_envelope

from .conftest import Recorder, wait_until

KEYS = (
    "envelope",
    "dataMessage",
    "message",
    "sourceUuid",
    "sourceNumber",
    "source",
    "sourceDevice",
    "timestamp",
    "groupInfo",
    "groupId",
    "type",
    "attachments",
    "subscription",
    "result",
    "account",
    "exception",
    "error",
    "reaction",
    "syncMessage",
    "receiptMessage",
    "typingMessage",
    "editMessage",
    "id",
)


def junk(rng: random.Random, depth: int = 0) -> Any:
    pick = rng.randrange(9 if depth < 4 else 5)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice([0, -1, 1, 2**53, 2**63, rng.randrange(-(10**6), 10**6)])
    if pick == 3:
        return rng.choice(
            [
                "",
                "x",
                "+15550000000",
                ACCOUNT,
                "\ufffc",
                "0f0f0f0f-1111-2222-3333-444444444444",
                "DELIVER",
                "UPDATE",
            ]
        )
    if pick == 4:
        return rng.random() * 1e6
    if pick in (5, 6):
        return {rng.choice(KEYS): junk(rng, depth + 1) for _ in range(rng.randrange(5))}
    return [junk(rng, depth + 1) for _ in range(rng.randrange(4))]


async def test_random_notifications_are_ignored_and_counted(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any, recorder: Recorder
) -> None:
    rng = random.Random(1405)
    adapter = make_adapter()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            sub = max(fake.subscriptions)
            for n in range(300):
                kind = rng.randrange(5)
                if kind == 0:  # a receive for our subscription with a random result
                    frame: Any = {
                        "jsonrpc": "2.0",
                        "method": "receive",
                        "params": {"subscription": sub, "result": junk(rng)},
                    }
                elif kind == 1:  # random params altogether
                    frame = {"jsonrpc": "2.0", "method": "receive", "params": junk(rng)}
                elif kind == 2:  # another method, maybe with an id (a request to us)
                    frame = {
                        "jsonrpc": "2.0",
                        "method": rng.choice(["callEvent", "send", "x"]),
                        "params": junk(rng),
                    }
                    if rng.random() < 0.5:
                        frame["id"] = n
                elif kind == 3:  # a response nobody asked for
                    frame = {
                        "jsonrpc": "2.0",
                        "id": rng.choice([None, n, "p1", 10**9]),
                        "result": junk(rng),
                    }
                else:  # an envelope of random parts under our subscription and account
                    envelope = {rng.choice(KEYS): junk(rng) for _ in range(rng.randrange(6))}
                    frame = {
                        "jsonrpc": "2.0",
                        "method": "receive",
                        "params": {
                            "subscription": sub,
                            "result": {"envelope": envelope, "account": ACCOUNT},
                        },
                    }
                await fake.inject(frame)
            fake.push(text_envelope("still here"))
            await wait_until(lambda: "still here" in recorder.texts)
            nursery.cancel_scope.cancel()
    assert all(e.text.strip() for e in recorder.events)  # nothing empty got through
    assert adapter.statistics().subscriptions == 1  # valid JSON-RPC never broke the connection
    assert sum(adapter.statistics().ignored.values()) >= 100


async def test_random_bytes_end_the_connection_and_it_comes_back(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any, recorder: Recorder
) -> None:
    rng = random.Random(2207)
    samples = [
        b"\xff\xfe\x00garbage",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"jsonrpc":"2.0","method":"receive","params":{}}}',
        b'{"jsonrpc":"2.0",',
        bytes(rng.randrange(256) for _ in range(200)).replace(b"\n", b" "),
        json.dumps({"jsonrpc": 2.0, "method": "receive"}).encode(),
    ]
    adapter = make_adapter()
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            for n, sample in enumerate(samples, start=1):
                await wait_until(lambda: adapter.health()["subscription"] == "active")
                await fake.inject(sample + b"\n")
                await fake.wait_until(lambda n=n: len(fake.subscribe_log) == n + 1)  # type: ignore[misc]
            await wait_until(lambda: adapter.health()["subscription"] == "active")
            fake.push(text_envelope("after the noise"))
            await recorder.wait_for(1)
            nursery.cancel_scope.cancel()
    assert recorder.texts == ["after the noise"]
    assert adapter.statistics().bad_frames == len(samples)
