"""A second, independent fake Discord (gateway v10 + REST) on one loopback port, written
from reference/discord-protocol.md alone (§1, §4, §5, §9), to audit prismd against
choices the first fake did not make.

One listener serves ``/api/v10/...`` (HTTP/1.1, keep-alive) and the gateway (a WebSocket
upgrade on any other path, wsproto, uncompressed JSON text frames). Choices where the
reference leaves one: frames' keys in a varying order (``d`` first, ``t`` first, spaced
or compact), READY and messages with unknown extra fields, RESUMED carrying the next
``s`` (kept in the replay buffer), an op 7 followed by a drop of TCP without a close
frame, a Resume of an attached session kicking the old socket (TCP dropped).

Knobs (attributes, set by a test at any time) are named after what they do; every fault
is counted down, so a scenario says how many requests or dispatches it hits.
"""

from __future__ import annotations

import json
import math
import random
import secrets
import time
from collections import deque
from typing import Any

import attrs
import trio
from wsproto import ConnectionType, WSConnection
from wsproto.events import (
    AcceptConnection,
    BytesMessage,
    CloseConnection,
    Ping,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError

from tests.fakes.discord_alt_rest import BOT_ID, rest_answer

EPOCH_MS = 1420070400000

APP_ID = "9100000000000000002"
PRIVILEGED = (1 << 1) | (1 << 8) | (1 << 15)
KNOWN_INTENTS = (1 << 26) - 1


@attrs.define(eq=False)
class Session:
    id: str
    shard: tuple[int, int]
    seq: int = 0
    buffer: deque[tuple[int, str]] = attrs.field(factory=lambda: deque(maxlen=500))
    conn: _Gw | None = None
    detached_at: float | None = None


@attrs.define(eq=False)
class _Gw:
    """One gateway socket."""

    fake: AltDiscord
    stream: trio.SocketStream
    ws: WSConnection
    out: trio.MemorySendChannel[Any]
    out_recv: trio.MemoryReceiveChannel[Any]
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    session: Session | None = None
    identified: bool = False
    last_heard: float = 0.0
    sent_times: deque[float] = attrs.field(factory=deque)
    close_code: int | None = None
    server_closed: bool = False
    target: str = ""
    lock: trio.Lock = attrs.field(factory=trio.Lock)

    async def write(self, data: bytes) -> None:
        async with self.lock:
            await self.stream.send_all(data)

    def queue(self, item: Any) -> None:
        self.out.send_nowait(item)


@attrs.define(eq=False)
class AltDiscord:
    token: str = "alt-bot-token"
    heartbeat_interval_ms: int = 1000
    resume_ttl_s: float = 120.0
    nonce_window_s: float = 180.0
    max_concurrency: int = 1
    privileged_enabled: bool = True
    bucket_limit: int = 5
    bucket_window_s: float = 5.0
    global_per_s: int = 50
    replay_max: int = 500
    gateway_token: str | None = None
    """The token Identify/Resume accept (``None``: :attr:`token`; another: reset, 4004)."""
    # --- faults (counted down)
    reconnect_before_hello: int = 0
    withhold_acks: bool = False
    drop_wire: int = 0
    """Dispatches numbered and buffered but not written (a resume replays them)."""
    never_send: int = 0
    """Messages stored but never dispatched at all ("may never be sent")."""
    duplicate_same_s: int = 0
    duplicate_new_s: int = 0
    lose_post_response: int = 0
    """POST messages committed, then the TCP connection dropped unanswered."""
    post_500_after_commit: int = 0
    post_502: int = 0
    route_429: int = 0
    global_429: int = 0
    shared_429: int = 0
    # --- state
    rng: random.Random = attrs.field(factory=random.Random)
    port: int = 0
    sessions: dict[str, Session] = attrs.field(factory=dict)
    messages: dict[str, list[dict[str, Any]]] = attrs.field(factory=dict)
    dm_users: dict[str, str] = attrs.field(factory=dict)
    """DM channel id → the user's id."""
    closed_dms: set[str] = attrs.field(factory=set)
    forbidden: set[str] = attrs.field(factory=set)
    nonces: dict[tuple[str, str], tuple[float, str, str]] = attrs.field(factory=dict)
    """(author, nonce) → (when, channel, message id)."""
    deleted: set[str] = attrs.field(factory=set)
    identifies: list[float] = attrs.field(factory=list)
    resumes: list[tuple[str, int]] = attrs.field(factory=list)
    resume_targets: list[str] = attrs.field(factory=list)
    """The request target of each socket a Resume was sent on."""
    heartbeats: list[Any] = attrs.field(factory=list)
    client_close_codes: list[int | None] = attrs.field(factory=list)
    server_close_codes: list[int] = attrs.field(factory=list)
    requests: list[tuple[str, str, int]] = attrs.field(factory=list)
    invalid_requests: int = 0
    nonce_hits: int = 0
    typing: list[str] = attrs.field(factory=list)
    conns: list[_Gw] = attrs.field(factory=list)
    _buckets: dict[tuple[str, str, str], list[float]] = attrs.field(factory=dict, init=False)
    _bucket_names: dict[tuple[str, str], str] = attrs.field(factory=dict, init=False)
    _global_times: deque[float] = attrs.field(factory=deque, init=False)
    _last_flake: int = 0
    _start_remaining: int = 1000

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._expire_loop)
            task_status.started()
            await trio.serve_listeners(self._client, listeners, handler_nursery=nursery)

    # ------------------------------------------------------------------ helpers

    def snowflake(self) -> str:
        flake = (int(time.time() * 1000) - EPOCH_MS) << 22
        self._last_flake = max(flake, self._last_flake + 1)
        return str(self._last_flake)

    def open_dm(self, user_id: str, channel_id: str | None = None) -> str:
        for channel, user in self.dm_users.items():
            if user == user_id:
                return channel
        channel = channel_id or self.snowflake()
        self.dm_users[channel] = user_id
        self.messages.setdefault(channel, [])
        return channel

    def _encode(self, op: int, d: Any, s: int | None = None, t: str | None = None) -> str:
        keys = [("op", op), ("d", d), ("s", s), ("t", t)]
        style = self.rng.randrange(3)
        if style == 0:
            keys = [keys[3], keys[2], keys[0], keys[1]]  # t, s, op, d (prismd's fast path)
        elif style == 1:
            keys = [keys[1], keys[0], keys[3], keys[2]]  # d first
        separators = (", ", ": ") if self.rng.random() < 0.3 else (",", ":")
        return json.dumps(dict(keys), separators=separators)

    def _message(
        self, channel: str, author: dict[str, Any], content: str, reference: str | None = None
    ) -> dict[str, Any]:
        message: dict[str, Any] = {
            "type": 19 if reference else 0,
            "tts": False,
            "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S.000000+00:00", time.gmtime()),
            "pinned": False,
            "mentions": [],
            "mention_roles": [],
            "mention_everyone": False,
            "id": self.snowflake(),
            "flags": 0,
            "embeds": [],
            "edited_timestamp": None,
            "content": content,
            "components": [],
            "channel_id": channel,
            "author": author,
            "attachments": [],
        }
        if reference:
            message["message_reference"] = {
                "type": 0,
                "channel_id": channel,
                "message_id": reference,
            }
            message["referenced_message"] = self.find(channel, reference)
        self.messages.setdefault(channel, []).append(message)
        return message

    def find(self, channel: str, message_id: str) -> dict[str, Any] | None:
        return next((m for m in self.messages.get(channel, []) if m["id"] == message_id), None)

    def user_message(self, channel: str, user_id: str, content: str) -> dict[str, Any]:
        """A user writes in DM ``channel``: stored, then dispatched (faults permitting)."""
        self.open_dm(user_id, channel)
        author = {
            "id": user_id,
            "username": f"u{user_id[-4:]}",
            "global_name": None,
            "avatar": None,
            "discriminator": "0",
            "public_flags": 0,
            "clan": None,
        }
        message = self._message(channel, author, content)
        if self.never_send > 0:
            self.never_send -= 1
        else:
            self.dispatch("MESSAGE_CREATE", {**message, "channel_type": 1})
        return message

    def sessions_seq(self) -> list[int]:
        return [session.seq for session in self.sessions.values()]

    def bot_messages(self) -> list[dict[str, Any]]:
        return [
            m
            for ms in self.messages.values()
            for m in ms
            if m["author"]["id"] == BOT_ID and m["id"] not in self.deleted
        ]

    # ------------------------------------------------------------------ gateway events

    def dispatch(self, t: str, d: Any) -> None:
        for session in list(self.sessions.values()):
            if session.shard[0] != 0:
                continue  # DMs only to shard 0
            session.seq += 1
            frame = self._encode(0, d, session.seq, t)
            session.buffer.append((session.seq, frame))
            conn = session.conn
            if conn is None:
                continue
            if self.drop_wire > 0:
                self.drop_wire -= 1
                continue
            conn.queue(frame)
            if self.duplicate_same_s > 0:
                self.duplicate_same_s -= 1
                conn.queue(frame)
            elif self.duplicate_new_s > 0:
                self.duplicate_new_s -= 1
                session.seq += 1
                again = self._encode(0, d, session.seq, t)
                session.buffer.append((session.seq, again))
                conn.queue(again)

    def large_guild(self, members: int = 3000) -> None:
        """A GUILD_CREATE of some hundreds of KiB (sent in fragments, after a ping)."""
        users = [{"user": {"id": str(10**17 + n), "username": f"m{n}"}} for n in range(members)]
        self.dispatch("GUILD_CREATE", {"id": "9300000000000000001", "members": users})

    def reconnect_all(self) -> None:
        """Op 7 on every socket, then TCP dropped a little later."""
        for conn in list(self.conns):
            conn.queue(self._encode(7, None))
            conn.queue(("drop_after", 0.5))

    def invalidate_all(self, resumable: bool) -> None:
        """Op 9 mid-session; ``False`` ends the session."""
        for conn in list(self.conns):
            if conn.session is not None and not resumable:
                self.sessions.pop(conn.session.id, None)
                conn.session.conn = None
                conn.session = None
            conn.queue(self._encode(9, resumable))

    def request_heartbeat_all(self) -> None:
        for conn in list(self.conns):
            conn.queue(self._encode(1, None))

    def close_all(self, code: int | None) -> None:
        """Close every socket with ``code`` (``None``: TCP dropped); 4003, 4007 and 4009
        end the session too ("start a new one")."""
        for conn in list(self.conns):
            if code in (4003, 4007, 4009) and conn.session is not None:
                self.sessions.pop(conn.session.id, None)
            conn.queue(("close", code))

    async def _expire_loop(self) -> None:
        while True:
            await trio.sleep(0.5)
            now = trio.current_time()
            for sid, session in list(self.sessions.items()):
                gone = session.detached_at is not None and session.conn is None
                if gone and now - (session.detached_at or now) > self.resume_ttl_s:
                    del self.sessions[sid]

    async def _gateway(self, stream: trio.SocketStream, head: bytes) -> None:
        ws = WSConnection(ConnectionType.SERVER)
        ws.receive_data(head)
        send, recv = trio.open_memory_channel[Any](math.inf)
        conn = _Gw(self, stream, ws, send, recv, last_heard=trio.current_time())
        for event in ws.events():
            if isinstance(event, Request):
                conn.target = event.target
                await stream.send_all(ws.send(AcceptConnection()))
        self.conns.append(conn)
        try:
            with conn.scope:  # cancelled: TCP dropped (the caller closes the stream)
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._guarded, conn, self._writer)
                    nursery.start_soon(self._watchdog, conn)
                    if self.reconnect_before_hello > 0:
                        self.reconnect_before_hello -= 1
                        conn.queue(self._encode(7, None))  # in place of Hello
                        conn.queue(("drop_after", 0.3))
                    hello = {"heartbeat_interval": self.heartbeat_interval_ms, "_trace": ["alt"]}
                    conn.queue(self._encode(10, hello))
                    await self._guarded(conn, self._reader)
        finally:
            self.conns.remove(conn)
            if conn.session is not None and conn.session.conn is conn:
                conn.session.conn = None
                conn.session.detached_at = trio.current_time()
                if conn.close_code in (1000, 1001):
                    self.sessions.pop(conn.session.id, None)

    async def _guarded(self, conn: _Gw, part: Any) -> None:
        try:
            await part(conn)
        except (trio.BrokenResourceError, trio.ClosedResourceError, LocalProtocolError):
            pass
        conn.scope.cancel()

    async def _writer(self, conn: _Gw) -> None:
        async for item in conn.out_recv:
            if isinstance(item, tuple):
                if item[0] == "drop_after":
                    await trio.sleep(item[1])
                    return
                code = item[1]
                if code is not None:
                    self.server_close_codes.append(code)
                    conn.server_closed = True
                    await conn.write(conn.ws.send(CloseConnection(code=code, reason="")))
                    await trio.sleep(0.5)  # the client's answer, then TCP ends
                return
            if len(item) <= 16384:
                await conn.write(conn.ws.send(TextMessage(data=item)))
                continue
            # A large frame: a ping first, then the message in fragments of 8 KiB.
            await conn.write(conn.ws.send(Ping(b"alt")))
            parts = [item[i : i + 8192] for i in range(0, len(item), 8192)]
            for n, part in enumerate(parts):
                last = n == len(parts) - 1
                await conn.write(conn.ws.send(TextMessage(data=part, message_finished=last)))

    async def _watchdog(self, conn: _Gw) -> None:
        """No heartbeat for 1.5 intervals (+1 s): the connection is closed (resumable).
        Seen silent twice, 0.25 s apart: a test process stalled past the limit (a loaded
        machine) has its reader read what came meanwhile before the second look, so only
        the client's own silence closes it."""
        limit = self.heartbeat_interval_ms / 1000 * 1.5 + 1.0
        silent_before = False
        while True:
            await trio.sleep(0.25)
            silent = trio.current_time() - conn.last_heard > limit
            if silent and silent_before:
                conn.queue(("close", 4000))
                return
            silent_before = silent

    async def _reader(self, conn: _Gw) -> None:
        while True:
            data = await conn.stream.receive_some(65536)
            if not data:
                return
            conn.ws.receive_data(data)
            for event in conn.ws.events():
                if isinstance(event, CloseConnection):
                    if conn.server_closed:
                        return  # the answer to our close (an echo, not the client's)
                    conn.close_code = event.code
                    self.client_close_codes.append(event.code)
                    await conn.write(conn.ws.send(event.response()))
                    return
                if isinstance(event, Ping):
                    await conn.write(conn.ws.send(event.response()))
                elif isinstance(event, (TextMessage, BytesMessage)):
                    if not event.message_finished:
                        conn.queue(("close", 4002))
                        continue
                    self._client_payload(
                        conn, bytes(event.data) if isinstance(event.data, bytearray) else event.data
                    )

    def _client_payload(self, conn: _Gw, raw: str | bytes) -> None:
        now = trio.current_time()
        conn.last_heard = now
        conn.sent_times.append(now)
        while conn.sent_times and now - conn.sent_times[0] > 60:
            conn.sent_times.popleft()
        size = len(raw.encode() if isinstance(raw, str) else raw)
        if size > 4096:
            return conn.queue(("close", 4002))
        if len(conn.sent_times) > 120:
            return conn.queue(("close", 4008))
        try:
            payload = json.loads(raw)
            op, d = payload["op"], payload.get("d")
        except (ValueError, KeyError, TypeError):
            return conn.queue(("close", 4002))
        if op == 1:
            self.heartbeats.append(d)
            if not self.withhold_acks:
                conn.queue(self._encode(11, None))
        elif op == 2:
            self._identify(conn, d)
        elif op == 6:
            self._resume(conn, d)
        elif op in (3, 4, 8, 31, 43):
            if not conn.identified:
                conn.queue(("close", 4003))
        else:
            conn.queue(("close", 4001))

    def _identify(self, conn: _Gw, d: Any) -> None:
        if conn.identified:
            return conn.queue(("close", 4005))
        if not isinstance(d, dict) or d.get("token") != (self.gateway_token or self.token):
            return conn.queue(("close", 4004))
        intents = d.get("intents")
        if not isinstance(intents, int) or intents & ~KNOWN_INTENTS:
            return conn.queue(("close", 4013))
        if intents & PRIVILEGED and not self.privileged_enabled:
            return conn.queue(("close", 4014))
        shard = d.get("shard", [0, 1])
        if not (isinstance(shard, list) and len(shard) == 2 and 0 <= shard[0] < shard[1]):
            return conn.queue(("close", 4010))
        now = trio.current_time()
        if sum(1 for t in self.identifies if now - t < 5.0) >= self.max_concurrency:
            return conn.queue(self._encode(9, False))
        self.identifies.append(now)
        self._start_remaining -= 1
        conn.identified = True
        session = Session(secrets.token_hex(16), (shard[0], shard[1]), conn=conn)
        session.buffer = deque(maxlen=self.replay_max)
        self.sessions[session.id] = session
        conn.session = session
        session.seq = 1
        ready = {
            "_trace": ["alt-gw-ready"],
            "application": {"flags": 0, "id": APP_ID},
            "guilds": [],
            "private_channels": [],
            "geo_ordered_rtc_regions": ["local"],
            "user_settings": {},
            "relationships": [],
            "session_type": "normal",
            "resume_gateway_url": f"ws://127.0.0.1:{self.port}/resume",
            "shard": list(shard),
            "user": {
                "verified": True,
                "username": "alt",
                "mfa_enabled": False,
                "id": BOT_ID,
                "global_name": None,
                "flags": 0,
                "bot": True,
            },
            "session_id": session.id,
            "v": 10,
        }
        frame = self._encode(0, ready, 1, "READY")
        session.buffer.append((1, frame))
        conn.queue(frame)
        session.seq += 1
        guild = self._encode(
            0, {"id": "9300000000000000001", "unavailable": True}, session.seq, "GUILD_DELETE"
        )
        session.buffer.append((session.seq, guild))
        conn.queue(guild)

    def _resume(self, conn: _Gw, d: Any) -> None:
        if not isinstance(d, dict) or d.get("token") != (self.gateway_token or self.token):
            return conn.queue(("close", 4004))
        session = self.sessions.get(str(d.get("session_id")))
        seq = d.get("seq")
        self.resumes.append((str(d.get("session_id")), seq if isinstance(seq, int) else -1))
        self.resume_targets.append(conn.target)
        if session is None:
            return conn.queue(self._encode(9, False))
        oldest = session.buffer[0][0] if session.buffer else session.seq + 1
        if not isinstance(seq, int) or seq > session.seq or seq < oldest - 1:
            return conn.queue(("close", 4007))
        old = session.conn
        if old is not None and old is not conn:
            old.session = None
            old.queue(("close", None))  # kicked: TCP dropped
        session.conn, session.detached_at = conn, None
        conn.session, conn.identified = session, True
        for s, frame in list(session.buffer):
            if s > seq:
                conn.queue(frame)
        session.seq += 1
        resumed = self._encode(0, {"_trace": ["alt-gw-resumed"]}, session.seq, "RESUMED")
        session.buffer.append((session.seq, resumed))
        conn.queue(resumed)

    # ------------------------------------------------------------------ HTTP

    async def _client(self, stream: trio.SocketStream) -> None:
        buf = bytearray()
        try:
            while True:
                while b"\r\n\r\n" not in buf:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buf += data
                end = buf.index(b"\r\n\r\n") + 4
                head = bytes(buf[:end])
                lines = head.decode("latin-1").split("\r\n")
                method, target, _version = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        name, value = line.split(":", 1)
                        headers[name.strip().lower()] = value.strip()
                if headers.get("upgrade", "").lower() == "websocket":
                    await self._gateway(stream, head + bytes(buf[end:]))
                    return
                length = int(headers.get("content-length", "0"))
                while len(buf) < end + length:
                    data = await stream.receive_some(65536)
                    if not data:
                        return
                    buf += data
                body = bytes(buf[end : end + length])
                del buf[: end + length]
                answer = rest_answer(self, method, target, headers, body)
                if answer is None:
                    return  # the response is lost: TCP dropped
                status, out_headers, payload = answer
                reason = {200: "OK", 204: "No Content"}.get(status, "Error")
                lines_out = [f"HTTP/1.1 {status} {reason}", f"Content-Length: {len(payload)}"]
                if payload:
                    lines_out.append("Content-Type: application/json")
                lines_out += [f"{k}: {v}" for k, v in out_headers.items()]
                await stream.send_all(("\r\n".join(lines_out) + "\r\n\r\n").encode() + payload)
        except (trio.BrokenResourceError, trio.ClosedResourceError, ValueError):
            return
        finally:
            await trio.aclose_forcefully(stream)
