"""A small HTTP/1.1 client over trio and h11, for the Bot API calls of Telegram and Discord's
REST calls, their file downloads and uploads.

What a bot's REST traffic needs and no more, each request costing one ``send`` (head and
body together) and the reads of its answer:

* **Keep-alive connections per origin**, at most ``max_connections`` requests in flight in
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

import ssl
from collections.abc import Awaitable, Callable, Mapping, Sequence

import attrs
import h11
import trio

READ_CHUNK = 65_536
CONNECT_TIMEOUT_S = 10.0

Header = tuple[bytes, bytes]
_BODY_METHODS = frozenset({b"POST", b"PUT", b"PATCH"})


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


@attrs.frozen
class Origin:
    scheme: str
    host: str
    port: int

    @property
    def host_header(self) -> Header:
        default = 443 if self.scheme == "https" else 80
        host = f"[{self.host}]" if ":" in self.host else self.host  # an IPv6 literal
        netloc = host if self.port == default else f"{host}:{self.port}"
        return (b"Host", netloc.encode("idna"))


@attrs.define(eq=False)
class _Connection:
    stream: trio.abc.Stream
    socket: trio.socket.SocketType
    h11: h11.Connection = attrs.field(factory=lambda: h11.Connection(h11.CLIENT))


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
        try:
            return await self._request(
                origin, method, target, headers, body, cap, ready, read_timeout_s
            )
        finally:
            self._slots.release()

    async def _request(
        self,
        origin: Origin,
        method: bytes,
        target: bytes,
        headers: Sequence[Header],
        body: bytes,
        cap: int,
        ready: Callable[[], Awaitable[None]] | None,
        read_timeout_s: float | None,
    ) -> tuple[int, Mapping[str, str], bytes]:
        connection = self._take(origin)
        try:
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
        state = connection.h11
        if state.our_state is h11.DONE and state.their_state is h11.DONE:
            state.start_next_cycle()
            self._idle.setdefault(origin, []).append(connection)
        else:
            await trio.aclose_forcefully(connection.stream)
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
    state = connection.h11
    if body or method in _BODY_METHODS:
        head.append((b"Content-Length", str(len(body)).encode()))
    try:
        data = state.send(h11.Request(method=method, target=target, headers=head)) or b""
        if body:
            data += state.send(h11.Data(data=body)) or b""
        data += state.send(h11.EndOfMessage()) or b""
    except h11.LocalProtocolError:
        failure: HttpTransportError = LocalProtocolError()
    else:
        try:
            await connection.stream.send_all(data)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError):
            failure = WriteError()
        else:
            return await _answer(connection, cap, read_timeout_s)
    raise failure  # outside the handler: no __context__


async def _receive(connection: _Connection, read_timeout_s: float | None) -> bytes:
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


async def _answer(
    connection: _Connection, cap: int, read_timeout_s: float | None
) -> tuple[int, Mapping[str, str], bytes]:
    state = connection.h11
    status = 0
    headers: dict[str, str] = {}
    chunks: list[bytes] = []
    size = 0
    while True:
        try:
            event = state.next_event()
        except h11.RemoteProtocolError:
            event = None
        if event is None:
            raise RemoteProtocolError()
        if event is h11.NEED_DATA:
            state.receive_data(await _receive(connection, read_timeout_s))
        elif isinstance(event, h11.Response):
            status = event.status_code
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in event.headers}
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > cap:
                raise ResponseTooLarge(status)
        elif isinstance(event, h11.Data):
            size += len(event.data)
            if size > cap:
                raise ResponseTooLarge(status)
            chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return status, headers, chunks[0] if len(chunks) == 1 else b"".join(chunks)
        elif isinstance(event, h11.ConnectionClosed):
            raise RemoteProtocolError()
        # h11.InformationalResponse (1xx): wait for the real one.
