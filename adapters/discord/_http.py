"""A small HTTP/1.1 client over trio and h11, for the Discord REST calls and attachments.

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
  the caller bounds the whole exchange in time.
* **Failures** raise :class:`HttpTransportError` whose text is the failure's class only
  (never a URL, a header or a body); the connection is dropped.
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
    """No (complete) answer: for a POST, the outcome is unknown."""


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
    ) -> tuple[int, Mapping[str, str], bytes]:
        """One exchange: status, headers (lower-cased names, the last value of each) and
        the body. ``ready`` is awaited once a connection is ours, right before the
        request is written (a rate limit counts what leaves, when it leaves)."""
        async with self._slots:
            connection = self._take(origin)
            try:
                if connection is None:
                    connection = await self._open(origin)
                if ready is not None:
                    await ready()
                answer = await self._exchange(
                    connection, origin.host_header, method, target, headers, body, cap
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
        try:
            with trio.fail_after(CONNECT_TIMEOUT_S):
                tcp = await trio.open_tcp_stream(origin.host, origin.port)
        except (OSError, trio.TooSlowError) as error:
            raise HttpTransportError(type(error).__name__) from None
        stream: trio.abc.Stream = tcp
        if origin.scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            stream = trio.SSLStream(tcp, self._tls, server_hostname=origin.host)
        return _Connection(stream, tcp.socket)

    async def _exchange(
        self,
        connection: _Connection,
        origin_host: Header,
        method: bytes,
        target: bytes,
        headers: Sequence[Header],
        body: bytes,
        cap: int,
    ) -> tuple[int, Mapping[str, str], bytes]:
        state = connection.h11
        head = [origin_host, *headers]
        if body or method in _BODY_METHODS:
            head.append((b"Content-Length", str(len(body)).encode()))
        try:
            data = state.send(h11.Request(method=method, target=target, headers=head)) or b""
            if body:
                data += state.send(h11.Data(data=body)) or b""
            data += state.send(h11.EndOfMessage()) or b""
            await connection.stream.send_all(data)
            return await _answer(connection, cap)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as error:
            raise HttpTransportError(type(error).__name__) from None
        except h11.ProtocolError as error:
            raise HttpTransportError(type(error).__name__) from None


async def _answer(connection: _Connection, cap: int) -> tuple[int, Mapping[str, str], bytes]:
    state = connection.h11
    status = 0
    headers: dict[str, str] = {}
    chunks: list[bytes] = []
    size = 0
    while True:
        event = state.next_event()
        if event is h11.NEED_DATA:
            received = await connection.stream.receive_some(READ_CHUNK)
            state.receive_data(bytes(received))
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
            raise HttpTransportError("ConnectionClosed")
        # h11.InformationalResponse (1xx): wait for the real one.
