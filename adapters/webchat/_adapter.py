"""The local web chat channel: a chat page and a WebSocket on one TCP port.

Routes, access, connection budgets and the WebSocket protocol: docs/webchat-protocol.md.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from importlib import resources
from typing import Any, Literal
from urllib.parse import urlsplit

import attrs
import h11
import trio
import trio_websocket

from prismd.channel import (
    AdapterFatalError,
    AdapterFeatures,
    Admission,
    Admit,
    ApprovalInput,
    AttachmentRef,
    InboundEvent,
    PastReply,
    Preview,
    Reply,
    SendResult,
)
from prismd.journal import new_token, token_hash
from prismd.redact import replace_surrogates, utf8_len
from stores import SYSTEM_CLOCK, CheckpointConflictError, CheckpointStore, Clock, OwnershipScope
from stores.memory import MemoryStore

from ..toolkit import (
    Budget,
    ConnectionLimiter,
    Slot,
    close_gracefully,
    is_loopback_host,
    parse_host_port,
    read_request_head,
    respond,
    serve_limited,
    server_connection,
)
from ..toolkit import RequestHead as _Head
from ._past import Conversations, conversation_past
from ._previews import LivePreviews
from ._typing import TypingSignals

__all__ = ["Conversations", "WebchatAdapter", "WebchatStatistics", "parse_listen"]

log = logging.getLogger("prismd.webchat")

ACTOR_RE = re.compile(r"^[A-Za-z0-9_-]{8,64}$")
CLIENT_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
APPROVAL_RE = re.compile(r"^p:([ad]):([A-Za-z0-9_-]{32,64})$")
RESUME_RE = re.compile(r"^[A-Za-z0-9_-]{43}$")

HANDSHAKE_TIMEOUT_S = 10.0
HELLO_TIMEOUT_S = 30.0
"""A socket that sends no valid hello in this time is closed (1008)."""
SEND_TIMEOUT_S = 10.0
"""A reply that cannot be written to a socket in this time counts as not taken; the socket
is closed, since a peer that stops reading would otherwise hold replies forever."""
CLOSE_BUDGET_S = 2.0
STOP_CLOSE_BUDGET_S = 0.25
LISTENER_CLOSE_BUDGET_S = 1.0
MAX_PENDING = 128
"""Default bound on connections in their HTTP head, being answered, or before their hello."""
MAX_SOCKETS = 256
"""Default bound on established sockets (hello done)."""
IDLE_TIMEOUT_S = 600.0
"""An established socket without a message or a reply for this long is closed (1000)."""
PENDING, ESTABLISHED = "pending", "established"
NOT_CONNECTED = "webchat_not_connected"
RESUME_CHECK_TIMEOUT_S = 10.0
HISTORY_LIMIT = 20
"""Delivered replies shown to a reconnecting page (the journal holds no inbound text)."""
MAX_HISTORY_FRAME_BYTES = 256 * 1024
DAY_MS = 24 * 60 * 60 * 1000
SWEEP_INTERVAL_S = 3600.0
SWEEP_PAGES = 20
SWEEP_PAGE_SIZE = 500
RESUME_NAMESPACE = "prismd.v1.webchat-resume"
RESUME_CATEGORY = "prismd-webchat-resume"
SERVICE_TENANT = "prismd-service"
"""Adapter state lives outside every user tenant (like the Telegram cursor)."""

_PAGE_RESOURCE = "page.html"


def _load_page() -> tuple[bytes, str]:
    """The page bytes and its CSP (inline script/style allowed by their SHA-256 only)."""
    html = resources.files("adapters.webchat").joinpath(_PAGE_RESOURCE).read_text(encoding="utf-8")
    script_hashes = [_csp_hash(m) for m in re.findall(r"<script>(.*?)</script>", html, re.S)]
    style_hashes = [_csp_hash(m) for m in re.findall(r"<style>(.*?)</style>", html, re.S)]
    csp = "; ".join(
        [
            "default-src 'none'",
            "script-src " + (" ".join(script_hashes) or "'none'"),
            "style-src " + (" ".join(style_hashes) or "'none'"),
            "connect-src 'self'",
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        ]
    )
    return html.encode("utf-8"), csp


def _csp_hash(text: str) -> str:
    digest = hashlib.sha256(text.encode("utf-8")).digest()
    return "'sha256-" + base64.b64encode(digest).decode("ascii") + "'"


def parse_listen(listen: str) -> tuple[str, int]:
    """``"host:port"`` or ``"[v6]:port"`` → ``(host, port)``; raises ``ValueError``."""
    host, port = parse_host_port(listen)
    if not host:
        raise ValueError("listen must name a host")
    return host, port


def _host_header_is_loopback(value: str) -> bool:
    """The ``Host`` header names a loopback address (``localhost``, 127/8, ``[::1]``)."""
    try:
        host = urlsplit("//" + value).hostname
    except ValueError:
        return False
    return host is not None and is_loopback_host(host)


@attrs.frozen
class _Resumed:
    issued: str | None = None
    """The token just issued for a fresh actor (sent once in ``ready``), else ``None``."""


@attrs.define(eq=False)
class _ResumeTokens:
    """Which browser owns an actor id: one record per (connection, actor) holding only the
    SHA-256 prefix of a random token issued at the actor's first hello.

    Records are written create-only or by CAS, so of two browsers claiming a fresh actor at
    once exactly one gets the token. ``last_seen`` is refreshed at most daily; a record
    unused for ``ttl_ms`` no longer protects its actor and is deleted by :meth:`sweep`.
    """

    checkpoints: CheckpointStore
    connection_id: str
    clock: Clock
    ttl_ms: int
    _sweep_cursor: str | None = attrs.field(default=None, init=False)

    def _scope(self, actor: str | None) -> OwnershipScope:
        return OwnershipScope(
            tenant_id=SERVICE_TENANT, account_id=self.connection_id, user_id=actor
        )

    def _key(self, actor: str) -> str:
        return f"w1:{self.connection_id}:{actor}"

    async def claim(self, actor: str, presented: str | None) -> _Resumed | None:
        """``_Resumed`` when ``presented`` owns ``actor`` (or the actor was free and now
        belongs to a new token), ``None`` when another browser owns it. Store errors
        propagate."""
        scope, key = self._scope(actor), self._key(actor)
        row = await self.checkpoints.load_checkpoint(
            namespace=RESUME_NAMESPACE, key=key, scope=scope
        )
        now = self.clock.now_ms()
        stored = None if row is None else _resume_record(row.value)
        if row is not None and stored is not None and now - stored[1] <= self.ttl_ms:
            if presented is None or not hmac.compare_digest(token_hash(presented), stored[0]):
                return None
            if now - stored[1] >= DAY_MS:
                await self._write(key, scope, stored[0], now, row.version)
            return _Resumed()
        token = new_token()
        if not await self._write(
            key, scope, token_hash(token), now, 0 if row is None else row.version
        ):
            return None  # another browser claimed it a moment ago
        return _Resumed(issued=token)

    async def _write(
        self, key: str, scope: OwnershipScope, digest: str, now: int, expected: int
    ) -> bool:
        try:
            await self.checkpoints.save_checkpoint(
                namespace=RESUME_NAMESPACE,
                key=key,
                scope=scope,
                version=expected + 1,
                expected_version=expected,
                value={"tokenHash": digest, "lastSeenAtMs": now},
                category=RESUME_CATEGORY,
            )
        except CheckpointConflictError:
            return False
        return True

    async def sweep(self) -> int:
        """Delete records unused for longer than the TTL; returns how many.

        Bounded: at most ``SWEEP_PAGES`` pages per call. The listing is newest first, so
        the oldest records are at its end: a call that stops early leaves its cursor for
        the next call, which goes on from there (and starts over once it reached the end).
        """
        cutoff = self.clock.now_ms() - self.ttl_ms
        deleted = 0
        cursor = self._sweep_cursor
        for _page in range(SWEEP_PAGES):
            page = await self.checkpoints.list_checkpoints(
                namespace=RESUME_NAMESPACE,
                key_prefix=f"w1:{self.connection_id}:",
                category=RESUME_CATEGORY,
                scope=self._scope(None),
                cursor=cursor,
                limit=SWEEP_PAGE_SIZE,
            )
            for item in page.items:
                stored = _resume_record(item.value)
                if stored is None or stored[1] < cutoff:
                    removed = await self.checkpoints.delete_checkpoint(
                        namespace=RESUME_NAMESPACE, key=item.key, scope=item.scope
                    )
                    deleted += int(removed)
            cursor = page.next_cursor
            if cursor is None or not page.items:
                cursor = None
                break
        self._sweep_cursor = cursor
        return deleted


def _resume_record(value: object) -> tuple[str, int] | None:
    """``(token hash, last seen ms)`` of a stored record, ``None`` when it does not parse."""
    if not isinstance(value, Mapping):
        return None
    digest, seen = value.get("tokenHash"), value.get("lastSeenAtMs")
    if not isinstance(digest, str) or isinstance(seen, bool) or not isinstance(seen, int):
        return None
    return digest, seen


@attrs.frozen
class WebchatStatistics:
    """Bounded counters (no ids, no text)."""

    open_sockets: int
    actors: int
    connections: int
    admissions: int
    """``admit`` calls answered (any status)."""
    rejected_frames: int
    replies_sent: int
    replies_held: int
    """Replies no open socket took (``SendResult.hold()``; re-driven on reconnect)."""
    hellos_refused: int
    """Hellos for an actor id owned by another browser (wrong or missing resume token)."""
    typing_sent: int = 0
    """``typing`` calls that went out as frames (to the open sockets of their actor)."""


class _BadFrame(Exception):
    """A client frame we refuse; ``args[0]`` is the fixed text sent back."""


_FAIL_REASONS = {1002: "protocol error", 1007: "invalid UTF-8", 1009: "message too big"}
"""Close codes wsproto reports for a frame it could not accept (its ``ParseFailed``)."""
CLOSE_FRAME_BUDGET_S = 0.25


def _close_frame(code: int, reason: str) -> bytes:
    """A server's (unmasked) close frame; ``reason`` is fixed ASCII text, short."""
    payload = code.to_bytes(2, "big") + reason.encode("ascii")
    return bytes([0x88, len(payload)]) + payload


class _ReplayStream(trio.abc.Stream):
    """A stream that yields ``prefix`` before reading from ``inner``.

    The request head was consumed to route the request; wsproto must see it again.

    It also completes a failure trio-websocket leaves half done: for a frame wsproto refuses
    (a text frame that is not UTF-8 …) the library records close code 1007 locally and closes
    the transport without telling the peer, who would see an abnormal closure (1006).
    :meth:`tell_failure` sends that close frame; it runs when the library closes the stream
    and when the session ends, whichever comes first.
    """

    def __init__(self, inner: trio.abc.Stream, prefix: bytes) -> None:
        self._inner = inner
        self._prefix = prefix
        self.ws: Any = None
        """The WebSocket over this stream, once accepted."""
        self._close_sent = False

    async def send_close_frame(self, code: int, reason: str) -> None:
        """Write a close frame directly, once (bounded; never raises for a gone peer)."""
        if self._close_sent:
            return
        self._close_sent = True
        with trio.move_on_after(CLOSE_FRAME_BUDGET_S):
            try:
                await self._inner.send_all(_close_frame(code, reason))
            except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
                pass

    async def tell_failure(self) -> None:
        """Send the close frame of a failure the library did not send (see the class)."""
        code = self._failed_without_telling()
        if code is not None:
            # Shielded so a cancelled handler still tells the peer, bounded so a peer that
            # reads nothing cannot hold the handler (and a stop) forever.
            with trio.move_on_after(CLOSE_BUDGET_S, shield=True):
                await self.send_close_frame(code, _FAIL_REASONS[code])

    def _failed_without_telling(self) -> int | None:
        ws = self.ws
        closed = getattr(ws, "closed", None)
        if closed is None or closed.code not in _FAIL_REASONS:
            return None
        # Still OPEN for wsproto: no close frame went out (a peer's own close is answered,
        # which leaves it CLOSED). Private, hence looked up defensively; the tests pin it.
        state = getattr(getattr(ws, "_wsproto", None), "state", None)
        return int(closed.code) if getattr(state, "name", None) == "OPEN" else None

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self._inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self._prefix:
            n = len(self._prefix) if max_bytes is None else max_bytes
            chunk, self._prefix = self._prefix[:n], self._prefix[n:]
            await trio.lowlevel.checkpoint()
            return chunk
        return await self._inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.tell_failure()
        await self._inner.aclose()

    def __repr__(self) -> str:
        return "<webchat stream>"


@attrs.define(eq=False)
class _Socket:
    ws: Any  # trio_websocket.WebSocketConnection (untyped library)
    stream: trio.abc.Stream
    """The transport under ``ws``, closed directly when the peer stops reading."""
    slot: Slot
    """Its place among the listener's connections (touched by messages and replies)."""


@attrs.define(eq=False)
class WebchatAdapter:
    """The web chat channel adapter (:class:`prismd.channel.ChannelAdapter`).

    Guarantees:

    * ``run`` calls ``task_status.started()`` only once the listener accepts connections; the
      bound address is then in :attr:`bound` (bind port 0 in tests).
    * Every valid message frame becomes exactly one ``admit`` call, answered by one
      ``admission`` frame; invalid frames get an ``error`` frame and are never admitted.
    * ``send`` never raises for a closed or slow socket: it returns
      ``SendResult(True, message_id=…)`` when at least one open socket of the conversation took
      the reply, else ``SendResult.hold("webchat_not_connected")`` (not sent, not failed).
    * A socket joins its actor's conversation only after its hello proved the actor's
      resume token (or claimed a fresh actor); then, with ``conversations``, it gets the
      ``history`` frame and the runtime re-drives the conversation's held replies.
    * A misbehaving client never takes the listener down.
    """

    _connection_id: str = attrs.field(alias="connection_id")
    listen: str
    admit: Admit
    access_token: str | None = None
    clock: Clock = SYSTEM_CLOCK
    max_message_bytes: int = 64 * 1024
    max_pending: int = MAX_PENDING
    max_sockets: int = MAX_SOCKETS
    idle_timeout_s: float = IDLE_TIMEOUT_S
    pairing_only: bool = False
    """Every grant of this connection needs pairing (``prismctl pair``), so a listener off
    loopback is acceptable without an access token: strangers reach the socket but no agent."""
    checkpoints: CheckpointStore | None = None
    """Where resume tokens are kept (hashed); ``None`` keeps them in memory until the process
    ends (tests), so every browser must start a new chat after a restart."""
    conversations: Conversations | None = None
    """The runtime's history and re-drive (late-bound by the daemon's host)."""
    resume_ttl_days: int = 7
    """An actor id unused this long is free again (the daemon passes ``retention_days``)."""
    history_limit: int = HISTORY_LIMIT
    bound: tuple[str, int] | None = attrs.field(default=None, init=False)
    _listening: bool = attrs.field(default=False, init=False)
    _on_loopback: bool = attrs.field(default=True, init=False)
    _sockets: dict[str, set[_Socket]] = attrs.field(factory=dict, init=False)
    limiter: ConnectionLimiter = attrs.field(init=False)
    _admissions: int = attrs.field(default=0, init=False)
    _rejected_frames: int = attrs.field(default=0, init=False)
    _replies_sent: int = attrs.field(default=0, init=False)
    _replies_held: int = attrs.field(default=0, init=False)
    _hellos_refused: int = attrs.field(default=0, init=False)
    _page: bytes = attrs.field(default=b"", init=False)
    _csp: str = attrs.field(default="", init=False)
    _tokens: _ResumeTokens = attrs.field(init=False)
    _background: trio.Nursery | None = attrs.field(default=None, init=False)
    _previews: LivePreviews = attrs.field(init=False)
    _typing: TypingSignals = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._page, self._csp = _load_page()
        self._previews = LivePreviews(self._send_preview)
        self._typing = TypingSignals(self._send_preview, self._previews.busy)
        if not 1 <= self.resume_ttl_days <= 3650:
            raise ValueError("resume_ttl_days must be in 1..3650")
        if not 0 <= self.history_limit <= 100:
            raise ValueError("history_limit must be in 0..100")
        checkpoints = self.checkpoints
        if checkpoints is None:
            checkpoints = MemoryStore(clock=self.clock).checkpoints
        self._tokens = _ResumeTokens(
            checkpoints, self._connection_id, self.clock, self.resume_ttl_days * DAY_MS
        )
        self.limiter = ConnectionLimiter(
            f"web chat {self._connection_id}",
            {
                PENDING: Budget(
                    self.max_pending,
                    "evict",
                    "connections in their HTTP head or before their hello",
                ),
                ESTABLISHED: Budget(self.max_sockets, "evict", "established sockets"),
            },
            logger=log,
        )

    @property
    def connection_id(self) -> str:
        return self._connection_id

    # ------------------------------------------------------------------ supervisor surface

    def health(self) -> Mapping[str, str]:
        return {"listener": "listening" if self._listening else "stopped"}

    @property
    def receiver_lease_held(self) -> bool:
        """The web chat has no receiver lease: each browser is its own transport."""
        return False

    @property
    def features(self) -> AdapterFeatures:
        """Previews (the answer's live text), typing (:mod:`._typing`) and notices for
        messages settled unanswered (:mod:`._past`); no attachments."""
        return AdapterFeatures(previews=True, typing=True, unanswered_notices=True)

    def send_draft(self, preview: Preview) -> None:
        """Show a streaming answer's text in the actor's open tabs (a ``preview`` frame,
        coalesced, never after the reply that ends it; see :mod:`._previews`). Never
        blocks or raises; nothing when no tab of the actor is open."""
        actor = preview.external_conversation_id
        if (
            preview.connection_id != self._connection_id
            or self._background is None
            or not self._sockets.get(actor)
        ):
            return
        self._previews.offer(self._background, actor, preview.text)

    async def _send_preview(self, actor: str, frame: str) -> None:
        """``frame`` (a preview or a typing frame) to every open socket of ``actor``."""
        sockets = list(self._sockets.get(actor, ()))
        await _to_each(sockets, functools.partial(self._send_frame, frame=frame))

    async def send_typing(self, conversation_id: str, thread_id: str | None = None) -> None:
        """A ``typing`` frame to the actor's open tabs (see :mod:`._typing`); never raises,
        nothing when no tab of the actor is open."""
        if not self._sockets.get(conversation_id):
            await trio.lowlevel.checkpoint()
            return
        await self._typing.signal(conversation_id)

    async def fetch_attachment(self, ref: AttachmentRef) -> None:
        """Not offered (see :attr:`features`): the page sends no files."""
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        """Nothing is held outside :meth:`run`."""
        await trio.lowlevel.checkpoint()

    def statistics(self) -> WebchatStatistics:
        return WebchatStatistics(
            open_sockets=sum(len(s) for s in self._sockets.values()),
            actors=len(self._sockets),
            connections=self.limiter.open(),
            admissions=self._admissions,
            rejected_frames=self._rejected_frames,
            replies_sent=self._replies_sent,
            replies_held=self._replies_held,
            hellos_refused=self._hellos_refused,
            typing_sent=self._typing.sent,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled.

        Raises :class:`AdapterFatalError` for an unusable ``listen`` and for a non-loopback
        address without an access token; ``OSError`` if the port cannot be bound.
        """
        try:
            host, port = parse_listen(self.listen)
        except ValueError:
            raise AdapterFatalError("web chat listen address must be HOST:PORT") from None
        self._on_loopback = is_loopback_host(host)
        if not self._on_loopback and not self.access_token and not self.pairing_only:
            raise AdapterFatalError("web chat on a non-loopback address needs an access token")
        listeners = await trio.open_tcp_listeners(port, host=host)
        try:
            sockname = listeners[0].socket.getsockname()
            self.bound = (str(sockname[0]), int(sockname[1]))
            async with trio.open_nursery() as nursery:
                self._background = nursery
                await nursery.start(
                    functools.partial(serve_limited, budget=PENDING),
                    self._handle_connection,
                    listeners,
                    self.limiter,
                )
                nursery.start_soon(self._sweep_resume_tokens)
                self._listening = True
                log.info("web chat listening on %s port %d", self.bound[0], self.bound[1])
                task_status.started()
        finally:
            self._listening = False
            self._background = None
            with trio.move_on_after(LISTENER_CLOSE_BUDGET_S, shield=True):
                for listener in listeners:
                    await listener.aclose()

    async def send(self, reply: Reply) -> SendResult:
        sockets = list(self._sockets.get(reply.external_conversation_id, ()))
        frame = json.dumps(
            {
                "type": "reply",
                "replyId": reply.operation_id,
                "kind": reply.kind,
                "text": reply.text,
                "controls": [{"label": c.label, "value": c.value} for c in reply.controls],
                "inReplyTo": _client_id_of(reply.in_reply_to, reply.external_conversation_id),
            },
            # ASCII escapes: a lone surrogate in a reply must not make the WebSocket layer's
            # UTF-8 encoding raise (a raising send reads as an ambiguous delivery).
            ensure_ascii=True,
        )
        taken: list[_Socket] = []

        async def deliver(sock: _Socket) -> None:
            if await self._send_frame(sock, frame):
                sock.slot.touch()
                taken.append(sock)

        # under the actor's preview lock, so no stale preview follows the reply
        async with self._previews.replying(reply.external_conversation_id):
            await _to_each(sockets, deliver)
        if not taken:
            # No open socket took it: nothing reached the browser (a timed-out write is an
            # incomplete frame), so the runtime keeps it for the actor's next connection.
            self._replies_held += 1
            return SendResult.hold(NOT_CONNECTED)
        self._replies_sent += 1
        return SendResult(True, message_id="webchat-" + uuid.uuid4().hex)

    async def _sweep_resume_tokens(self) -> None:
        while True:
            try:
                deleted = await self._tokens.sweep()
            except Exception as exc:
                log.warning("web chat resume sweep failed: %s", type(exc).__name__)
            else:
                if deleted:
                    log.debug("web chat swept %d unused resume record(s)", deleted)
            await trio.sleep(SWEEP_INTERVAL_S)

    # ------------------------------------------------------------------ HTTP

    async def _handle_connection(self, stream: trio.SocketStream, slot: Slot) -> None:
        try:
            await self._serve_connection(stream, slot)
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the peer went away; nothing to report
        except* Exception as group:
            kinds = sorted({type(e).__name__ for e in group.exceptions})
            log.warning("web chat connection failed: %s", ", ".join(kinds))
        finally:
            await trio.aclose_forcefully(stream)

    async def _serve_connection(self, stream: trio.SocketStream, slot: Slot) -> None:
        conn = server_connection()
        # A connection that says nothing is answered 408 too (not just closed), as the web
        # chat always did: a client then knows the server gave up, not that it crashed.
        head = await read_request_head(stream, conn, answer_silence=True)
        if head is None or not await self._route(stream, conn, head, slot):
            await close_gracefully(stream)

    async def _route(
        self, stream: trio.SocketStream, conn: h11.Connection, head: _Head, slot: Slot
    ) -> bool:
        """Answer one request; True when it became a WebSocket (closed by its session)."""
        if not self._host_allowed(head):
            await self._respond(stream, conn, head.method, 421, b"misdirected request\n")
            return False
        if head.path == "/healthz":
            if head.method not in ("GET", "HEAD"):
                await self._respond(stream, conn, head.method, 405, b"method not allowed\n")
                return False
            body = (
                json.dumps({"status": "ok", "listener": self.health()["listener"]}).encode() + b"\n"
            )
            await self._respond(stream, conn, head.method, 200, body, "application/json")
            return False
        if head.path not in ("/", "/ws"):
            await self._respond(stream, conn, head.method, 404, b"not found\n")
            return False
        if head.method not in ("GET", "HEAD"):
            await self._respond(stream, conn, head.method, 405, b"method not allowed\n")
            return False
        credentials = self._credentials(head)
        if self.access_token and len(credentials) > 1:
            # One guess per request: never compare several presented tokens.
            await self._respond(stream, conn, head.method, 400, b"one access token at most\n")
            return False
        if not self._authorized(credentials):
            await self._respond(
                stream,
                conn,
                head.method,
                401,
                b"unauthorized\n",
                extra=[("WWW-Authenticate", "Bearer")],
            )
            return False
        if head.path == "/":
            await self._respond(
                stream,
                conn,
                head.method,
                200,
                self._page,
                "text/html; charset=utf-8",
                extra=[
                    ("Content-Security-Policy", self._csp),
                    ("X-Frame-Options", "DENY"),
                ],
            )
            return False
        upgrade = head.headers.get("upgrade", "").lower() == "websocket"
        connection_tokens = {
            t.strip().lower() for t in head.headers.get("connection", "").split(",")
        }
        if head.method != "GET" or not upgrade or "upgrade" not in connection_tokens:
            await self._respond(
                stream,
                conn,
                head.method,
                426,
                b"websocket upgrade required\n",
                extra=[("Upgrade", "websocket")],
            )
            return False
        if not self._origin_allowed(head):
            await self._respond(stream, conn, head.method, 403, b"forbidden origin\n")
            return False
        await self._serve_websocket(stream, head.raw, slot)
        return True

    def _host_allowed(self, head: _Head) -> bool:
        # On loopback without a token, being local is the only protection: a page on another
        # site that rebinds its DNS name to 127.0.0.1 would otherwise reach us with its own
        # Host. A token (or pairing off loopback) protects the other cases. An absolute-form
        # target's authority is the request's host for HTTP (RFC 9112 §3.2.2), so it must
        # pass the same test; the Host header must too, whatever a proxy makes of the two.
        if self.access_token or not self._on_loopback:
            return True
        if head.authority is not None and not _host_header_is_loopback(head.authority):
            return False
        return _host_header_is_loopback(head.headers.get("host", ""))

    def _origin_allowed(self, head: _Head) -> bool:
        # Browsers always send Origin on a WebSocket; other sites must not drive the chat.
        origin = head.headers.get("origin")
        if origin is None:
            return True  # non-browser clients (prismctl chat)
        try:
            parts = urlsplit(origin)
        except ValueError:
            return False
        host = head.authority if head.authority is not None else head.headers.get("host", "")
        return parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()

    @staticmethod
    def _credentials(head: _Head) -> list[str]:
        """Every access token the request presents (a bearer header, ``token=`` params)."""
        auth = head.headers.get("authorization", "")
        presented: list[str] = []
        if auth[:7].lower() == "bearer ":
            presented.append(auth[7:].strip())
        presented.extend(head.query.get("token", []))
        return presented

    def _authorized(self, credentials: Sequence[str]) -> bool:
        """The one presented token (at most one, see :meth:`_credentials`) is ours."""
        if not self.access_token:
            return True
        return len(credentials) == 1 and hmac.compare_digest(
            credentials[0].encode("utf-8"), self.access_token.encode("utf-8")
        )

    _respond = staticmethod(respond)
    """The shared responder (:func:`adapters.toolkit.respond`)."""

    # ------------------------------------------------------------------ WebSocket

    async def _serve_websocket(self, stream: trio.SocketStream, raw: bytes, slot: Slot) -> None:
        replay = _ReplayStream(stream, raw)
        async with trio.open_nursery() as nursery:
            ws: Any = None
            with trio.move_on_after(HANDSHAKE_TIMEOUT_S):
                request = await trio_websocket.wrap_server_stream(
                    nursery,
                    replay,
                    # the library closes (1009) only far above our own limit, so a merely
                    # oversized frame gets an error frame and the socket stays usable
                    max_message_size=4 * self.max_message_bytes,
                    message_queue_size=16,
                )
                ws = await request.accept()
                replay.ws = ws
            if ws is None:
                nursery.cancel_scope.cancel()
                return
            try:
                await self._session(_Socket(ws=ws, stream=replay, slot=slot))
            finally:
                await replay.tell_failure()
                if slot.evicted:
                    # Pushed out for a newcomer: say so without waiting for an answer (the
                    # library's reader is cancelled with us); the transport closes next.
                    with trio.move_on_after(STOP_CLOSE_BUDGET_S, shield=True):
                        await replay.send_close_frame(1013, "try again later")
                else:
                    # Stopping (we are cancelled): say 1001 "going away" and do not wait long
                    # for the peer's answer, since the library's reader is cancelled with us.
                    stopping = _cancelled_now()
                    budget = STOP_CLOSE_BUDGET_S if stopping else CLOSE_BUDGET_S
                    with trio.move_on_after(budget, shield=True):
                        await ws.aclose(1001 if stopping else 1000)
                nursery.cancel_scope.cancel()

    async def _session(self, sock: _Socket) -> None:
        ws = sock.ws
        hello: tuple[str, str | None] | None = None
        with trio.move_on_after(HELLO_TIMEOUT_S):
            while hello is None:
                message = await _get_message(ws)
                if message is None:
                    return
                try:
                    hello = self._hello_from(self._decode(message))
                except _BadFrame as bad:
                    if not await self._send_error(sock, bad.args[0]):
                        return
        if hello is None:
            await self._send_error(sock, "no hello received in time")
            await ws.aclose(1008, "no hello")
            return
        actor, presented = hello
        try:
            with trio.fail_after(RESUME_CHECK_TIMEOUT_S):
                resumed = await self._tokens.claim(actor, presented)
        except Exception as exc:
            log.warning("web chat resume check failed: %s", type(exc).__name__)
            await self._send_error(sock, "the chat is unavailable; try again later", "unavailable")
            await ws.aclose(1011, "unavailable")
            return
        if resumed is None:
            # Wrong or missing token for an actor another browser owns: this socket never
            # joins that conversation (no replies, no history).
            self._hellos_refused += 1
            await self._send_error(
                sock, "this chat belongs to another browser; start a new one", "resume_refused"
            )
            await ws.aclose(1008, "resume refused")
            return
        # Proved: from now on an established socket (the idlest one gives way if full).
        sock.slot.move(ESTABLISHED)
        ready: dict[str, str] = {"type": "ready", "actor": actor}
        if resumed.issued is not None:
            ready["resume"] = resumed.issued
        if not await self._send_frame(sock, json.dumps(ready)):
            return
        self._sockets.setdefault(actor, set()).add(sock)
        try:
            if self.conversations is not None:
                # Joined first, then history: a reply marked delivered meanwhile is either
                # in the history or sent live (the page shows a replyId once), never missed.
                # Frames are read only after it, so ``history`` is the first frame after
                # ``ready`` that the socket's own messages can cause.
                if not await self._send_history(sock, actor, self.conversations):
                    return
                if self._background is not None:
                    # In the listener's nursery, not this socket's: a re-drive cut short by
                    # the tab closing again would leave a claimed reply for the operator.
                    self._background.start_soon(self._redeliver, actor, self.conversations)
            while True:
                message = await self._next_message(sock)
                if message is None:
                    return
                sock.slot.touch()
                try:
                    event, client_id = self._event_from(actor, self._decode(message))
                except _BadFrame as bad:
                    if not await self._send_error(sock, bad.args[0]):
                        return
                    continue
                try:
                    admission = await self.admit(event)
                except Exception as exc:
                    # the client keeps the message and re-sends it; the journal dedups it
                    log.warning("web chat admit failed: %s", type(exc).__name__)
                    if not await self._send_error(sock, "the message could not be admitted"):
                        return
                    continue
                self._admissions += 1
                if not await self._send_frame(sock, _admission_frame(client_id, admission)):
                    return
        finally:
            peers = self._sockets.get(actor)
            if peers is not None:
                peers.discard(sock)
                if not peers:
                    del self._sockets[actor]

    async def _next_message(self, sock: _Socket) -> str | bytes | None:
        """The socket's next message; ``None`` once it closed, or after closing it (1000
        "idle") when it had neither a message nor a reply for ``idle_timeout_s``."""
        while True:
            with trio.move_on_at(sock.slot.last_active + self.idle_timeout_s):
                return await _get_message(sock.ws)
            if trio.current_time() >= sock.slot.last_active + self.idle_timeout_s:
                with trio.move_on_after(CLOSE_BUDGET_S):
                    await sock.ws.aclose(1000, "idle")
                return None
            # a reply went out meanwhile: the socket is not idle, wait on

    def _hello_from(self, frame: dict[str, Any]) -> tuple[str, str | None]:
        """``(actor, presented resume token or None)`` of a valid hello; :class:`_BadFrame`."""
        try:
            if frame.get("type") != "hello":
                raise _BadFrame("the first frame must be a hello")
            actor = frame.get("actor")
            if not isinstance(actor, str) or not ACTOR_RE.match(actor):
                raise _BadFrame("invalid actor id")
            presented = frame.get("resume")
            if presented is not None and (
                not isinstance(presented, str) or not RESUME_RE.match(presented)
            ):
                raise _BadFrame("invalid resume token")
            return actor, presented
        except _BadFrame:
            self._rejected_frames += 1
            raise

    async def _send_history(self, sock: _Socket, actor: str, conversations: Conversations) -> bool:
        """The ``history`` frame (empty when the journal cannot be read); False when the
        socket did not take it."""
        past: Sequence[PastReply] = ()
        if self.history_limit:
            past = await conversation_past(
                conversations,
                self._connection_id,
                actor,
                self.history_limit,
                RESUME_CHECK_TIMEOUT_S,
            )
        return await self._send_frame(sock, _history_frame(actor, past))

    async def _redeliver(self, actor: str, conversations: Conversations) -> None:
        """Ask the runtime to re-drive the actor's held replies (they reach every open
        socket of the actor through :meth:`send`). Never raises."""
        try:
            await conversations.redeliver_pending(
                connection_id=self._connection_id,
                external_conversation_id=actor,
                external_actor_id=actor,
            )
        except Exception as exc:
            log.warning("web chat re-drive failed: %s", type(exc).__name__)

    def _decode(self, message: str | bytes) -> dict[str, Any]:
        try:
            if isinstance(message, bytes):
                raise _BadFrame("binary frames are not supported")
            if utf8_len(message) > self.max_message_bytes:
                raise _BadFrame("frame too large")
            try:
                frame = json.loads(message)
            except (ValueError, RecursionError):  # RecursionError: nesting past the parser's limit
                raise _BadFrame("frame is not valid JSON") from None
            if not isinstance(frame, dict):
                raise _BadFrame("frame must be a JSON object")
            return frame
        except _BadFrame:
            self._rejected_frames += 1
            raise

    def _event_from(self, actor: str, frame: dict[str, Any]) -> tuple[InboundEvent, str | None]:
        kind = frame.get("type")
        try:
            if kind == "message":
                client_id = frame.get("id")
                if not isinstance(client_id, str) or not CLIENT_ID_RE.match(client_id):
                    raise _BadFrame("invalid message id")
                text = frame.get("text")
                if not isinstance(text, str) or not text.strip():
                    raise _BadFrame("message text must be a non-empty string")
                # ``json.loads`` joins escaped pairs, so a surrogate left is unpaired; the
                # journal cannot store it (as UTF-8), and a store refusal reads as retryable.
                text = replace_surrogates(text)
                return self._event(actor, f"{actor}:{client_id}", text, None), client_id
            if kind == "approve":
                client_id = frame.get("id")
                if client_id is not None and (
                    not isinstance(client_id, str) or not CLIENT_ID_RE.match(client_id)
                ):
                    raise _BadFrame("invalid message id")
                value = frame.get("value")
                match = APPROVAL_RE.match(value) if isinstance(value, str) else None
                if match is None:
                    raise _BadFrame("invalid approval value")
                approval = ApprovalInput(
                    token=match.group(2),
                    outcome="allow_once" if match.group(1) == "a" else "reject_once",
                )
                # the raw token must never become part of a journaled id
                digest = hashlib.sha256(match.group(0).encode("ascii")).hexdigest()[:32]
                event = self._event(actor, f"{actor}:approve-{digest}", "", approval)
                return event, client_id
            if kind == "hello":
                raise _BadFrame("hello was already received")
            raise _BadFrame("unknown frame type")
        except _BadFrame:
            self._rejected_frames += 1
            raise

    def _event(
        self, actor: str, event_id: str, text: str, approval: ApprovalInput | None
    ) -> InboundEvent:
        return InboundEvent(
            connection_id=self._connection_id,
            external_conversation_id=actor,
            external_actor_id=actor,
            event_id=event_id,
            text=text,
            approval=approval,
            received_at_ms=self.clock.now_ms(),
            claims={"platform": "webchat"},
        )

    async def _send_error(
        self,
        sock: _Socket,
        message: str,
        code: Literal["resume_refused", "unavailable"] | None = None,
    ) -> bool:
        frame = {"type": "error", "message": message}
        if code is not None:
            frame["code"] = code
        return await self._send_frame(sock, json.dumps(frame))

    async def _send_frame(self, sock: _Socket, frame: str) -> bool:
        """Write one frame; ``False`` (and the socket closed if stuck) when it did not go out."""
        with trio.move_on_after(SEND_TIMEOUT_S) as scope:
            try:
                await sock.ws.send_message(frame)
                return True
            except (
                trio_websocket.ConnectionClosed,
                trio.BrokenResourceError,
                trio.ClosedResourceError,
            ):
                return False
        if scope.cancelled_caught:
            # A close frame would queue behind the unsent bytes, and the library's own reader
            # may be stuck writing to this peer too: drop the transport, which ends both.
            await trio.aclose_forcefully(sock.stream)
        return False


async def _to_each(
    sockets: Sequence[_Socket], send: Callable[[_Socket], Awaitable[object]]
) -> None:
    """``send`` to every socket: concurrently, so one stalled tab cannot hold up the others
    for ``SEND_TIMEOUT_S``; to a lone one (the usual case) directly, with no nursery and
    task to spend per frame."""
    if len(sockets) == 1:
        await send(sockets[0])
        return
    async with trio.open_nursery() as nursery:
        for sock in sockets:
            nursery.start_soon(send, sock)


async def _get_message(ws: Any) -> str | bytes | None:
    try:
        message: str | bytes = await ws.get_message()
    except trio_websocket.ConnectionClosed:
        return None
    return message


def _history_frame(actor: str, past: Sequence[PastReply]) -> str:
    """The ``history`` frame: the newest replies that fit :data:`MAX_HISTORY_FRAME_BYTES`
    (clients bound a frame's size; prismctl chat's library closes the socket above 1 MiB),
    oldest first."""
    kept: list[str] = []
    size = 0
    for p in reversed(past):
        entry = json.dumps(
            {
                "replyId": p.operation_id,
                "kind": p.kind,
                "text": p.text,
                "inReplyTo": _client_id_of(p.in_reply_to, actor),
                "at": p.created_at_ms,
            },
            ensure_ascii=True,
        )
        size += len(entry) + 1
        if size > MAX_HISTORY_FRAME_BYTES:
            break
        kept.append(entry)
    return '{"type": "history", "replies": [' + ", ".join(reversed(kept)) + "]}"


def _admission_frame(client_id: str | None, admission: Admission) -> str:
    frame: dict[str, Any] = {
        "type": "admission",
        "id": client_id,
        "status": admission.status,
        "reason": admission.reason,
        "duplicate": admission.duplicate,
    }
    if admission.hint is not None:
        frame["hint"] = admission.hint  # the runtime's fixed text: a limit, or "send /help"
    return json.dumps(frame)


def _client_id_of(in_reply_to: str | None, actor: str) -> str | None:
    if in_reply_to is None:
        return None
    prefix = actor + ":"
    return in_reply_to[len(prefix) :] if in_reply_to.startswith(prefix) else in_reply_to


def _cancelled_now() -> bool:
    return trio.current_effective_deadline() == float("-inf")
