"""A small Bot API client: ``POST <origin>/bot<token>/<method>`` with bounded, fixed-text errors.

Guarantees (contract §11.2):

* Requests go through the toolkit's :class:`~adapters.toolkit.Http11` (keep-alive,
  one write per request).
* The token is read from the credential source on every request and appears only in the
  request URL; no exception raised here carries a URL, a token, a response body or a
  platform description. Every message is fixed text; callers branch on attributes.
* Redirects are never followed (a 3xx is an API error).
* Response bodies are read with a byte cap; an oversized or non-JSON body is a
  :class:`TelegramResponseError` (the request may have been processed).
* httpx (the multipart encoder) logs each request URL at INFO, and
  Telegram URLs carry the token: importing this module raises the ``httpx``/``httpcore``
  loggers to WARNING and installs a filter that drops any of their records mentioning a
  bot path, whatever level a host later sets.

What its callers make of a failure lives here too (the end of the module), so a failure is
described in one place: :func:`log_retry`, the one WARNING line of a retried call (its cause
class from :func:`describe_failure`, the delay, the attempt), and :class:`ReceiverStatus`,
the receiving side's state for ``health()`` (polling, backoff, unauthorized…), the fatal
error a rejected credential means, and the "reachable again" line after failed calls.
"""

from __future__ import annotations

import json
import logging
import re
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import attrs
import httpx
import trio

from prismd.channel import AdapterFatalError

from ..toolkit import (
    Activity,
    Header,
    Http11,
    HttpTransportError,
    Origin,
    ResponseTooLarge,
    is_loopback_host,
)

DEFAULT_API_ORIGIN = "https://api.telegram.org"
DEFAULT_MAX_RESPONSE_BYTES = 128 * 1024
MAX_CONNECTIONS = 4
"""Requests in flight per client, and the keep-alive connections its pool keeps: an idle
connection is polled (a system call) before its reuse, as httpcore polled every idle one
before each request (twenty idle connections cost twenty polls per request; 8 still cost
7.9% of the daemon's samples, 4 under 1%). Four carry Telegram's ~30 messages a second at
up to ~130 ms a request; a request waiting for one has not left (it waits outside its
deadline)."""
REQUEST_GRACE_S = 30.0
REJECTED_TOKEN = (
    "Telegram rejected the bot credentials: check the token this connection reads"
    " (token_env or token_file; the one @BotFather gave) and restart; prismd doctor tests it"
)
"""The connection's fatal error (and health's ``lastError``) on 401/403: what to fix."""
"""Added to the read timeout to make the deadline of a whole request (connect, send, body)."""
_TOKEN_RE = re.compile(r"^[0-9]{1,20}:[A-Za-z0-9_-]{1,1000}$")


class _DropBotUrls(logging.Filter):
    """Drops records that could carry a bot URL (``/bot<token>/`` or ``/file/bot<token>/``)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except Exception:
            return False
        return "/bot" not in text and "api.telegram.org" not in text


_FILTER = _DropBotUrls()
for _name in ("httpx", "httpcore"):
    _logger = logging.getLogger(_name)
    if _logger.level < logging.WARNING:
        _logger.setLevel(logging.WARNING)
    if _FILTER not in _logger.filters:
        _logger.addFilter(_FILTER)


class TelegramError(Exception):
    """Base of every Bot API client error; messages are fixed text."""


class TelegramCredentialError(TelegramError):
    """The credential source failed or returned an unusable token."""

    def __init__(self) -> None:
        super().__init__("Telegram credential unavailable")


class TelegramNetworkError(TelegramError):
    """The request failed in transport; Telegram may or may not have processed it.

    ``cause`` names the class of the failure for logs: the HTTP client's error type
    (``ConnectError``, ``ReadTimeout``…: :mod:`adapters.toolkit._http_client`) or
    ``deadline`` when the whole request ran out of time. A type name never carries the URL
    (whose text has the token).
    """

    def __init__(self, cause: str = "unknown") -> None:
        super().__init__("Telegram request failed")
        self.cause = cause


class TelegramResponseError(TelegramError):
    """The response was oversized or not the JSON envelope; outcome unknown."""

    def __init__(self) -> None:
        super().__init__("Telegram response invalid")


class TelegramApiError(TelegramError):
    """Telegram answered with an error (non-2xx or ``ok`` not true).

    ``status`` is ``error_code`` (else the HTTP status); ``retry_after`` comes from
    ``parameters.retry_after`` or the ``Retry-After`` header when a positive integer.
    ``description`` is kept for tests and decisions but never put in the message.
    ``enveloped`` is false when the body was not Telegram's JSON error envelope (e.g. a
    proxy's HTML 502): such an answer says nothing about whether Telegram processed the call.
    """

    def __init__(
        self,
        status: int,
        *,
        retry_after: int | None = None,
        migrate_to_chat_id: int | None = None,
        description: str = "",
        enveloped: bool = True,
    ) -> None:
        super().__init__("Telegram API error")
        self.enveloped = enveloped
        self.status = status
        self.retry_after = retry_after
        self.migrate_to_chat_id = migrate_to_chat_id
        self.description = description


def describe_failure(error: TelegramError) -> str:
    """A short, fixed-text cause class of a failed call, for logs (never a URL, token,
    body or platform description)."""
    if isinstance(error, TelegramNetworkError):
        return f"network error ({error.cause})"
    if isinstance(error, TelegramResponseError):
        return "unreadable response"
    if isinstance(error, TelegramCredentialError):
        return "credential unavailable"
    if isinstance(error, TelegramApiError):
        if error.retry_after is not None:
            return f"rate limited (HTTP {error.status}, retry_after {error.retry_after} s)"
        if error.status == 409:
            return "conflict (HTTP 409: another poller or a webhook)"
        if not error.enveloped:
            return f"HTTP {error.status} without a Bot API answer"
        return f"Bot API error {error.status}"
    return type(error).__name__


def validate_api_origin(origin: str) -> str:
    """An exact ``https://host[:port]`` origin (``http://`` only for loopback hosts).

    Raises :class:`ValueError` (fixed text) for paths, queries, fragments or userinfo.
    """
    try:
        url = httpx.URL(origin)
    except Exception:
        raise ValueError("api_origin must be an https origin") from None
    ok_scheme = url.scheme == "https" or (url.scheme == "http" and is_loopback_host(url.host))
    if (
        not ok_scheme
        or not url.host
        or url.userinfo
        or url.query
        or url.fragment
        or url.raw_path not in (b"", b"/")
        or origin.endswith("/")
    ):
        raise ValueError("api_origin must be an https origin")
    return origin


def _positive_int(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int | str):
        return None
    try:
        number = int(value)
    except ValueError:
        return None
    return number if number > 0 else None


_JSON_DUMPS = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode
_USER_AGENT = (b"User-Agent", b"prismd")
_ACCEPT = (b"Accept", b"application/json")
_JSON_HEADERS: tuple[Header, ...] = (_USER_AGENT, _ACCEPT, (b"Content-Type", b"application/json"))
_PATH_SAFE = "/:@-._~!$&'()*+,;="
_Answer = tuple[int, Mapping[str, str] | httpx.Headers, bytes]


def _origin(api_origin: str) -> Origin:
    parts = urllib.parse.urlsplit(api_origin)
    default = 443 if parts.scheme == "https" else 80
    return Origin(parts.scheme, parts.hostname or "", parts.port or default)


def _multipart(
    params: Mapping[str, Any] | None, files: Mapping[str, tuple[str, bytes, str]]
) -> tuple[tuple[Header, ...], bytes]:
    """A ``multipart/form-data`` body and its headers, encoded by httpx (no I/O: the
    request is only built, never sent through httpx)."""
    request = httpx.Request(
        "POST",
        "http://multipart.invalid/",
        data={k: str(v) for k, v in (params or {}).items()},
        files=dict(files),
    )
    body = request.read()
    content_type = request.headers["Content-Type"].encode("ascii")
    return (_USER_AGENT, _ACCEPT, (b"Content-Type", content_type)), body


def fixed_token(token: str) -> Callable[[], str]:
    """A credential source that answers ``token`` (read once, when the daemon starts)."""
    return lambda: token


@attrs.define(eq=False)
class TelegramApi:
    """One long-lived client per instance; ``call`` returns ``result`` of a successful
    envelope.

    Requests go through the toolkit's :class:`~adapters.toolkit.Http11` (keep-alive, at
    most :data:`MAX_CONNECTIONS`, head and body in one write, each read of the answer
    within the read timeout). What can be built once is: the request target of each
    method (per token value), the headers, the origin. A body is read as bytes under its
    cap and decoded once. Multipart bodies (``files``) are encoded by httpx and sent the
    same way.

    ``read_timeout_s`` must exceed the long-poll timeout so a quiet poll ends by Telegram's
    empty answer, not by our timeout.
    """

    token: Callable[[], str]
    api_origin: str = DEFAULT_API_ORIGIN
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    read_timeout_s: float = 60.0
    _http: Http11 = attrs.field(
        factory=lambda: Http11(max_connections=MAX_CONNECTIONS), init=False, repr=False
    )
    _token_seen: str | None = attrs.field(default=None, init=False, repr=False)
    _targets: dict[str, bytes] = attrs.field(factory=dict, init=False, repr=False)
    _origin: Origin = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        self._origin = _origin(self.api_origin)

    async def aclose(self) -> None:
        await self._http.aclose()

    def _token(self) -> str:
        try:
            token = self.token()
        except Exception:
            raise TelegramCredentialError() from None
        if token is self._token_seen:
            return token
        if not isinstance(token, str) or not _TOKEN_RE.fullmatch(token):
            raise TelegramCredentialError()
        # A new token value (rotated): every target is rebuilt with it.
        self._token_seen = token
        self._targets.clear()
        return token

    def _target(self, path: str) -> bytes:
        """``/bot<token>/<path>`` (``path`` may start with ``file/``: then
        ``/file/bot<token>/…``), built once per token value."""
        token = self._token()
        target = self._targets.get(path)
        if target is None:
            if path.startswith("file/"):
                text = f"/file/bot{token}/{path[5:]}"
            else:
                text = f"/bot{token}/{path}"
            target = urllib.parse.quote(text, safe=_PATH_SAFE).encode("ascii")
            if len(self._targets) < 64:  # methods are few; file paths are not kept forever
                self._targets[path] = target
        return target

    async def call(
        self,
        method: str,
        params: Mapping[str, Any] | None = None,
        *,
        files: Mapping[str, tuple[str, bytes, str]] | None = None,
        read_timeout_s: float | None = None,
        max_response_bytes: int | None = None,
    ) -> Any:
        """POST ``params`` as JSON (or multipart with ``files``); return the ``result``.

        ``max_response_bytes`` overrides the client's cap for this call (``getUpdates``
        batches are legitimately much larger than any other answer).

        Raises :class:`TelegramApiError`, :class:`TelegramNetworkError`,
        :class:`TelegramResponseError` or :class:`TelegramCredentialError`.
        """
        target = self._target(method)
        read_s = self.read_timeout_s if read_timeout_s is None else read_timeout_s
        if files is not None:
            headers, body = _multipart(params, files)
        else:
            headers, body = _JSON_HEADERS, _JSON_DUMPS(params or {}).encode("utf-8")
        cap = self.max_response_bytes if max_response_bytes is None else max_response_bytes
        status, answer_headers, body = await self._request(
            b"POST", target, headers, body, read_s, cap
        )
        try:
            envelope = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            envelope = None
        if not isinstance(envelope, dict):
            if 200 <= status < 300:
                raise TelegramResponseError()
            raise TelegramApiError(
                status,
                retry_after=_positive_int(answer_headers.get("retry-after")),
                enveloped=False,
            )
        if envelope.get("ok") is True and 200 <= status < 300:
            return envelope.get("result")
        parameters = envelope.get("parameters")
        parameters = parameters if isinstance(parameters, dict) else {}
        code = envelope.get("error_code")
        error_status = code if isinstance(code, int) and not isinstance(code, bool) else status
        retry_after = _positive_int(parameters.get("retry_after"))
        if retry_after is None:
            retry_after = _positive_int(answer_headers.get("retry-after"))
        migrate = parameters.get("migrate_to_chat_id")
        description = envelope.get("description")
        raise TelegramApiError(
            error_status,
            retry_after=retry_after,
            migrate_to_chat_id=migrate
            if isinstance(migrate, int) and not isinstance(migrate, bool)
            else None,
            description=description if isinstance(description, str) else "",
        )

    async def download(self, file_path: str, max_bytes: int) -> bytes | None:
        """GET ``<origin>/file/bot<token>/<file_path>``; ``None`` when not 2xx or over the cap.

        The cap is checked against ``Content-Length`` before reading and while reading.
        Transport failures raise :class:`TelegramNetworkError`.
        """
        token = self._token()
        target = urllib.parse.quote(f"/file/bot{token}/{file_path}", safe=_PATH_SAFE)
        try:
            status, _headers, body = await self._request(
                b"GET", target.encode("ascii"), (_USER_AGENT,), b"", self.read_timeout_s, max_bytes
            )
        except TelegramResponseError:
            return None
        if not 200 <= status < 300:
            return None
        return body

    async def _request(
        self,
        method: bytes,
        target: bytes,
        headers: tuple[Header, ...],
        body: bytes,
        read_s: float,
        cap: int,
    ) -> _Answer:
        # Each read is bounded by ``read_s``, not the whole exchange: a server dripping a
        # byte now and then would hold the call forever. The whole request gets its read
        # budget + 30 s, counted once a connection is ours (waiting for one sends nothing).
        read_s = read_s or self.read_timeout_s
        budget = read_s + REQUEST_GRACE_S
        scope = trio.CancelScope()

        async def start_clock() -> None:
            scope.deadline = trio.current_time() + budget

        cause = "deadline"
        with scope:
            try:
                return await self._http.request(
                    self._origin, method, target, headers, body, cap, start_clock, read_s
                )
            except ResponseTooLarge:
                cause = ""
            except (HttpTransportError, OSError) as exc:
                cause = type(exc).__name__
        # Raised outside the handler so no ``__context__`` links to the failure (an
        # OSError's text may name the host; the token is in the request's path).
        if not cause:
            raise TelegramResponseError()
        raise TelegramNetworkError(cause)


# ------------------------------------------------ what the callers make of a failure

log = logging.getLogger("prismd.telegram")
_E = TypeVar("_E")
_R = TypeVar("_R")

STATES = (
    "idle",
    "starting",
    "standby",
    "polling",
    "serving",
    "backoff",
    "rate_limited",
    "conflict",
    "unauthorized",
    "webhook_active",
    "stopped",
)
FATAL_STATES = frozenset({"unauthorized", "webhook_active"})
"""States that say why the adapter stopped: they stay visible after ``run`` ends."""


def log_retry(
    connection_id: str, method: str, error: TelegramError, delay_s: float, attempt: int
) -> None:
    """One WARNING per retried call: cause class, delay and attempt (never a URL or text)."""
    log.warning(
        "telegram %s: %s failed: %s; retry in %.1f s (attempt %d)",
        connection_id,
        method,
        describe_failure(error),
        delay_s,
        attempt,
    )


@attrs.define(eq=False)
class ReceiverStatus:
    """``state`` for ``health()`` (one of :data:`STATES`), and the count of consecutive
    failed receiving calls behind the "reachable again" line. Shared by the poller, the
    webhook server and the update handler of one adapter."""

    connection_id: str
    state: str = "idle"
    failed_calls: int = 0
    activity: Activity = attrs.field(factory=Activity)
    """When an update last reached the adapter (polled, posted or from the inbox), and the
    last failed receiving call's cause class."""

    def health_fields(self) -> Mapping[str, str]:
        return self.activity.health_fields()

    def seeing(self, admit: Callable[[_E], Awaitable[_R]]) -> Callable[[_E], Awaitable[_R]]:
        return self.activity.seeing(admit)

    def _note_error(self, cause: str) -> None:
        self.activity.note_error(cause)

    def fatal(self, error: TelegramError) -> AdapterFatalError | None:
        """The fatal error for 401/403 or an unusable credential (state ``unauthorized``),
        else ``None``."""
        if isinstance(error, TelegramCredentialError) or (
            isinstance(error, TelegramApiError) and error.status in (401, 403)
        ):
            self.state = "unauthorized"
            self._note_error(REJECTED_TOKEN)
            return AdapterFatalError(REJECTED_TOKEN)
        return None

    def log_retry(self, method: str, error: TelegramError, delay_s: float) -> None:
        """A retried receiving call (counts towards :meth:`log_reachable`)."""
        self.failed_calls += 1
        self._note_error(describe_failure(error))
        log_retry(self.connection_id, method, error, delay_s, self.failed_calls)

    def log_reachable(self) -> None:
        """After failed calls: one INFO line that the Bot API answers again (a reconnect)."""
        if self.failed_calls:
            log.info(
                "telegram %s: Bot API reachable again after %d failed call(s)",
                self.connection_id,
                self.failed_calls,
            )
            self.failed_calls = 0

    def stopped(self) -> None:
        if self.state not in FATAL_STATES:
            self.state = "stopped"
