"""A small HTTP/1.1 client over trio, for the Bot API calls of Telegram and Discord's REST
calls, their file downloads and uploads.

What a bot's REST traffic needs and no more, each request costing one ``send`` (head and
body together) and the reads of its answer:

* **Its own codec**, a few string operations a request: the head written from validated
  bytes (a method, target, header name or value HTTP/1.1 forbids is refused before anything
  is sent), the answer read by RFC 9112's framing — 1xx skipped; no body for ``HEAD``, 204
  and 304; ``Transfer-Encoding: chunked``; ``Content-Length`` (several must agree); else
  until the server closes. h11, which this client used before, cost about 90 µs a request
  in Python (a Discord message's reply, a Telegram ``sendMessage``); this costs a tenth.

* **Keep-alive connections per origin** (an HTTP/1.1 answer without ``Connection: close``
  whose body was framed and read exactly), at most ``max_connections`` requests in flight in
  all (a fair semaphore: a request waiting for one has sent nothing). An idle connection
  the server closed (or that holds unread bytes) is dropped before use — a readability
  poll, as httpcore does — so a request is not written into a dead socket.
* **TLS** for ``https`` with one default context (system CA store, hostname checked),
  built once.
* **Bounded**: the answer's body is read under a byte cap (``Content-Length`` checked
  first, then while reading; over it: :class:`ResponseTooLarge`, the connection dropped);
  each read of the answer within ``read_timeout_s`` when given (:class:`ReadTimeout`); the
  caller bounds the whole exchange in time.
* **Failures** raise a subclass of :class:`HttpTransportError` named by its cause —
  :class:`ConnectError` (the TLS handshake included), :class:`ConnectTimeout`,
  :class:`LocalProtocolError`, :class:`WriteError`, :class:`ReadError`,
  :class:`ReadTimeout`, :class:`RemoteProtocolError` (the words httpx uses for the same
  causes) — whose text is that name only (never a URL, a header or a body), raised without
  a ``__cause__`` or ``__context__``; the connection is dropped.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence

import attrs
import trio

READ_CHUNK = 65_536
CONNECT_TIMEOUT_S = 10.0
MAX_HEAD_BYTES = 65_536
"""An answer's status line and headers (h11's limit was 16 KiB)."""
MAX_CHUNK_LINE = 1024

Header = tuple[bytes, bytes]
_BODY_METHODS = frozenset({b"POST", b"PUT", b"PATCH"})
_TOKEN = re.compile(rb"[-!#$%&'*+.^_`|~0-9A-Za-z]+\Z")
_TARGET = re.compile(rb"[\x21-\x7e\x80-\xff]+\Z")
_VALUE = re.compile(
    rb"(?:[\x21-\x7e\x80-\xff](?:[ \t\x21-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?\Z"
)
_STATUS = re.compile(rb"HTTP/1\.([0-9]) ([0-9]{3})(?:[ \t][^\r\n]*)?\Z")
_FIELD = re.compile(rb"([-!#$%&'*+.^_`|~0-9A-Za-z]+):[ \t]*([^\x00\r\n]*?)[ \t]*\Z")
_PAIRS = re.compile(
    r"(?<![^\n])([-!#$%&'*+.^_`|~0-9A-Za-z]+):[ \t]*([^\x00\r\n]*[^\x00\r\n \t])?[ \t]*\r*\n"
)
"""The fields of header lines (each ended by ``\n``) as :data:`_FIELD` reads each line, in
one pass: a line it does not match whole (an obs-fold, a line :data:`_FIELD` refuses) has
no match, since a match begins only where a line does."""
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,16})[ \t]*(?:;[^\r\n]*)?\r?\n")
_NO_BODY = frozenset({204, 304})


class HttpTransportError(Exception):
    """No (complete) answer: for a POST, the outcome is unknown. The text is the cause's
    class name, fixed."""

    def __init__(self) -> None:
        super().__init__(type(self).__name__)


class ConnectError(HttpTransportError):
    """The connection could not be opened (refused, unreachable, name not resolved)."""


class ConnectTimeout(HttpTransportError):
    """The connection was not open within :data:`CONNECT_TIMEOUT_S`."""


class LocalProtocolError(HttpTransportError):
    """The request cannot be written as HTTP/1.1 (a header or target it forbids)."""


class WriteError(HttpTransportError):
    """The request could not be written (the connection broke)."""


class ReadError(HttpTransportError):
    """The answer could not be read (the connection broke)."""


class ReadTimeout(HttpTransportError):
    """No byte of the answer arrived within the per-read timeout."""


class RemoteProtocolError(HttpTransportError):
    """The server broke HTTP/1.1, or closed the connection before a complete answer."""


class ResponseTooLarge(Exception):
    """The answer's body is over the cap (nothing past it was read)."""

    def __init__(self, status: int) -> None:
        super().__init__(f"response over the cap (HTTP {status})")
        self.status = status


@attrs.frozen(cache_hash=True)
class Origin:
    scheme: str
    host: str
    port: int
    host_header: Header = attrs.field(init=False, eq=False, repr=False)
    """Built once, with the origin (a client keeps its origin)."""

    @host_header.default
    def _host_header(self) -> Header:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        netloc = host if self.port == default else f"{host}:{self.port}"
        return (b"Host", netloc.encode("idna"))


@attrs.define(eq=False)
class _Connection:
    stream: trio.abc.Stream
    socket: trio.socket.SocketType
    reusable: bool = False
    """The last answer left the connection ready for the next request (keep-alive)."""


@attrs.define(eq=False)
class Http11:
    max_connections: int = 4
    _slots: trio.Semaphore = attrs.field(init=False)
    _idle: dict[Origin, list[_Connection]] = attrs.field(factory=dict, init=False)
    _tls: ssl.SSLContext | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        self._slots = trio.Semaphore(self.max_connections)

    async def aclose(self) -> None:
        idle, self._idle = self._idle, {}
        for connections in idle.values():
            for connection in connections:
                await trio.aclose_forcefully(connection.stream)

    async def request(
        self,
        origin: Origin,
        method: bytes,
        target: bytes,
        headers: Sequence[Header],
        body: bytes,
        cap: int,
        ready: Callable[[], Awaitable[None]] | None = None,
        read_timeout_s: float | None = None,
    ) -> tuple[int, Mapping[str, str], bytes]:
        """One exchange: status, headers (lower-cased names, the last value of each) and
        the body. ``ready`` is awaited once a connection is ours, right before the
        request is written (a rate limit counts what leaves, when it leaves);
        ``read_timeout_s`` bounds each read of the answer."""
        # A free slot is taken without a trip through the scheduler (Semaphore.acquire
        # always yields once): the exchange yields soon enough, and a cancellation is
        # noticed there, before anything is sent.
        try:
            self._slots.acquire_nowait()
        except trio.WouldBlock:
            await self._slots.acquire()
        connection = None
        try:
            connection = self._take(origin)
            if connection is None:
                connection = await self._open(origin)
            if ready is not None:
                await ready()
            answer = await _exchange(
                connection,
                [origin.host_header, *headers],
                method,
                target,
                body,
                cap,
                read_timeout_s,
            )
        except BaseException:
            if connection is not None:
                await trio.aclose_forcefully(connection.stream)
            raise
        else:
            if connection.reusable:
                self._idle.setdefault(origin, []).append(connection)
            else:
                await trio.aclose_forcefully(connection.stream)
        finally:
            self._slots.release()
        return answer

    def _take(self, origin: Origin) -> _Connection | None:
        idle = self._idle.get(origin)
        while idle:
            connection = idle.pop()
            try:
                readable = connection.socket.is_readable()
            except OSError:
                readable = True
            if not readable:
                return connection
            # Closed by the server (or bytes nobody asked for): never write into it.
            connection.socket.close()
        return None

    async def _open(self, origin: Origin) -> _Connection:
        tcp: trio.SocketStream | None = None
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                tcp = await trio.open_tcp_stream(origin.host, origin.port)
                if origin.scheme != "https":
                    return _Connection(tcp, tcp.socket)
                if self._tls is None:
                    self._tls = ssl.create_default_context()
                tls = trio.SSLStream(tcp, self._tls, server_hostname=origin.host)
                await tls.do_handshake()
                return _Connection(tls, tcp.socket)
        except trio.TooSlowError:
            failure: HttpTransportError = ConnectTimeout()
        except (OSError, trio.BrokenResourceError):
            failure = ConnectError()
        except BaseException:
            if tcp is not None:
                await trio.aclose_forcefully(tcp)
            raise
        if tcp is not None:
            await trio.aclose_forcefully(tcp)
        raise failure  # outside the handler: no __context__


async def _exchange(
    connection: _Connection,
    head: list[Header],
    method: bytes,
    target: bytes,
    body: bytes,
    cap: int,
    read_timeout_s: float | None,
) -> tuple[int, Mapping[str, str], bytes]:
    length = len(body) if body or method in _BODY_METHODS else None
    data = _encode_request(method, target, head, body, length)
    if data is None:
        raise LocalProtocolError()
    connection.reusable = False
    try:
        await connection.stream.send_all(data)
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
        failure: HttpTransportError = WriteError()
    else:
        return await _Answer(connection, read_timeout_s).read(method, cap)
    raise failure  # outside the handler: no __context__


def _encode_request(
    method: bytes, target: bytes, headers: Sequence[Header], body: bytes, length: int | None
) -> bytes | None:
    """The request's bytes, head (``Content-Length: length`` last, unless ``None``) and
    body; ``None`` if HTTP/1.1 forbids a part of it."""
    if _TOKEN.match(method) is None or _TARGET.match(target) is None:
        return None
    parts = [method, b" ", target, b" HTTP/1.1\r\n"]
    for name, value in headers:
        if _TOKEN.match(name) is None or _VALUE.match(value) is None:
            return None
        parts += (name, b": ", value, b"\r\n")
    if length is not None:
        parts += (b"Content-Length: ", str(length).encode(), b"\r\n")
    parts.append(b"\r\n")
    parts.append(body)
    return b"".join(parts)


def _field(
    name: str, value: str, headers: dict[str, str], lengths: list[str], codings: list[str]
) -> None:
    """One header field of an answer (``name`` lower-cased): kept (the last of a name wins),
    and a length's or a transfer coding's values noted."""
    headers[name] = value
    if name == "content-length":
        lengths.extend(v.strip() for v in value.split(","))
    elif name == "transfer-encoding":
        codings.extend(v.strip().lower() for v in value.split(","))


def _head_end(buffer: bytearray) -> tuple[int, int] | None:
    """Where the blank line ending an answer's head begins and ends in ``buffer`` (the
    first ``\\r?\\n\\r?\\n`` within :data:`MAX_HEAD_BYTES` + 4 bytes); ``None`` if none."""
    limit = MAX_HEAD_BYTES + 4
    crlf = buffer.find(b"\n\r\n", 0, limit)
    lf = buffer.find(b"\n\n", 0, crlf + 1 if crlf >= 0 else limit)
    if lf >= 0:
        at, end = lf, lf + 2
    elif crlf >= 0:
        at, end = crlf, crlf + 3
    else:
        return None
    return (at - 1 if at and buffer[at - 1] == 0x0D else at), end


async def _receive(connection: _Connection, read_timeout_s: float | None) -> bytes:
    """The next bytes of the answer; ``b""`` once the server closed."""
    failure: HttpTransportError
    try:
        if read_timeout_s is None:
            return bytes(await connection.stream.receive_some(READ_CHUNK))
        with trio.move_on_after(read_timeout_s):
            return bytes(await connection.stream.receive_some(READ_CHUNK))
        failure = ReadTimeout()
    except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
        failure = ReadError()
    raise failure  # outside the handler: no __context__


class _Broken(Exception):
    """The answer breaks HTTP/1.1, or ended early (raised as :class:`RemoteProtocolError`)."""


@attrs.define(eq=False)
class _Answer:
    """One answer read off a connection (RFC 9112 §6.3 message body length)."""

    connection: _Connection
    read_timeout_s: float | None
    buffer: bytearray = attrs.field(factory=bytearray)
    closed: bool = False

    async def _more(self) -> None:
        if self.closed:
            raise _Broken
        data = await _receive(self.connection, self.read_timeout_s)
        if data:
            self.buffer += data
        else:
            self.closed = True

    async def read(self, method: bytes, cap: int) -> tuple[int, Mapping[str, str], bytes]:
        try:
            return await self._read(method, cap)
        except _Broken:
            pass
        raise RemoteProtocolError()  # outside the handler: no __context__

    async def _read(self, method: bytes, cap: int) -> tuple[int, Mapping[str, str], bytes]:
        while True:
            status, minor, headers, lengths, chunked = await self._head()
            if status >= 200 or status == 101:
                break  # a 1xx other than 101 is followed by the real answer
        if status == 101:
            raise _Broken  # no protocol switch was asked for
        keep = minor >= 1 and "close" not in headers.get("connection", "").lower()
        if method == b"HEAD" or status in _NO_BODY:
            body = b""
        elif chunked:
            body = await self._chunked(status, cap)
        elif lengths:
            if len(set(lengths)) != 1 or not lengths[0].isdigit():
                raise _Broken
            body = await self._exactly(status, int(lengths[0]), cap)
        else:
            body = await self._until_closed(status, cap)
            keep = False
        self.connection.reusable = keep and not self.buffer and not self.closed
        return status, headers, body

    async def _head(self) -> tuple[int, int, dict[str, str], list[str], bool]:
        while True:
            end = _head_end(self.buffer)
            if end is not None:
                break
            if len(self.buffer) > MAX_HEAD_BYTES:
                raise _Broken
            await self._more()
        first, _, fields = bytes(self.buffer[: end[0]]).partition(b"\n")
        del self.buffer[: end[1]]
        status_line = _STATUS.match(first.rstrip(b"\r"))
        if status_line is None:
            raise _Broken
        headers: dict[str, str] = {}
        lengths: list[str] = []
        codings: list[str] = []
        if fields:
            text = fields.decode("latin-1") + "\n"
            pairs = _PAIRS.findall(text)
            if len(pairs) == text.count("\n"):
                # Every line a plain field (as in every answer): one pass, no line loop.
                for name, value in pairs:
                    _field(name.lower(), value, headers, lengths, codings)
            else:
                self._fields(fields.split(b"\n"), headers, lengths, codings)
        if codings and codings != ["chunked"]:
            raise _Broken  # only chunked is understood (as h11)
        return int(status_line[2]), int(status_line[1]), headers, lengths, bool(codings)

    @staticmethod
    def _fields(
        lines: list[bytes], headers: dict[str, str], lengths: list[str], codings: list[str]
    ) -> None:
        """Header lines one at a time: an obs-fold, or a line that breaks HTTP/1.1."""
        name = ""
        for raw in lines:
            line = raw.rstrip(b"\r")
            if line[:1] in (b" ", b"\t") and name:  # obs-fold: the last field goes on
                headers[name] += " " + line.strip(b" \t").decode("latin-1")
                continue
            field = _FIELD.match(line)
            if field is None:
                raise _Broken
            name = field[1].decode("ascii").lower()
            _field(name, field[2].decode("latin-1"), headers, lengths, codings)

    async def _exactly(self, status: int, length: int, cap: int) -> bytes:
        if length > cap:
            raise ResponseTooLarge(status)
        while len(self.buffer) < length:
            await self._more()
        body = bytes(self.buffer[:length])
        del self.buffer[:length]
        return body

    async def _until_closed(self, status: int, cap: int) -> bytes:
        while not self.closed:
            if len(self.buffer) > cap:
                raise ResponseTooLarge(status)
            await self._more()
        if len(self.buffer) > cap:
            raise ResponseTooLarge(status)
        body = bytes(self.buffer)
        self.buffer.clear()
        return body

    async def _chunked(self, status: int, cap: int) -> bytes:
        parts: list[bytes] = []
        size = 0
        while True:
            line = await self._line()
            match = _CHUNK_SIZE.fullmatch(line)
            if match is None:
                raise _Broken
            length = int(match[1], 16)
            if length == 0:
                break
            size += length
            if size > cap:
                raise ResponseTooLarge(status)
            parts.append(await self._exactly(status, length, cap))
            if await self._line() not in (b"\r\n", b"\n"):
                raise _Broken
        while await self._line() not in (b"\r\n", b"\n"):
            pass  # trailer fields: not read
        return b"".join(parts)

    async def _line(self) -> bytes:
        """The next line, its end included."""
        while True:
            end = self.buffer.find(b"\n")
            if end >= 0:
                line = bytes(self.buffer[: end + 1])
                del self.buffer[: end + 1]
                return line
            if len(self.buffer) > MAX_CHUNK_LINE:
                raise _Broken
            await self._more()
