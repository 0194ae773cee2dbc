"""The Discord REST client: ``{api_origin}/api/v10`` with rate limits kept
(reference/discord-protocol.md §4, §5).

* **Per-route buckets** from the ``X-RateLimit-*`` headers, keyed by (method, route,
  top-level resource id): a bucket with nothing ``Remaining`` waits for its reset. Routes
  whose answers name the same ``X-RateLimit-Bucket`` share one (per resource id). Idle
  buckets are forgotten past :data:`MAX_BUCKETS`.
* **Global 50/s**: a sliding window (one second and 50 ms) of the requests written, each
  counted right before it is and, once answered, timed by its answer — the latest moment
  Discord can have received it — so no delay on the way (a slow network, a stalled
  server) can bunch more than 50 into one of Discord's seconds; a request still unanswered
  counts as sent now. While the window is full, the requests waiting for it leave
  together when their places free within 20 ms of each other (one wake-up of the loop
  for them all, never before a place is free). A global 429 blocks every request for its
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
import functools
import json
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from ..toolkit import Header, Http11, HttpTransportError, Origin, ResponseTooLarge

log = logging.getLogger("prismd.discord")

DEFAULT_API_ORIGIN = "https://discord.com"
API_PATH = "/api/v10"
USER_AGENT = "DiscordBot (https://github.com/prismd/prismd, 0.1)"
GLOBAL_PER_SECOND = 50
GLOBAL_WINDOW_S = 1.05
"""The global limit's window, with 50 ms to spare (discord.js's offset): requests counted
when they are written may reach Discord a little apart from how they left."""
PACE_TOGETHER = 4
"""At most this many requests waiting for a full global window leave together
(:func:`_leave_at`; no more than :data:`MAX_CONNECTIONS` can wait)."""
PACE_SLACK_S = 0.02
"""How long a free place of the global window may wait for the next ones to free."""
MAX_429_RETRIES = 3
INVALID_WINDOW_S = 600.0
INVALID_GUARD = 1_000
BAN_COOLDOWN_S = 60.0
MAX_RESPONSE_BYTES = 4 * 1024 * 1024
MAX_CONNECTIONS = 4
MAX_BUCKETS = 4096
"""Buckets kept (one per route and channel used); past it, those idle and reset go."""
"""Requests in flight, and the keep-alive connections kept (per origin)."""
_JSON_DUMPS = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode
_USER_AGENT = (b"User-Agent", USER_AGENT.encode())
_JSON_TYPE = (b"Content-Type", b"application/json")


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


class DiscordResponseTooLarge(DiscordApiError):
    """An answer over the byte cap (nothing past it was read)."""

    def __init__(self, status: int) -> None:
        super().__init__(status, None)


class DiscordGuardError(DiscordError):
    """Refused locally: the invalid-request guard or a Cloudflare ban cooldown."""


@functools.lru_cache(maxsize=MAX_BUCKETS)
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
    """Requests go through :class:`~adapters.toolkit.Http11` (keep-alive, one ``send`` per request,
    bounded bodies). Built once: the origin and base path, the headers (the
    ``Authorization`` one per token value)."""

    token: Callable[[], str] = attrs.field(repr=False)
    api_origin: str = DEFAULT_API_ORIGIN
    timeout_s: float = 15.0
    invalid_guard: int = INVALID_GUARD
    ban_cooldown_s: float = BAN_COOLDOWN_S
    _http: Http11 = attrs.field(factory=lambda: Http11(max_connections=MAX_CONNECTIONS))
    _origin: Origin | None = attrs.field(init=False)
    _base: str = attrs.field(init=False)
    _auth: tuple[str, Header] | None = attrs.field(default=None, init=False)
    _buckets: dict[tuple[str, ...], _Bucket] = attrs.field(factory=dict, init=False)
    _shared: dict[tuple[str, str], str] = attrs.field(factory=dict, init=False)
    """(method, route) → the ``X-RateLimit-Bucket`` its answers name."""
    _global: collections.deque[float] = attrs.field(factory=collections.deque, init=False)
    """When each answered request of the window leaves it (its answer + the window)."""
    _in_flight: int = attrs.field(default=0, init=False)
    """Requests counted in the window and not answered yet."""
    _global_lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)
    _pacing: int = attrs.field(default=0, init=False)
    """Requests waiting for a place in the global window."""
    _global_until: float = attrs.field(default=0.0, init=False)
    _invalid: collections.deque[float] = attrs.field(factory=collections.deque, init=False)
    invalid_requests: int = attrs.field(default=0, init=False)
    """Counted 401/403/429 answers (all time; the guard counts the last ten minutes)."""

    def __attrs_post_init__(self) -> None:
        self._origin = _origin(self.api_origin)
        self._base = urllib.parse.urlsplit(self.api_origin).path.rstrip("/") + API_PATH

    def _authorization(self) -> Header:
        token = self.token()
        if self._auth is None or self._auth[0] is not token:
            self._auth = (token, (b"Authorization", f"Bot {token}".encode()))
        return self._auth[1]

    async def aclose(self) -> None:
        await self._http.aclose()

    async def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Mapping[str, Any] | None = None,
        params: Mapping[str, Any] | None = None,
        not_after: float | None = None,
    ) -> Any:
        """One call, rate limits kept; the decoded JSON (``None`` for 204). ``not_after``
        (Trio time): a rate limit that would hold the request past it raises a 429 at once
        (a resend must leave inside its nonce's window)."""
        key = route_key(method, path)
        bucket = self._bucket(key)
        for _attempt in range(MAX_429_RETRIES + 1):
            self._check_guard()
            # A free bucket is taken without a trip through the scheduler (Lock.acquire
            # always yields once); the exchange yields soon enough.
            try:
                bucket.lock.acquire_nowait()
            except trio.WouldBlock:
                await bucket.lock.acquire()
            try:
                await self._wait_bucket(bucket, not_after)
                status, headers, body = await self._send(method, path, json_body, params)
                self._update_bucket(self._learn(key, bucket, headers), headers)
            finally:
                bucket.lock.release()
            if status == 429:
                delay = self._on_429(headers, body)
                if not_after is not None and trio.current_time() + delay > not_after:
                    raise DiscordApiError(429, None, retry_after=delay)
                await trio.sleep(delay)
                continue
            if status in (401, 403):
                self._count_invalid()
            if status == 204:
                return None
            decoded = _json(body)
            if 200 <= status < 300:
                return decoded
            code = decoded.get("code") if isinstance(decoded, Mapping) else None
            raise DiscordApiError(status, code if isinstance(code, int) else None)
        raise DiscordApiError(429, None)

    async def _send(
        self,
        method: str,
        path: str,
        json_body: Mapping[str, Any] | None,
        params: Mapping[str, Any] | None,
    ) -> tuple[int, Mapping[str, str], bytes]:
        if self._origin is None:
            raise DiscordTransportError("Discord unreachable (InvalidURL)")
        target = self._base + path
        if params:
            target += "?" + urllib.parse.urlencode(params)
        headers = [_USER_AGENT, self._authorization()]
        content = b""
        if json_body is not None:
            content = _JSON_DUMPS(json_body).encode()
            headers.append(_JSON_TYPE)
        return await self._exchange(
            self._origin,
            method.encode(),
            target.encode(),
            headers,
            content,
            MAX_RESPONSE_BYTES,
            self._wait_global,
        )

    async def _exchange(
        self,
        origin: Origin,
        method: bytes,
        target: bytes,
        headers: list[Header],
        body: bytes,
        cap: int,
        ready: Callable[[], Awaitable[None]] | None = None,
    ) -> tuple[int, Mapping[str, str], bytes]:
        """One exchange within ``timeout_s`` in all (connect, send, answer; not the wait
        for the global limit, ``ready``): a transport failure or the deadline is
        :class:`DiscordTransportError`; an answer over ``cap``
        :class:`DiscordResponseTooLarge`."""
        cause = "deadline"
        scope = trio.CancelScope()
        paced = ready
        counted = False

        async def start_clock() -> None:
            nonlocal counted
            if paced is not None:
                await paced()
                counted = True
            scope.deadline = trio.current_time() + self.timeout_s

        try:
            with scope:
                try:
                    return await self._http.request(
                        origin, method, target, headers, body, cap, start_clock
                    )
                except ResponseTooLarge as error:
                    raise DiscordResponseTooLarge(error.status) from None
                except HttpTransportError as error:
                    cause = str(error)
        finally:
            if counted:
                self._answered()
        raise DiscordTransportError(f"Discord unreachable ({cause})")

    async def download(self, url: str, max_bytes: int) -> bytes | None:
        """GET ``url`` (an attachment on the CDN) without the bot token; ``None`` unless
        2xx within ``max_bytes`` (checked against ``Content-Length``, then while
        reading). Raises :class:`DiscordTransportError`."""
        origin = _origin(url)
        if origin is None:
            return None
        parts = urllib.parse.urlsplit(url)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        try:
            status, _headers, body = await self._exchange(
                origin, b"GET", target.encode(), [_USER_AGENT], b"", max_bytes
            )
        except DiscordResponseTooLarge:
            return None
        return body if 200 <= status < 300 else None

    def _check_guard(self) -> None:
        if self._invalid:
            now = trio.current_time()
            while self._invalid and now - self._invalid[0] > INVALID_WINDOW_S:
                self._invalid.popleft()
        if len(self._invalid) >= self.invalid_guard:
            raise DiscordGuardError("invalid-request guard: too many 401/403/429 answers")

    def _count_invalid(self) -> None:
        self.invalid_requests += 1
        self._invalid.append(trio.current_time())

    def _bucket(self, key: tuple[str, str, str]) -> _Bucket:
        name = self._shared.get(key[:2])
        found = self._buckets.get(key if name is None else (name, key[2]))
        if found is not None:
            return found
        if len(self._buckets) >= MAX_BUCKETS:
            now = trio.current_time()
            for old in [k for k, b in self._buckets.items() if b.reset_at <= now]:
                if not self._buckets[old].lock.locked():
                    del self._buckets[old]
        bucket = self._buckets[key if name is None else (name, key[2])] = _Bucket()
        return bucket

    def _learn(
        self, key: tuple[str, str, str], bucket: _Bucket, headers: Mapping[str, str]
    ) -> _Bucket:
        """The bucket an answer names (``X-RateLimit-Bucket``): the one every route naming
        it shares for this resource id from now on."""
        name = headers.get("x-ratelimit-bucket")
        if not name:
            return bucket
        self._shared[key[:2]] = name
        return self._buckets.setdefault((name, key[2]), bucket)

    async def _wait_bucket(self, bucket: _Bucket, not_after: float | None) -> None:
        now = trio.current_time()
        until = bucket.reset_at if bucket.remaining == 0 and bucket.reset_at > now else now
        if not_after is not None and max(until, self._global_until) > not_after:
            raise DiscordApiError(429, None)  # limited past the caller's deadline
        if until > now:
            await trio.sleep(until - now)
            bucket.remaining = None

    async def _wait_global(self) -> None:
        """Take a place in the global 50 a second: at once while the window has room (no
        lock, no sleep); else callers queue on a fair lock and only the first one sleeps,
        until the window slides (no herd woken to find it still full), and those waiting
        leave together when their places free close together (:func:`_leave_at`)."""
        now = trio.current_time()
        if not self._global_lock.locked() and self._global_until <= now and self._room(now):
            self._in_flight += 1
            return
        self._pacing += 1
        try:
            async with self._global_lock:
                while True:
                    now = trio.current_time()
                    if self._global_until > now:
                        await trio.sleep(self._global_until - now)
                    elif self._room(now):
                        self._in_flight += 1
                        return
                    elif self._global:
                        leave = _leave_at(self._global, self._in_flight, self._pacing)
                        await trio.sleep_until(leave)
                    else:  # all 50 unanswered (more connections than the limit): soon
                        await trio.sleep(0.05)
        finally:
            self._pacing -= 1

    def _room(self, now: float) -> bool:
        window = self._global
        while window and window[0] <= now:
            window.popleft()
        return len(window) + self._in_flight < GLOBAL_PER_SECOND

    def _answered(self) -> None:
        """A request counted in the window was answered (or given up): it stays in the
        window, timed from now."""
        self._in_flight -= 1
        self._global.append(trio.current_time() + GLOBAL_WINDOW_S)

    def _update_bucket(self, bucket: _Bucket, headers: Mapping[str, str]) -> None:
        remaining = _number(headers.get("x-ratelimit-remaining"))
        reset_after = _number(headers.get("x-ratelimit-reset-after"))
        if remaining is not None:
            bucket.remaining = int(remaining)
        if reset_after is not None:
            bucket.reset_at = trio.current_time() + reset_after

    def _on_429(self, headers: Mapping[str, str], raw: bytes) -> float:
        """The wait a 429 asks for (and its bookkeeping)."""
        body = _json(raw)
        scope = headers.get("x-ratelimit-scope")
        limited = (
            "x-ratelimit-scope" in headers
            or "x-ratelimit-global" in headers
            or "retry-after" in headers
            or (isinstance(body, Mapping) and _number(body.get("retry_after")) is not None)
        )
        if not isinstance(body, Mapping) or not limited:
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
            retry = _number(headers.get("retry-after"))
        delay = min(max(retry if retry is not None else 1.0, 0.0), 3600.0) + 0.05
        if body.get("global") is True or headers.get("x-ratelimit-global", "").lower() == "true":
            self._global_until = trio.current_time() + delay
        log.info("discord: rate limited (%s); retry in %.2f s", scope or "unknown", delay)
        return delay


def _leave_at(window: collections.deque[float], in_flight: int, waiting: int) -> float:
    """When the requests ``waiting`` for a full global window leave: once it has a place
    for each of them (at most :data:`PACE_TOGETHER`), if that comes within
    :data:`PACE_SLACK_S` of its first free place; else at that first place.

    Leaving together, they cost the loop one wake-up instead of one each (on a VM a
    wake-up from idle costs some 0.1-0.2 ms of CPU: more than a send), and their answers
    enter the window together, so their places free together again a window later. None
    leaves before the window has a place for it; a place waits at most the slack (one
    place's time at 50 a second). A request waiting alone leaves at the first place."""
    first = len(window) + in_flight - GLOBAL_PER_SECOND  # its leaving frees a place
    last = first + min(waiting, PACE_TOGETHER) - 1
    first = max(0, min(first, len(window) - 1))
    last = max(0, min(last, len(window) - 1))
    return min(window[last], window[first] + PACE_SLACK_S)


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        return None


def _origin(url: str) -> Origin | None:
    """The scheme, host and port of an ``http(s)`` URL (``None``: not one)."""
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        return None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return None
    return Origin(parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80))


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
