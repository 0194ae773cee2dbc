"""``prismctl chat``: a terminal client for the web chat channel.

It speaks the WebSocket protocol documented in :mod:`adapters.webchat`: each stdin line is a
``message`` frame with a fresh random client id; replies are printed as they arrive.
Approval controls are printed as the ``/approve TOKEN`` / ``/deny TOKEN`` text the runtime
understands, so typing that line answers them.

Exit codes: 0 after stdin ends (EOF) or Ctrl-C — first waiting a bounded time for the
admissions and replies still due — and 1 when the server cannot be reached, refuses the
socket (for example 401 without the right token) or closes it mid-session. The access
token travels in an ``Authorization: Bearer`` header and is never printed.
"""

from __future__ import annotations

import json
import re
import secrets
import ssl
import sys
from collections.abc import AsyncIterable, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, TextIO
from urllib.parse import urlsplit

import attrs
import trio
import trio_websocket

from .redact import replace_surrogates

__all__ = ["chat", "run_chat_cli"]

ACTOR_RE = re.compile(r"^[A-Za-z0-9_-]{8,64}$")
APPROVAL_RE = re.compile(r"^p:([ad]):([A-Za-z0-9_-]{32,64})$")
CONNECT_TIMEOUT_S = 10.0
LINGER_S = 15.0
"""After EOF, how long to wait for admissions and replies still due."""


class ChatConnectError(Exception):
    """The chat socket could not be opened; the message is safe to show (no token)."""


@attrs.frozen
class _Target:
    host: str
    port: int
    resource: str
    tls: bool
    shown: str
    """The URL as printed: scheme, host, port and path only (never the query)."""


def _target(url: str) -> _Target:
    """``http(s)://host:port/`` (the page) or ``ws(s)://host:port/ws`` → the socket target."""
    try:
        parts = urlsplit(url if "://" in url else "http://" + url)
    except ValueError:  # e.g. an unclosed "[" of an IPv6 host
        raise ChatConnectError("the chat URL cannot be parsed") from None
    scheme = parts.scheme.lower()
    if scheme not in ("http", "https", "ws", "wss"):
        raise ChatConnectError("the chat URL must start with http://, https://, ws:// or wss://")
    tls = scheme in ("https", "wss")
    try:
        port = parts.port or (443 if tls else 80)
    except ValueError:
        raise ChatConnectError("the chat URL has an invalid port") from None
    if not parts.hostname:
        raise ChatConnectError("the chat URL names no host")
    path = parts.path if scheme in ("ws", "wss") and parts.path not in ("", "/") else "/ws"
    host = parts.hostname
    shown_host = f"[{host}]" if ":" in host else host
    ws_scheme = "wss" if tls else "ws"
    return _Target(
        host=host,
        port=port,
        resource=path,
        tls=tls,
        shown=f"{ws_scheme}://{shown_host}:{port}{path}",
    )


@asynccontextmanager
async def _open_socket(target: _Target, token: str | None, timeout_s: float) -> AsyncIterator[Any]:
    """Open the socket; this code owns the TCP stream, so it is closed in every case."""
    stream: trio.SocketStream | trio.SSLStream[trio.SocketStream]
    try:
        with trio.fail_after(timeout_s):
            if target.tls:
                stream = await trio.open_ssl_over_tcp_stream(
                    target.host,
                    target.port,
                    ssl_context=ssl.create_default_context(),
                    https_compatible=True,
                )
            else:
                stream = await trio.open_tcp_stream(target.host, target.port)
    except (OSError, trio.TooSlowError) as exc:
        reason = "timed out" if isinstance(exc, trio.TooSlowError) else _os_reason(exc)
        raise ChatConnectError(f"cannot connect to {target.shown}: {reason}") from None
    headers = [(b"authorization", b"Bearer " + token.encode("utf-8"))] if token else []
    host_header = target.host if target.port in (80, 443) else f"{target.host}:{target.port}"
    if ":" in target.host:
        host_header = f"[{target.host}]:{target.port}"
    refused: int | None = None
    try:
        async with trio.open_nursery() as nursery:
            try:
                with trio.fail_after(timeout_s):
                    ws = await trio_websocket.wrap_client_stream(
                        nursery, stream, host_header, target.resource, extra_headers=headers
                    )
            except trio.TooSlowError:
                raise ChatConnectError(
                    f"cannot connect to {target.shown}: no WebSocket handshake"
                ) from None
            try:
                yield ws
            finally:
                with trio.move_on_after(2, shield=True):
                    await ws.aclose()
                nursery.cancel_scope.cancel()
    except* trio_websocket.ConnectionRejected as group:
        refused = getattr(group.exceptions[0], "status_code", 0)
    finally:
        await trio.aclose_forcefully(stream)
    if refused is not None:
        hint = " (wrong or missing access token?)" if refused == 401 else ""
        raise ChatConnectError(f"{target.shown} refused the chat socket: HTTP {refused}{hint}")


def _os_reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


@attrs.define(eq=False)
class _Conversation:
    ws: Any
    out: TextIO
    err: TextIO
    ready: trio.Event = attrs.field(factory=trio.Event)
    closed: bool = False
    hello_refused: str | None = None
    awaiting_admission: set[str] = attrs.field(factory=set)
    awaiting_reply: set[str] = attrs.field(factory=set)
    changed: trio.Event = attrs.field(factory=trio.Event)

    def _print(self, stream: TextIO, text: str) -> None:
        # A lone surrogate (a JSON escape) would make a strict UTF-8 stdout raise.
        stream.write(replace_surrogates(text) + "\n")
        stream.flush()

    def _touch(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    @property
    def settled(self) -> bool:
        return not self.awaiting_admission and not self.awaiting_reply

    async def send_line(self, text: str) -> None:
        client_id = secrets.token_urlsafe(15)
        self.awaiting_admission.add(client_id)
        frame = {"type": "message", "id": client_id, "text": text}
        # ASCII escapes: stdin decodes bytes that are not UTF-8 to lone surrogates, which the
        # WebSocket layer cannot encode (the server turns them into U+FFFD).
        await self.ws.send_message(json.dumps(frame))

    async def read_frames(self, on_close: trio.CancelScope) -> None:
        while True:
            try:
                message = await self.ws.get_message()
            except trio_websocket.ConnectionClosed:
                self.closed = True
                on_close.cancel()
                return
            try:
                frame = json.loads(message)
            except (TypeError, ValueError, RecursionError):
                continue
            if isinstance(frame, dict):
                self._handle(frame)
                self._touch()

    def _handle(self, frame: dict[str, Any]) -> None:
        kind = frame.get("type")
        if kind == "ready":
            self.ready.set()
        elif kind == "admission":
            self._admission(frame)
        elif kind == "reply":
            self._reply(frame)
        elif kind == "error":
            message = str(frame.get("message", "error"))
            if not self.ready.is_set():
                self.hello_refused = message
                self.ready.set()
            self._print(self.err, f"server error: {message}")

    def _admission(self, frame: dict[str, Any]) -> None:
        client_id = frame.get("id")
        if not isinstance(client_id, str) or client_id not in self.awaiting_admission:
            return
        self.awaiting_admission.discard(client_id)
        status = frame.get("status")
        if status == "accepted":
            if frame.get("duplicate"):
                self._print(self.err, "(already received)")
            else:
                self.awaiting_reply.add(client_id)
            return
        reason = frame.get("hint") or frame.get("reason") or status
        self._print(self.err, f"(not accepted: {reason})")

    def _reply(self, frame: dict[str, Any]) -> None:
        label = "agent" if frame.get("kind") == "final" else "agent (notice)"
        self._print(self.out, f"{label}> {frame.get('text', '')}")
        for control in frame.get("controls") or ():
            if not isinstance(control, dict):
                continue
            match = APPROVAL_RE.match(str(control.get("value", "")))
            if match is None:
                continue
            verb = "/approve" if match.group(1) == "a" else "/deny"
            self._print(self.out, f"  [{control.get('label', '')}] type: {verb} {match.group(2)}")
        in_reply_to = frame.get("inReplyTo")
        if isinstance(in_reply_to, str):
            self.awaiting_reply.discard(in_reply_to)

    async def wait_settled(self) -> None:
        while not self.settled and not self.closed:
            await self.changed.wait()


async def chat(
    url: str,
    *,
    actor: str | None,
    token: str | None,
    lines: AsyncIterable[str],
    out: TextIO,
    err: TextIO,
    linger_s: float = LINGER_S,
    connect_timeout_s: float = CONNECT_TIMEOUT_S,
) -> int:
    """Chat over the web chat socket: send each of ``lines``, print replies to ``out``.

    Returns 0 when ``lines`` ends (after waiting up to ``linger_s`` for admissions and replies
    still due) and 1 when the socket cannot be opened, the hello is refused or the server
    closes the socket. Messages and diagnostics go to ``err``; the token never does.
    """
    if actor is None:
        actor = secrets.token_urlsafe(18)
    elif not ACTOR_RE.match(actor):
        err.write("prismctl chat: the actor id must be 8-64 characters of A-Z a-z 0-9 _ -\n")
        return 1
    failure = "the connection was lost"
    try:
        return await _converse(url, actor, token, lines, out, err, linger_s, connect_timeout_s)
    except* ChatConnectError as group:
        failure = str(group.exceptions[0])
    except* (trio_websocket.ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    err.write(f"prismctl chat: {failure}\n")
    err.flush()
    return 1


async def _converse(
    url: str,
    actor: str,
    token: str | None,
    lines: AsyncIterable[str],
    out: TextIO,
    err: TextIO,
    linger_s: float,
    connect_timeout_s: float,
) -> int:
    target = _target(url)
    async with _open_socket(target, token, connect_timeout_s) as ws:
        conversation = _Conversation(ws=ws, out=out, err=err)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conversation.read_frames, nursery.cancel_scope)
            await ws.send_message(json.dumps({"type": "hello", "actor": actor}))
            with trio.move_on_after(connect_timeout_s):
                await conversation.ready.wait()
            if not conversation.ready.is_set() or conversation.hello_refused:
                nursery.cancel_scope.cancel()
                raise ChatConnectError(f"{target.shown} did not accept the hello")
            err.write(f"connected to {target.shown} as {actor}; type a message, Ctrl-D to quit\n")
            err.flush()
            async for line in lines:
                text = line.rstrip("\r\n")
                if text.strip():
                    await conversation.send_line(text)
            with trio.move_on_after(linger_s):
                await conversation.wait_settled()
            nursery.cancel_scope.cancel()
    if conversation.closed:
        raise ChatConnectError(f"{target.shown} closed the connection")
    return 0


async def _stdin_lines(stdin: TextIO) -> AsyncIterator[str]:
    while True:
        # readline blocks in a worker thread; on exit that thread is simply abandoned
        line = await trio.to_thread.run_sync(stdin.readline, abandon_on_cancel=True)
        if not line:
            return
        yield line


def run_chat_cli(url: str, *, actor: str | None, token: str | None) -> int:
    """Chat from the terminal: stdin lines out, replies to stdout. Returns the exit code."""

    async def main() -> int:
        return await chat(
            url,
            actor=actor,
            token=token,
            lines=_stdin_lines(sys.stdin),
            out=sys.stdout,
            err=sys.stderr,
        )

    try:
        return trio.run(main)
    except KeyboardInterrupt:
        return 0
