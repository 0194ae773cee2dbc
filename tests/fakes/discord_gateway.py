"""The gateway half of the fake Discord (:mod:`tests.fakes.discord_api` is the REST half and
the facade tests use), faithful to ``reference/discord-protocol.md`` §1, §2, §7 and §9.

Per connection: Hello ``{op:10,d:{heartbeat_interval}}`` (ms, a knob), op 1 recorded and
acknowledged with op 11 (unless ACKs are withheld), a server op 1 request on demand;
Identify validated (4004 bad or reset token, 4013 unknown intent bit, 4014 a privileged
intent not enabled, 4010 bad shard, 4005 a second Identify), counted against
``session_start_limit`` (over ``max_concurrency`` in 5 s: op 9 ``false``; the daily total
exhausted: the token is reset), READY at ``s=1``; Resume replays every buffered event with
``s > seq`` then RESUMED, or op 9 ``false`` (unknown, invalidated, expired, or older than the
replay buffer), or close 4007 (``seq`` ahead of the session). A session outlives its socket
unless the client closed with 1000/1001; it expires ``resume_ttl_s`` after it was left.
Client payloads over 4096 bytes close 4002; over 120 in 60 s close 4008.

Routing: a guild event goes to every session of shard ``(guild_id >> 22) % num_shards``, a
DM to shard 0 — so two sessions identifying the same shard both receive everything, each
with its own ``s``. Intents filter MESSAGE_CREATE (512 guild, 4096 DM) and blank the
content without MESSAGE_CONTENT unless it is a DM, mentions the bot or is the bot's own.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest

GUILDS = 1 << 0
GUILD_MESSAGES = 1 << 9
DIRECT_MESSAGES = 1 << 12
MESSAGE_CONTENT = 1 << 15
PRIVILEGED = (1 << 1) | (1 << 8) | MESSAGE_CONTENT
KNOWN_INTENTS = (1 << 26) - 1
FATAL_UNLESS_RECONNECTING = frozenset({4004, 4010, 4011, 4012, 4013, 4014})


@attrs.define(eq=False)
class Session:
    session_id: str
    shard: tuple[int, int]
    intents: int
    seq: int = 0
    events: list[dict[str, Any]] = attrs.field(factory=list)
    """The replay buffer: dispatch payloads, oldest first (bounded)."""
    connections: list[GatewayConnection] = attrs.field(factory=list)
    left_at: float | None = None
    """When its last socket went (``None`` while attached)."""
    invalid: bool = False

    def resumable(self, now: float, ttl_s: float) -> bool:
        if self.invalid:
            return False
        return self.left_at is None or now - self.left_at <= ttl_s


@attrs.define(eq=False)
class GatewayConnection:
    ws: WebSocketConnection
    session: Session | None = None
    identified: bool = False
    outbox: trio.MemorySendChannel[dict[str, Any] | None] = attrs.field(default=None)
    closed: bool = False
    muted: bool = False
    """Sends nothing more (no ACK, no event) while the TCP connection stays open."""


@attrs.frozen
class Received:
    """One payload a client sent (``op``, its ``d``), when, on which connection."""

    op: int
    d: Any
    at: float
    connection: int


class Gateway:
    """State and behaviour of the fake gateway; :class:`FakeDiscord` owns one."""

    def __init__(self, owner: Any) -> None:
        self.owner = owner
        self.sessions: dict[str, Session] = {}
        self.connections: list[GatewayConnection] = []
        self.received: list[Received] = []
        self.client_close_codes: list[int | None] = []
        """The code of every close the client started (``None``: TCP dropped, no frame)."""
        self.identify_times: list[float] = []
        self.resumes: list[tuple[str, int, str]] = []
        """``(session_id, seq, outcome)`` per Resume: ``replayed`` / ``invalid`` / ``4007``."""
        self.withhold_acks = 0
        self.duplicate_next = 0
        self.drop_next = 0
        self.lose_next = 0
        """How many next events get their ``s`` and a place in the replay buffer but are
        not written to the socket (lost on the way: a gap in ``s``)."""
        self.skip_next = 0
        """How many next numbers of ``s`` are skipped: never an event, in no replay (``s`` is
        "monotonically increasing per session", reference §9, not said to be contiguous)."""
        self.kick_on_resume = False
        self.reconnect_before_hello = 0
        """How many next connections get op 7 instead of Hello (then a 4000 close)."""
        self.silent_before_hello = 0
        """How many next connections are accepted and then sent nothing (no Hello)."""
        self.refuse_resume_with: int | None = None
        """A Resume of a session that cannot be resumed is answered by closing with this
        code instead of op 9 ``false`` (4009: "Session timed out … start a new one", OPS
        close codes): a legal choice the reference leaves open."""
        self.paths: list[str] = []
        """The request target (path and query) of every connection, in order."""
        self.connection_count = 0

    # ------------------------------------------------------------------ dispatching

    def dispatch(self, name: str, data: Mapping[str, Any], guild_id: str | None) -> int:
        """Route one event to its sessions; how many sessions got it."""
        if self.drop_next:
            self.drop_next -= 1
            return 0
        copies = 2 if self.duplicate_next else 1
        if self.duplicate_next:
            self.duplicate_next -= 1
        lost = bool(self.lose_next)
        if lost:
            self.lose_next -= 1
        count = 0
        now = trio.current_time()
        for session in list(self.sessions.values()):
            if not session.resumable(now, self.owner.resume_ttl_s):
                continue
            shard_id, shards = session.shard
            target = 0 if guild_id is None else (int(guild_id) >> 22) % shards
            if target != shard_id:
                continue
            payload = self._filtered(name, data, session.intents, guild_id)
            if payload is None:
                continue
            for _ in range(copies):
                self.push(session, name, payload, lost=lost)
            count += 1
        return count

    def _filtered(
        self, name: str, data: Mapping[str, Any], intents: int, guild_id: str | None
    ) -> dict[str, Any] | None:
        out = dict(data)
        if name in ("MESSAGE_CREATE", "MESSAGE_UPDATE"):
            needed = GUILD_MESSAGES if guild_id is not None else DIRECT_MESSAGES
            if not intents & needed:
                return None
            bot_id = self.owner.bot_user_id
            mentioned = any(m.get("id") == bot_id for m in out.get("mentions", ()))
            own = out.get("author", {}).get("id") == bot_id
            if not (intents & MESSAGE_CONTENT or guild_id is None or mentioned or own):
                out["content"] = ""
                out["embeds"] = []
                out["attachments"] = []
        return out

    def push(
        self, session: Session, name: str, data: Mapping[str, Any], *, lost: bool = False
    ) -> None:
        if self.skip_next:
            self.skip_next -= 1
            session.seq += 1
        session.seq += 1
        payload = {"op": 0, "t": name, "s": session.seq, "d": data}
        session.events.append(payload)
        if len(session.events) > self.owner.replay_limit:
            del session.events[0]
        if lost:
            return
        for connection in session.connections:
            self.send(connection, payload)

    def send(self, connection: GatewayConnection, payload: dict[str, Any] | None) -> None:
        if connection.closed or connection.muted:
            return
        try:
            connection.outbox.send_nowait(payload)
        except (trio.WouldBlock, trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    # ------------------------------------------------------------------ server faults

    def live(self) -> list[GatewayConnection]:
        return [c for c in self.connections if not c.closed]

    def reconnect(self, close_after_s: float = 0.05) -> None:
        """Op 7 to every live connection, then a close (4000) after ``close_after_s``."""
        for connection in self.live():
            self.send(connection, {"op": 7, "d": None})
            self.owner.nursery.start_soon(self.close_later, connection, close_after_s, 4000)

    def invalidate(self, resumable: bool) -> None:
        """Op 9 ``d=resumable`` to every live connection (``false`` ends the sessions)."""
        for connection in self.live():
            if not resumable and connection.session is not None:
                connection.session.invalid = True
            self.send(connection, {"op": 9, "d": resumable})

    def close_all(self, code: int | None) -> None:
        """Close every live connection with ``code`` (``None``: drop TCP, no frame)."""
        for connection in self.live():
            self.owner.nursery.start_soon(self.close_later, connection, 0, code)

    def mute(self) -> None:
        """Every live connection goes silent but stays open (a stalled, "zombied" one)."""
        for connection in self.live():
            connection.muted = True

    def request_heartbeat(self) -> None:
        for connection in self.live():
            self.send(connection, {"op": 1, "d": None})

    def expire_sessions(self) -> None:
        """Every session forgets it may be resumed (as if the resume window had passed)."""
        for session in self.sessions.values():
            session.invalid = True

    async def close_later(self, connection: GatewayConnection, delay: float, code: Any) -> None:
        await trio.sleep(delay)
        await self._close(connection, code)

    async def _close(self, connection: GatewayConnection, code: int | None) -> None:
        if connection.closed:
            return
        connection.closed = True
        self._detach(connection)
        with trio.move_on_after(2):
            if code is None:
                await connection.ws._close_stream()
            else:
                await connection.ws.aclose(code)

    def _detach(self, connection: GatewayConnection) -> None:
        session = connection.session
        if session is not None and connection in session.connections:
            session.connections.remove(connection)
            if not session.connections:
                session.left_at = trio.current_time()

    # ------------------------------------------------------------------ one socket

    async def handle(self, request: WebSocketRequest) -> None:
        self.paths.append(request.path)
        ws = await request.accept()
        send, receive = trio.open_memory_channel[dict[str, Any] | None](10_000)
        connection = GatewayConnection(ws=ws, outbox=send)
        self.connections.append(connection)
        self.connection_count += 1
        number = self.connection_count
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._writer, connection, receive)
            try:
                if self.reconnect_before_hello:
                    self.reconnect_before_hello -= 1
                    self.send(connection, {"op": 7, "d": None})
                    await trio.sleep(0.05)
                    await self._close(connection, 4000)
                    return
                if self.silent_before_hello:
                    self.silent_before_hello -= 1
                    await self._silent(connection)
                    return
                interval = self.owner.heartbeat_interval_ms
                self.send(connection, {"op": 10, "d": {"heartbeat_interval": interval}})
                await self._reader(connection, number)
            finally:
                if not connection.closed:
                    connection.closed = True
                    self._detach(connection)
                send.close()
                nursery.cancel_scope.cancel()

    async def _silent(self, connection: GatewayConnection) -> None:
        """Read what the client sends and never answer (no Hello), until it leaves."""
        try:
            while True:
                await connection.ws.get_message()
        except ConnectionClosed as closed:
            reason = closed.reason
            code = None if reason is None or reason.code == 1006 else reason.code
            self.client_close_codes.append(code)

    async def _writer(
        self,
        connection: GatewayConnection,
        receive: trio.MemoryReceiveChannel[dict[str, Any] | None],
    ) -> None:
        try:
            async for payload in receive:
                if payload is None:
                    return
                await connection.ws.send_message(json.dumps(payload))
        except ConnectionClosed:
            return

    async def _reader(self, connection: GatewayConnection, number: int) -> None:
        window: list[float] = []
        while True:
            try:
                raw = await connection.ws.get_message()
            except ConnectionClosed as closed:
                if not connection.closed:
                    reason = closed.reason
                    code = None if reason is None or reason.code == 1006 else reason.code
                    self.client_close_codes.append(code)
                    session = connection.session
                    if session is not None and code in (1000, 1001):
                        session.invalid = True
                return
            now = trio.current_time()
            window = [t for t in window if now - t < 60.0]
            window.append(now)
            size = len(raw.encode() if isinstance(raw, str) else raw)
            if size > 4096:
                await self._close(connection, 4002)
                return
            if len(window) > 120:
                await self._close(connection, 4008)
                return
            try:
                payload = json.loads(raw)
                op = payload["op"]
            except (ValueError, KeyError, TypeError):
                await self._close(connection, 4002)
                return
            self.received.append(Received(op, payload.get("d"), now, number))
            if op == 1:
                if self.withhold_acks:
                    self.withhold_acks -= 1
                else:
                    self.send(connection, {"op": 11})
            elif op == 2:
                code = identify(self, connection, payload.get("d"))
                if code is not None:
                    await self._close(connection, code)
                    return
            elif op == 6:
                code = resume(self, connection, payload.get("d"))
                if code is not None:
                    await self._close(connection, code)
                    return
            else:
                await self._close(connection, 4001)
                return

    def push_one(
        self, session: Session, connection: GatewayConnection, name: str, data: Mapping[str, Any]
    ) -> None:
        session.seq += 1
        payload = {"op": 0, "t": name, "s": session.seq, "d": data}
        session.events.append(payload)
        self.send(connection, payload)

    # ------------------------------------------------------------------ queries

    def heartbeats(self) -> list[Received]:
        return [r for r in self.received if r.op == 1]

    def identifies(self) -> list[Received]:
        return [r for r in self.received if r.op == 2]

    def count(self, predicate: Callable[[Received], bool]) -> int:
        return sum(1 for r in self.received if predicate(r))


def identify(self: Gateway, connection: GatewayConnection, d: Any) -> int | None:
    """Op 2 on ``connection``: a close code, or ``None`` (READY or op 9 sent)."""
    owner = self.owner
    if connection.identified:
        return 4005
    if not isinstance(d, Mapping) or d.get("token") != owner.token or owner.token_reset:
        return 4004
    intents = d.get("intents")
    if not isinstance(intents, int) or intents & ~KNOWN_INTENTS:
        return 4013
    if intents & PRIVILEGED & ~owner.enabled_privileged:
        return 4014
    shard = d.get("shard", [0, 1])
    if (
        not isinstance(shard, list)
        or len(shard) != 2
        or not all(isinstance(x, int) for x in shard)
        or not 0 <= shard[0] < shard[1]
    ):
        return 4010
    now = trio.current_time()
    recent = [t for t in self.identify_times if now - t < owner.identify_window_s]
    if len(recent) >= owner.max_concurrency:
        self.send(connection, {"op": 9, "d": False})
        return None
    if owner.identify_remaining <= 0:
        owner.token_reset = True  # "the bot token will be reset"
        return 4004
    owner.identify_remaining -= 1
    self.identify_times.append(now)
    connection.identified = True
    session = Session(secrets.token_hex(16), (shard[0], shard[1]), intents)
    self.sessions[session.session_id] = session
    session.connections.append(connection)
    connection.session = session
    self.push(
        session,
        "READY",
        {
            "v": 10,
            "user": owner.bot_user(),
            "guilds": [],
            "session_id": session.session_id,
            "resume_gateway_url": owner.resume_gateway_url,
            "shard": list(session.shard),
            "application": {"id": owner.application_id, "flags": 0},
        },
    )
    return None


def resume(self: Gateway, connection: GatewayConnection, d: Any) -> int | None:
    """Op 6 on ``connection``: a close code, or ``None`` (replayed, or op 9 sent)."""
    owner = self.owner
    if not isinstance(d, Mapping) or d.get("token") != owner.token or owner.token_reset:
        return 4004
    session = self.sessions.get(str(d.get("session_id")))
    seq = d.get("seq")
    now = trio.current_time()
    if session is None or not session.resumable(now, owner.resume_ttl_s):
        self.resumes.append((str(d.get("session_id")), -1, "invalid"))
        if self.refuse_resume_with is not None:
            return self.refuse_resume_with
        self.send(connection, {"op": 9, "d": False})
        return None
    if not isinstance(seq, int) or seq > session.seq:
        self.resumes.append((session.session_id, -1, "4007"))
        return 4007
    oldest = session.events[0]["s"] if session.events else session.seq + 1
    if seq < oldest - 1:
        self.resumes.append((session.session_id, seq, "invalid"))
        session.invalid = True
        self.send(connection, {"op": 9, "d": False})
        return None
    self.resumes.append((session.session_id, seq, "replayed"))
    if self.kick_on_resume:
        for old in list(session.connections):
            self.owner.nursery.start_soon(self.close_later, old, 0, 4000)
    connection.identified = True
    connection.session = session
    for payload in session.events:
        if payload["s"] > seq:
            self.send(connection, payload)
    session.connections.append(connection)
    session.left_at = None
    self.push_one(session, connection, "RESUMED", {})
    return None
