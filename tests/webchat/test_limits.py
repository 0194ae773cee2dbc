"""The web chat under exhaustion (each flood of issue 10, with a legitimate user served while
it is on) and the small hardenings: 1007 for invalid UTF-8, one access token per request,
absolute-form targets checked like ``Host``, trio-websocket's debug lines kept out of the
logs."""

from __future__ import annotations

import io
import logging
import os
import struct
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio
import trio_websocket

from adapters.webchat._adapter import MAX_PENDING, MAX_SOCKETS, WebchatAdapter
from prismd.channel import Reply
from prismd.daemon import _logs as logs
from tests.support.flood import drip, gone
from tests.support.waiting import wait_until

from ._support import connect, get, hello, http, recv, send, start, upgrade

ACTOR = "actor_0123456789"
HELLO = b'{"type": "hello", "actor": "actor_0123456789"}'
SECRET_TOKEN = "wc-secret-token-0123456789"
FLOOD = 300
"""More than either budget holds (MAX_PENDING, MAX_SOCKETS)."""


def actor(n: int) -> str:
    return f"flood-actor-{n:06d}"


async def new_user_is_served(adapter: WebchatAdapter, user: str = ACTOR, **options: object) -> None:
    """A fresh browser: the page, /healthz, and a socket whose message is admitted."""
    assert (await http(adapter, get("/healthz")))[0] == 200
    async with connect(adapter, **options) as ws:  # type: ignore[arg-type]
        await hello(ws, user)
        await send(ws, {"type": "message", "id": "m1", "text": "hello"})
        assert (await recv(ws))["status"] == "accepted"


@pytest.mark.slow
async def test_held_sockets_cannot_lock_a_new_user_out(nursery: trio.Nursery) -> None:
    """300 established sockets (more than MAX_SOCKETS) held open and silent: the page,
    /healthz and a new user's socket are still served; the idlest sockets gave way."""
    assert FLOOD > MAX_SOCKETS
    with trio.fail_after(60):
        adapter, recorder = await start(nursery)
        async with AsyncExitStack() as held:
            for n in range(FLOOD):
                ws = await held.enter_async_context(connect(adapter))
                await hello(ws, actor(n))
            assert adapter.limiter.open("established") == MAX_SOCKETS
            await new_user_is_served(adapter)
            stats = adapter.limiter.statistics()["established"]
            assert stats.open <= MAX_SOCKETS and stats.evicted == FLOOD + 1 - MAX_SOCKETS
    assert [e.external_actor_id for e in recorder.events] == [ACTOR]


@pytest.mark.slow
async def test_sockets_held_before_their_hello_cannot_lock_a_new_user_out(
    nursery: trio.Nursery,
) -> None:
    """300 upgraded sockets that never say hello: they count with the heads, the oldest
    give way, and a new user is served at once (not after the 30 s hello timeout)."""
    with trio.fail_after(60):
        adapter, _ = await start(nursery)
        async with AsyncExitStack() as held:
            for _ in range(FLOOD):
                await held.enter_async_context(connect(adapter))
            await wait_until(lambda: adapter.limiter.statistics()["pending"].evicted >= 1)
            assert adapter.limiter.open("pending") <= MAX_PENDING
            await new_user_is_served(adapter)


@pytest.mark.slow
async def test_slow_unauthenticated_heads_cannot_starve_an_authenticated_user(
    nursery: trio.Nursery,
) -> None:
    """300 heads dripping a byte every half second to a token-protected listener: an
    authenticated user still gets the page and a socket while they drip."""
    with trio.fail_after(60):
        adapter, _ = await start(nursery, access_token=SECRET_TOKEN)
        assert adapter.bound is not None
        head = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slow\r\n\r\n"
        async with AsyncExitStack() as held, trio.open_nursery() as drips:
            for _ in range(FLOOD):
                stream = await held.enter_async_context(await trio.open_tcp_stream(*adapter.bound))
                drips.start_soon(drip, stream, head, 0.5)
            await wait_until(lambda: adapter.limiter.open("pending") == MAX_PENDING)
            assert (await http(adapter, get(f"/?token={SECRET_TOKEN}")))[0] == 200
            bearer = [(b"authorization", f"Bearer {SECRET_TOKEN}".encode())]
            await new_user_is_served(adapter, headers=bearer)
            assert adapter.limiter.open("pending") <= MAX_PENDING
            drips.cancel_scope.cancel()


async def test_an_idle_established_socket_is_closed(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    """No message and no reply for ``idle_timeout_s``: closed 1000 "idle". A message from
    the client or a reply to it starts the wait over."""
    adapter, _ = await start(nursery, idle_timeout_s=60)
    closed_at: dict[str, float] = {}

    async def user(name: str, message_at: float | None) -> None:
        async with connect(adapter) as ws:
            await hello(ws, name)
            start = trio.current_time()
            if message_at is not None:
                await trio.sleep(message_at)
                await send(ws, {"type": "message", "id": "m1", "text": "still here"})
                assert (await recv(ws))["type"] == "admission"
            with pytest.raises(trio_websocket.ConnectionClosed) as info:
                while True:
                    frame = await recv(ws)
                    assert frame["type"] == "reply"
            assert info.value.reason is not None
            assert (info.value.reason.code, info.value.reason.reason) == (1000, "idle")
            closed_at[name] = trio.current_time() - start

    async def reply_at(delay: float, to: str) -> None:
        await trio.sleep(delay)
        result = await adapter.send(
            Reply(connection_id="web", external_conversation_id=to, text="late", kind="final")
        )
        assert result.delivered

    with trio.fail_after(300):
        async with trio.open_nursery() as users:
            users.start_soon(user, "silent-0000001", None)
            users.start_soon(user, "talker-0000001", 40.0)
            users.start_soon(user, "reader-0000001", None)
            users.start_soon(reply_at, 50.0, "reader-0000001")
    assert 60 <= closed_at["silent-0000001"] < 61
    assert 100 <= closed_at["talker-0000001"] < 101
    assert 110 <= closed_at["reader-0000001"] < 111


# ---------------------------------------------------------------------- raw WebSocket


def client_frame(opcode: int, payload: bytes) -> bytes:
    """A masked client frame (RFC 6455 §5.2), payload under 126 bytes."""
    mask = os.urandom(4)
    masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
    return bytes([0x80 | opcode, 0x80 | len(payload)]) + mask + masked


@asynccontextmanager
async def raw_socket(
    adapter: WebchatAdapter, request: bytes | None = None
) -> AsyncIterator[RawSocket]:
    """A WebSocket opened by hand with ``request`` (default: a plain upgrade)."""
    assert adapter.bound is not None
    stream = await trio.open_tcp_stream(*adapter.bound)
    async with stream:
        await stream.send_all(request or upgrade())
        sock = RawSocket(stream)
        response = await sock.read_until(b"\r\n\r\n")
        assert response.startswith(b"HTTP/1.1 101 "), response
        yield sock


class RawSocket:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""

    async def _fill(self, size: int) -> None:
        while len(self.buffer) < size:
            data = await self.stream.receive_some(65536)
            assert data, "closed without a close frame"
            self.buffer += data

    async def read_until(self, marker: bytes) -> bytes:
        while marker not in self.buffer:
            await self._fill(len(self.buffer) + 1)
        head, _, self.buffer = self.buffer.partition(marker)
        return head + marker

    async def read_frame(self) -> tuple[int, bytes]:
        await self._fill(2)
        opcode, length = self.buffer[0] & 0x0F, self.buffer[1] & 0x7F
        offset = 2
        if length == 126:
            await self._fill(4)
            (length,) = struct.unpack("!H", self.buffer[2:4])
            offset = 4
        elif length == 127:
            await self._fill(10)
            (length,) = struct.unpack("!Q", self.buffer[2:10])
            offset = 10
        await self._fill(offset + length)
        payload = self.buffer[offset : offset + length]
        self.buffer = self.buffer[offset + length :]
        return opcode, payload


async def test_invalid_utf8_closes_with_1007(nursery: trio.Nursery) -> None:
    """RFC 6455 §8.1: a text frame that is not UTF-8 fails the connection with 1007 — a
    close frame the client sees, not a bare TCP close (an "abnormal" 1006)."""
    with trio.fail_after(10):
        adapter, recorder = await start(nursery)
        async with raw_socket(adapter) as sock:
            await sock.stream.send_all(client_frame(0x1, HELLO))
            opcode, payload = await sock.read_frame()
            assert opcode == 0x1 and b'"ready"' in payload
            await sock.stream.send_all(client_frame(0x1, b'{"type":"message","text":"\xff\xfe"}'))
            opcode, payload = await sock.read_frame()
            assert opcode == 0x8, (opcode, payload)
            assert struct.unpack("!H", payload[:2])[0] == 1007
            assert payload[2:] == b"invalid UTF-8"
            assert await gone(sock.stream)
        await new_user_is_served(adapter, "next-user-0001")
    assert len(recorder.events) == 1  # only the next user's message


# ---------------------------------------------------------------------- access checks


async def test_one_access_token_per_request(nursery: trio.Nursery) -> None:
    """Several ``token=`` parameters, or a parameter and a bearer header, are refused (400)
    without comparing any of them, even when one is right: a request is one guess."""
    with trio.fail_after(10):
        adapter, _ = await start(nursery, access_token=SECRET_TOKEN)
        bearer = f"Authorization: Bearer {SECRET_TOKEN}\r\n"
        assert (await http(adapter, get(f"/?token=a&token={SECRET_TOKEN}")))[0] == 400
        assert (await http(adapter, get(f"/?token={SECRET_TOKEN}&token={SECRET_TOKEN}")))[0] == 400
        assert (await http(adapter, get(f"/?token={SECRET_TOKEN}", extra=bearer)))[0] == 400
        assert (await http(adapter, upgrade(f"/ws?token=x&token={SECRET_TOKEN}")))[0] == 400
        assert (await http(adapter, get(f"/?token={SECRET_TOKEN}")))[0] == 200
        assert (await http(adapter, get("/", extra=bearer)))[0] == 200
        assert (await http(adapter, get("/healthz?token=a&token=b")))[0] == 200  # never guarded
    with trio.fail_after(10):
        open_adapter, _ = await start(nursery)  # no token configured: tokens mean nothing
        assert (await http(open_adapter, get("/?token=a&token=b")))[0] == 200


@pytest.mark.parametrize(
    ("target", "host", "expected"),
    [
        ("http://evil.example/", "127.0.0.1", 421),
        ("http://evil.example/healthz", "127.0.0.1", 421),
        ("//evil.example/healthz", "127.0.0.1", 421),
        ("http://127.0.0.1@evil.example/", "127.0.0.1", 421),
        ("http://127.0.0.1/", "evil.example", 421),
        ("http://127.0.0.1/", "127.0.0.1", 200),
        ("http://localhost:8787/healthz", "127.0.0.1", 200),
    ],
)
async def test_absolute_form_targets_are_checked_like_host(
    nursery: trio.Nursery, target: str, host: str, expected: int
) -> None:
    """HTTP makes an absolute-form target's authority the request's host: on loopback
    without a token it must name loopback too (DNS rebinding), like ``Host``."""
    with trio.fail_after(10):
        adapter, _ = await start(nursery)
        assert (await http(adapter, f"GET {target} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()))[
            0
        ] == expected


async def test_an_absolute_form_upgrade_compares_origin_with_its_authority(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(10):
        adapter, _ = await start(nursery)
        assert adapter.bound is not None
        host, port = adapter.bound
        request = upgrade(f"http://localhost:{port}/ws", host=f"{host}:{port}")
        same_host_header = f"Origin: http://{host}:{port}\r\n"
        refused = request.replace(b"\r\n\r\n", f"\r\n{same_host_header}\r\n".encode())
        assert (await http(adapter, refused))[0] == 403  # Origin is not the target's host
        allowed = request.replace(
            b"\r\n\r\n", f"\r\nOrigin: http://localhost:{port}\r\n\r\n".encode()
        )
        async with raw_socket(adapter, allowed) as sock:
            await sock.stream.send_all(client_frame(0x1, HELLO))
            opcode, payload = await sock.read_frame()
            assert opcode == 0x1 and b'"ready"' in payload


# ---------------------------------------------------------------------- logs


@pytest.fixture
def daemon_logging() -> Iterator[io.StringIO]:
    """prismd's own log configuration at debug, into a buffer; restored afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    library = logging.getLogger("trio-websocket")
    library_level = library.level
    out = io.StringIO()
    logs.configure_logging("debug", stream=out, timestamps=False)
    try:
        yield out
    finally:
        for handler in list(root.handlers):
            if handler not in handlers:
                root.removeHandler(handler)
        root.setLevel(level)
        library.setLevel(library_level)
        logs._installed.clear()


async def test_trio_websocket_debug_lines_never_reach_the_logs(
    nursery: trio.Nursery, daemon_logging: io.StringIO
) -> None:
    """trio-websocket logs a client's ping payloads and close reasons at DEBUG: prismd's
    logging keeps that logger at WARNING, and drops its records below WARNING even when
    someone turns the logger back to DEBUG."""
    seen: list[str] = []

    class Witness(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    library = logging.getLogger("trio-websocket")
    assert library.getEffectiveLevel() >= logging.WARNING
    library.setLevel(logging.DEBUG)  # what a curious operator might do
    witness = Witness()
    library.addHandler(witness)
    try:
        with trio.fail_after(10):
            adapter, _ = await start(nursery)
            async with connect(adapter) as ws:
                await hello(ws, ACTOR)
                await ws.ping(b"ping-payload-text-xyzzy")
                await ws.aclose(1000, "close-reason-text-xyzzy")
            await new_user_is_served(adapter, "next-user-0001")
    finally:
        library.removeHandler(witness)
    assert any("ping-payload-text-xyzzy" in line for line in seen)  # the library said it
    assert any("close-reason-text-xyzzy" in line for line in seen)
    written = daemon_logging.getvalue()
    assert "web chat listening on" in written  # prismd's own lines get through
    assert "xyzzy" not in written and "trio-websocket" not in written
