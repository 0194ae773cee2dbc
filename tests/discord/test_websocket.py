"""The gateway's own WebSocket client (adapters/discord/_websocket.py) against a raw
loopback server that writes the frames by hand: what the fake's trio-websocket server never
sends (fragments, pings, masked or reserved-bit frames, bad UTF-8, oversized messages, a
refused or wrong upgrade). Talking to the fake itself is covered by every gateway test."""

from __future__ import annotations

import base64
import functools
import hashlib
import ssl
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio
import trustme

from adapters.discord import _websocket
from adapters.discord._websocket import (
    ConnectionClosed,
    HandshakeError,
    connect,
)
from tests.support import tls

GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
Script = Callable[[trio.SocketStream, "Peer"], Awaitable[None]]


def frame(opcode: int, payload: bytes, *, fin: bool = True, first_bits: int = 0) -> bytes:
    head = bytes((0x80 * fin | first_bits | opcode,))
    size = len(payload)
    if size < 126:
        return head + bytes((size,)) + payload
    if size < 65536:
        return head + bytes((126,)) + size.to_bytes(2, "big") + payload
    return head + bytes((127,)) + size.to_bytes(8, "big") + payload


class Peer:
    """What the server read from the client after the upgrade: its frames, unmasked."""

    def __init__(self) -> None:
        self.request = b""
        self.frames: list[tuple[int, bytes]] = []
        self.buffer = bytearray()

    async def read_frame(self, stream: trio.SocketStream) -> tuple[int, bytes]:
        while True:
            parsed = self._parse()
            if parsed is not None:
                self.frames.append(parsed)
                return parsed
            data = await stream.receive_some(65536)
            if not data:
                raise EOFError
            self.buffer += data

    def _parse(self) -> tuple[int, bytes] | None:
        buf = self.buffer
        if len(buf) < 2:
            return None
        assert buf[1] & 0x80, "client frames are masked"
        length, at = buf[1] & 0x7F, 2
        if length == 126:
            length, at = int.from_bytes(buf[2:4], "big"), 4
        elif length == 127:
            length, at = int.from_bytes(buf[2:10], "big"), 10
        if len(buf) < at + 4 + length:
            return None
        mask = buf[at : at + 4]
        payload = bytes(b ^ mask[i % 4] for i, b in enumerate(buf[at + 4 : at + 4 + length]))
        opcode = buf[0] & 0x0F
        del buf[: at + 4 + length]
        return opcode, payload


async def accept(stream: trio.SocketStream, peer: Peer, *, answer: bytes | None = None) -> None:
    head = bytearray()
    while b"\r\n\r\n" not in head:
        head += await stream.receive_some(65536)
    peer.request = bytes(head)
    key = next(
        line.split(b":", 1)[1].strip()
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"sec-websocket-key:")
    )
    accept_key = base64.b64encode(hashlib.sha1(key + GUID).digest())
    await stream.send_all(
        answer
        or b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Accept: "
        + accept_key
        + b"\r\n\r\n"
    )


async def serve(nursery: trio.Nursery, script: Script) -> tuple[str, Peer]:
    peer = Peer()

    async def handler(stream: trio.SocketStream) -> None:
        try:
            await script(stream, peer)
        except (EOFError, trio.BrokenResourceError):
            pass

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return f"ws://127.0.0.1:{port}/gateway?v=10&encoding=json", peer


async def test_messages_fragments_and_pings(nursery: trio.Nursery) -> None:
    big = "é" * 70_000  # a 64-bit length field

    async def script(stream: trio.SocketStream, peer: Peer) -> None:
        await accept(stream, peer)
        # Two frames in one write, a fragmented message with a ping between its parts.
        await stream.send_all(frame(1, b'{"op":10}') + frame(2, b"\x00\x01"))
        await stream.send_all(frame(1, b'{"a":', fin=False) + frame(9, b"are you there"))
        await stream.send_all(frame(0, b'"b"', fin=False) + frame(0, b"}"))
        await stream.send_all(frame(1, big.encode()))
        assert await peer.read_frame(stream) == (10, b"are you there")  # the pong
        assert await peer.read_frame(stream) == (1, b'{"op":1,"d":null}')
        await stream.send_all(frame(8, (4000).to_bytes(2, "big") + b"bye"))
        await peer.read_frame(stream)

    url, peer = await serve(nursery, script)
    with trio.fail_after(5):
        async with connect(url, 5) as ws:
            assert await ws.get_message() == '{"op":10}'
            assert await ws.get_message() == b"\x00\x01"
            assert await ws.get_message() == '{"a":"b"}'
            assert await ws.get_message() == big
            await ws.send_message('{"op":1,"d":null}')
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
            assert closed.value.code == 4000
            with pytest.raises(ConnectionClosed):
                await ws.send_message("after the close")
    assert b"GET /gateway?v=10&encoding=json HTTP/1.1" in peer.request
    assert f"Host: 127.0.0.1:{url.split(':')[2].split('/')[0]}".encode() in peer.request
    # The server's close answered with its code.
    assert peer.frames[-1] == (8, (4000).to_bytes(2, "big"))
    assert len(peer.frames) == 3


async def test_close_sends_our_code_and_waits_for_the_answer(nursery: trio.Nursery) -> None:
    async def script(stream: trio.SocketStream, peer: Peer) -> None:
        await accept(stream, peer)
        _opcode, payload = await peer.read_frame(stream)
        await stream.send_all(frame(1, b"late") + frame(8, payload))

    url, peer = await serve(nursery, script)
    with trio.fail_after(5):
        async with connect(url, 5) as ws:
            await ws.aclose(4000)
            await ws.aclose(4000)  # once only
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
    assert closed.value.code == 4000
    assert peer.frames == [(8, (4000).to_bytes(2, "big"))]


@pytest.mark.parametrize(
    ("bad", "code"),
    [
        (frame(1, b"x", first_bits=0x40), 1002),  # a reserved bit: no extension was agreed
        (bytes((0x81, 0x81)) + b"\x00\x00\x00\x00x", 1002),  # a masked server frame
        (frame(3, b"x"), 1002),  # an unknown opcode
        (frame(0, b"x"), 1002),  # a continuation with nothing to continue
        (frame(9, b"x", fin=False), 1002),  # a fragmented control frame
        (frame(8, b"\x03"), 1002),  # a close frame of one byte
        (frame(1, b"\xff\xfe"), 1007),  # not UTF-8
        (bytes((0x81, 127)) + (1 << 40).to_bytes(8, "big"), 1009),  # over the cap
        (frame(1, b"a" * 101), 1009),
        (frame(1, b"a" * 60, fin=False) + frame(0, b"a" * 60, fin=False), 1009),
    ],
)
async def test_a_frame_the_server_may_not_send_closes_with_its_code(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch, bad: bytes, code: int
) -> None:
    monkeypatch.setattr(_websocket, "MAX_MESSAGE_BYTES", 100)  # a message's cap (64 MiB)

    async def script(stream: trio.SocketStream, peer: Peer) -> None:
        await accept(stream, peer)
        await stream.send_all(bad)
        await peer.read_frame(stream)

    url, peer = await serve(nursery, script)
    with trio.fail_after(5):
        async with connect(url, 5) as ws:
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
            await ws.aclose(4000)  # the close is sent already: nothing more goes out
    assert closed.value.code == code
    assert peer.frames == [(8, code.to_bytes(2, "big"))]


async def test_a_dropped_stream_is_a_close_without_a_code(nursery: trio.Nursery) -> None:
    async def script(stream: trio.SocketStream, peer: Peer) -> None:
        await accept(stream, peer)
        await stream.send_all(frame(1, b"one") + frame(1, b"two")[:-1])  # the second cut short
        await stream.aclose()

    url, _peer = await serve(nursery, script)
    with trio.fail_after(5):
        async with connect(url, 5) as ws:
            assert await ws.get_message() == "one"
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
            assert closed.value.code is None


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Accept: d3Jvbmc=\r\n\r\n",
        b"nonsense\r\n\r\n",
        b"",
    ],
)
async def test_a_refused_or_wrong_upgrade_is_a_handshake_error(
    nursery: trio.Nursery, answer: bytes
) -> None:
    async def script(stream: trio.SocketStream, peer: Peer) -> None:
        if answer:
            await accept(stream, peer, answer=answer)
        else:
            await stream.receive_some(65536)
            await stream.aclose()
        await trio.sleep_forever()

    url, _peer = await serve(nursery, script)
    with trio.fail_after(5), pytest.raises(HandshakeError):
        async with connect(url, 5):
            pass


async def test_no_answer_to_the_upgrade_is_a_timeout(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    async def script(stream: trio.SocketStream, peer: Peer) -> None:
        await trio.sleep_forever()

    url, _peer = await serve(nursery, script)
    with pytest.raises(trio.TooSlowError):
        async with connect(url, 5):
            pass


async def _serve_tls(
    nursery: trio.Nursery, script: Script, ca: trustme.CA, directory: Path
) -> tuple[str, Peer]:
    """:func:`serve` behind TLS: the server's certificate for ``localhost``, issued by ``ca``."""
    peer = Peer()
    server_context = tls.server_context(ca, directory)

    async def handler(raw: trio.SocketStream) -> None:
        stream = trio.SSLStream(raw, server_context, server_side=True)
        try:
            await script(stream, peer)  # type: ignore[arg-type]
        except (EOFError, trio.BrokenResourceError):
            pass
        finally:
            await trio.aclose_forcefully(stream)

    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    port = listeners[0].socket.getsockname()[1]
    return f"wss://localhost:{port}/gateway?v=10&encoding=json", peer


async def test_wss_verifies_the_server_and_speaks_through_tls(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``wss://`` is TLS with the system's default verification (Discord's gateway is
    ``wss://gateway.discord.gg``): a server whose certificate the trust store holds is
    talked to; the frames go through the TLS stream both ways."""
    ca = trustme.CA()
    tls.trust(ca, tmp_path, monkeypatch)

    async def script(stream: trio.SocketStream, peer: Peer) -> None:
        await accept(stream, peer)
        await stream.send_all(frame(1, b'{"op":10}'))
        assert await peer.read_frame(stream) == (1, b'{"op":1,"d":null}')
        await stream.send_all(frame(8, (4000).to_bytes(2, "big")))
        await peer.read_frame(stream)

    url, peer = await _serve_tls(nursery, script, ca, tmp_path)
    with trio.fail_after(10):
        async with connect(url, 10) as ws:
            assert await ws.get_message() == '{"op":10}'
            await ws.send_message('{"op":1,"d":null}')
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
            assert closed.value.code == 4000
    assert b"Host: localhost:" in peer.request


async def test_wss_refuses_a_server_it_cannot_verify(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A certificate from an authority the trust store does not hold ends the connection
    before the upgrade is written: nothing is sent to an impostor."""
    tls.trust(trustme.CA(), tmp_path, monkeypatch)

    async def script(stream: trio.SocketStream, peer: Peer) -> None:
        await accept(stream, peer)

    url, peer = await _serve_tls(nursery, script, trustme.CA(), tmp_path)
    with trio.fail_after(10):
        with pytest.raises((trio.BrokenResourceError, ssl.SSLError)):
            async with connect(url, 10):
                pass
    assert peer.request == b""
