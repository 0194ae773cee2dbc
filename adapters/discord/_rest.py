"""The Discord REST client: ``{api_origin}/api/v10`` with rate limits kept
(reference/discord-protocol.md §4, §5).

* **Per-route buckets** from the ``X-RateLimit-*`` headers, keyed by (method, route,
  top-level resource id): a bucket with nothing ``Remaining`` waits for its reset.
* **Global 50/s**: a sliding one-second window; a global 429 blocks every request for its
  ``retry_after``.
* **429** sleeps ``retry_after`` (float seconds, body or ``Retry-After``) and tries again,
  at most :data:`MAX_429_RETRIES` times per call.
* **Invalid-request guard**: 401, 403 and non-``shared`` 429 answers are counted over ten
  minutes; past :data:`INVALID_GUARD` (a tenth of the 10,000 that gets an IP banned) every
  call is refused locally until the window clears. A 429 without JSON or without rate-limit
  headers is Cloudflare's ban: every call waits :data:`BAN_COOLDOWN_S`.

Errors carry the HTTP status and Discord's JSON ``code`` only: never the token, a URL's
ids or message text. A transport failure or timeout raises :class:`DiscordTransportError`
(for a POST the outcome is unknown: the sender decides).
"""

from __future__ import annotations

import collections
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import httpx
import trio

log = logging.getLogger("prismd.discord")

DEFAULT_API_ORIGIN = "https://discord.com"
API_PATH = "/api/v10"
USER_AGENT = "DiscordBot (https://github.com/prismd/prismd, 0.1)"
GLOBAL_PER_SECOND = 50
MAX_429_RETRIES = 3
INVALID_WINDOW_S = 600.0
INVALID_GUARD = 1_000
BAN_COOLDOWN_S = 60.0
MAX_RESPONSE_BYTES = 4 * 1024 * 1024


class DiscordError(Exception):
    """A REST call failed (fixed text: status and code, nothing else)."""


class DiscordTransportError(DiscordError):
    """No answer (network error, timeout): for a POST, the outcome is unknown."""


class DiscordApiError(DiscordError):
    def __init__(self, status: int, code: int | None, retry_after: float | None = None) -> None:
        super().__init__(f"Discord answered HTTP {status} (code {code})")
        self.status = status
        self.code = code
        self.retry_after = retry_after


class DiscordGuardError(DiscordError):
    """Refused locally: the invalid-request guard or a Cloudflare ban cooldown."""


def route_key(method: str, path: str) -> tuple[str, str, str]:
    """(method, route with ids replaced, top-level resource id) of ``/channels/1/messages``."""
    parts = path.strip("/").split("/")
    major = parts[1] if len(parts) > 1 and parts[0] in ("channels", "guilds", "webhooks") else ""
    shape = "/".join(p if not p.isdigit() else "{id}" for p in parts)
    return method, shape, major


@attrs.define(eq=False)
class _Bucket:
    remaining: int | None = None
    reset_at: float = 0.0
    lock: trio.Lock = attrs.field(factory=trio.Lock)


@attrs.define(eq=False, kw_only=True)
class DiscordRest:
    token: Callable[[], str] = attrs.field(repr=False)
    api_origin: str = DEFAULT_API_ORIGIN
    timeout_s: float = 15.0
    transport: Any = None
    invalid_guard: int = INVALID_GUARD
    ban_cooldown_s: float = BAN_COOLDOWN_S
    _client: httpx.AsyncClient | None = attrs.field(default=None, init=False)
    _buckets: dict[tuple[str, str, str], _Bucket] = attrs.field(factory=dict, init=False)
    _global: collections.deque[float] = attrs.field(factory=collections.deque, init=False)
    _global_until: float = attrs.field(default=0.0, init=False)
    _invalid: collections.deque[float] = attrs.field(factory=collections.deque, init=False)
    invalid_requests: int = attrs.field(default=0, init=False)
    """Counted 401/403/429 answers (all time; the guard counts the last ten minutes)."""

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.api_origin.rstrip("/") + API_PATH,
                timeout=httpx.Timeout(self.timeout_s, connect=10.0),
                transport=self.transport,
                follow_redirects=False,
                headers={"User-Agent": USER_AGENT},
            )
        return self._client

    async def aclose(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> Any:
        """One call, rate limits kept; the decoded JSON (``None`` for 204)."""
        key = route_key(method, path)
        bucket = self._buckets.setdefault(key, _Bucket())
        for _attempt in range(MAX_429_RETRIES + 1):
            self._check_guard()
            async with bucket.lock:
                await self._wait_bucket(bucket)
                await self._wait_global()
                response = await self._send(method, path, json_body, params)
                self._update_bucket(bucket, response)
            if response.status_code == 429:
                delay = self._on_429(response)
                await trio.sleep(delay)
                continue
            if response.status_code in (401, 403):
                self._count_invalid()
            if response.status_code == 204:
                return None
            body = _json(response)
            if 200 <= response.status_code < 300:
                return body
            code = body.get("code") if isinstance(body, Mapping) else None
            raise DiscordApiError(response.status_code, code if isinstance(code, int) else None)
        raise DiscordApiError(429, None)

    async def _send(
        self,
        method: str,
        path: str,
        json_body: Mapping[str, Any] | None,
        params: Mapping[str, Any] | None,
    ) -> httpx.Response:
        headers = {"Authorization": f"Bot {self.token()}"}
        content = None
        if json_body is not None:
            headers["Content-Type"] = "application/json"
            content = json.dumps(json_body, separators=(",", ":")).encode()
        try:
            response = await self._http().request(
                method, path, content=content, params=params, headers=headers
            )
        except (httpx.TransportError, httpx.InvalidURL) as error:
            raise DiscordTransportError(f"Discord unreachable ({type(error).__name__})") from None
        if len(response.content) > MAX_RESPONSE_BYTES:
            raise DiscordApiError(response.status_code, None)
        return response

    def _check_guard(self) -> None:
        now = trio.current_time()
        while self._invalid and now - self._invalid[0] > INVALID_WINDOW_S:
            self._invalid.popleft()
        if len(self._invalid) >= self.invalid_guard:
            raise DiscordGuardError("invalid-request guard: too many 401/403/429 answers")

    def _count_invalid(self) -> None:
        self.invalid_requests += 1
        self._invalid.append(trio.current_time())

    async def _wait_bucket(self, bucket: _Bucket) -> None:
        now = trio.current_time()
        if bucket.remaining == 0 and bucket.reset_at > now:
            await trio.sleep(bucket.reset_at - now)
            bucket.remaining = None

    async def _wait_global(self) -> None:
        while True:
            now = trio.current_time()
            if self._global_until > now:
                await trio.sleep(self._global_until - now)
                continue
            while self._global and now - self._global[0] >= 1.0:
                self._global.popleft()
            if len(self._global) < GLOBAL_PER_SECOND:
                self._global.append(now)
                return
            await trio.sleep(1.0 - (now - self._global[0]))

    def _update_bucket(self, bucket: _Bucket, response: httpx.Response) -> None:
        remaining = _number(response.headers.get("x-ratelimit-remaining"))
        reset_after = _number(response.headers.get("x-ratelimit-reset-after"))
        if remaining is not None:
            bucket.remaining = int(remaining)
        if reset_after is not None:
            bucket.reset_at = trio.current_time() + reset_after

    def _on_429(self, response: httpx.Response) -> float:
        """The wait a 429 asks for (and its bookkeeping)."""
        body = _json(response)
        scope = response.headers.get("x-ratelimit-scope")
        has_headers = "x-ratelimit-scope" in response.headers or "retry-after" in response.headers
        if not isinstance(body, Mapping) or not has_headers:
            # Cloudflare's ban (HTML, code 0 or 40333 without headers): back off hard.
            self._count_invalid()
            self._global_until = trio.current_time() + self.ban_cooldown_s
            log.warning(
                "discord: blocked by Cloudflare; pausing requests %.0f s", self.ban_cooldown_s
            )
            return self.ban_cooldown_s
        if scope != "shared":
            self._count_invalid()
        retry = _number(body.get("retry_after"))
        if retry is None:
            retry = _number(response.headers.get("retry-after"))
        delay = min(max(retry if retry is not None else 1.0, 0.0), 3600.0) + 0.05
        if body.get("global") is True or response.headers.get("x-ratelimit-global"):
            self._global_until = trio.current_time() + delay
        log.info("discord: rate limited (%s); retry in %.2f s", scope or "unknown", delay)
        return delay


def _json(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return None


def _number(value: object) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return None
