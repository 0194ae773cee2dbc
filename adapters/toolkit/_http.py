"""The HTTP/1.1 server pieces (h11 over Trio) shared by the web chat, the Telegram webhook and
the ``/metrics`` endpoint: one bounded request-head reader, one bounded body reader, one
responder.

Guarantees of :func:`read_request_head`:

* the whole head (request line and headers) must arrive within ``timeout_s``, counted from
  the first call, not per read, so a client dripping a byte now and then cannot hold the
  connection (slowloris): a partly received head is answered **408**; a connection that sent
  nothing is closed silently (an idle keep-alive connection, a browser's preconnect), or
  answered 408 too with ``answer_silence=True`` (the web chat's choice);
* a head larger than ``max_head_bytes`` is answered **431**, whether h11 saw it incomplete
  (its ``max_incomplete_event_size``) or it arrived whole in one read;
* anything h11 cannot parse is answered with h11's status hint, at least **400**;
* reads are at most :data:`READ_CHUNK` bytes, and nothing is buffered beyond what h11 holds.

:func:`read_body` bounds the body in size (**413**, also from ``Content-Length`` before
reading) and time (**408**), raising :class:`HttpError` with the status to answer.

:func:`respond` writes one response with fixed hardening headers (``Cache-Control:
no-store``, ``X-Content-Type-Options: nosniff``, ``Referrer-Policy: no-referrer``), an
``Allow`` header on 405, no body for ``HEAD``/204/304, and ``Connection: close`` unless told
to keep the connection; the write is bounded by :data:`SEND_TIMEOUT_S`.

A server closes each connection with :func:`adapters.toolkit.close_gracefully` (half-close,
read and discard for a bounded time), so an error answered before the request was read
whole — a 413 to a client still uploading, a 401 before the body — reaches the client
instead of a reset.

Routing stays with each server; by convention an unknown path is 404 and a known path with
another method is 405.

A receiver of POSTs (the Telegram webhook, the A2A push receiver) keeps its connections in
the two budgets of :func:`receiver_limiter` and answers each connection's requests with
:func:`serve_requests`: one keep-alive loop, back in :data:`PENDING` between requests.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

import attrs
import h11
import trio

from ._budgets import Budget, ConnectionLimiter, Slot
from ._streams import close_gracefully

__all__ = [
    "HEAD_TIMEOUT_S",
    "MAX_HEAD_BYTES",
    "PENDING",
    "READ_CHUNK",
    "RECEIVER_HEAD_TIMEOUT_S",
    "RECEIVER_IDLE_TIMEOUT_S",
    "SEND_TIMEOUT_S",
    "SERVING",
    "HttpError",
    "RequestHead",
    "read_body",
    "read_request_head",
    "receiver_limiter",
    "respond",
    "serve_requests",
    "server_connection",
]

MAX_HEAD_BYTES = 8 * 1024
"""Default bound on a request head (431 above it)."""
HEAD_TIMEOUT_S = 10.0
"""Default time for a whole request head to arrive (408 after it)."""
SEND_TIMEOUT_S = 10.0
"""A response that cannot be written in this time is abandoned (the caller closes)."""
READ_CHUNK = 4096

_TEXT = "text/plain; charset=utf-8"
_NO_BODY_STATUSES = frozenset({204, 304})


class HttpError(Exception):
    """A request we refuse; ``status`` is the code to answer with (fixed text only)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


@attrs.frozen
class RequestHead:
    """One parsed request head."""

    method: str
    path: str
    """The target's path, without the query."""
    query: Mapping[str, list[str]]
    headers: Mapping[str, str]
    """Lower-cased names; a repeated header keeps its last value (values decoded latin-1)."""
    raw: bytes = attrs.field(repr=False)
    """Every byte read from the stream while reading this head (the head, and whatever
    arrived with it): a protocol switch (the web chat's WebSocket upgrade) replays them."""
    authority: str | None = None
    """The ``host[:port]`` a target names itself (absolute-form ``http://host/path``, or a
    ``//host/path`` that parses the same): HTTP makes it the request's host in place of the
    ``Host`` header, so a server that checks ``Host`` checks this too. ``None`` for the
    usual origin-form ``/path``."""


def server_connection(max_head_bytes: int = MAX_HEAD_BYTES) -> h11.Connection:
    """An h11 server connection whose incomplete heads are bounded by ``max_head_bytes``."""
    return h11.Connection(h11.SERVER, max_incomplete_event_size=max_head_bytes)


async def read_request_head(
    stream: trio.abc.Stream,
    conn: h11.Connection,
    *,
    max_head_bytes: int = MAX_HEAD_BYTES,
    timeout_s: float = HEAD_TIMEOUT_S,
    answer_silence: bool = False,
) -> RequestHead | None:
    """The next request head on ``conn``, or ``None`` once the request was answered
    (400/408/431) or the peer closed or stayed silent; see the module docstring.

    ``conn`` may be a keep-alive connection after ``start_next_cycle()``: bytes h11 already
    holds count towards this head. Transport errors (``trio.BrokenResourceError``…) propagate.
    """
    buffered = len(conn.trailing_data[0])
    raw = bytearray()
    request: h11.Request | None = None
    with trio.move_on_after(timeout_s):
        try:
            while request is None:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(READ_CHUNK)
                    raw += data
                    conn.receive_data(bytes(data))  # b"" marks the end of the stream
                elif isinstance(event, h11.Request):
                    request = event
                else:
                    return None  # the peer closed (or paused) before a request
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint if exc.error_status_hint >= 400 else 400
            await respond(stream, conn, "GET", status, _reason_body(status))
            return None
    if request is None:
        if buffered or raw or answer_silence:
            await respond(stream, conn, "GET", 408, _reason_body(408))
        return None
    # h11 bounds only a head it has not seen whole; one that came in a single read is
    # measured here (what h11 still holds is not part of the head).
    if buffered + len(raw) - len(conn.trailing_data[0]) > max_head_bytes:
        await respond(stream, conn, "GET", 431, _reason_body(431))
        return None
    return _parse_head(request, bytes(raw))


async def read_body(
    stream: trio.abc.Stream,
    conn: h11.Connection,
    head: RequestHead,
    *,
    max_bytes: int,
    timeout_s: float = HEAD_TIMEOUT_S,
) -> bytes:
    """The request body, whole. Raises :class:`HttpError` 413 (over ``max_bytes``, declared
    or read), 408 (not complete within ``timeout_s``) or 400 (a broken chunked body)."""
    length = head.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > max_bytes:
        raise HttpError(413)
    chunks: list[bytes] = []
    size = 0
    with trio.move_on_after(timeout_s):
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    conn.receive_data(bytes(await stream.receive_some(READ_CHUNK)))
                elif isinstance(event, h11.Data):
                    size += len(event.data)
                    if size > max_bytes:
                        raise HttpError(413)
                    chunks.append(bytes(event.data))
                elif isinstance(event, h11.EndOfMessage):
                    return b"".join(chunks)
                else:
                    raise HttpError(400)  # the peer closed mid-body
        except h11.RemoteProtocolError:
            raise HttpError(400) from None
    raise HttpError(408)


async def respond(
    stream: trio.abc.Stream,
    conn: h11.Connection,
    method: str,
    status: int,
    body: bytes = b"",
    content_type: str = _TEXT,
    extra: Sequence[tuple[str, str]] | None = None,
    *,
    close: bool = True,
    allow: str = "GET, HEAD",
) -> None:
    """Write one response (see the module docstring); does nothing when h11 cannot answer
    in the connection's state. ``allow`` is the ``Allow`` header of a 405."""
    headers: list[tuple[str, str]] = []
    bodiless = status in _NO_BODY_STATUSES
    if not bodiless:
        headers += [("Content-Type", content_type), ("Content-Length", str(len(body)))]
    headers += [
        ("Cache-Control", "no-store"),
        ("X-Content-Type-Options", "nosniff"),
        ("Referrer-Policy", "no-referrer"),
    ]
    if close:
        headers.append(("Connection", "close"))
    headers += list(extra or ())
    if status == 405:
        headers.append(("Allow", allow))
    try:
        reason = HTTPStatus(status).phrase.encode("ascii")
        data = conn.send(h11.Response(status_code=status, headers=headers, reason=reason)) or b""
        if method != "HEAD" and not bodiless and body:
            data += conn.send(h11.Data(data=body)) or b""
        data += conn.send(h11.EndOfMessage()) or b""
    except h11.LocalProtocolError:
        return  # h11 cannot answer in this state; the caller closes
    with trio.move_on_after(SEND_TIMEOUT_S):
        await stream.send_all(data)


PENDING, SERVING = "pending", "serving"
"""A receiver's budgets (:func:`receiver_limiter`): connections in a request head or idle
between requests, and requests past the receiver's check."""
RECEIVER_HEAD_TIMEOUT_S = 30.0
"""A receiver's first request head must arrive within this time."""
RECEIVER_IDLE_TIMEOUT_S = 75.0
"""A kept-alive connection to a receiver must send its next request head within this time."""

Answer = Callable[
    [trio.SocketStream, h11.Connection, "RequestHead", Slot], Awaitable[tuple[int, bool]]
]
"""``answer(stream, conn, head, slot)`` → ``(status, close the connection)`` for one request
(it reads the body itself, and moves ``slot`` to :data:`SERVING` once the request passed
its check)."""


def receiver_limiter(
    label: str, *, max_pending: int, max_serving: int, serving: str, logger: logging.Logger
) -> ConnectionLimiter:
    """A receiver's two budgets: :data:`PENDING` (``max_pending``; when full the oldest gives
    way) and :data:`SERVING` (``max_serving`` requests past the receiver's check, described
    as ``serving`` in the log line; when full a newcomer is refused and stays pending)."""
    return ConnectionLimiter(
        label,
        {
            PENDING: Budget(max_pending, "evict", "connections in a request head"),
            SERVING: Budget(max_serving, "refuse", serving),
        },
        logger=logger,
    )


async def serve_requests(
    stream: trio.SocketStream,
    slot: Slot,
    answer: Answer,
    *,
    allow: str = "POST",
    max_head_bytes: int = MAX_HEAD_BYTES,
    head_timeout_s: float = RECEIVER_HEAD_TIMEOUT_S,
    idle_timeout_s: float = RECEIVER_IDLE_TIMEOUT_S,
    fatal: tuple[type[Exception], ...] = (),
) -> None:
    """A receiver's connection handler: answer its requests in turn, the first head within
    ``head_timeout_s``, each next one within ``idle_timeout_s``, each with the status
    ``answer`` returns (``allow`` is the ``Allow`` header of a 405); between requests
    ``slot`` is back in :data:`PENDING`. Ends when the peer closed or stayed silent, after an
    answer that closes the connection, or when a request was not read whole; then closes
    ``stream`` gracefully. One broken connection never takes the receiver down: its
    exception ends it and is not logged (no payload reaches a log), except those in
    ``fatal``, which propagate."""
    try:
        conn = server_connection(max_head_bytes)
        timeout = head_timeout_s
        while True:
            head = await read_request_head(
                stream, conn, max_head_bytes=max_head_bytes, timeout_s=timeout
            )
            if head is None:
                return
            status, close = await answer(stream, conn, head, slot)
            await respond(stream, conn, head.method, status, close=close, allow=allow)
            if close or conn.our_state is h11.MUST_CLOSE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()
            slot.move(PENDING)  # waiting for the next head: evictable again
            timeout = idle_timeout_s
    except fatal:
        raise
    except Exception:
        pass
    finally:
        await close_gracefully(stream)


def _reason_body(status: int) -> bytes:
    return HTTPStatus(status).phrase.lower().encode("ascii") + b"\n"


def _parse_head(request: h11.Request, raw: bytes) -> RequestHead:
    parts = urlsplit(request.target.decode("ascii", "replace"))
    headers = {
        name.decode("ascii", "replace").lower(): value.decode("latin-1")
        for name, value in request.headers
    }
    return RequestHead(
        method=request.method.decode("ascii", "replace"),
        path=parts.path,
        query=parse_qs(parts.query),
        headers=headers,
        raw=raw,
        authority=parts.netloc or None,
    )
