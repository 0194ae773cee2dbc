"""The REST routes of the fake Discord (:mod:`tests.fakes.discord_api` documents them)."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from .discord_api import Channel, FakeDiscord


def error(code: int, message: str) -> dict[str, Any]:
    return {"code": code, "message": message}


def route(
    fake: FakeDiscord, method: str, parts: list[str], query: Mapping[str, list[str]], body: Any
) -> tuple[int, Any]:
    if method == "GET" and parts == ["gateway", "bot"]:
        return 200, {
            "url": fake.gateway_url,
            "shards": fake.recommended_shards,
            "session_start_limit": {
                "total": fake.identify_total,
                "remaining": fake.identify_remaining,
                "reset_after": fake.reset_after_ms,
                "max_concurrency": fake.max_concurrency,
            },
        }
    if method == "GET" and parts == ["gateway"]:
        return 200, {"url": fake.gateway_url}
    if method == "GET" and parts == ["users", "@me"]:
        return 200, fake.bot_user()
    if method == "GET" and parts == ["oauth2", "applications", "@me"]:
        owner = {**fake.bot_user(), "id": "1000000000000000003", "bot": False}
        return 200, {
            "id": fake.application_id,
            "name": fake.bot_username,
            "icon": None,
            "description": "",
            "bot_public": True,
            "bot_require_code_grant": False,
            "owner": owner,
            "team": None,
            "verify_key": "0" * 64,
            "flags": 0,
            "summary": "",
        }
    if parts[0] != "channels" or len(parts) < 3:
        return 404, error(0, "404: Not Found")
    channel = fake.channels.get(parts[1])
    if channel is None:
        return 404, error(10003, "Unknown Channel")
    if parts[2] == "typing" and method == "POST":
        return 204, None
    if parts[2] != "messages":
        return 404, error(0, "404: Not Found")
    if method == "GET" and len(parts) == 3:
        return 200, _history(fake, channel, query)
    if method == "GET" and len(parts) == 4:
        message = next((m for m in channel.messages if m["id"] == parts[3]), None)
        return (200, dict(message)) if message is not None else (404, error(10008, "Unknown"))
    if method == "POST" and len(parts) == 3:
        return _post(fake, channel, body)
    if method == "PATCH" and len(parts) == 4:
        return _patch(fake, channel, parts[3], body)
    if method == "DELETE" and len(parts) == 4:
        return _delete(fake, channel, parts[3])
    return 405, error(0, "405: Method Not Allowed")


def _history(fake: FakeDiscord, channel: Channel, query: Mapping[str, list[str]]) -> list[Any]:
    if channel.no_history:
        return []  # "Without READ_MESSAGE_HISTORY it returns nothing"
    after = int(query.get("after", ["0"])[0] or 0)
    limit = max(1, min(100, int(query.get("limit", ["50"])[0] or 50)))
    found = [m for m in channel.messages if int(m["id"]) > after]
    found = found[:limit]  # the oldest ``limit`` after ``after``
    return list(reversed(found))  # newest first


def _post(fake: FakeDiscord, channel: Channel, body: Any) -> tuple[int, Any]:
    if not isinstance(body, Mapping):
        return 400, error(50035, "Invalid Form Body")
    if channel.blocked:
        return 403, error(50007, "Cannot send messages to this user")
    if channel.no_permission:
        return 403, error(50013, "Missing Permissions")
    content = body.get("content")
    if not isinstance(content, str) or not content:
        return 400, error(50006, "Cannot send an empty message")
    if len(content) > 2000:
        return 400, error(50035, "Invalid Form Body")
    nonce = body.get("nonce")
    if nonce is not None and (not isinstance(nonce, (str, int)) or len(str(nonce)) > 25):
        return 400, error(50035, "Invalid Form Body")
    reference = body.get("message_reference")
    if isinstance(reference, Mapping) and channel.no_history:
        return 400, error(160002, "Cannot reply without permission to read message history")
    if isinstance(reference, Mapping):
        target = str(reference.get("message_id"))
        exists = any(m["id"] == target for m in channel.messages)
        if not exists and reference.get("fail_if_not_exists", True) is not False:
            return 400, error(50035, "Invalid Form Body")
        if not exists:
            reference = None
    now = trio.current_time()
    if nonce is not None and body.get("enforce_nonce") is True:
        seen = fake.nonces.get((fake.bot_user_id, str(nonce)))
        if seen is not None and now - seen[1] <= fake.nonce_window_s:
            if seen[0] in fake.deleted_ids:
                return 404, error(10008, "Unknown Message")
            original = next((m for m in channel.messages if m["id"] == seen[0]), None) or next(
                m for c in fake.channels.values() for m in c.messages if m["id"] == seen[0]
            )
            return 200, {**original, "nonce": str(nonce)}
    author = fake.bot_user()
    ref = None
    if isinstance(reference, Mapping):
        ref = {"message_id": str(reference["message_id"]), "channel_id": channel.id}
    created = fake._create(
        channel, author, content, nonce=None if nonce is None else str(nonce), reference=ref
    )
    if nonce is not None:
        fake.nonces[(fake.bot_user_id, str(nonce))] = (created["id"], now)
    return 200, created


def _delete(fake: FakeDiscord, channel: Channel, message_id: str) -> tuple[int, Any]:
    message = next((m for m in channel.messages if m["id"] == message_id), None)
    if message is None:
        return 404, error(10008, "Unknown Message")
    if message["author"]["id"] != fake.bot_user_id:
        return 403, error(50013, "Missing Permissions")
    fake.delete_message(message_id)
    fake.deleted.append(dict(message))
    event = {"id": message_id, "channel_id": channel.id}
    fake.gateway.dispatch("MESSAGE_DELETE", event, channel.guild_id)
    return 204, None


def _patch(fake: FakeDiscord, channel: Channel, message_id: str, body: Any) -> tuple[int, Any]:
    message = next((m for m in channel.messages if m["id"] == message_id), None)
    if message is None:
        return 404, error(10008, "Unknown Message")
    if message["author"]["id"] != fake.bot_user_id:
        return 403, error(50005, "Cannot edit a message authored by another user")
    if not isinstance(body, Mapping) or not isinstance(body.get("content"), str):
        return 400, error(50035, "Invalid Form Body")
    if not body["content"] or len(body["content"]) > 2000:
        return 400, error(50035, "Invalid Form Body")
    message["content"] = body["content"]
    message["edited_timestamp"] = "2026-12-05T12:00:01.000000+00:00"
    fake.gateway.dispatch("MESSAGE_UPDATE", dict(message), channel.guild_id)
    return 200, dict(message)


def bucket(
    fake: FakeDiscord,
    key: tuple[str, str, str],
    now: float,
    headers: list[tuple[str, str]],
    force: bool,
) -> dict[str, Any] | None:
    hits = [t for t in fake.buckets.get(key, []) if now - t < fake.route_window_s]
    fake.buckets[key] = hits
    reset_after = fake.route_window_s - (now - hits[0]) if hits else fake.route_window_s
    bucket = f"{key[0]}-{key[1]}".encode().hex()[:16]
    if len(hits) >= fake.route_limit or force:
        retry = round(max(reset_after, 0.05), 3)
        headers += [
            ("X-RateLimit-Limit", str(fake.route_limit)),
            ("X-RateLimit-Remaining", "0"),
            ("X-RateLimit-Reset-After", f"{retry:.3f}"),
            ("X-RateLimit-Bucket", bucket),
            ("X-RateLimit-Scope", "user"),
            ("Retry-After", str(math.ceil(retry))),
        ]
        return {"message": "You are being rate limited.", "retry_after": retry, "global": False}
    hits.append(now)
    headers += [
        ("X-RateLimit-Limit", str(fake.route_limit)),
        ("X-RateLimit-Remaining", str(fake.route_limit - len(hits))),
        ("X-RateLimit-Reset", f"{time.time() + reset_after:.3f}"),
        ("X-RateLimit-Reset-After", f"{reset_after:.3f}"),
        ("X-RateLimit-Bucket", bucket),
    ]
    return None
