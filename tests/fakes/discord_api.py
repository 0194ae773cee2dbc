"""A fake Discord on loopback: REST (h11 through the adapter toolkit) and the gateway
(trio-websocket, :mod:`tests.fakes.discord_gateway`), faithful to
``reference/discord-protocol.md`` §4, §5 and §9.

REST under ``/api/v10`` (``Authorization: Bot <token>``, else 401 ``{code:0}``):

* ``GET /gateway/bot`` — ``{url, shards, session_start_limit:{total, remaining,
  reset_after, max_concurrency}}``; ``GET /users/@me``; ``GET /oauth2/applications/@me``
  (what discord.py reads at login, for the peer bench).
* ``POST /channels/{id}/messages`` — content 1..2000 characters (else 50006 / 50035), a
  ``message_reference`` to an unknown message is 50035 unless ``fail_if_not_exists`` is
  false; ``nonce`` ≤ 25 characters; with ``enforce_nonce`` a (author, nonce) seen within
  ``nonce_window_s`` returns the original message (200), or 10008 if it was deleted. The
  message is stored and MESSAGE_CREATE (with ``nonce``) dispatched to the gateway.
  Channel faults: ``blocked`` → 403 50007, ``no_permission`` → 403 50013, unknown → 404
  10003, ``no_history`` → a reply is 400 160002 and the history reads empty.
* ``PATCH /channels/{id}/messages/{mid}`` (the author only, else 50005) → MESSAGE_UPDATE;
  ``DELETE`` of the bot's own message → 204 and MESSAGE_DELETE;
  ``POST /channels/{id}/typing`` → 204; ``GET /channels/{id}/messages?after=&limit=`` →
  newest first, without ``nonce``.
* Rate limits: a bucket per (method, route, channel) of ``route_limit`` requests per
  ``route_window_s`` with ``X-RateLimit-Limit/-Remaining/-Reset/-Reset-After/-Bucket``;
  over it 429 ``{message, retry_after, global:false}`` with ``X-RateLimit-Scope: user`` and
  ``Retry-After``; over ``global_limit`` requests in one second 429 ``{global:true}`` with
  ``X-RateLimit-Global``; invalid requests (401/403/non-shared 429) counted, and past
  ``ban_after_invalid`` every answer is Cloudflare's HTML 429 without headers. Every JSON
  answer of the API carries ``Via: 1.1 google`` (Discord's API answers through Google's
  front end; discord.py reads a 429 without ``Via`` as Cloudflare's ban and gives up, as
  the reference notes — the ban's HTML has none).
* Faults (:meth:`FakeDiscord.fail_next`): ``commit_drop`` (the message is created, the
  connection closed without an answer), ``commit_500``, ``commit_hang`` (created, the
  answer never comes), ``502`` (nothing created), ``429`` (a per-route limit hit),
  ``429_global_bare`` (the global limit as reference §9 describes it: ``{message,
  retry_after, global:true}`` and ``X-RateLimit-Global``, no other header).
* Users' messages (:meth:`FakeDiscord.user_message`) and forwards
  (:meth:`FakeDiscord.forward`: beyond the reference, as Discord's "Message Reference
  Types" and "Message Snapshot Object" give them — type 0, empty content, a reference of
  type 1, the forwarded message in ``message_snapshots``).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from typing import Any

import attrs
import h11
import trio
from trio_websocket import serve_websocket

from adapters.toolkit import HttpError, read_body, read_request_head, respond, server_connection

from .discord_gateway import Gateway
from .discord_rest import bucket as rest_bucket
from .discord_rest import route as rest_route

DISCORD_EPOCH_MS = 1420070400000
BAN_HTML = b"<html><body>error code: 1015</body></html>"


@attrs.define(eq=False)
class Channel:
    id: str
    guild_id: str | None = None
    type: int = 1
    messages: list[dict[str, Any]] = attrs.field(factory=list)
    blocked: bool = False
    no_permission: bool = False
    no_history: bool = False
    """The bot lacks READ_MESSAGE_HISTORY here: a reply is 400 160002, history is empty."""


@attrs.frozen
class Request:
    method: str
    path: str
    body: Any
    at: float
    status: int


class FakeDiscord:
    def __init__(
        self,
        *,
        token: str = "discord-bot-token-secret",
        heartbeat_interval_ms: float = 41_250,
        resume_ttl_s: float = 180.0,
        replay_limit: int = 1000,
        nonce_window_s: float = 180.0,
    ) -> None:
        self.token = token
        self.bot_user_id = "1000000000000000001"
        self.bot_username = "prism"
        self.application_id = "1000000000000000002"
        self.heartbeat_interval_ms = heartbeat_interval_ms
        self.resume_ttl_s = resume_ttl_s
        self.replay_limit = replay_limit
        self.nonce_window_s = nonce_window_s
        self.enabled_privileged = 0
        self.recommended_shards = 1
        self.identify_total = 1000
        self.identify_remaining = 1000
        self.reset_after_ms = 14_400_000
        self.max_concurrency = 1
        self.identify_window_s = 5.0
        """``max_concurrency`` identifies per this window (Discord: 5 s)."""
        self.token_reset = False
        self.resume_url_override: str | None = None
        """READY's ``resume_gateway_url`` when set (Discord names another host, with or
        without a path and a query, and that host may be unreachable)."""
        self.route_limit = 5
        self.route_window_s = 5.0
        self.shared_message_bucket = False
        """Posting, editing and deleting a channel's messages share one bucket (one
        ``X-RateLimit-Bucket`` for the three routes), as Discord may group routes."""
        self.global_limit = 50
        self.ban_after_invalid = 10_000
        self.invalid_requests = 0
        self.channels: dict[str, Channel] = {}
        self.requests: list[Request] = []
        self.deleted: list[dict[str, Any]] = []
        """Messages removed by DELETE, as they were last."""
        self.gateway = Gateway(self)
        self.rest_port = 0
        self.gateway_port = 0
        self.nursery: trio.Nursery = None  # type: ignore[assignment]
        self.nonces: dict[tuple[str, str], tuple[str, float]] = {}
        self.deleted_ids: set[str] = set()
        self._last_snowflake = 0
        self.buckets: dict[tuple[str, str, str], list[float]] = {}
        self._global: list[float] = []
        self._faults: dict[str, list[str]] = {}
        self._offset_ms = int(time.time() * 1000)
        self.files: dict[str, bytes] = {}
        """CDN path → the attachment's bytes."""
        self.cdn_requests: list[tuple[str, bool]] = []
        """``(path, whether an Authorization header came)`` per CDN request."""

    # ------------------------------------------------------------------ addresses

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.rest_port}"

    @property
    def gateway_url(self) -> str:
        return f"ws://127.0.0.1:{self.gateway_port}/"

    @property
    def resume_gateway_url(self) -> str:
        if self.resume_url_override is not None:
            return self.resume_url_override
        return f"ws://127.0.0.1:{self.gateway_port}/resume"

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.rest_port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            await nursery.start(trio.serve_listeners, self._connection, listeners)
            server = await nursery.start(serve_websocket, self.gateway.handle, "127.0.0.1", 0, None)
            self.gateway_port = server.port
            task_status.started()

    # ------------------------------------------------------------------ test controls

    def snowflake(self) -> str:
        ms = self._offset_ms + int(trio.current_time() * 1000) - DISCORD_EPOCH_MS
        value = max(ms << 22, self._last_snowflake + 1)
        self._last_snowflake = value
        return str(value)

    def bot_user(self) -> dict[str, Any]:
        """The bot's user object (as READY, ``/users/@me`` and its messages carry it)."""
        return {
            "id": self.bot_user_id,
            "username": self.bot_username,
            "global_name": None,
            "discriminator": "0",
            "avatar": None,
            "bot": True,
        }

    def channel(self, channel_id: str, guild_id: str | None = None) -> Channel:
        if channel_id not in self.channels:
            self.channels[channel_id] = Channel(channel_id, guild_id, 0 if guild_id else 1)
        return self.channels[channel_id]

    def user_message(
        self,
        channel_id: str,
        author_id: str,
        content: str,
        *,
        guild_id: str | None = None,
        mention_bot: bool = False,
        nickname_mention: bool = False,
        bot: bool = False,
        attachments: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """A user posts ``content`` (and ``attachments``, from :meth:`attachment`); stored
        and dispatched (MESSAGE_CREATE). ``mention_bot`` puts ``<@id>`` first, or ``<@!id>``
        (the nickname form, MSG "Message Formatting") with ``nickname_mention``."""
        channel = self.channel(channel_id, guild_id)
        if mention_bot:
            form = "<@!" if nickname_mention else "<@"
            content = f"{form}{self.bot_user_id}> {content}"
        author = _user(author_id)
        if bot:
            author["bot"] = True
        mentions: list[Mapping[str, Any]] = []
        if mention_bot:
            mentions.append(self.bot_user())
        return self._create(channel, author, content, mentions=mentions, attachments=attachments)

    def forward(
        self,
        channel_id: str,
        author_id: str,
        content: str,
        *,
        attachments: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """A user forwards a message (``content``, ``attachments``) from another channel:
        the forward has no content of its own, a ``message_reference`` of type 1 (FORWARD)
        and the forwarded message in ``message_snapshots`` (a subset of a message's fields,
        no author: Discord's "Message Snapshot Object")."""
        channel = self.channel(channel_id)
        snapshot = {
            "type": 0,
            "content": content,
            "embeds": [],
            "attachments": list(attachments or ()),
            "timestamp": "2026-12-04T09:00:00.000000+00:00",
            "edited_timestamp": None,
            "flags": 0,
            "mentions": [],
            "mention_roles": [],
        }
        origin = {"type": 1, "channel_id": "3999999999999999999", "message_id": self.snowflake()}
        return self._create(channel, _user(author_id), "", reference=origin, snapshot=snapshot)

    def attachment(
        self,
        channel_id: str,
        filename: str,
        data: bytes,
        content_type: str,
        size: int | None = None,
    ) -> dict[str, Any]:
        """An attachment object (MSG "Attachment Structure") whose ``url`` serves ``data``
        on the CDN path, signed as Discord's are (``ex``/``is``/``hm``); ``size`` is what
        it declares (default: the true length)."""
        attachment_id = self.snowflake()
        path = f"/attachments/{channel_id}/{attachment_id}/{filename}"
        self.files[path] = data
        issued = int(time.time())
        query = f"ex={issued + 86_400:x}&is={issued:x}&hm={'0' * 64}&"
        return {
            "id": attachment_id,
            "filename": filename,
            "size": len(data) if size is None else size,
            "url": f"{self.origin}{path}?{query}",
            "proxy_url": f"{self.origin}{path}?{query}",
            "content_type": content_type,
            "width": 64,
            "height": 64,
        }

    def _create(
        self,
        channel: Channel,
        author: Mapping[str, Any],
        content: str,
        *,
        mentions: list[Mapping[str, Any]] | None = None,
        nonce: str | None = None,
        reference: Mapping[str, Any] | None = None,
        attachments: list[dict[str, Any]] | None = None,
        snapshot: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        message: dict[str, Any] = {
            "id": self.snowflake(),
            "channel_id": channel.id,
            "author": dict(author),
            "content": content,
            "timestamp": "2026-12-05T12:00:00.000000+00:00",
            "edited_timestamp": None,
            "tts": False,
            "mention_everyone": False,
            "mentions": list(mentions or ()),
            "mention_roles": [],
            "attachments": list(attachments or ()),
            "embeds": [],
            "pinned": False,
            "type": 19 if reference else 0,
        }
        if reference is not None:
            message["message_reference"] = dict(reference)
        if snapshot is not None:  # a forward: a type 0 message whose reference is type 1
            message["type"] = 0
            message["message_snapshots"] = [{"message": dict(snapshot)}]
        channel.messages.append(message)
        event = dict(message)
        if nonce is not None:
            event["nonce"] = nonce
        if channel.guild_id is not None:
            event["guild_id"] = channel.guild_id
        self.gateway.dispatch("MESSAGE_CREATE", event, channel.guild_id)
        return event

    def bot_messages(self, channel_id: str | None = None) -> list[dict[str, Any]]:
        return [
            m
            for c in self.channels.values()
            if channel_id is None or c.id == channel_id
            for m in c.messages
            if m["author"]["id"] == self.bot_user_id
        ]

    def delete_message(self, message_id: str) -> None:
        for channel in self.channels.values():
            channel.messages = [m for m in channel.messages if m["id"] != message_id]
        self.deleted_ids.add(message_id)

    def fail_next(self, route: str, *faults: str) -> None:
        """The next requests whose ``METHOD /path`` contains ``route`` meet ``faults``."""
        self._faults.setdefault(route, []).extend(faults)

    def clear_faults(self) -> None:
        """Forget the faults :meth:`fail_next` armed that no request has met yet."""
        self._faults.clear()

    def calls(self, method: str, fragment: str) -> list[Request]:
        return [r for r in self.requests if r.method == method and fragment in r.path]

    # ------------------------------------------------------------------ HTTP

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = server_connection()
        try:
            while True:
                head = await read_request_head(stream, conn, timeout_s=60)
                if head is None:
                    return
                try:
                    body = await read_body(stream, conn, head, max_bytes=1 << 20)
                except HttpError as error:
                    await respond(stream, conn, head.method, error.status)
                    return
                answer = await self._dispatch(head.method, head.path, head.query, head, body)
                if answer is None:
                    return  # a fault: the connection is dropped without an answer
                status, payload, headers = answer
                data = b"" if payload is None else payload
                content_type = "text/html" if data == BAN_HTML else "application/json"
                if head.path.startswith("/attachments/") and status == 200:
                    content_type = "application/octet-stream"
                await respond(
                    stream, conn, head.method, status, data, content_type, headers, close=False
                )
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return
        finally:
            with trio.move_on_after(1, shield=True):
                await stream.aclose()

    async def _dispatch(
        self, method: str, path: str, query: Mapping[str, list[str]], head: Any, raw: bytes
    ) -> tuple[int, bytes | None, list[tuple[str, str]]] | None:
        now = trio.current_time()
        body: Any = None
        if raw:
            try:
                body = json.loads(raw)
            except ValueError:
                return self._record(method, path, None, 400, error(50035, "Invalid Form Body"))
        if path.startswith("/attachments/"):  # the CDN: no token wanted, none checked
            self.cdn_requests.append((path, "authorization" in head.headers))
            data = self.files.get(path)
            self.requests.append(Request(method, path, None, now, 200 if data else 404))
            return (200, data, []) if data is not None else (404, b"", [])
        if self.invalid_requests >= self.ban_after_invalid:
            self.requests.append(Request(method, path, body, now, 429))
            return 429, BAN_HTML, []
        if head.headers.get("authorization") != f"Bot {self.token}" or self.token_reset:
            self.invalid_requests += 1
            return self._record(method, path, body, 401, error(0, "401: Unauthorized"))
        self._global = [t for t in self._global if now - t < 1.0]
        if len(self._global) >= self.global_limit:
            self.invalid_requests += 1
            retry = round(1.0 - (now - self._global[0]), 3)
            payload = {"message": "You are being rate limited.", "retry_after": retry}
            payload["global"] = True
            extra = [
                ("X-RateLimit-Global", "true"),
                ("X-RateLimit-Scope", "global"),
                ("Retry-After", str(math.ceil(retry))),
            ]
            return self._record(method, path, body, 429, payload, extra)
        self._global.append(now)
        fault = self._fault(f"{method} {path}")
        if fault == "429_global_bare":
            self.invalid_requests += 1
            payload = {"message": "You are being rate limited.", "retry_after": 0.25}
            payload["global"] = True
            bare = [("X-RateLimit-Global", "true")]
            return self._record(method, path, body, 429, payload, bare, via=False)
        if not path.startswith("/api/v10/"):
            return self._record(method, path, body, 404, error(0, "404: Not Found"))
        route = path[len("/api/v10") :]
        parts = route.strip("/").split("/")
        bucket_headers: list[tuple[str, str]] = []
        if parts[0] == "channels" and len(parts) >= 2:
            key = (method, parts[2] if len(parts) > 2 else "", parts[1])
            if self.shared_message_bucket and key[1] == "messages" and method != "GET":
                key = ("POST|PATCH|DELETE", "messages", parts[1])  # one X-RateLimit-Bucket
            limited = rest_bucket(self, key, now, bucket_headers, fault == "429")
            if limited is not None:
                self.invalid_requests += 1
                return self._record(method, path, body, 429, limited, bucket_headers)
        if fault == "502":
            return self._record(method, path, body, 502, error(0, "502: Bad Gateway"))
        answer = rest_route(self, method, parts, query, body)
        status, payload = answer
        if status in (401, 403):
            self.invalid_requests += 1
        if fault in ("commit_drop", "commit_hang") and status < 300:
            self.requests.append(Request(method, path, body, now, 0))
            if fault == "commit_hang":
                await trio.sleep_forever()
            return None
        if fault == "commit_500" and status < 300:
            return self._record(method, path, body, 500, error(0, "500: Internal Server Error"))
        return self._record(method, path, body, status, payload, bucket_headers)

    def _fault(self, target: str) -> str | None:
        for route, queue in self._faults.items():
            if route in target and queue:
                return queue.pop(0)
        return None

    def _record(
        self,
        method: str,
        path: str,
        body: Any,
        status: int,
        payload: Any,
        headers: list[tuple[str, str]] | None = None,
        *,
        via: bool = True,
    ) -> tuple[int, bytes | None, list[tuple[str, str]]]:
        self.requests.append(Request(method, path, body, trio.current_time(), status))
        data = None if payload is None else json.dumps(payload).encode()
        return status, data, [*(headers or ()), *((("Via", "1.1 google"),) if via else ())]


def _user(user_id: str) -> dict[str, Any]:
    """A user's author object (no ``bot`` flag)."""
    return {
        "id": user_id,
        "username": f"user{user_id[-4:]}",
        "global_name": None,
        "discriminator": "0",
        "avatar": None,
    }


def error(code: int, message: str) -> dict[str, Any]:
    return {"code": code, "message": message}
