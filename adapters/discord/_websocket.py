"""The gateway's WebSocket client (RFC 6455), read in the caller's task.

trio-websocket runs a reader task per connection that feeds wsproto and hands each message
over a channel: three task switches and a generator pipeline per gateway frame. The
gateway needs little of it — text messages of JSON, a close code, a ping answered — so the
shard's reader task parses the frames itself here: one ``receive_some`` serves every frame
it holds, a complete frame costs a header read and a slice.

* **Handshake**: ``GET`` with ``Upgrade: websocket``, a random ``Sec-WebSocket-Key``,
  version 13, no extensions or subprotocols; ``101`` with the matching
  ``Sec-WebSocket-Accept`` or :class:`HandshakeError`.
* **Frames in**: unmasked (a masked one, a reserved bit, an unknown opcode, a fragmented or
  oversized control frame, a continuation out of place, invalid UTF-8 in a text message
  are protocol errors: closed 1002/1007); fragments joined up to :data:`MAX_MESSAGE_BYTES`
  (over it: closed 1009); a ping answered with its
  pong; a close answered with the same code (RFC 6455 §5.5.1) and raised as
  :class:`ConnectionClosed` with it (``None``: no code, or the TCP stream ended).
* **Frames out**: text, masked with a fresh key; one writer at a time.
* **Closing**: :meth:`GatewaySocket.aclose` sends a close frame with the caller's code
  (the gateway never uses 1000/1001) and reads until the answer; :func:`connect` closes
  the TCP stream on every path.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import ssl
import urllib.parse
from collections.abc import AsyncIterator

import trio

MAX_MESSAGE_BYTES = 64 << 20
"""The largest gateway message read. A large guild's GUILD_CREATE, uncompressed, can run to
several MiB; a cap the server's own payloads exceed would close 1009, resume and meet the
same payload again, so the cap is far above them and bounds memory only against a broken
peer (discord.py reads without a cap). trio-websocket's default, used before, was 1 MiB."""
MAX_HEAD_BYTES = 16 * 1024
RECEIVE_BYTES = 65536
_GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
_CONTINUATION, _TEXT, _BINARY, _CLOSE, _PING, _PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA


class HandshakeError(Exception):
    """The server did not accept the upgrade (fixed text: the status, never a header)."""


class ConnectionClosed(Exception):
    """The connection ended: ``code`` is the close code (``None``: none given, or the TCP
    stream ended without a close frame)."""

    def __init__(self, code: int | None) -> None:
        super().__init__(f"websocket closed ({code})")
        self.code = code


class _Violation(Exception):
    """A frame the server may not send: the connection is closed with ``code``."""

    def __init__(self, code: int) -> None:
        self.code = code


class GatewaySocket:
    """One client connection on an open stream (see :func:`connect`)."""

    def __init__(self, stream: trio.abc.Stream, buffered: bytes) -> None:
        self._stream = stream
        self._buffer = bytearray(buffered)
        self._send_lock = trio.StrictFIFOLock()
        self._fragments: list[bytes] = []
        self._fragments_size = 0
        self._fragment_opcode: int | None = None
        self._close_sent = False
        self._closed: ConnectionClosed | None = None

    async def get_message(self) -> str | bytes:
        """The next text (``str``) or binary (``bytes``) message. Raises
        :class:`ConnectionClosed`."""
        if self._closed is not None:
            raise self._closed
        try:
            while True:
                frame = self._next_frame()
                if frame is None:
                    data = await self._stream.receive_some(RECEIVE_BYTES)
                    if not data:
                        raise self._ended(None)
                    self._buffer += data
                    continue
                message = await self._handle(*frame)
                if message is not None:
                    return message
        except _Violation as violation:
            with contextlib.suppress(ConnectionClosed):
                await self._write(_CLOSE, violation.code.to_bytes(2, "big"))
            raise self._ended(violation.code) from None
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            raise self._ended(None) from None

    async def send_message(self, text: str) -> None:
        """Send one text message. Raises :class:`ConnectionClosed` once closing began."""
        if self._closed is not None or self._close_sent:
            raise self._closed or ConnectionClosed(None)
        await self._write(_TEXT, text.encode())

    async def aclose(self, code: int) -> None:
        """Send a close frame with ``code`` (unless one was sent or the connection ended)
        and read until the server's answer; bound it with a timeout."""
        if self._closed is not None or self._close_sent:
            return
        with contextlib.suppress(ConnectionClosed):
            await self._write(_CLOSE, code.to_bytes(2, "big"))
            while True:
                await self.get_message()

    # ------------------------------------------------------------------ frames

    def _next_frame(self) -> tuple[bool, int, bytes] | None:
        """(fin, opcode, payload) of the first complete frame in the buffer, taken out of
        it; ``None`` until one is complete."""
        buf = self._buffer
        size = len(buf)
        if size < 2:
            return None
        first, second = buf[0], buf[1]
        length = second & 0x7F
        at = 2
        if length == 126:
            if size < 4:
                return None
            length, at = int.from_bytes(buf[2:4], "big"), 4
        elif length == 127:
            if size < 10:
                return None
            length, at = int.from_bytes(buf[2:10], "big"), 10
        if first & 0x70 or second & 0x80:
            raise _Violation(1002)  # a reserved bit (no extension) or a masked frame
        if length > MAX_MESSAGE_BYTES:
            raise _Violation(1009)
        end = at + length
        if size < end:
            return None
        payload = bytes(buf[at:end])
        del buf[:end]
        return bool(first & 0x80), first & 0x0F, payload

    async def _handle(self, fin: bool, opcode: int, payload: bytes) -> str | bytes | None:
        if opcode >= _CLOSE:
            if not fin or len(payload) > 125:
                raise _Violation(1002)
            if opcode == _CLOSE:
                await self._closed_by_peer(payload)
            elif opcode == _PING:
                await self._write(_PONG, payload)
            elif opcode != _PONG:
                raise _Violation(1002)
            return None
        if opcode == _CONTINUATION:
            if self._fragment_opcode is None:
                raise _Violation(1002)
        elif opcode in (_TEXT, _BINARY):
            if self._fragment_opcode is not None:
                raise _Violation(1002)
            if fin:
                return self._message(opcode, payload)
            self._fragment_opcode = opcode
        else:
            raise _Violation(1002)
        self._fragments_size += len(payload)
        if self._fragments_size > MAX_MESSAGE_BYTES:
            raise _Violation(1009)
        self._fragments.append(payload)
        if not fin:
            return None
        kind, whole = self._fragment_opcode, b"".join(self._fragments)
        self._fragments, self._fragments_size, self._fragment_opcode = [], 0, None
        return self._message(kind, whole)

    def _message(self, opcode: int, payload: bytes) -> str | bytes:
        if opcode == _BINARY:
            return payload
        try:
            return payload.decode()
        except UnicodeDecodeError:
            raise _Violation(1007) from None

    async def _closed_by_peer(self, payload: bytes) -> None:
        if len(payload) == 1:
            raise _Violation(1002)
        code = int.from_bytes(payload[:2], "big") if payload else None
        if not self._close_sent:
            # Answer with the same code (none for none), then the server ends the stream.
            with contextlib.suppress(ConnectionClosed):
                await self._write(_CLOSE, payload[:2])
        raise self._ended(code)

    def _ended(self, code: int | None) -> ConnectionClosed:
        self._closed = ConnectionClosed(code)
        return self._closed

    async def _write(self, opcode: int, payload: bytes) -> None:
        mask = os.urandom(4)
        size = len(payload)
        if size < 126:
            head = bytes((0x80 | opcode, 0x80 | size))
        elif size < 65536:
            head = bytes((0x80 | opcode, 0x80 | 126)) + size.to_bytes(2, "big")
        else:
            head = bytes((0x80 | opcode, 0x80 | 127)) + size.to_bytes(8, "big")
        if size:
            key = (mask * (size // 4 + 1))[:size]
            masked = (int.from_bytes(payload, "big") ^ int.from_bytes(key, "big")).to_bytes(
                size, "big"
            )
        else:
            masked = b""
        async with self._send_lock:
            if opcode == _CLOSE:
                self._close_sent = True
            try:
                await self._stream.send_all(head + mask + masked)
            except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
                raise self._ended(None) from None


async def _handshake(stream: trio.abc.Stream, host: str, resource: str) -> bytes:
    """Upgrade ``stream``; the bytes read past the answer's head (the first frames)."""
    key = base64.b64encode(os.urandom(16))
    request = (
        (
            f"GET {resource} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        ).encode()
        + b"Sec-WebSocket-Key: "
        + key
        + b"\r\n\r\n"
    )
    await stream.send_all(request)
    head = bytearray()
    while b"\r\n\r\n" not in head:
        if len(head) > MAX_HEAD_BYTES:
            raise HandshakeError("websocket handshake answer too long")
        data = await stream.receive_some(RECEIVE_BYTES)
        if not data:
            raise HandshakeError("websocket handshake: connection closed")
        head += data
    end = head.index(b"\r\n\r\n")
    lines = bytes(head[:end]).split(b"\r\n")
    status = lines[0].split(b" ", 2)
    if len(status) < 2 or status[0] not in (b"HTTP/1.1", b"HTTP/1.0") or status[1] != b"101":
        code = status[1].decode("ascii", "replace")[:3] if len(status) > 1 else "?"
        raise HandshakeError(f"websocket handshake refused (HTTP {code})")
    fields: dict[bytes, bytes] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if sep:
            fields[name.strip().lower()] = value.strip()
    accept = base64.b64encode(hashlib.sha1(key + _GUID).digest())
    if (
        fields.get(b"upgrade", b"").lower() != b"websocket"
        or b"upgrade" not in fields.get(b"connection", b"").lower()
        or fields.get(b"sec-websocket-accept") != accept
    ):
        raise HandshakeError("websocket handshake: not an upgrade to this key")
    if fields.get(b"sec-websocket-extensions") or fields.get(b"sec-websocket-protocol"):
        raise HandshakeError("websocket handshake: an extension or protocol not asked for")
    return bytes(head[end + 4 :])


@contextlib.asynccontextmanager
async def connect(url: str, timeout_s: float) -> AsyncIterator[GatewaySocket]:
    """A client connection to a ``ws://`` or ``wss://`` URL (connected and upgraded within
    ``timeout_s``); its TCP stream is closed on every path."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    secure = parts.scheme == "wss"
    port = parts.port or (443 if secure else 80)
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    authority = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        authority += f":{parts.port}"
    with trio.fail_after(timeout_s):
        stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
    try:
        if secure:
            stream = trio.SSLStream(stream, ssl.create_default_context(), server_hostname=host)
        with trio.fail_after(timeout_s):
            buffered = await _handshake(stream, authority, resource)
        yield GatewaySocket(stream, buffered)
    finally:
        await trio.aclose_forcefully(stream)
