"""adapters.toolkit.open_jsonrpc_client against a loopback JSON-RPC server (a stand-in for
signal-cli's ``--tcp`` daemon): ids, errors, notifications, per-call deadlines, bounded
pending calls, a server that goes away or misbehaves."""

from __future__ import annotations

import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
from trio.testing import MockClock

from adapters.toolkit import (
    Incoming,
    JsonRpcConnectionError,
    JsonRpcTimeoutError,
    RpcError,
    open_jsonrpc_client,
)

DEADLINE = 10

Handler = Callable[[dict[str, Any], Callable[[Any], Awaitable[None]]], Awaitable[None]]


@asynccontextmanager
async def loopback_server(handle: Handler) -> AsyncIterator[tuple[trio.SocketStream, list[Any]]]:
    """A TCP server on 127.0.0.1 that runs ``handle(request, send)`` for every line it reads
    (each in its own task, so answers may come out of order); yields a connected client
    stream and the list of requests seen."""
    seen: list[Any] = []

    async def serve(stream: trio.SocketStream) -> None:
        async with stream, trio.open_nursery() as nursery:
            lock = trio.Lock()

            async def send(message: Any) -> None:
                async with lock:
                    data = message if isinstance(message, bytes) else json.dumps(message).encode()
                    await stream.send_all(data + b"\n")

            buffer = b""
            while data := await stream.receive_some(65536):
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    request = json.loads(line)
                    seen.append(request)
                    nursery.start_soon(handle, request, send)
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        (listener,) = await nursery.start(
            functools.partial(trio.serve_tcp, host="127.0.0.1"), serve, 0
        )
        port = listener.socket.getsockname()[1]
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        yield stream, seen
        nursery.cancel_scope.cancel()


def answer(request: dict[str, Any], result: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request["id"], "result": result}


async def test_calls_are_matched_by_id_even_out_of_order() -> None:
    async def handle(request: dict[str, Any], send: Callable[[Any], Awaitable[None]]) -> None:
        if request["method"] == "slow":
            await trio.sleep(0.2)
        await send(answer(request, {"echo": request.get("params"), "method": request["method"]}))

    with trio.fail_after(DEADLINE):
        async with (
            loopback_server(handle) as (stream, seen),
            open_jsonrpc_client(stream) as client,
        ):
            results: dict[str, Any] = {}

            async def call(method: str) -> None:
                results[method] = await client.call(method, {"n": method})

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, "slow")
                await trio.sleep(0.05)
                nursery.start_soon(call, "fast")
            assert results == {
                "slow": {"echo": {"n": "slow"}, "method": "slow"},
                "fast": {"echo": {"n": "fast"}, "method": "fast"},
            }
            assert await client.call("version") == {"echo": None, "method": "version"}
            assert client.pending == 0
    assert [r["id"] for r in seen] == [1, 2, 3]
    assert all(r["jsonrpc"] == "2.0" for r in seen) and "params" not in seen[2]


async def test_an_error_response_raises_with_the_servers_code() -> None:
    async def handle(request: dict[str, Any], send: Callable[[Any], Awaitable[None]]) -> None:
        error = {"code": -5, "message": "Rate limit exceeded", "data": {"retryAfterSeconds": 3}}
        await send({"jsonrpc": "2.0", "id": request["id"], "error": error})

    with trio.fail_after(DEADLINE):
        async with (
            loopback_server(handle) as (stream, _seen),
            open_jsonrpc_client(stream) as client,
        ):
            with pytest.raises(RpcError) as info:
                await client.call("send", {"message": "hi"})
    assert (info.value.code, info.value.message) == (-5, "Rate limit exceeded")
    assert info.value.data == {"retryAfterSeconds": 3}


async def test_notifications_arrive_in_order_and_server_requests_are_refused() -> None:
    refused = trio.Event()

    async def handle(request: dict[str, Any], send: Callable[[Any], Awaitable[None]]) -> None:
        if "error" in request:
            refused.set()
        if request.get("method") == "subscribeReceive":
            for n in range(3):
                await send({"jsonrpc": "2.0", "method": "receive", "params": {"n": n}})
            await send({"jsonrpc": "2.0", "id": "srv-1", "method": "whoAreYou"})
            await send(answer(request, 7))

    with trio.fail_after(DEADLINE):
        async with (
            loopback_server(handle) as (stream, seen),
            open_jsonrpc_client(stream) as client,
        ):
            assert await client.call("subscribeReceive") == 7
            notes = [await client.notifications.receive() for _ in range(3)]
            assert notes == [Incoming("receive", {"n": n}) for n in range(3)]
            await refused.wait()
    assert seen[1] == {
        "jsonrpc": "2.0",
        "id": "srv-1",
        "error": {"code": -32601, "message": "method not found"},
    }


@pytest.mark.slow
async def test_a_call_past_its_deadline_times_out_and_its_late_answer_is_dropped(
    mock_clock: MockClock,
) -> None:
    mock_clock.autojump_threshold = 0.1  # virtual time moves only when the loopback is idle

    async def handle(request: dict[str, Any], send: Callable[[Any], Awaitable[None]]) -> None:
        if request["method"] == "hang":
            await trio.sleep(30)
        await send(answer(request, request["method"]))

    with trio.fail_after(600):
        async with (
            loopback_server(handle) as (stream, _seen),
            open_jsonrpc_client(stream, timeout_s=10) as client,
        ):
            start = trio.current_time()
            with pytest.raises(JsonRpcTimeoutError) as info:
                await client.call("hang")
            assert info.value.sent is True  # the server may act on it: ambiguous
            assert 10 <= trio.current_time() - start < 11
            with pytest.raises(JsonRpcTimeoutError):
                await client.call("hang", timeout_s=2)
            assert await client.call("ok") == "ok"  # the connection is still good
            await trio.sleep(40)
            assert client.late_answers == 2 and client.pending == 0


async def test_pending_calls_are_bounded(mock_clock: MockClock) -> None:
    mock_clock.autojump_threshold = 0.1
    release = trio.Event()

    async def handle(request: dict[str, Any], send: Callable[[Any], Awaitable[None]]) -> None:
        await release.wait()
        await send(answer(request, request["params"]["n"]))

    with trio.fail_after(600):
        async with (
            loopback_server(handle) as (stream, seen),
            open_jsonrpc_client(stream, max_pending=2, timeout_s=60) as client,
        ):
            results: list[int] = []

            async def call(n: int) -> None:
                results.append(await client.call("work", {"n": n}))

            async with trio.open_nursery() as nursery:
                for n in range(3):
                    nursery.start_soon(call, n)
                await trio.sleep(5)
                assert client.pending == 2 and len(seen) == 2  # the third waits for a slot
                # no slot within its deadline: it never left, so it is safe to retry
                with pytest.raises(JsonRpcTimeoutError) as info:
                    await client.call("work", {"n": 9}, timeout_s=1)
                assert info.value.sent is False
                release.set()
            assert sorted(results) == [0, 1, 2]


async def test_a_server_that_goes_away_fails_pending_calls_and_ends_notifications() -> None:
    gone = trio.Event()

    async def handle(request: dict[str, Any], send: Callable[[Any], Awaitable[None]]) -> None:
        gone.set()
        await trio.sleep_forever()

    with trio.fail_after(DEADLINE):
        async with (
            loopback_server(handle) as (stream, _seen),
            open_jsonrpc_client(stream) as client,
        ):

            async def cut() -> None:
                await gone.wait()
                # the server side closes: the client sees EOF
                await client._stream.send_eof()  # type: ignore[attr-defined]

            async with trio.open_nursery() as nursery:
                nursery.start_soon(cut)
                with pytest.raises(JsonRpcConnectionError) as info:
                    await client.call("send")
                assert info.value.sent is True
            with pytest.raises(JsonRpcConnectionError) as again:
                await client.call("send")
            assert again.value.sent is False
            with pytest.raises(trio.EndOfChannel):
                await client.notifications.receive()


async def test_an_oversized_frame_breaks_the_connection_instead_of_buffering() -> None:
    async def handle(request: dict[str, Any], send: Callable[[Any], Awaitable[None]]) -> None:
        await send(b'{"jsonrpc":"2.0","method":"receive","params":"' + b"x" * 5000 + b'"}')
        await send(answer(request, "too late"))

    with trio.fail_after(DEADLINE):
        async with (
            loopback_server(handle) as (stream, _seen),
            open_jsonrpc_client(stream, max_frame_bytes=1024) as client,
        ):
            with pytest.raises(JsonRpcConnectionError):
                await client.call("version")


async def test_unreadable_frames_are_dropped_not_fatal() -> None:
    async def handle(request: dict[str, Any], send: Callable[[Any], Awaitable[None]]) -> None:
        await send(b"not json at all")
        await send(b"[1, 2]")
        await send(answer(request, "fine"))

    with trio.fail_after(DEADLINE):
        async with (
            loopback_server(handle) as (stream, _seen),
            open_jsonrpc_client(stream) as client,
        ):
            assert await client.call("version") == "fine"


async def test_bad_bounds_are_refused() -> None:
    left, _right = trio.testing.memory_stream_pair()
    for kwargs in ({"timeout_s": 0}, {"max_pending": 0}, {"max_notifications": -1}):
        with pytest.raises(ValueError):
            async with open_jsonrpc_client(left, **kwargs):  # type: ignore[arg-type]
                pass
