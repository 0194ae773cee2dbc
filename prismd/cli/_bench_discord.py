"""``prismd bench --scenario discord``: a real ``prismd run`` with a Discord connection.

The bench serves, on loopback, the few parts of Discord an echo bot meets — the gateway
(Hello, Identify → READY, Resume → RESUMED, heartbeats acknowledged, ``MESSAGE_CREATE``
dispatched with a rising sequence, the bot's own messages included, as Discord sends
them) and the REST calls (``GET /gateway/bot``, ``GET /users/@me``, ``POST
…/messages`` with the ``X-RateLimit-*`` headers of every answer, ``POST …/typing``). The
daemon knows nothing of it: it is its ``api_origin``, and the gateway URL comes from
``GET /gateway/bot``. The bench does not enforce Discord's limits; the daemon keeps its
own (the global 50 requests a second among them, so at most 50 answers a second).

Measured, as for ``telegram``: DMs per second from 20 users, each sending the next when
its answer came (closed loop); latency from a dispatch to its answer's POST; the daemon's
CPU per message (``cpu_ms_per_message``, from ``/proc``); REST requests per message
(``requests_per_message``; by route in ``requests``), the most in any one second
(``peak_requests_per_s``: at most Discord's 50) and gateway frames the daemon sent
(``gateway_frames_sent``: heartbeats, Identify).
"""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

import attrs
import trio
from trio_websocket import ConnectionClosed, WebSocketRequest, serve_websocket

from adapters.toolkit import RequestHead

from ._bench_live import CLIENTS, ClosedLoop, Daemon, JsonAnswer, bot_daemon, serve_json

TOKEN = "bench-discord-token-" + "c" * 40
BOT_ID = "1000000000000000001"
FIRST_USER = 2000000000000000001
FIRST_DM = 3000000000000000001
DISCORD_EPOCH_MS = 1420070400000
HEARTBEAT_MS = 41_250
POST_MESSAGE = "POST /channels/{id}/messages"


@attrs.define(eq=False)
class BenchDiscord(ClosedLoop):
    """The gateway and REST on loopback (reference/discord-protocol.md shapes); the
    conversations are DM channels, ``requests`` by route."""

    rest_port: int = 0
    gateway_port: int = 0
    sockets: list[Any] = attrs.Factory(list)
    """The identified or resumed gateway sockets (dispatches go to each)."""
    seq: int = 0
    last_snowflake: int = 0
    ready: trio.Event = attrs.Factory(trio.Event)
    request_times: list[float] = attrs.Factory(list)
    frames_in: int = 0

    def snowflake(self) -> str:
        value = max((int(time.time() * 1000) - DISCORD_EPOCH_MS) << 22, self.last_snowflake + 1)
        self.last_snowflake = value
        return str(value)

    # ------------------------------------------------------------------ gateway

    async def dispatch(self, event: str, data: dict[str, Any]) -> None:
        self.seq += 1
        frame = json.dumps({"op": 0, "s": self.seq, "t": event, "d": data})
        for ws in list(self.sockets):
            try:
                await ws.send_message(frame)
            except ConnectionClosed:
                self.sockets.remove(ws)

    async def offer(self, channel: str, user: str, text: str) -> None:
        """A user DMs the bot: MESSAGE_CREATE."""
        self.offered(channel)
        await self.dispatch("MESSAGE_CREATE", _message(self.snowflake(), channel, user, text))

    async def gateway(self, request: WebSocketRequest) -> None:
        ws = await request.accept()
        try:
            await ws.send_message(json.dumps({"op": 10, "d": {"heartbeat_interval": HEARTBEAT_MS}}))
            while True:
                frame = json.loads(await ws.get_message())
                self.frames_in += 1
                op = frame.get("op")
                if op == 1:
                    await ws.send_message('{"op":11}')
                elif op == 2:
                    self.sockets.append(ws)
                    self.seq += 1
                    ready = {
                        "v": 10,
                        "user": {"id": BOT_ID, "username": "bench", "bot": True},
                        "guilds": [],
                        "session_id": "bench-session",
                        "resume_gateway_url": f"ws://127.0.0.1:{self.gateway_port}/",
                        "shard": [0, 1],
                        "application": {"id": BOT_ID, "flags": 0},
                    }
                    await ws.send_message(
                        json.dumps({"op": 0, "s": self.seq, "t": "READY", "d": ready})
                    )
                    self.ready.set()
                elif op == 6:
                    self.sockets.append(ws)
                    self.seq += 1
                    await ws.send_message(
                        json.dumps({"op": 0, "s": self.seq, "t": "RESUMED", "d": None})
                    )
                    self.ready.set()
        except ConnectionClosed:
            pass
        finally:
            if ws in self.sockets:
                self.sockets.remove(ws)

    # ------------------------------------------------------------------ REST

    async def rest(self, stream: trio.SocketStream) -> None:
        await serve_json(stream, self._answer_rest)

    async def _answer_rest(self, head: RequestHead, body: bytes) -> JsonAnswer:
        status, payload, route = self._answer(head.method, head.path, body)
        self.requests[route] = self.requests.get(route, 0) + 1
        self.request_times.append(time.monotonic())
        if route == POST_MESSAGE:
            await self.dispatch("MESSAGE_CREATE", payload)  # Discord echoes our own
        headers = [
            ("X-RateLimit-Limit", "5"),
            ("X-RateLimit-Remaining", "4"),
            ("X-RateLimit-Reset", f"{time.time() + 5:.3f}"),
            ("X-RateLimit-Reset-After", "5.000"),
            ("X-RateLimit-Bucket", "bench"),
        ]
        return status, payload, headers

    def _answer(self, method: str, path: str, body: bytes) -> tuple[int, Any, str]:
        parts = path.split("?", 1)[0].removeprefix("/api/v10/").split("/")
        if method == "GET" and parts == ["gateway", "bot"]:
            limit = {"total": 1000, "remaining": 999, "reset_after": 14_400_000}
            url = f"ws://127.0.0.1:{self.gateway_port}/"
            bot = {"url": url, "shards": 1, "session_start_limit": limit | {"max_concurrency": 1}}
            return 200, bot, "GET /gateway/bot"
        if method == "GET" and parts == ["users", "@me"]:
            return 200, {"id": BOT_ID, "username": "bench", "bot": True}, "GET /users/@me"
        if method == "POST" and len(parts) == 3 and parts[0] == "channels":
            channel = parts[1]
            if parts[2] == "typing":
                return 204, None, "POST /channels/{id}/typing"
            if parts[2] == "messages":
                sent = json.loads(body)
                self.answer(channel)
                message = _message(self.snowflake(), channel, BOT_ID, str(sent.get("content")))
                message["author"]["bot"] = True
                message["nonce"] = sent.get("nonce")
                return 200, message, POST_MESSAGE
        return 404, {"message": "404: Not Found", "code": 0}, f"{method} (unknown)"

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, self.rest, 0, host="127.0.0.1")
            )
            self.rest_port = listeners[0].socket.getsockname()[1]
            server = await nursery.start(serve_websocket, self.gateway, "127.0.0.1", 0, None)
            self.gateway_port = server.port
            task_status.started()


def _message(message_id: str, channel: str, author: str, text: str) -> dict[str, Any]:
    """A DM's MESSAGE_CREATE payload (MSG "Message Structure")."""
    return {
        "id": message_id,
        "type": 0,
        "channel_id": channel,
        "author": {"id": author, "username": f"user{author[-4:]}", "global_name": None},
        "content": text,
        "timestamp": "2026-01-01T00:00:00.000000+00:00",
        "edited_timestamp": None,
        "tts": False,
        "mention_everyone": False,
        "mentions": [],
        "mention_roles": [],
        "attachments": [],
        "embeds": [],
        "pinned": False,
        "flags": 0,
        "components": [],
    }


async def discord(workdir: Path, duration_s: float) -> dict[str, Any]:
    """A real ``prismd run`` on the loopback gateway and REST, the echo agent, 20 DM
    conversations each sending its next message when the answer came."""
    fake = BenchDiscord()
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        origin = f"http://127.0.0.1:{fake.rest_port}"
        async with bot_daemon(workdir, "discord", TOKEN, origin, "shards = 1") as daemon:
            with trio.fail_after(30):
                await fake.ready.wait()
            await trio.sleep(0.5)  # READY handled, the session stored
            result = await _closed_loop(fake, daemon, duration_s)
        nursery.cancel_scope.cancel()
    return {"discord": result}


async def _closed_loop(fake: BenchDiscord, daemon: Daemon, duration_s: float) -> dict[str, Any]:
    users = {str(FIRST_DM + i): str(FIRST_USER + i) for i in range(CLIENTS)}

    async def offer(channel: str) -> None:
        await fake.offer(channel, users[channel], "ping")

    fake.request_times.clear()
    frames0 = fake.frames_in
    result = await fake.run(daemon, list(users), offer, duration_s, per="message")
    result["peak_requests_per_s"] = _peak_per_second(fake.request_times)
    result["gateway_frames_sent"] = fake.frames_in - frames0
    return result


def _peak_per_second(times: list[float]) -> int:
    """The most requests in any one second (Discord's global limit is 50)."""
    peak = start = 0
    for end, at in enumerate(times):
        while at - times[start] >= 1.0:
            start += 1
        peak = max(peak, end - start + 1)
    return peak
