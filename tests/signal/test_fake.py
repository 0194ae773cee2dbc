"""The fake signal-cli itself follows ``protocols-telegram-signal.md`` §2 and the sg03
request/response samples, so the adapter tests exercise what signal-cli does."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import attrs
import pytest
import trio
from trio.testing import MockClock

from tests.fakes.signal_cli import ACCOUNT, FakeSignalCli, SendOutcome, text_envelope

from .conftest import fixture

DEADLINE = 10


@attrs.define(eq=False)
class Raw:
    """A bare line client on the fake's socket."""

    stream: trio.abc.Stream
    buffer: bytearray = attrs.field(factory=bytearray)

    async def send(self, line: bytes | dict[str, Any] | list[Any]) -> None:
        data = line if isinstance(line, bytes) else json.dumps(line).encode()
        await self.stream.send_all(data + b"\n")

    async def line(self) -> Any:
        with trio.fail_after(DEADLINE):
            while b"\n" not in self.buffer:
                data = await self.stream.receive_some(65536)
                assert data, "connection closed"
                self.buffer += data
        end = self.buffer.index(b"\n")
        raw = bytes(self.buffer[:end])
        del self.buffer[: end + 1]
        return json.loads(raw)

    async def call(self, request_id: Any, method: str, params: Any = None) -> Any:
        message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
        if params is not None:
            message["params"] = params
        await self.send(message)
        while True:
            answer = await self.line()
            if isinstance(answer, dict) and answer.get("id") == request_id:
                return answer


_OPEN: list[trio.abc.Stream] = []


async def raw(fake: FakeSignalCli, tcp: bool = False) -> Raw:
    if tcp:
        stream: trio.abc.Stream = await trio.open_tcp_stream("127.0.0.1", fake.port)
    else:
        assert fake.socket_path is not None
        stream = await trio.open_unix_socket(fake.socket_path)
    _OPEN.append(stream)
    return Raw(stream)


@pytest.fixture(autouse=True)
async def _close_clients() -> AsyncIterator[None]:
    yield
    while _OPEN:
        await trio.aclose_forcefully(_OPEN.pop())


async def test_subscription_ids_come_from_one_counter_across_connections(
    fake: FakeSignalCli,
) -> None:
    a, b = await raw(fake), await raw(fake, tcp=True)
    assert await a.call("id", "subscribeReceive") == {"jsonrpc": "2.0", "result": 0, "id": "id"}
    assert (await b.call(1, "subscribeReceive"))["result"] == 1
    assert (await a.call(2, "subscribeCallEvents"))["result"] == 2
    assert (await b.call(3, "subscribeReceive"))["result"] == 3
    assert fake.subscriptions == {0: 1, 1: 2, 3: 2}
    # a subscription belongs to its connection
    assert (await a.call("u1", "unsubscribeReceive", {"subscription": 1}))["error"] == {
        "code": -1,
        "message": "Unknown subscription id",
        "data": None,
    }
    assert await b.call("u1", "unsubscribeReceive", {"subscription": 1}) == {
        "jsonrpc": "2.0",
        "result": {},
        "id": "u1",
    }
    assert fake.subscriptions == {0: 1, 3: 2}
    # a closed connection drops its subscriptions
    await b.stream.aclose()
    with trio.fail_after(DEADLINE):
        await fake.wait_until(lambda: fake.subscriptions == {0: 1})


async def test_messages_wait_until_subscribed_and_are_handed_out_once(fake: FakeSignalCli) -> None:
    fake.push(text_envelope("one"))
    fake.push(text_envelope("two", timestamp=2))
    a = await raw(fake)
    await trio.sleep(0.05)
    assert len(fake.queue) == 2 and not fake.deliveries
    await a.send({"jsonrpc": "2.0", "id": 1, "method": "subscribeReceive"})
    seen: list[Any] = []
    while len(seen) < 3:
        seen.append(await a.line())
    notes = [m for m in seen if m.get("method") == "receive"]
    assert [n["params"]["result"]["envelope"]["dataMessage"]["message"] for n in notes] == [
        "one",
        "two",
    ]
    assert notes[0] == {
        "jsonrpc": "2.0",
        "method": "receive",
        "params": {
            "subscription": 0,
            "result": {"envelope": text_envelope("one"), "account": ACCOUNT},
        },
    }
    # a later subscriber does not get them again
    b = await raw(fake)
    assert (await b.call(9, "subscribeReceive"))["result"] == 1
    fake.push(text_envelope("three", timestamp=3))
    got_a = await a.line()
    got_b = await b.line()
    assert got_a["params"]["subscription"] == 0 and got_b["params"]["subscription"] == 1
    with trio.fail_after(DEADLINE):
        await fake.wait_until(lambda: len(fake.deliveries) == 4)
    assert not fake.queue


async def test_framing_errors_are_answered_like_signal_cli(fake: FakeSignalCli) -> None:
    c = await raw(fake)
    await c.send(b"")
    assert await c.line() == {
        "jsonrpc": "2.0",
        "error": {"code": -32700, "message": "Empty input line", "data": None},
        "id": None,
    }
    await c.send(b"{not json")
    answer = await c.line()
    assert answer["error"]["code"] == -32700 and answer["id"] is None
    await c.send(b"5")
    assert (await c.line())["error"] == {
        "code": -32600,
        "message": "unexpected type: NUMBER",
        "data": None,
    }
    await c.send([])
    assert (await c.line())["error"]["message"] == "invalid request"
    manpage = fixture("sg03_rpc_request_response_examples.json")["invalid_request_manpage"]
    await c.send(manpage["request"])
    assert await c.line() == manpage["response"]
    await c.send({"jsonrpc": "1.0", "id": 7, "method": "send"})
    assert await c.line() == {
        "jsonrpc": "2.0",
        "error": {"code": -32600, "message": "only jsonrpc version 2.0 is supported", "data": None},
        "id": 7,
    }
    assert (await c.call(8, "listContacts"))["error"] == {
        "code": -32601,
        "message": "Method not implemented",
        "data": None,
    }
    # a notification (no id) is run and never answered; the next answer is the next call's
    await c.send({"jsonrpc": "2.0", "method": "subscribeReceive"})
    assert (await c.call(10, "version"))["result"] == {"version": "0.14.6"}
    assert 0 in fake.subscriptions
    # a batch is answered with one array
    await c.send(
        [
            {"jsonrpc": "2.0", "id": "x", "method": "version"},
            {"jsonrpc": "2.0", "id": "y", "method": "nope"},
        ]
    )
    batch = await c.line()
    assert sorted(m["id"] for m in batch) == ["x", "y"]


async def test_send_results_and_errors_have_the_documented_shapes(fake: FakeSignalCli) -> None:
    samples = fixture("sg03_rpc_request_response_examples.json")
    c = await raw(fake)
    ok = await c.call(
        4, "send", {"recipient": ["f369fa48-ab4e-4265-9a74-5d53f7c1e00b"], "message": "MESSAGE"}
    )
    shape = samples["send_full_result_shape_DERIVED"]
    assert set(ok) == set(shape) and set(ok["result"]) == set(shape["result"])
    assert (
        ok["result"]["results"] == shape["result"]["results"][:1]
        or ok["result"]["results"][0]["type"] == "SUCCESS"
    )
    assert (
        ok["result"]["results"][0]["recipientAddress"]["uuid"]
        == "f369fa48-ab4e-4265-9a74-5d53f7c1e00b"
    )
    fake.script_send(SendOutcome.results("RATE_LIMIT_FAILURE"))
    limited = await c.call(4, "send", {"recipient": "+16178691278", "message": "MESSAGE"})
    sample = samples["send_all_failed_ratelimit_DERIVED"]
    assert limited["error"]["code"] == sample["error"]["code"] == -5
    assert limited["error"]["message"] == sample["error"]["message"]
    got = limited["error"]["data"]["response"]["results"][0]
    want = sample["error"]["data"]["response"]["results"][0]
    assert (
        set(got) == set(want)
        and got["type"] == want["type"]
        and got["recipientAddress"]["number"] == "+16178691278"
    )
    fake.script_send(SendOutcome.results("IDENTITY_FAILURE"))
    assert (await c.call(5, "send", {"recipient": ["+1555"], "message": "m"}))["error"][
        "code"
    ] == -4
    fake.script_send(SendOutcome.results("UNREGISTERED_FAILURE"))
    assert (await c.call(6, "send", {"recipient": ["+1555"], "message": "m"}))["error"][
        "code"
    ] == -1
    empty = await c.call(7, "send", {"recipient": ["+1555"], "message": ""})
    assert empty["error"]["code"] == -1 and "empty message" in empty["error"]["message"]
    group = await c.call(8, "send", {"groupId": "R1JPVVA=", "message": "hi"})
    assert [r["groupId"] for r in group["result"]["results"]] == ["R1JPVVA=", "R1JPVVA="]
    assert [s["message"] for s in fake.sends] == ["MESSAGE", "hi"]


async def test_a_killed_process_resets_connections_and_restarts_fresh(
    autojump_clock: MockClock, fake: FakeSignalCli, nursery: trio.Nursery
) -> None:
    c = await raw(fake)
    assert (await c.call(1, "subscribeReceive"))["result"] == 0
    await fake.kill()
    assert fake.socket_path is not None
    assert await trio.Path(fake.socket_path).exists()  # left behind
    with trio.fail_after(DEADLINE):
        try:
            data = await c.stream.receive_some(10)
        except trio.BrokenResourceError:
            data = b""
    assert data == b""
    with pytest.raises(OSError):
        _OPEN.append(await trio.open_unix_socket(fake.socket_path))
    fake.push(text_envelope("while down"))
    await fake.start(nursery)
    d = await raw(fake)
    assert (await d.call(1, "subscribeReceive"))["result"] == 0  # a new process counts from 0
    assert (await d.line())["params"]["result"]["envelope"]["dataMessage"][
        "message"
    ] == "while down"
    t = await raw(fake, tcp=True)
    assert (await t.call(2, "version"))["result"]["version"] == "0.14.6"
    assert fake.starts == 2
