"""The REST half of the second fake Discord (:mod:`tests.fakes.discord_alt`): routes under
``/api/v10``, rate limits with the ``X-RateLimit-*`` headers (per route and channel, the
global 50 a second, forced 429s of each scope), error bodies ``{code, message}``, Create
Message with ``enforce_nonce`` returning the original, history without nonces."""

from __future__ import annotations

import json
import math
import secrets
import time
import urllib.parse
from typing import TYPE_CHECKING, Any

import trio

if TYPE_CHECKING:
    from tests.fakes.discord_alt import AltDiscord

Answer = tuple[int, dict[str, str], bytes]
BOT_ID = "9100000000000000001"


def _error(fake: AltDiscord, status: int, code: int, message: str, **extra: Any) -> Answer:
    if status in (401, 403):
        fake.invalid_requests += 1
    return status, {}, json.dumps({"message": message, "code": code, **extra}).encode()


def _limited(fake: AltDiscord, method: str, route: str, major: str) -> Answer | dict[str, str]:
    now = trio.current_time()
    while fake._global_times and now - fake._global_times[0] > 1.0:
        fake._global_times.popleft()
    if fake.global_429 > 0 or len(fake._global_times) >= fake.global_per_s:
        fake.global_429 = max(0, fake.global_429 - 1)
        fake.invalid_requests += 1
        retry = round(fake.rng.uniform(0.05, 0.4), 3)
        body = {"message": "You are being rate limited.", "retry_after": retry, "global": True}
        return (
            429,
            {
                "Retry-After": str(math.ceil(retry)),
                "X-RateLimit-Global": "true",
                "X-RateLimit-Scope": "global",
            },
            json.dumps(body).encode(),
        )
    fake._global_times.append(now)
    name = fake._bucket_names.setdefault((method, route), secrets.token_hex(8))
    times = fake._buckets.setdefault((method, route, major), [])
    times[:] = [t for t in times if now - t < fake.bucket_window_s]
    reset_after = (times[0] + fake.bucket_window_s - now) if times else fake.bucket_window_s
    headers = {
        "X-RateLimit-Limit": str(fake.bucket_limit),
        "X-RateLimit-Bucket": name,
        "X-RateLimit-Reset-After": f"{reset_after:.3f}",
        "X-RateLimit-Reset": f"{time.time() + reset_after:.3f}",
    }
    forced = fake.route_429 > 0 or fake.shared_429 > 0
    if forced or len(times) >= fake.bucket_limit:
        scope = "shared" if fake.shared_429 > 0 and fake.route_429 == 0 else "user"
        if fake.route_429 > 0:
            fake.route_429 -= 1
        elif fake.shared_429 > 0:
            fake.shared_429 -= 1
        if scope == "user":
            fake.invalid_requests += 1
        retry = round(reset_after if not forced else fake.rng.uniform(0.1, 0.6), 3)
        body = {"message": "You are being rate limited.", "retry_after": retry, "global": False}
        return (
            429,
            {
                **headers,
                "X-RateLimit-Remaining": "0",
                "Retry-After": str(math.ceil(retry)),
                "X-RateLimit-Scope": scope,
            },
            json.dumps(body).encode(),
        )
    times.append(now)
    headers["X-RateLimit-Remaining"] = str(fake.bucket_limit - len(times))
    return headers


def rest_answer(
    fake: AltDiscord, method: str, target: str, headers: dict[str, str], body: bytes
) -> Answer | None:
    parts = urllib.parse.urlsplit(target)
    path = parts.path.removeprefix("/api/v10")
    query = dict(urllib.parse.parse_qsl(parts.query))
    answer = _route(fake, method, path, query, headers, body)
    if answer is not None:
        fake.requests.append((method, path, answer[0]))
    return answer


def _route(
    fake: AltDiscord,
    method: str,
    path: str,
    query: dict[str, str],
    headers: dict[str, str],
    body: bytes,
) -> Answer | None:
    if path == "/gateway" and method == "GET":
        return 200, {}, json.dumps({"url": f"ws://127.0.0.1:{fake.port}/"}).encode()
    if headers.get("authorization") != f"Bot {fake.token}":
        return _error(fake, 401, 0, "401: Unauthorized")
    segs = path.strip("/").split("/")
    shape = "/".join("{id}" if s.isdigit() else s for s in segs)
    major = segs[1] if len(segs) > 1 and segs[0] == "channels" else ""
    limited = _limited(fake, method, shape, major)
    if isinstance(limited, tuple):
        return limited
    rl = limited

    def ok(value: Any) -> Answer:
        return 200, rl, json.dumps(value).encode()

    if path == "/gateway/bot" and method == "GET":
        return ok(
            {
                "url": f"ws://127.0.0.1:{fake.port}/",
                "shards": 1,
                "session_start_limit": {
                    "total": 1000,
                    "remaining": fake._start_remaining,
                    "reset_after": 14_400_000,
                    "max_concurrency": fake.max_concurrency,
                },
            }
        )
    if path == "/users/@me" and method == "GET":
        return ok({"id": BOT_ID, "username": "alt", "bot": True, "global_name": None})
    if path == "/users/@me/channels" and method == "POST":
        recipient = str(json.loads(body or b"{}").get("recipient_id", ""))
        return ok({"id": fake.open_dm(recipient), "type": 1, "recipients": [{"id": recipient}]})
    if segs[0] != "channels" or len(segs) < 3 or not major.isdigit():
        return _error(fake, 404, 0, "404: Not Found")
    if major not in fake.messages:
        return _error(fake, 404, 10003, "Unknown Channel")
    if shape == "channels/{id}/typing" and method == "POST":
        fake.typing.append(major)
        return 204, rl, b""
    if shape == "channels/{id}/messages" and method == "GET":
        return ok(_history(fake, major, query))
    if shape == "channels/{id}/messages" and method == "POST":
        return _post(fake, major, headers, body, rl)
    if shape == "channels/{id}/messages/{id}":
        message = fake.find(major, segs[3])
        if message is None or segs[3] in fake.deleted:
            return _error(fake, 404, 10008, "Unknown Message")
        if method == "GET":
            return ok({k: v for k, v in message.items() if k != "nonce"})
        if message["author"]["id"] != BOT_ID:
            return _error(fake, 403, 50005, "Cannot edit a message authored by another user")
        if method == "DELETE":
            fake.deleted.add(segs[3])
            fake.dispatch("MESSAGE_DELETE", {"id": segs[3], "channel_id": major})
            return 204, rl, b""
        if method == "PATCH":
            message["content"] = str(json.loads(body or b"{}").get("content", message["content"]))
            message["edited_timestamp"] = message["timestamp"]
            fake.dispatch("MESSAGE_UPDATE", message)
            return ok(message)
    return _error(fake, 405, 0, "405: Method Not Allowed")


def _history(fake: AltDiscord, channel: str, query: dict[str, str]) -> list[dict[str, Any]]:
    limit = max(1, min(100, int(query.get("limit", "50"))))
    live = [m for m in fake.messages[channel] if m["id"] not in fake.deleted]
    if "after" in query:
        picked = [m for m in live if int(m["id"]) > int(query["after"])][:limit]
    elif "before" in query:
        picked = [m for m in live if int(m["id"]) < int(query["before"])][-limit:]
    else:
        picked = live[-limit:]
    return [{k: v for k, v in m.items() if k != "nonce"} for m in reversed(picked)]


def _post(
    fake: AltDiscord, channel: str, headers: dict[str, str], body: bytes, rl: dict[str, str]
) -> Answer | None:
    if "application/json" not in headers.get("content-type", ""):
        return _error(fake, 400, 50035, "Invalid Form Body")
    request = json.loads(body)
    content = request.get("content")
    nonce = request.get("nonce")
    if not isinstance(content, str) or not content.strip():
        return _error(fake, 400, 50006, "Cannot send an empty message")
    if len(content.encode("utf-16-le")) // 2 > 2000 or (nonce is not None and len(str(nonce)) > 25):
        return _error(fake, 400, 50035, "Invalid Form Body", errors={"content": {}})
    if fake.post_502 > 0:
        fake.post_502 -= 1
        return 502, {}, b'{"message": "502: Bad Gateway", "code": 0}'
    if channel in fake.closed_dms:
        return _error(fake, 403, 50007, "Cannot send messages to this user")
    if channel in fake.forbidden:
        return _error(fake, 403, 50013, "Missing Permissions")
    now = trio.current_time()
    key = (BOT_ID, str(nonce))
    if nonce is not None and request.get("enforce_nonce") is True:
        hit = fake.nonces.get(key)
        if hit is not None and now - hit[0] < fake.nonce_window_s:
            if hit[2] in fake.deleted:
                return _error(fake, 404, 10008, "Unknown Message")
            original = fake.find(hit[1], hit[2])
            fake.nonce_hits += 1
            return 200, rl, json.dumps(original).encode()
    reference = request.get("message_reference") or {}
    target = reference.get("message_id")
    if target is not None and fake.find(channel, str(target)) is None:
        if reference.get("fail_if_not_exists", True):
            return _error(
                fake,
                400,
                50035,
                "Invalid Form Body",
                errors={
                    "message_reference": {
                        "_errors": [{"code": "MESSAGE_REFERENCE_UNKNOWN_MESSAGE"}]
                    }
                },
            )
        target = None
    author = {
        "id": BOT_ID,
        "username": "alt",
        "bot": True,
        "global_name": None,
        "discriminator": "0",
    }
    message = fake._message(channel, author, content, str(target) if target else None)
    if nonce is not None:
        message["nonce"] = nonce
        fake.nonces[key] = (now, channel, message["id"])
    fake.dispatch("MESSAGE_CREATE", {**message, "channel_type": 1})
    if fake.lose_post_response > 0:
        fake.lose_post_response -= 1
        return None
    if fake.post_500_after_commit > 0:
        fake.post_500_after_commit -= 1
        return 500, {}, b'{"message": "500: Internal Server Error", "code": 0}'
    return 200, rl, json.dumps(message).encode()
