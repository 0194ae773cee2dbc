"""The A2A client's unary JSON-RPC calls (send, get, cancel, list) over the toolkit's
HTTP/1.1 client (:class:`~adapters.toolkit.Http11`): keep-alive connections, one write a
request, about a tenth of httpx's CPU a call — a followed task is read by ``GetTask`` again
and again. The card and the streams stay on httpx and httpx-sse (:mod:`._client`).

Time: a request waits at most ``timeout_s`` for a connection before it is written (a free
slot among :data:`RPC_CONNECTIONS`, a connection opened within the toolkit's connect
timeout), else it is :class:`~._errors.Refused` — nothing was sent; once written, each read
of the answer gets ``timeout_s`` (else :class:`~._errors.OutcomeUnknown`). The answer is
read up to :data:`MAX_ANSWER_BYTES`. ``https`` is verified against the system's CA store.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import attrs
import httpx
import trio

from adapters.toolkit import (
    Header,
    Http11,
    HttpTransportError,
    Origin,
    ReadTimeout,
    ResponseTooLarge,
)

from ._errors import A2AError, OutcomeUnknown, Refused

RPC_CONNECTIONS = 128
"""Unary calls in flight at once per client (the follower's polls, the runs' calls); a call
beyond waits for one, within its ``timeout_s``."""
MAX_ANSWER_BYTES = 64 * 1024 * 1024
"""The largest answer read (a task's artifacts may carry files inline, base64)."""

Answer = tuple[int, Mapping[str, str], bytes]
"""Status, headers (lower-case names), body."""


@attrs.frozen
class Endpoint:
    """Where a unary call goes: the URL, its origin and request target (parsed once)."""

    url: str
    origin: Origin
    target: bytes

    @classmethod
    def of(cls, url: str) -> Endpoint:
        parsed = httpx.URL(url)
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        host = parsed.raw_host.decode("ascii")
        return cls(url, Origin(parsed.scheme, host, port), parsed.raw_path or b"/")


def same_origin(a: httpx.URL, b: httpx.URL) -> bool:
    return (a.scheme, a.host, a.port) == (b.scheme, b.host, b.port)


@attrs.define(eq=False)
class Unary:
    """The unary calls of one client over ``rpc`` (shared or its own)."""

    rpc: Http11
    timeout_s: float
    _endpoint: Endpoint | None = None
    """The last URL posted to, parsed."""

    async def post(
        self, url: str, headers: list[Header], data: bytes, wait_s: float | None = None
    ) -> tuple[str, *Answer]:
        """POST ``data`` to ``url``, following a same-origin 307/308 once: the URL answered
        at and the answer. Errors classified (:class:`Refused`, :class:`OutcomeUnknown`).
        ``wait_s`` (else ``timeout_s``) bounds each read of the answer."""
        endpoint = self._endpoint
        if endpoint is None or endpoint.url != url:
            endpoint = self._endpoint = Endpoint.of(url)
        for _hop in range(2):
            status, answer_headers, body = await self._exchange(endpoint, headers, data, wait_s)
            if status in (307, 308):
                location = answer_headers.get("location")
                if location is None:
                    raise Refused("redirect")
                target = httpx.URL(endpoint.url)
                try:
                    moved = target.join(location)
                    if not same_origin(moved, target):
                        raise Refused("redirect")
                    endpoint = Endpoint.of(str(moved))
                except (httpx.InvalidURL, ValueError):
                    raise Refused("redirect") from None  # a Location that is no URL
                continue
            self._endpoint = endpoint
            return endpoint.url, status, answer_headers, body
        raise Refused("redirect")

    async def _exchange(
        self, endpoint: Endpoint, headers: list[Header], data: bytes, wait_s: float | None
    ) -> Answer:
        """One request and its answer. Not written within ``timeout_s`` (no connection free,
        or none could be opened): :class:`Refused`; written, then no complete answer:
        :class:`OutcomeUnknown`."""
        sent = False
        failure: A2AError | None = None
        with trio.CancelScope(deadline=trio.current_time() + self.timeout_s) as before_sent:

            async def ready() -> None:
                nonlocal sent
                sent = True
                before_sent.deadline = math.inf  # written now: each read is bounded instead

            try:
                return await self.rpc.request(
                    endpoint.origin,
                    b"POST",
                    endpoint.target,
                    headers,
                    data,
                    MAX_ANSWER_BYTES,
                    ready,
                    self.timeout_s if wait_s is None else wait_s,
                )
            except ReadTimeout:
                failure = OutcomeUnknown("timeout")
            except HttpTransportError:
                # Before a connection was ours: not opened (refused, unreachable, not
                # within the toolkit's connect timeout).
                failure = OutcomeUnknown("transport") if sent else Refused("connect")
            except ResponseTooLarge:
                failure = OutcomeUnknown("too_large")
        raise failure or Refused("connect")  # None: no connection within timeout_s
