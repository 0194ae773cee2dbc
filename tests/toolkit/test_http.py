"""adapters.toolkit HTTP pieces over real loopback sockets: an error answered before the
request was read whole (413 to a client still uploading) reaches the client, because the
server closes gracefully; the idle-connection choice (silent close or 408)."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
import trio

from adapters.toolkit import (
    HttpError,
    close_gracefully,
    read_body,
    read_request_head,
    respond,
    server_connection,
)

DEADLINE = 20
UPLOAD = 2 * 1024 * 1024  # far beyond what the server accepts, and beyond socket buffers


@asynccontextmanager
async def server(*, answer_silence: bool = False) -> AsyncIterator[int]:
    """A toolkit HTTP server on 127.0.0.1 accepting bodies of at most 1000 bytes."""

    async def handle(stream: trio.SocketStream) -> None:
        conn = server_connection()
        head = await read_request_head(stream, conn, timeout_s=2, answer_silence=answer_silence)
        if head is not None:
            try:
                body = await read_body(stream, conn, head, max_bytes=1000, timeout_s=5)
            except HttpError as refused:
                await respond(stream, conn, head.method, refused.status, b"refused\n")
            else:
                await respond(stream, conn, head.method, 200, b"%d bytes\n" % len(body))
        await close_gracefully(stream)

    async with trio.open_nursery() as nursery:
        serve = functools.partial(trio.serve_tcp, host="127.0.0.1")
        (listener,) = await nursery.start(serve, handle, 0)
        yield listener.socket.getsockname()[1]
        nursery.cancel_scope.cancel()


async def _upload(port: int, declared: int | None, chunked: bool = False) -> bytes:
    """Send a head then ``UPLOAD`` body bytes while reading the answer to the end."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    headers = b"POST /upload HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    if chunked:
        headers += b"Transfer-Encoding: chunked\r\n"
    elif declared is not None:
        headers += b"Content-Length: %d\r\n" % declared
    answer = bytearray()
    async with stream:
        await stream.send_all(headers + b"\r\n")

        async def send_body() -> None:
            chunk = b"x" * 65536
            try:
                for _ in range(UPLOAD // len(chunk)):
                    await stream.send_all(b"10000\r\n" + chunk + b"\r\n" if chunked else chunk)
                await stream.send_eof()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the server stopped reading after its bounded drain: fine

        async with trio.open_nursery() as nursery:
            nursery.start_soon(send_body)
            while data := await stream.receive_some(65536):
                answer += data
            nursery.cancel_scope.cancel()
    return bytes(answer)


@pytest.mark.parametrize(
    ("declared", "chunked"),
    [(UPLOAD, False), (None, True)],
    ids=["declared length, refused before reading", "chunked, refused mid-body"],
)
async def test_a_413_reaches_a_client_that_is_still_uploading(
    declared: int | None, chunked: bool
) -> None:
    with trio.fail_after(DEADLINE):
        async with server() as port:
            for _ in range(5):  # a reset would lose it now and then, not every time
                answer = await _upload(port, declared, chunked)
                assert answer.startswith(b"HTTP/1.1 413 "), answer[:80]
                assert answer.endswith(b"refused\n")


async def test_a_body_within_the_bound_is_read() -> None:
    with trio.fail_after(DEADLINE):
        async with server() as port:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                body = b"y" * 1000
                request = b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 1000\r\n\r\n" + body
                await stream.send_all(request)
                answer = b""
                while data := await stream.receive_some(65536):
                    answer += data
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n") and answer.endswith(b"1000 bytes\n")
    assert b"connection: close" in answer.lower() and b"cache-control: no-store" in answer.lower()


@pytest.mark.parametrize(("answer_silence", "expected"), [(False, b""), (True, b"408")])
async def test_a_silent_connection_is_closed_or_answered_408(
    answer_silence: bool, expected: bytes, autojump_clock: trio.abc.Clock
) -> None:
    async with server(answer_silence=answer_silence) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        start = trio.current_time()
        answer = b""
        with trio.fail_after(60):
            async with stream:
                while data := await stream.receive_some(65536):
                    answer += data
    assert 2 <= trio.current_time() - start < 4
    if expected:
        assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    else:
        assert answer == b""


async def test_close_gracefully_is_bounded_for_a_peer_that_never_stops_sending(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A peer that keeps sending cannot hold the server: the drain ends after its budget."""
    done = trio.Event()
    ended_at: list[float] = []

    async def handle(stream: trio.SocketStream) -> None:
        await close_gracefully(stream, drain_s=1.0, max_bytes=10**12)
        ended_at.append(trio.current_time())
        done.set()

    async with trio.open_nursery() as nursery:
        serve = functools.partial(trio.serve_tcp, host="127.0.0.1")
        (listener,) = await nursery.start(serve, handle, 0)
        stream = await trio.open_tcp_stream("127.0.0.1", listener.socket.getsockname()[1])
        start = trio.current_time()

        async def flood() -> None:
            try:
                while True:
                    await stream.send_all(b"z" * 65536)
                    await trio.sleep(0.1)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass

        async with stream:
            nursery.start_soon(flood)
            with trio.fail_after(30):
                await done.wait()
            nursery.cancel_scope.cancel()
    assert 1.0 <= ended_at[0] - start < 1.5
