"""A small A2A client: dicts in, :mod:`._wire` records out. Its unary JSON-RPC calls
(send, get, cancel, list) go over the toolkit's HTTP/1.1 client (:class:`~adapters.toolkit.Http11`:
keep-alive, one write a request, about a tenth of httpx's CPU a call — a followed task is
read by ``GetTask`` again and again); the card and the streams over httpx and httpx-sse.

It speaks JSON-RPC in both dialects and tells the three ways a call can go wrong apart,
because a send must never be repeated when it may have landed:

* :class:`Refused` — definitely not processed: the connection was refused or timed out
  before it was made, a 429/503 (``retry_after`` from ``Retry-After`` when given), or a
  307/308 to another origin. Safe to make again later.
* :class:`OutcomeUnknown` — the request went out and no answer came (a timeout, a cut
  connection, a 5xx from a proxy). A send that ends so is never made again.
* :class:`RemoteError` — the peer answered with an error (a JSON-RPC ``code``, or an HTTP
  status). Definite too; whether it is worth retrying depends on the code.

A unary call's connection is opened within :data:`~adapters.toolkit.Http11`'s connect
timeout, and the request waits at most ``timeout_s`` for a connection before it is
written (then it is :class:`Refused`); each read of the answer within ``timeout_s``
(then :class:`OutcomeUnknown`), the answer at most :data:`MAX_ANSWER_BYTES`.

A v1.0 call answered -32601 (method not found) is made again once as a whole v0.3
request, and the client speaks v0.3 from then on (:attr:`A2AClient.dialect`). A 307/308 to
the same origin (a missing trailing slash) is followed once and remembered. Nothing the
peer sends reaches an exception message or a log: only codes and statuses.
"""

from __future__ import annotations

import contextlib
import email.utils
import itertools
import json
import math
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping
from typing import Any

import attrs
import httpx
import httpx_sse
import trio

from adapters.toolkit import Header, Http11, is_loopback_host

from ._errors import A2AError as A2AError
from ._errors import CardError as CardError
from ._errors import OutcomeUnknown as OutcomeUnknown
from ._errors import Refused as Refused
from ._errors import RemoteError as RemoteError
from ._unary import RPC_CONNECTIONS, Unary
from ._wire import (
    METHOD_NOT_FOUND,
    METHODS,
    AgentCard,
    Dialect,
    Message,
    Observation,
    PushConfig,
    Task,
    envelope,
    read_card,
    read_observation,
    read_task,
    send_params,
    task_params,
)

CARD_PATHS = ("/.well-known/agent-card.json", "/.well-known/agent.json")


def check_url(url: str, what: str) -> httpx.URL:
    """``https://``, or ``http://`` for a loopback host only; raises :class:`CardError`."""
    try:
        parsed = httpx.URL(url)
    except Exception as exc:
        raise CardError(f"{what} is not a URL") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise CardError(f"{what} must be an http(s) URL")
    if parsed.scheme == "http" and not is_loopback_host(parsed.host):
        raise CardError(f"{what}: http:// is accepted only for loopback hosts")
    if parsed.userinfo:
        raise CardError(f"{what} must not carry credentials")
    return parsed


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta seconds or an HTTP date), or ``None``."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # "²" is a digit to str.isdigit, not to float
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when is None:
        return None
    delta = when.timestamp() - (time.time() if now is None else now)
    return max(0.0, delta) if math.isfinite(delta) else None


class _Body(httpx.AsyncByteStream):
    """A request body sent without an async generator. httpx's own ``ByteStream`` yields its
    bytes from one, and a request cancelled while it is being sent (a poll cut by
    ``/cancel`` or a stop) leaves that generator to the garbage collector, which Trio
    reports as a ``ResourceWarning``."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def __aiter__(self) -> AsyncIterator[bytes]:
        return _Once(self._data)


class _Once:
    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data

    def __aiter__(self) -> _Once:
        return self

    async def __anext__(self) -> bytes:
        if self._data is None:
            raise StopAsyncIteration
        data, self._data = self._data, None
        return data


def json_request(
    http: httpx.AsyncClient,
    url: str,
    body: Mapping[str, Any],
    headers: Mapping[str, str],
    timeout: float | httpx.Timeout,
) -> httpx.Request:
    """A JSON-RPC POST whose body is a :class:`_Body` (its ``Content-Length`` set)."""
    data = json.dumps(body).encode()
    request = http.build_request("POST", url, content=data, headers=headers, timeout=timeout)
    request.stream = _Body(data)
    return request


def _new_tag() -> str:
    return secrets.token_hex(4)


@attrs.define(eq=False)
class A2AClient:
    """One remote agent's JSON-RPC interface. ``http`` (the card, streams) is shared and
    never mutated; ``rpc`` carries the unary calls — the caller's, else the client's own
    (:meth:`aclose`). Request ids are ``prismd-<tag>-<n>``, ``tag`` random per client: the
    ids of several instances calling one peer never meet (its records tell who asked)."""

    http: httpx.AsyncClient
    card: AgentCard
    bearer: str | None = attrs.field(default=None, repr=False)
    timeout_s: float = 30.0
    dialect: Dialect = attrs.field(default=None)
    url: str = attrs.field(default=None)
    rpc: Http11 | None = attrs.field(default=None, repr=False)
    tag: str = attrs.field(factory=_new_tag)
    _ids: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1))
    _own_rpc: bool = attrs.field(default=False, init=False)
    _unary: Unary = attrs.field(init=False, repr=False)
    _rpc_headers: dict[Dialect, list[Header]] = attrs.field(factory=dict, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.dialect is None:
            self.dialect = self.card.dialect
        if self.url is None:
            self.url = self.card.url
        check_url(self.url, "the card's interface URL")
        if self.rpc is None:
            self.rpc = Http11(max_connections=RPC_CONNECTIONS)
            self._own_rpc = True
        self._unary = Unary(self.rpc, self.timeout_s)

    async def aclose(self) -> None:
        """Close the connections of the client's own ``rpc`` (not a caller's)."""
        if self._own_rpc and self.rpc is not None:
            await self.rpc.aclose()

    # ------------------------------------------------------------------ discovery

    @classmethod
    async def discover(
        cls,
        http: httpx.AsyncClient,
        *,
        url: str | None = None,
        card_url: str | None = None,
        bearer: str | None = None,
        protocol: str = "auto",
        timeout_s: float = 30.0,
        rpc: Http11 | None = None,
    ) -> A2AClient:
        """Fetch the card (``card_url``, else ``<url>/.well-known/agent-card.json`` and then
        ``agent.json``) and build a client for its JSON-RPC interface. ``protocol`` other
        than ``"auto"`` overrides the card's dialect. Raises :class:`CardError`,
        :class:`Refused` (the peer is down) or :class:`OutcomeUnknown`."""
        raw = await fetch_card(http, url=url, card_url=card_url, bearer=bearer, timeout_s=timeout_s)
        card = read_card(raw)
        if card is None:
            raise CardError("the card offers no JSON-RPC interface")
        if protocol == "1.0":
            card = attrs.evolve(card, dialect="1.0")
        elif protocol == "0.3":
            card = attrs.evolve(card, dialect="0.3")
        return cls(http, card, bearer, timeout_s, rpc=rpc)

    # ------------------------------------------------------------------ calls

    def _headers(self, dialect: Dialect, *, stream: bool = False) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        headers["Accept"] = "text/event-stream" if stream else "application/json"
        if dialect == "1.0":
            headers["A2A-Version"] = "1.0"
        if self.bearer:
            headers["Authorization"] = f"Bearer {self.bearer}"
        return headers

    def _unary_headers(self, dialect: Dialect) -> list[Header]:
        headers = self._rpc_headers.get(dialect)
        if headers is None:
            headers = [
                (name.encode("latin-1"), value.encode("latin-1"))
                for name, value in self._headers(dialect).items()
            ]
            self._rpc_headers[dialect] = headers
        return headers

    async def _post(
        self, body: Mapping[str, Any], dialect: Dialect, wait_s: float | None = None
    ) -> tuple[int, Mapping[str, str], bytes]:
        """One POST to :attr:`url`, following a same-origin 307/308 once (then the URL
        moved to); errors classified. ``wait_s`` (else ``timeout_s``) bounds each read."""
        url, status, headers, raw = await self._unary.post(
            self.url, self._unary_headers(dialect), json.dumps(body).encode(), wait_s
        )
        if url != self.url:
            self.url = url
        return status, headers, raw

    async def _call(
        self,
        name: str,
        params: Callable[[Dialect], Mapping[str, Any]],
        wait_s: float | None = None,
    ) -> Any:
        """The JSON-RPC ``result`` of ``name`` (a key of :data:`METHODS`). A read (or the
        idempotent cancel) cut at the transport — a pooled connection the peer had just
        closed — is made once more at once; a send never is."""
        if name == "send":
            return await self._call_once(name, params, wait_s)
        try:
            return await self._call_once(name, params)
        except OutcomeUnknown as exc:
            if exc.reason != "transport":
                raise
            return await self._call_once(name, params)

    def _next_id(self) -> str:
        return f"prismd-{self.tag}-{next(self._ids)}"

    async def _call_once(
        self,
        name: str,
        params: Callable[[Dialect], Mapping[str, Any]],
        wait_s: float | None = None,
    ) -> Any:
        dialect = self.dialect
        for _attempt in range(2):
            method = METHODS[dialect].get(name)
            if method is None:
                raise RemoteError(METHOD_NOT_FOUND)
            body = envelope(method, params(dialect), self._next_id())
            status, headers, raw = await self._post(body, dialect, wait_s)
            try:
                answer = json.loads(raw)
            except (ValueError, RecursionError):
                answer = None
            if status in (429, 503):
                raise Refused(f"http_{status}", retry_after_s(headers.get("retry-after")))
            error = answer.get("error") if isinstance(answer, Mapping) else None
            if isinstance(error, Mapping):
                code = error.get("code")
                code = code if isinstance(code, int) else None
                if code == METHOD_NOT_FOUND and dialect == "1.0":
                    dialect = "0.3"
                    continue
                raise RemoteError(code, status)
            if status >= 500:
                raise OutcomeUnknown(f"http_{status}")
            if status >= 300 or not isinstance(answer, Mapping):
                raise RemoteError(None, status)
            if "result" not in answer:
                raise OutcomeUnknown("no_result")
            if dialect != self.dialect:
                self.dialect = dialect
            return answer["result"]
        raise RemoteError(METHOD_NOT_FOUND)

    async def send(
        self,
        *,
        message_id: str,
        text: str,
        context_id: str | None = None,
        task_id: str | None = None,
        push: PushConfig | None = None,
        wait_s: float | None = None,
    ) -> Task | Message:
        """Send one user message asking for immediate acceptance; the task or the answer.
        ``wait_s`` (else ``timeout_s``) bounds the wait for the answer: a peer that ignores
        immediate acceptance answers when the task is over (``reference`` §2: LangGraph).

        Raises :class:`Refused` (make it again later), :class:`OutcomeUnknown` (never make
        it again for this ``message_id``) or :class:`RemoteError`.
        """
        tenant = self.card.tenant
        result = await self._call(
            "send",
            lambda d: send_params(
                d,
                message_id=message_id,
                text=text,
                context_id=context_id,
                task_id=task_id,
                push=push,
                tenant=tenant,
            ),
            wait_s,
        )
        observed = read_observation(result)
        if not isinstance(observed, Task | Message):
            raise OutcomeUnknown("unreadable")
        return observed

    async def get_task(self, task_id: str) -> Task:
        """``GetTask`` / ``tasks/get``. -32001 (task lost) arrives as :class:`RemoteError`."""
        tenant = self.card.tenant
        result = await self._call("get", lambda d: task_params(d, task_id, tenant))
        task = read_task(result)
        if task is None:
            # Wrapped as a send's result (``{"task": …}``) by a peer that answers both alike.
            wrapped = read_observation(result)
            task = wrapped if isinstance(wrapped, Task) else None
        if task is None:
            raise OutcomeUnknown("unreadable")
        return task

    async def cancel_task(self, task_id: str) -> Task | None:
        """``CancelTask`` / ``tasks/cancel`` (idempotent); the task as the peer answered."""
        tenant = self.card.tenant
        result = await self._call("cancel", lambda d: task_params(d, task_id, tenant))
        return read_task(result)

    async def list_tasks(
        self,
        *,
        context_id: str | None = None,
        status_timestamp_after: str | None = None,
        page_size: int = 50,
        history_length: int | None = None,
        page_token: str | None = None,
    ) -> tuple[tuple[Task, ...], str | None]:
        """One page of v1.0 ``ListTasks`` (newest first) and the next page's token (``None``
        on the last); v0.3 has none: RemoteError -32601.
        ``history_length`` unset: the server's default (a2a-sdk: the whole history; n is
        the *last* n messages, and the user's message is the first)."""
        if self.dialect != "1.0":
            raise RemoteError(METHOD_NOT_FOUND)

        params = {
            "pageSize": page_size,
            "historyLength": history_length,
            "pageToken": page_token,
            "contextId": context_id,
            "statusTimestampAfter": status_timestamp_after,
            "tenant": self.card.tenant,
        }
        given = {name: value for name, value in params.items() if value is not None}
        result = await self._call("list", lambda _d: given)
        raw = result.get("tasks") if isinstance(result, Mapping) else None
        tasks = [read_task(t) for t in raw] if isinstance(raw, list) else []
        token = result.get("nextPageToken") if isinstance(result, Mapping) else None
        return tuple(t for t in tasks if t is not None), token if token else None

    async def subscribe(
        self,
        task_id: str,
        on_item: Callable[[Observation], bool],
        *,
        idle_s: float = 60.0,
        after_item: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Stream a task's events (``SubscribeToTask`` / ``tasks/resubscribe``) into
        ``on_item`` until the peer closes the stream, ``on_item`` answers ``True`` (enough),
        or ``idle_s`` without an event (comments do not count). ``after_item`` is awaited
        after each event, before the next is read (the caller's writes, in order with the
        stream). Raises the client's errors (an unsupported or finished stream:
        :class:`RemoteError`).

        A callback rather than an async iterator: the stream is ended by cancelling its own
        scope, so httpx's and httpx-sse's generators always run to their end (an iterator
        left half-read by its consumer would leave them to the garbage collector).
        """
        dialect = self.dialect
        method = METHODS[dialect]["subscribe"]
        body = envelope(method, task_params(dialect, task_id, self.card.tenant), self._next_id())
        timeout = httpx.Timeout(self.timeout_s, read=idle_s)
        failure: A2AError | None = None
        with _classified(), trio.CancelScope() as scope:
            request = json_request(
                self.http, self.url, body, self._headers(dialect, stream=True), timeout
            )
            request.headers["Cache-Control"] = "no-store"
            response = await self.http.send(request, stream=True)
            async with contextlib.aclosing(response):
                source = httpx_sse.EventSource(response)
                if response.status_code in (429, 503):
                    raise Refused(
                        f"http_{response.status_code}",
                        retry_after_s(response.headers.get("retry-after")),
                    )
                kind = response.headers.get("content-type", "")
                if "text/event-stream" not in kind:
                    await response.aread()
                    raise RemoteError(_error_code(response), response.status_code)
                # Silence is measured from the last event with data: SSE comments
                # (keep-alives) reset httpx's read timeout but say nothing about the task
                # (and once the peer sent an ``id:``, httpx-sse yields each comment's blank
                # line as an event without data).
                scope.deadline = trio.current_time() + idle_s
                async for event in source.aiter_sse():
                    if scope.cancel_called or not event.data:
                        continue
                    scope.deadline = trio.current_time() + idle_s
                    failure, enough = _stream_item(event.data, on_item)
                    if after_item is not None:
                        await after_item()
                    if failure is not None or enough:
                        scope.cancel()
        if failure is not None:
            raise failure


async def fetch_card(
    http: httpx.AsyncClient,
    *,
    url: str | None,
    card_url: str | None,
    bearer: str | None,
    timeout_s: float,
) -> object:
    """The card's JSON (``card_url``, else ``<url>/.well-known/agent-card.json`` and then
    ``agent.json``: the legacy path is tried when the first gives no JSON card — not found,
    another error status, or a 200 that is not JSON). Raises :class:`CardError`,
    :class:`Refused` or :class:`OutcomeUnknown`."""
    if card_url is not None:
        candidates = [card_url]
    elif url is not None:
        base = url.rstrip("/")
        candidates = [base + path for path in CARD_PATHS]
    else:
        raise CardError("neither url nor card_url")
    for candidate in candidates:
        check_url(candidate, "the card URL")
    for candidate in candidates:
        response = await _get(http, candidate, bearer, timeout_s)
        if response.status_code in (429, 503):
            raise Refused(
                f"http_{response.status_code}",
                retry_after_s(response.headers.get("retry-after")),
            )
        last = candidate is candidates[-1]
        if response.status_code != 200:
            if not last:
                continue  # not there (404, or a 401/405/500 for a path it does not serve)
            raise CardError(f"the card could not be fetched (HTTP {response.status_code})")
        try:
            return response.json()
        except ValueError as exc:
            if not last:
                continue  # a catch-all page (a web app's 200 HTML) where no card is
            raise CardError("the card is not JSON") from exc
    raise CardError("the card could not be fetched")


def _stream_item(data: str, on_item: Callable[[Observation], bool]) -> tuple[A2AError | None, bool]:
    """One SSE frame: (an error the stream carried, whether the consumer has enough)."""
    try:
        frame = json.loads(data)
    except ValueError:
        return None, False
    if not isinstance(frame, Mapping):
        return None, False
    error = frame.get("error")
    if isinstance(error, Mapping):
        code = error.get("code")
        return RemoteError(code if isinstance(code, int) else None), False
    observed = read_observation(frame.get("result"))
    return None, observed is not None and on_item(observed)


def _error_code(response: httpx.Response) -> int | None:
    try:
        answer = response.json()
    except ValueError:
        return None
    error = answer.get("error") if isinstance(answer, Mapping) else None
    code = error.get("code") if isinstance(error, Mapping) else None
    return code if isinstance(code, int) else None


async def _get(
    http: httpx.AsyncClient, url: str, bearer: str | None, timeout_s: float
) -> httpx.Response:
    headers = {"Accept": "application/json"}
    if bearer:
        headers["Authorization"] = f"Bearer {bearer}"
    with _classified():
        response = await http.get(url, headers=headers, timeout=timeout_s)
    return response


@contextlib.contextmanager
def _classified() -> Iterator[None]:
    """httpx's failures as the client's: no connection → :class:`Refused`; a timeout or a
    broken transport after → :class:`OutcomeUnknown`."""
    try:
        yield
    except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
        raise Refused("connect") from exc
    except httpx.TimeoutException as exc:
        raise OutcomeUnknown("timeout") from exc
    except httpx.TransportError as exc:
        raise OutcomeUnknown("transport") from exc
