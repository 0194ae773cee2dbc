"""A small Bot API client: ``POST <origin>/bot<token>/<method>`` with bounded, fixed-text errors.

Guarantees (contract §11.2):

* The token is read from the credential source on every request and appears only in the
  request URL; no exception raised here carries a URL, a token, a response body or a
  platform description. Every message is fixed text; callers branch on attributes.
* Redirects are never followed (``follow_redirects=False``: a 3xx is an API error).
* Response bodies are read with a byte cap; an oversized or non-JSON body is a
  :class:`TelegramResponseError` (the request may have been processed).
* httpx logs each request URL at INFO, and Telegram URLs carry the token: importing this
  module raises the ``httpx``/``httpcore`` loggers to WARNING and installs a filter that
  drops any of their records mentioning a bot path, whatever level a host later sets.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import httpx
import trio

from ..toolkit import is_loopback_host

DEFAULT_API_ORIGIN = "https://api.telegram.org"
DEFAULT_MAX_RESPONSE_BYTES = 128 * 1024
MAX_CONNECTIONS = 4
"""Requests in flight per client, and the keep-alive connections its pool keeps: httpcore
checks every idle connection (a ``poll`` each) before each request, so the twenty idle
connections twenty concurrent sends left cost twenty system calls per request (8 still cost
7.9% of the daemon's samples, 4 under 1%). Four carry Telegram's ~30 messages a second at
up to ~130 ms a request; a request waiting for one has not left (it waits outside its
deadline)."""
REQUEST_GRACE_S = 30.0
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

    ``cause`` names the class of the failure for logs: the httpx/OS exception type
    (``ConnectError``, ``ReadTimeout``…) or ``deadline`` when the whole request ran out of
    time. A type name never carries the URL (whose text has the token).
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
_JSON_TYPE = (b"Content-Type", b"application/json")


@attrs.define(eq=False)
class TelegramApi:
    """One long-lived httpx connection pool per client; ``call`` returns ``result`` of a
    successful envelope.

    The pool is httpx's own transport (:class:`httpx.AsyncHTTPTransport`, keep-alive), or
    the injected ``transport`` (tests: :class:`httpx.MockTransport`, a loopback fake).
    Requests go to it directly: the :class:`httpx.AsyncClient` layers above it (URL
    merging, cookies, auth, redirects, event hooks) do nothing a Bot API call wants —
    redirects are never followed and no cookie is kept. What can be built once is: the
    URL of each method (per token value), the headers, the timeouts. A body is read as
    bytes under its cap and decoded once.

    ``read_timeout_s`` must exceed the long-poll timeout so a quiet poll ends by Telegram's
    empty answer, not by our timeout.
    """

    token: Callable[[], str]
    api_origin: str = DEFAULT_API_ORIGIN
    transport: httpx.AsyncBaseTransport | None = None
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES
    read_timeout_s: float = 60.0
    _pool: httpx.AsyncBaseTransport | None = attrs.field(default=None, init=False)
    _token_seen: str | None = attrs.field(default=None, init=False, repr=False)
    _urls: dict[str, httpx.URL] = attrs.field(factory=dict, init=False, repr=False)
    _host: tuple[bytes, bytes] = attrs.field(init=False, repr=False)
    _timeouts: dict[float, dict[str, float | None]] = attrs.field(factory=dict, init=False)
    _slots: trio.Semaphore = attrs.field(factory=lambda: trio.Semaphore(MAX_CONNECTIONS))

    def __attrs_post_init__(self) -> None:
        self._host = (b"Host", httpx.URL(self.api_origin).netloc)

    def _transport(self) -> httpx.AsyncBaseTransport:
        if self._pool is None:
            self._pool = (
                self.transport
                if self.transport is not None
                else httpx.AsyncHTTPTransport(
                    trust_env=False,
                    retries=0,
                    limits=httpx.Limits(
                        max_connections=MAX_CONNECTIONS,
                        max_keepalive_connections=MAX_CONNECTIONS,
                    ),
                )
            )
        return self._pool

    async def aclose(self) -> None:
        if self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.aclose()

    def _token(self) -> str:
        try:
            token = self.token()
        except Exception:
            raise TelegramCredentialError() from None
        if token is self._token_seen:
            return token
        if not isinstance(token, str) or not _TOKEN_RE.fullmatch(token):
            raise TelegramCredentialError()
        # A new token value (rotated): every URL is rebuilt with it.
        self._token_seen = token
        self._urls.clear()
        return token

    def _url(self, path: str) -> httpx.URL:
        """``<origin>/bot<token>/<path>`` (``path`` may start with ``file/``: then
        ``<origin>/file/bot<token>/…``), built once per token value."""
        token = self._token()
        url = self._urls.get(path)
        if url is None:
            if path.startswith("file/"):
                url = httpx.URL(f"{self.api_origin}/file/bot{token}/{path[5:]}")
            else:
                url = httpx.URL(f"{self.api_origin}/bot{token}/{path}")
            if len(self._urls) < 64:  # methods are few; file paths are not kept forever
                self._urls[path] = url
        return url

    def _timeout(self, read_s: float) -> dict[str, float | None]:
        timeout = self._timeouts.get(read_s)
        if timeout is None:
            timeout = self._timeouts[read_s] = httpx.Timeout(10.0, read=read_s).as_dict()
        return timeout

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
        url = self._url(method)
        read_s = self.read_timeout_s if read_timeout_s is None else read_timeout_s
        extensions = {"timeout": self._timeout(read_s)}
        if files is not None:
            request = httpx.Request(
                "POST",
                url,
                headers=[_USER_AGENT, _ACCEPT],
                data={k: str(v) for k, v in (params or {}).items()},
                files=dict(files),
                extensions=extensions,
            )
        else:
            body = _JSON_DUMPS(params or {}).encode("utf-8")
            request = httpx.Request(
                "POST",
                url,
                headers=[
                    self._host,
                    _USER_AGENT,
                    _ACCEPT,
                    _JSON_TYPE,
                    (b"Content-Length", str(len(body)).encode("ascii")),
                ],
                stream=httpx.ByteStream(body),
                extensions=extensions,
            )
        cap = self.max_response_bytes if max_response_bytes is None else max_response_bytes
        status, headers, body = await self._request(request, read_s, cap)
        try:
            envelope = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: absurdly deep nesting
            envelope = None
        if not isinstance(envelope, dict):
            if 200 <= status < 300:
                raise TelegramResponseError()
            raise TelegramApiError(
                status, retry_after=_positive_int(headers.get("retry-after")), enveloped=False
            )
        if envelope.get("ok") is True and 200 <= status < 300:
            return envelope.get("result")
        parameters = envelope.get("parameters")
        parameters = parameters if isinstance(parameters, dict) else {}
        code = envelope.get("error_code")
        error_status = code if isinstance(code, int) and not isinstance(code, bool) else status
        retry_after = _positive_int(parameters.get("retry_after"))
        if retry_after is None:
            retry_after = _positive_int(headers.get("retry-after"))
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
        url = httpx.URL(f"{self.api_origin}/file/bot{token}/{file_path}")
        request = httpx.Request(
            "GET",
            url,
            headers=[self._host, _USER_AGENT],
            extensions={"timeout": self._timeout(self.read_timeout_s)},
        )
        try:
            status, _headers, body = await self._request(request, self.read_timeout_s, max_bytes)
        except TelegramResponseError:
            return None
        if not 200 <= status < 300:
            return None
        return body

    async def _request(
        self, request: httpx.Request, read_s: float, cap: int
    ) -> tuple[int, httpx.Headers, bytes]:
        # A free connection first (see MAX_CONNECTIONS): waiting for it sends nothing.
        # Taken without a trip through the scheduler when one is free (Semaphore.acquire
        # always yields once): the exchange itself yields soon enough, and a cancellation
        # is noticed there (it raises before anything is sent).
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            await self._slots.acquire()
        try:
            return await self._exchange(request, read_s, cap)
        finally:
            self._slots.release()

    async def _exchange(
        self, request: httpx.Request, read_s: float, cap: int
    ) -> tuple[int, httpx.Headers, bytes]:
        # httpx bounds each read, not the whole exchange: a server dripping a byte now and
        # then would hold the call forever. The whole request gets its read budget + 30 s.
        cause = "deadline"
        with trio.move_on_after((read_s or self.read_timeout_s) + REQUEST_GRACE_S):
            try:
                response = await self._transport().handle_async_request(request)
                try:
                    length = _positive_int(response.headers.get("content-length"))
                    if length is not None and length > cap:
                        raise TelegramResponseError()
                    body = await _read_capped(response.stream, cap)  # type: ignore[arg-type]
                finally:
                    await response.aclose()
                return response.status_code, response.headers, body
            except TelegramError:
                raise
            except (httpx.HTTPError, OSError) as exc:
                cause = type(exc).__name__
        # Raised outside the handler so no ``__context__`` links to the httpx exception,
        # whose message carries the request URL and therefore the token.
        raise TelegramNetworkError(cause)


async def _read_capped(stream: httpx.AsyncByteStream, cap: int) -> bytes:
    """The whole body, or :class:`TelegramResponseError` once it exceeds ``cap`` bytes."""
    first = b""
    chunks: list[bytes] | None = None
    size = 0
    async for chunk in stream:
        size += len(chunk)
        if size > cap:
            raise TelegramResponseError()
        if chunks is not None:
            chunks.append(chunk)
        elif first:
            chunks = [first, chunk]
        else:
            first = chunk
    return first if chunks is None else b"".join(chunks)
