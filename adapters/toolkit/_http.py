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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from http import HTTPStatus
from urllib.parse import parse_qs, urlsplit

import attrs
import h11
import trio

__all__ = [
    "HEAD_TIMEOUT_S",
    "MAX_HEAD_BYTES",
    "READ_CHUNK",
    "SEND_TIMEOUT_S",
    "HttpError",
    "RequestHead",
    "read_body",
    "read_request_head",
    "respond",
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
