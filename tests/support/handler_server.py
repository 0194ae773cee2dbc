"""A loopback HTTP/1.1 server that answers each request with what a test's handler returns.

For the tests whose server is one function (``httpx.Request`` in, ``httpx.Response`` out,
sync or async — the shape of ``httpx.MockTransport``'s handlers): the client under test
talks to it over a real socket, through its real HTTP client, instead of through a seam
that replaces that client. A handler that raises cuts the connection without an answer (the
client sees its request go out and nothing come back). A response whose body is an async
stream is sent chunk by chunk as the stream yields (``Transfer-Encoding: chunked``), so a
dripping server is one.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

import h11
import httpx
import trio

Handler = Callable[[httpx.Request], httpx.Response | Awaitable[httpx.Response]]
_FRAMING = {b"content-length", b"transfer-encoding", b"connection"}


async def serve_handler(nursery: trio.Nursery, handler: Handler) -> str:
    """Serve ``handler`` on 127.0.0.1 until ``nursery`` is cancelled; its origin."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    origin = f"http://127.0.0.1:{port}"

    async def connection(stream: trio.SocketStream) -> None:
        async with stream:
            try:
                await _serve(stream, handler, origin)
            except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
                pass

    nursery.start_soon(trio.serve_listeners, connection, listeners)
    return origin


async def read_request(
    conn: h11.Connection, stream: trio.abc.ReceiveStream
) -> tuple[h11.Request, bytes] | None:
    """The next whole request on ``conn`` (its head and body), ``None`` once the client
    closed or sent something that is not one."""
    head: h11.Request | None = None
    body = b""
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(bytes(await stream.receive_some(65_536)))
        elif isinstance(event, h11.Request):
            head = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage) and head is not None:
            return head, body
        else:
            return None


async def _serve(stream: trio.SocketStream, handler: Handler, origin: str) -> None:
    conn = h11.Connection(h11.SERVER)
    while (got := await read_request(conn, stream)) is not None:
        head, body = got
        request = httpx.Request(
            head.method.decode(),
            origin + head.target.decode(),
            headers=[(k, v) for k, v in head.headers if k.lower() != b"host"],
            content=body,
        )
        try:
            answer = handler(request)
            response = await answer if inspect.isawaitable(answer) else answer
        except Exception:
            return  # cut: no answer at all
        headers = [(k, v) for k, v in response.headers.raw if k.lower() not in _FRAMING]
        if isinstance(response.stream, httpx.AsyncByteStream) and not _read(response):
            await stream.send_all(
                conn.send(h11.Response(status_code=response.status_code, headers=headers))
            )
            async for chunk in response.stream:
                await stream.send_all(conn.send(h11.Data(data=chunk)))
        else:
            content = response.content
            headers.append((b"content-length", str(len(content)).encode()))
            await stream.send_all(
                conn.send(h11.Response(status_code=response.status_code, headers=headers))
            )
            await stream.send_all(conn.send(h11.Data(data=content)))
        await stream.send_all(conn.send(h11.EndOfMessage()))
        conn.start_next_cycle()


def _read(response: httpx.Response) -> bool:
    """Whether the response's body is already in memory (built from ``content``/``json``)."""
    try:
        response.content  # noqa: B018 (raises for a stream not read yet)
    except httpx.ResponseNotRead:
        return False
    return True
