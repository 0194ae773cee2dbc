"""``prismctl chat``: a terminal client for the web chat channel.

It speaks the WebSocket protocol documented in :mod:`adapters.webchat`: each stdin line is a
``message`` frame with a fresh random client id; replies are printed as they arrive.
Approval controls are printed as the ``/approve TOKEN`` / ``/deny TOKEN`` text the runtime
understands, so typing that line answers them.

Like the page, it keeps its actor id and the resume token the server issued for it —
``prismctl chat`` in a file under the user's state directory (``$XDG_STATE_HOME/prismd/
chat.json``, else ``~/.local/state/prismd/chat.json``; directory 0700, file 0600), one entry
per chat server — so a later run continues the same conversation and receives the answers
that arrived while it was away. When the socket is lost (the daemon restarts) it reconnects
with bounded, jittered backoff, re-sends the messages not yet acknowledged with the same
client ids (the journal answers them as duplicates, never runs them twice) and shows each
reply once (by its ``replyId``).

Exit codes: 0 after stdin ends (EOF) or Ctrl-C — first waiting a bounded time for the
admissions and replies still due — and 1 when the server cannot be reached at the start,
refuses the socket (for example 401 without the right token) or the actor id, or stays
unreachable for ``reconnect_for_s``. The access token travels in an ``Authorization:
Bearer`` header; neither it nor the resume token is ever printed.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import secrets
import signal
import ssl
import sys
import tempfile
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal, TextIO
from urllib.parse import urlsplit

import attrs
import trio
import trio_websocket

from ..channel import replace_surrogates

__all__ = ["ChatState", "chat", "default_state_path", "run_chat_cli"]

ACTOR_RE = re.compile(r"^[A-Za-z0-9_-]{8,64}$")
APPROVAL_RE = re.compile(r"^p:([ad]):([A-Za-z0-9_-]{32,64})$")
RESUME_RE = re.compile(r"^[A-Za-z0-9_-]{43}$")
CONNECT_TIMEOUT_S = 10.0
LINGER_S = 15.0
CLOSE_WHEN_CANCELLED_S = 0.1
"""After EOF, how long to wait for admissions and replies still due."""
RECONNECT_START_S = 0.5
RECONNECT_MAX_S = 15.0
"""Backoff between reconnect attempts doubles from the start to this bound (+ up to 50 %
jitter, so clients of one restarted daemon do not all come back at the same instant)."""
RECONNECT_FOR_S = 300.0
"""Give up (exit 1) after this long without a connection."""
MAX_SEEN_REPLIES = 512
MAX_SERVERS = 32
STATE_FILE = "chat.json"


class ChatConnectError(Exception):
    """The chat socket could not be opened; the message is safe to show (no token).

    ``fatal``: the server answered and refused (HTTP status, actor id refused); retrying
    the same request cannot help.
    """

    def __init__(self, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


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
                # Cancelled (Ctrl-C), the socket's reader task is cancelled too: the close
                # frame goes out, but the server's answer would never be read; waiting for
                # it held a Ctrl-C for the whole 2 s.
                cancelled = trio.current_effective_deadline() == -math.inf
                with trio.move_on_after(CLOSE_WHEN_CANCELLED_S if cancelled else 2, shield=True):
                    await ws.aclose()
                nursery.cancel_scope.cancel()
    except* trio_websocket.ConnectionRejected as group:
        refused = getattr(group.exceptions[0], "status_code", 0)
    finally:
        await trio.aclose_forcefully(stream)
    if refused is not None:
        hint = " (wrong or missing access token?)" if refused == 401 else ""
        raise ChatConnectError(
            f"{target.shown} refused the chat socket: HTTP {refused}{hint}", fatal=True
        )


def _os_reason(exc: OSError) -> str:
    """Why a connection failed, in words: trio's "all attempts failed" carries the
    attempts' own errors in a group (its ``__cause__``)."""
    causes: list[BaseException] = [exc]
    if isinstance(exc.__cause__, BaseExceptionGroup):
        causes = list(exc.__cause__.exceptions)
    if causes and all(isinstance(c, ConnectionRefusedError) for c in causes):
        return "connection refused — is prismd running?"
    first = causes[0] if causes else exc
    if isinstance(first, OSError) and first.strerror:
        return first.strerror
    return type(first).__name__


def default_state_path(env: Mapping[str, str] | None = None) -> Path:
    """``$XDG_STATE_HOME/prismd/chat.json`` (an absolute ``XDG_STATE_HOME`` only, as the XDG
    spec says), else ``~/.local/state/prismd/chat.json``."""
    environ = os.environ if env is None else env
    base = environ.get("XDG_STATE_HOME", "")
    root = Path(base) if base and os.path.isabs(base) else Path.home() / ".local" / "state"
    return root / "prismd" / STATE_FILE


@attrs.define(eq=False)
class ChatState:
    """The actor id and resume token kept per chat server (``ws://host:port/ws``).

    A missing or unreadable file is an empty state. Saving writes a fresh 0600 file and
    renames it over the old one (never a half-written file); at most ``MAX_SERVERS``
    servers are kept, the most recently used. A save that fails is reported once and the
    chat goes on (the id then lives only as long as this run).
    """

    path: Path
    _servers: OrderedDict[str, dict[str, str]] = attrs.field(init=False, factory=OrderedDict)

    def __attrs_post_init__(self) -> None:
        try:
            raw = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return
        servers = raw.get("servers") if isinstance(raw, dict) else None
        if not isinstance(servers, dict):
            return
        for server, entry in list(servers.items())[-MAX_SERVERS:]:
            if isinstance(server, str) and isinstance(entry, dict):
                actor, resume = entry.get("actor"), entry.get("resume")
                if isinstance(actor, str) and ACTOR_RE.match(actor):
                    kept = {"actor": actor}
                    if isinstance(resume, str) and RESUME_RE.match(resume):
                        kept["resume"] = resume
                    self._servers[server] = kept

    def get(self, server: str) -> tuple[str, str | None] | None:
        entry = self._servers.get(server)
        return None if entry is None else (entry["actor"], entry.get("resume"))

    def put(self, server: str, actor: str, resume: str | None) -> None:
        """Remember ``actor`` (and its token) for ``server``; raises ``OSError``."""
        entry = {"actor": actor} if resume is None else {"actor": actor, "resume": resume}
        self._servers.pop(server, None)
        self._servers[server] = entry
        while len(self._servers) > MAX_SERVERS:
            self._servers.popitem(last=False)
        directory = self.path.parent
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        data = json.dumps({"version": 1, "servers": dict(self._servers)}, indent=1) + "\n"
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".chat.", suffix=".tmp")  # 0600
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


@attrs.define(eq=False)
class _Conversation:
    """One terminal conversation across sockets: what was typed and what is still due."""

    out: TextIO
    err: TextIO
    outbox: list[str] = attrs.field(factory=list)
    """Typed lines not sent yet (typed while disconnected, or not yet picked up)."""
    unacked: dict[str, str] = attrs.field(factory=dict)
    """Sent, no admission yet: re-sent with the same client id after a reconnect."""
    awaiting_reply: set[str] = attrs.field(factory=set)
    seen: OrderedDict[str, None] = attrs.field(factory=OrderedDict)
    eof: bool = False
    linger_until: float = float("inf")
    changed: trio.Event = attrs.field(factory=trio.Event)

    def print(self, stream: TextIO, text: str) -> None:
        # A lone surrogate (a JSON escape) would make a strict UTF-8 stdout raise.
        stream.write(replace_surrogates(text) + "\n")
        stream.flush()

    def touch(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    @property
    def settled(self) -> bool:
        return not self.outbox and not self.unacked and not self.awaiting_reply

    @property
    def finished(self) -> bool:
        """Input ended and everything due arrived, or the linger time is over."""
        return self.eof and (self.settled or trio.current_time() >= self.linger_until)

    async def feed(self, lines: AsyncIterable[str], linger_s: float) -> None:
        async for line in lines:
            text = line.rstrip("\r\n")
            if text.strip():
                self.outbox.append(text)
                self.touch()
        self.eof = True
        self.linger_until = trio.current_time() + linger_s
        self.touch()

    def mark_seen(self, reply_id: object) -> bool:
        """Remember ``reply_id``; True when it was seen before (a reply is shown once)."""
        if not isinstance(reply_id, str):
            return False
        if reply_id in self.seen:
            return True
        self.seen[reply_id] = None
        while len(self.seen) > MAX_SEEN_REPLIES:
            self.seen.popitem(last=False)
        return False


@attrs.define(eq=False)
class _Link:
    """One socket of the conversation."""

    ws: Any
    conversation: _Conversation
    ready: trio.Event = attrs.field(factory=trio.Event)
    refused: str | None = None
    """Why the hello was refused (``resume_refused``, ``unavailable``, or another error)."""
    issued: str | None = None
    closed: bool = False

    async def send_frame(self, frame: dict[str, Any]) -> None:
        # ASCII escapes: stdin decodes bytes that are not UTF-8 to lone surrogates, which the
        # WebSocket layer cannot encode (the server turns them into U+FFFD).
        await self.ws.send_message(json.dumps(frame))

    async def send_message(self, client_id: str, text: str) -> None:
        await self.send_frame({"type": "message", "id": client_id, "text": text})

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
                self.conversation.touch()

    def _handle(self, frame: dict[str, Any]) -> None:
        conv = self.conversation
        kind = frame.get("type")
        if kind == "ready":
            resume = frame.get("resume")
            if isinstance(resume, str) and RESUME_RE.match(resume):
                self.issued = resume
            self.ready.set()
        elif kind == "history":
            # Already shown by the run that received them (or the page): remembered only,
            # so a reply seen here and live is not printed twice.
            for past in frame.get("replies") or ():
                if isinstance(past, dict):
                    conv.mark_seen(past.get("replyId"))
        elif kind == "admission":
            self._admission(frame)
        elif kind == "reply":
            self._reply(frame)
        elif kind == "error":
            message = str(frame.get("message", "error"))
            if not self.ready.is_set():
                code = frame.get("code")
                self.refused = code if code in ("resume_refused", "unavailable") else message
                self.ready.set()
                if code in ("resume_refused", "unavailable"):
                    return
            conv.print(conv.err, f"server error: {message}")

    def _admission(self, frame: dict[str, Any]) -> None:
        conv = self.conversation
        client_id = frame.get("id")
        if not isinstance(client_id, str) or client_id not in conv.unacked:
            return
        status = frame.get("status")
        if status == "denied" and frame.get("reason") == "stopped":
            return  # the daemon is stopping: re-sent with the same id after reconnecting
        del conv.unacked[client_id]
        if status == "accepted":
            if frame.get("duplicate"):
                conv.print(conv.err, "(already received)")
            else:
                conv.awaiting_reply.add(client_id)
            return
        reason = frame.get("hint") or frame.get("reason") or status
        conv.print(conv.err, f"(not accepted: {reason})")

    def _reply(self, frame: dict[str, Any]) -> None:
        conv = self.conversation
        in_reply_to = frame.get("inReplyTo")
        if isinstance(in_reply_to, str):
            conv.awaiting_reply.discard(in_reply_to)
        if conv.mark_seen(frame.get("replyId")):
            return
        label = "agent" if frame.get("kind") == "final" else "agent (notice)"
        conv.print(conv.out, f"{label}> {frame.get('text', '')}")
        for control in frame.get("controls") or ():
            if not isinstance(control, dict):
                continue
            match = APPROVAL_RE.match(str(control.get("value", "")))
            if match is None:
                continue
            verb = "/approve" if match.group(1) == "a" else "/deny"
            conv.print(conv.out, f"  [{control.get('label', '')}] type: {verb} {match.group(2)}")


_Ended = Literal["finished", "lost", "unavailable"]


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The first exception inside (possibly nested) groups: nurseries wrap each level."""
    first = group.exceptions[0]
    while isinstance(first, BaseExceptionGroup):
        first = first.exceptions[0]
    return first


@attrs.define(eq=False)
class _Client:
    target: _Target
    actor: str
    resume: str | None
    token: str | None
    conversation: _Conversation
    state: ChatState | None
    connect_timeout_s: float
    reconnect_for_s: float
    rng: random.Random
    connected_once: bool = False
    was_ready: bool = False
    """The last socket got as far as ``ready`` (its loss is a fresh one)."""
    state_failed: bool = False

    async def run(self) -> int:
        conv = self.conversation
        delay = RECONNECT_START_S
        lost_since: float | None = None
        while True:
            ended: _Ended = "lost"
            self.was_ready = False
            try:
                async with _open_socket(self.target, self.token, self.connect_timeout_s) as ws:
                    ended = await self._session(_Link(ws=ws, conversation=conv))
            except* ChatConnectError as group:
                failure = _first_leaf(group)
                assert isinstance(failure, ChatConnectError)
                if failure.fatal or not self.connected_once:
                    raise failure from None
            except* (
                trio_websocket.ConnectionClosed,
                trio_websocket.HandshakeError,
                trio.BrokenResourceError,
                trio.ClosedResourceError,
            ):
                pass  # the socket died under us: reconnect
            if ended == "finished":
                return 0
            if not self.connected_once:
                # never got as far as ready: a wrong address or a refusing server, not a restart
                reason = "is unavailable" if ended == "unavailable" else "closed the connection"
                raise ChatConnectError(f"{self.target.shown} {reason}")
            now = trio.current_time()
            if self.was_ready:
                lost_since, delay = now, RECONNECT_START_S  # it was up: a fresh loss
            elif lost_since is None:
                lost_since = now
            if conv.eof and now >= conv.linger_until:
                if conv.settled:
                    return 0
                raise ChatConnectError("the connection was lost before every answer arrived")
            if now - lost_since >= self.reconnect_for_s:
                raise ChatConnectError(
                    f"{self.target.shown} unreachable for {self.reconnect_for_s:.0f} s; giving up"
                )
            wait = delay + self.rng.uniform(0, delay / 2)
            conv.print(conv.err, f"connection lost; reconnecting in {wait:.1f} s")
            with trio.move_on_at(min(now + wait, conv.linger_until)):
                await trio.sleep_forever()
            delay = min(delay * 2, RECONNECT_MAX_S)

    async def _session(self, link: _Link) -> _Ended:
        conv = self.conversation
        async with trio.open_nursery() as nursery:
            nursery.start_soon(link.read_frames, nursery.cancel_scope)
            hello: dict[str, Any] = {"type": "hello", "actor": self.actor}
            if self.resume is not None:
                hello["resume"] = self.resume
            await link.send_frame(hello)
            with trio.move_on_after(self.connect_timeout_s):
                await link.ready.wait()
            if not link.ready.is_set() or link.refused is not None:
                nursery.cancel_scope.cancel()
                if link.refused == "unavailable" or (not link.ready.is_set() and link.closed):
                    return "unavailable"
                if link.refused == "resume_refused":
                    raise ChatConnectError(
                        f"{self.target.shown} refused actor id {self.actor}: it belongs to "
                        "another client (start a new chat with --actor)",
                        fatal=True,
                    )
                raise ChatConnectError(f"{self.target.shown} did not accept the hello")
            self._ready(link)
            # Unacknowledged messages again, same ids: the journal answers duplicates.
            for client_id, text in list(conv.unacked.items()):
                await link.send_message(client_id, text)
            while not conv.finished:
                while conv.outbox:
                    text = conv.outbox.pop(0)
                    client_id = secrets.token_urlsafe(15)
                    conv.unacked[client_id] = text
                    await link.send_message(client_id, text)
                if conv.finished:
                    break
                with trio.move_on_at(conv.linger_until):
                    await conv.changed.wait()
            nursery.cancel_scope.cancel()
        return "lost" if link.closed and not conv.finished else "finished"

    def _ready(self, link: _Link) -> None:
        conv = self.conversation
        self.was_ready = True
        if link.issued is not None:
            self.resume = link.issued
            self._save()
        if not self.connected_once:
            conv.print(
                conv.err,
                f"connected to {self.target.shown} as {self.actor}; type a message, Ctrl-D to quit",
            )
        else:
            conv.print(conv.err, f"reconnected to {self.target.shown}")
        self.connected_once = True

    def _save(self) -> None:
        if self.state is None:
            return
        try:
            self.state.put(self.target.shown, self.actor, self.resume)
        except OSError as exc:
            if not self.state_failed:
                self.state_failed = True
                conv = self.conversation
                conv.print(
                    conv.err,
                    f"prismctl chat: cannot keep the chat id in {self.state.path}: "
                    f"{_os_reason(exc)}",
                )


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
    state_path: Path | None = None,
    reconnect_for_s: float = RECONNECT_FOR_S,
    rng: random.Random | None = None,
) -> int:
    """Chat over the web chat socket: send each of ``lines``, print replies to ``out``.

    Returns 0 when ``lines`` ends (after waiting up to ``linger_s`` for admissions and replies
    still due) and 1 when the socket cannot be opened at first, the socket or the actor id
    is refused, or the server stays unreachable for ``reconnect_for_s``. A socket lost
    later is reconnected (see the module docstring). With ``state_path`` the actor id and
    its resume token are read from and kept in that file (:class:`ChatState`); ``actor``
    overrides the kept id. Messages and diagnostics go to ``err``; tokens never do.
    """
    if actor is not None and not ACTOR_RE.match(actor):
        err.write("prismctl chat: the actor id must be 8-64 characters of A-Z a-z 0-9 _ -\n")
        return 1
    failure = "the connection was lost"
    try:
        target = _target(url)
        state = None if state_path is None else ChatState(state_path)
        kept = None if state is None else state.get(target.shown)
        if actor is None:
            actor = kept[0] if kept is not None else secrets.token_urlsafe(18)
        resume = kept[1] if kept is not None and kept[0] == actor else None
        conversation = _Conversation(out=out, err=err)
        client = _Client(
            target=target,
            actor=actor,
            resume=resume,
            token=token,
            conversation=conversation,
            state=state,
            connect_timeout_s=connect_timeout_s,
            reconnect_for_s=reconnect_for_s,
            rng=rng or random.Random(),
        )
        if state is not None and kept != (actor, resume):
            client._save()  # a new id is kept at once, before any message is sent
        async with trio.open_nursery() as nursery:
            nursery.start_soon(conversation.feed, lines, linger_s)
            code = await client.run()
            nursery.cancel_scope.cancel()
        return code
    except* ChatConnectError as group:
        failure = str(_first_leaf(group))
    err.write(f"prismctl chat: {failure}\n")
    err.flush()
    return 1


async def _stdin_lines(stdin: TextIO) -> AsyncIterator[str]:
    while True:
        # readline blocks in a worker thread; on exit that thread is simply abandoned
        line = await trio.to_thread.run_sync(stdin.readline, abandon_on_cancel=True)
        if not line:
            return
        yield line


def run_chat_cli(
    url: str,
    *,
    actor: str | None,
    token: str | None,
    state_path: Path | None = None,
    reconnect_for_s: float = RECONNECT_FOR_S,
) -> int:
    """Chat from the terminal: stdin lines out, replies to stdout. Returns the exit code.

    The actor id and resume token are kept in ``state_path`` (default
    :func:`default_state_path`)."""

    from ._quiet import EXIT_INTERRUPTED, run_quietly

    async def main() -> int:
        # Ctrl-C is received as a signal and cancels the chat where it waits: a
        # KeyboardInterrupt raised at any bytecode could land between a coroutine's
        # creation and its await, and Python would print "never awaited" on the way out.
        codes: list[int] = []
        with trio.open_signal_receiver(signal.SIGINT) as interrupts:
            async with trio.open_nursery() as nursery:

                async def interrupted() -> None:
                    async for _signal in interrupts:
                        codes.append(EXIT_INTERRUPTED)
                        nursery.cancel_scope.cancel()

                nursery.start_soon(interrupted)
                codes.append(
                    await chat(
                        url,
                        actor=actor,
                        token=token,
                        lines=_stdin_lines(sys.stdin),
                        out=sys.stdout,
                        err=sys.stderr,
                        state_path=state_path or default_state_path(),
                        reconnect_for_s=reconnect_for_s,
                    )
                )
                nursery.cancel_scope.cancel()
        return codes[0]

    # A Ctrl-C before the signal is received here (however Trio wraps it) is a quiet exit
    # 130 too, as in every prismctl command.
    return run_quietly(lambda: trio.run(main))
