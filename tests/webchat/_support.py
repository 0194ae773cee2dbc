"""Helpers shared by the web chat tests: a recording ``admit``, raw HTTP and WS clients."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio
import trio_websocket

from adapters.webchat._adapter import WebchatAdapter
from prismd.channel import Admission, InboundEvent
from tests.support.clocks import ManualClock

FIXED_NOW_MS = 1_780_000_000_000
REPO_ROOT = Path(__file__).resolve().parents[2]


@attrs.define
class Recorder:
    """An ``admit`` that records events and answers like a journal (duplicates by event id)."""

    events: list[InboundEvent] = attrs.field(factory=list)
    answer: Admission | None = None
    fail: bool = False

    async def __call__(self, event: InboundEvent) -> Admission:
        await trio.lowlevel.checkpoint()
        if self.fail:
            raise RuntimeError("store is on fire")
        seen = any(e.event_id == event.event_id for e in self.events)
        self.events.append(event)
        if self.answer is not None:
            return self.answer
        return Admission("accepted", operation_id="op-" + event.event_id, duplicate=seen)


async def start(nursery: trio.Nursery, **kwargs: Any) -> tuple[WebchatAdapter, Recorder]:
    recorder = kwargs.pop("admit", None) or Recorder()
    kwargs.setdefault("listen", "127.0.0.1:0")
    kwargs.setdefault("clock", ManualClock(FIXED_NOW_MS))
    adapter = WebchatAdapter(connection_id="web", admit=recorder, **kwargs)
    await nursery.start(adapter.run)
    return adapter, recorder


def ws_url(adapter: WebchatAdapter, query: str = "") -> str:
    assert adapter.bound is not None
    host, port = adapter.bound
    return f"ws://{host}:{port}/ws{query}"


async def http(adapter: WebchatAdapter, request: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send raw request bytes, read to EOF; return status, lower-cased headers, body."""
    assert adapter.bound is not None
    stream = await trio.open_tcp_stream(*adapter.bound)
    async with stream:
        await stream.send_all(request)
        data = bytearray()
        while chunk := await stream.receive_some(65536):
            data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    version, status_text, reason = lines[0].split(" ", 2)
    assert version == "HTTP/1.1" and reason  # a reason phrase, e.g. "OK"
    status = int(status_text)
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, body


def get(path: str, host: str = "127.0.0.1", extra: str = "", method: str = "GET") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode()


def upgrade(path: str = "/ws", host: str = "127.0.0.1", extra: str = "") -> bytes:
    """A raw WebSocket upgrade request (for answers that refuse it; the library client
    leaks its socket on a rejected handshake)."""
    return get(
        path,
        host=host,
        extra="Upgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n" + extra,
    )


async def recv(ws: trio_websocket.WebSocketConnection) -> dict[str, Any]:
    message = await ws.get_message()
    assert isinstance(message, str)
    frame = json.loads(message)
    assert isinstance(frame, dict)
    return frame


async def send(ws: trio_websocket.WebSocketConnection, frame: dict[str, Any]) -> None:
    await ws.send_message(json.dumps(frame))


RESUME_RE = re.compile(r"^[A-Za-z0-9_-]{43}$")


async def hello(
    ws: trio_websocket.WebSocketConnection,
    actor: str,
    resume: str | None = None,
    *,
    history: bool = False,
) -> str:
    """Say hello as ``actor``, with the resume token its browser keeps once it has one.

    Returns that token: the one just issued (a fresh actor's ``ready`` carries it), else
    ``resume``. With ``history`` (an adapter wired to a runtime) the ``history`` frame that
    follows ``ready`` is read too, and must be empty.
    """
    frame: dict[str, Any] = {"type": "hello", "actor": actor}
    if resume is not None:
        frame["resume"] = resume
    await send(ws, frame)
    ready = await recv(ws)
    issued = ready.pop("resume", None)
    assert ready == {"type": "ready", "actor": actor}
    if resume is None:
        assert isinstance(issued, str) and RESUME_RE.match(issued), issued
    else:
        assert issued is None  # a known browser is not sent its token again
    if history:
        assert await recv(ws) == {"type": "history", "replies": []}
    return issued or resume  # type: ignore[return-value]


@asynccontextmanager
async def connect(
    adapter: WebchatAdapter,
    resource: str = "/ws",
    headers: list[tuple[bytes, bytes]] | None = None,
    **options: Any,
) -> AsyncIterator[trio_websocket.WebSocketConnection]:
    """A client socket to ``adapter`` whose TCP stream the test owns (see :func:`connect_to`)."""
    assert adapter.bound is not None
    host, port = adapter.bound
    async with connect_to(host, port, resource, headers, **options) as ws:
        yield ws


@asynccontextmanager
async def connect_to(
    host: str,
    port: int,
    resource: str = "/ws",
    headers: list[tuple[bytes, bytes]] | None = None,
    **options: Any,
) -> AsyncIterator[trio_websocket.WebSocketConnection]:
    """A client socket whose TCP stream the test owns.

    trio-websocket's client never closes its stream when the *server* closes first (the
    close handshake is already done when ``aclose`` runs), which ``-W error`` reports as an
    unclosed socket; owning the stream closes it in every case.
    """
    stream = await trio.open_tcp_stream(host, port)
    try:
        async with trio.open_nursery() as nursery:
            ws = await trio_websocket.wrap_client_stream(
                nursery, stream, f"{host}:{port}", resource, extra_headers=headers, **options
            )
            try:
                yield ws
            finally:
                with trio.move_on_after(2, shield=True):
                    await ws.aclose()
                nursery.cancel_scope.cancel()
    finally:
        await trio.aclose_forcefully(stream)
