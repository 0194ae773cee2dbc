"""The REST client's HTTP/1.1 (adapters/toolkit/_http_client.py) against raw loopback servers:
keep-alive reuse, an idle connection the server closed never written into, body caps (by
Content-Length and while reading a chunked body), and failures that name a class only."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio
import trio.testing
import trustme

from adapters.toolkit._http_client import (
    ConnectError,
    Http11,
    HttpTransportError,
    LocalProtocolError,
    Origin,
    ReadTimeout,
    RemoteProtocolError,
    ResponseTooLarge,
)
from tests.support import tls

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


async def _serve(
    nursery: trio.Nursery, handler: Callable[[trio.SocketStream], Awaitable[None]]
) -> Origin:
    listeners = await nursery.start(functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1"))
    return Origin("http", "127.0.0.1", listeners[0].socket.getsockname()[1])


async def _read_request(stream: trio.SocketStream) -> bytes:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = await stream.receive_some(65536)
        if not chunk:
            return data
        data += chunk
    return data


async def test_keep_alive_reuses_one_connection_in_one_write(nursery: trio.Nursery) -> None:
    connections: list[int] = []
    sizes: list[int] = []

    async def handler(stream: trio.SocketStream) -> None:
        connections.append(1)
        while True:
            request = await _read_request(stream)
            if not request:
                return
            sizes.append(len(request))
            await stream.send_all(OK)

    origin = await _serve(nursery, handler)
    client = Http11()
    with trio.fail_after(10):
        for _ in range(3):
            body = b'{"content":"hi"}'
            status, headers, data = await client.request(
                origin, b"POST", b"/api/v10/x", [(b"Content-Type", b"application/json")], body, 100
            )
            assert (status, headers["content-length"], data) == (200, "2", b"ok")
    await client.aclose()
    assert len(connections) == 1
    # Head and body left in one send: the server read them together.
    assert all(size > 16 for size in sizes) and len(sizes) == 3


async def test_an_idle_connection_the_server_closed_is_not_written_into(
    nursery: trio.Nursery,
) -> None:
    requests: list[bytes] = []

    async def handler(stream: trio.SocketStream) -> None:
        requests.append(await _read_request(stream))
        await stream.send_all(OK)  # keep-alive announced, then closed at once

    origin = await _serve(nursery, handler)
    client = Http11()
    with trio.fail_after(10):
        await client.request(origin, b"GET", b"/a", [], b"", 100)
        await trio.sleep(0.1)  # the close reaches us
        status, _headers, data = await client.request(origin, b"POST", b"/b", [], b"x", 100)
    await client.aclose()
    assert (status, data) == (200, b"ok") and len(requests) == 2


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 1000,
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        + b"".join(b"40\r\n" + b"x" * 64 + b"\r\n" for _ in range(20))
        + b"0\r\n\r\n",
    ],
)
async def test_a_body_over_the_cap_is_refused(answer: bytes, nursery: trio.Nursery) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await _read_request(stream)
        await stream.send_all(answer)

    origin = await _serve(nursery, handler)
    client = Http11()
    with trio.fail_after(10), pytest.raises(ResponseTooLarge):
        await client.request(origin, b"GET", b"/big", [], b"", 256)
    await client.aclose()


async def test_failures_name_a_class_only(nursery: trio.Nursery) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await _read_request(stream)  # and close without an answer

    origin = await _serve(nursery, handler)
    client = Http11()
    with trio.fail_after(10):
        with pytest.raises(HttpTransportError) as dropped:
            await client.request(origin, b"POST", b"/secret-path?token=abc", [], b"x", 100)
        with pytest.raises(HttpTransportError) as refused:
            await client.request(Origin("http", "127.0.0.1", 1), b"GET", b"/secret", [], b"", 1)
    await client.aclose()
    for error in (dropped.value, refused.value):
        assert "secret" not in str(error) and "127.0.0.1" not in str(error)


def test_the_host_header_of_an_origin() -> None:
    assert Origin("https", "discord.com", 443).host_header == (b"Host", b"discord.com")
    assert Origin("http", "127.0.0.1", 8080).host_header == (b"Host", b"127.0.0.1:8080")
    assert Origin("http", "::1", 8080).host_header == (b"Host", b"[::1]:8080")


async def test_failures_are_named_by_cause_without_a_url_or_a_context(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    async def silent(stream: trio.SocketStream) -> None:
        await _read_request(stream)
        await trio.sleep(1_000)  # never answers

    async def cut(stream: trio.SocketStream) -> None:
        await _read_request(stream)  # and close without an answer

    async def garbage(stream: trio.SocketStream) -> None:
        await _read_request(stream)
        await stream.send_all(b"NOT HTTP AT ALL\r\n\r\n")

    client = Http11()
    refused = Origin("http", "127.0.0.1", 1)
    cases = [
        (refused, None, ConnectError),
        (await _serve(nursery, silent), 5.0, ReadTimeout),
        (await _serve(nursery, cut), None, RemoteProtocolError),
        (await _serve(nursery, garbage), None, RemoteProtocolError),
    ]
    target = b"/bot123456:secret-token/sendMessage"
    for origin, read_timeout_s, expected in cases:
        with trio.fail_after(30):
            with pytest.raises(HttpTransportError) as raised:
                await client.request(
                    origin, b"POST", target, [], b"{}", 100, read_timeout_s=read_timeout_s
                )
        error = raised.value
        assert type(error) is expected
        assert str(error) == expected.__name__
        assert error.__cause__ is None and error.__context__ is None
        for text in (str(error), repr(error)):
            assert "secret" not in text and "127.0.0.1" not in text and "/bot" not in text
    await client.aclose()


async def test_the_read_timeout_bounds_each_read_not_the_answer(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    """An answer dripping a byte every 4 s is read whole under a 5 s per-read timeout (the
    caller bounds the whole exchange)."""
    answer = OK.replace(b"Content-Length: 2", b"Content-Length: 5").replace(b"ok", b"drips")

    async def drip(stream: trio.SocketStream) -> None:
        await _read_request(stream)
        for byte in answer:
            await stream.send_all(bytes([byte]))
            if byte == ord("d") or byte == ord("s"):
                await trio.sleep(4)

    origin = await _serve(nursery, drip)
    client = Http11()
    with trio.fail_after(60):
        status, _headers, body = await client.request(
            origin, b"GET", b"/", [], b"", 100, read_timeout_s=5.0
        )
    assert (status, body) == (200, b"drips")
    await client.aclose()


@pytest.mark.parametrize(
    ("answer", "body", "reused"),
    [
        (OK, b"ok", True),
        (b"HTTP/1.1 100 Continue\r\n\r\n" + OK, b"ok", True),
        (b"HTTP/1.1 204 No Content\r\nX-A: 1\r\n\r\n", b"", True),
        (b"HTTP/1.1 200 OK\nContent-Length: 2\n\nok", b"ok", True),  # bare LF lines
        (
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"2;ext=1\r\nok\r\n3\r\n!!!\r\n0\r\nX-Trailer: t\r\n\r\n",
            b"ok!!!",
            True,
        ),
        (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok", b"ok", False),
        (b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok", b"ok", False),
        (b"HTTP/1.1 200 OK\r\n\r\nuntil closed", b"until closed", False),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 2, 2\r\n\r\nok", b"ok", True),
    ],
)
async def test_answers_framed_as_http_1_1_says(
    answer: bytes, body: bytes, reused: bool, nursery: trio.Nursery
) -> None:
    """Each answer's body is read by its framing, and the connection kept only when the
    answer leaves it ready for the next request."""
    connections: list[int] = []

    async def handler(stream: trio.SocketStream) -> None:
        connections.append(1)
        while await _read_request(stream):
            await stream.send_all(answer)
            if not reused:
                return

    origin = await _serve(nursery, handler)
    client = Http11()
    with trio.fail_after(10):
        for _ in range(2):
            status, _headers, data = await client.request(origin, b"GET", b"/", [], b"", 100)
            assert (status, data) == (200 if body or b"204" not in answer else 204, body)
    await client.aclose()
    assert len(connections) == (1 if reused else 2)


@pytest.mark.parametrize(
    "answer",
    [
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\nok!",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nok\r\n0\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nBad Header\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort",
        b"HTTP/2 200\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX: " + b"x" * 70_000 + b"\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n folded: first\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX: a\x00b\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n(x): 1\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX: a\rb\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n: 1\r\n\r\nok",
    ],
)
async def test_a_broken_answer_is_a_remote_protocol_error(
    answer: bytes, nursery: trio.Nursery
) -> None:
    async def handler(stream: trio.SocketStream) -> None:
        await _read_request(stream)
        await stream.send_all(answer)

    origin = await _serve(nursery, handler)
    client = Http11()
    with trio.fail_after(10), pytest.raises(RemoteProtocolError) as raised:
        await client.request(origin, b"GET", b"/", [], b"", 100_000)
    await client.aclose()
    assert raised.value.__context__ is None


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (
            b"HTTP/1.1 200 OK\r\nX-A:  one two \t\r\nx-a: last\r\nSet-Cookie: a=1; Path=/\r\n"
            b"Empty:\r\nX-R: r\r\r\nContent-Length: 2\r\n\r\nok",
            {
                "x-a": "last",
                "set-cookie": "a=1; Path=/",
                "empty": "",
                "x-r": "r",
                "content-length": "2",
            },
        ),
        (
            b"HTTP/1.1 200 OK\r\nX-A: one\r\n  two\r\nContent-Length: 2\r\n\r\nok",
            {"x-a": "one two", "content-length": "2"},
        ),
        (
            b"HTTP/1.1 200 OK\nX-B: caf\xe9\nContent-Length: 2\n\nok",
            {"x-b": "caf\xe9", "content-length": "2"},
        ),
    ],
)
async def test_header_fields_read_as_http_1_1_says(
    answer: bytes, expected: dict[str, str], nursery: trio.Nursery
) -> None:
    """Names lower-cased, the last of a repeated name kept, values without the blanks
    around them (latin-1), an obs-fold joined to its field."""

    async def handler(stream: trio.SocketStream) -> None:
        await _read_request(stream)
        await stream.send_all(answer)

    origin = await _serve(nursery, handler)
    client = Http11()
    with trio.fail_after(10):
        status, headers, body = await client.request(origin, b"GET", b"/", [], b"", 100)
    await client.aclose()
    assert (status, dict(headers), body) == (200, expected, b"ok")


async def test_a_request_http_forbids_is_refused_before_anything_is_sent(
    nursery: trio.Nursery,
) -> None:
    received: list[bytes] = []

    async def handler(stream: trio.SocketStream) -> None:
        received.append(await _read_request(stream))

    origin = await _serve(nursery, handler)
    client = Http11()
    bad = [
        (b"GET", b"/a b", []),
        (b"G T", b"/", []),
        (b"GET", b"/", [(b"X-Ok", b"1\r\nX-Injected: 1")]),
        (b"GET", b"/", [(b"Bad Name", b"1")]),
    ]
    with trio.fail_after(10):
        for method, target, headers in bad:
            with pytest.raises(LocalProtocolError):
                await client.request(origin, method, target, headers, b"", 100)
        await trio.sleep(0.1)
    await client.aclose()
    assert set(received) <= {b""}  # connections opened, nothing written on them


async def _serve_tls(
    nursery: trio.Nursery,
    handler: Callable[[trio.abc.Stream], Awaitable[None]],
    ca: trustme.CA,
    directory: Path,
) -> Origin:
    """A loopback ``https`` origin named ``localhost``, its certificate issued by ``ca``."""
    context = tls.server_context(ca, directory)

    async def tls_handler(raw: trio.SocketStream) -> None:
        stream = trio.SSLStream(raw, context, server_side=True)
        try:
            await handler(stream)
        except trio.BrokenResourceError:
            pass
        finally:
            await trio.aclose_forcefully(stream)

    listeners = await nursery.start(
        functools.partial(trio.serve_tcp, tls_handler, 0, host="127.0.0.1")
    )
    return Origin("https", "localhost", listeners[0].socket.getsockname()[1])


async def test_https_verifies_the_server_and_keeps_the_connection(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Bot APIs are ``https``: TLS with the system's default verification (here a trust
    store holding one throwaway authority), and keep-alive over TLS as over TCP — the
    session tickets a TLS 1.3 server sends after its handshake are not taken for bytes
    nobody asked for."""
    ca = trustme.CA()
    tls.trust(ca, tmp_path, monkeypatch)
    connections: list[int] = []
    requests: list[bytes] = []

    async def handler(stream: trio.abc.Stream) -> None:
        connections.append(1)
        while True:
            request = await _read_request(stream)  # type: ignore[arg-type]
            if not request:
                return
            requests.append(request)
            await stream.send_all(OK)

    origin = await _serve_tls(nursery, handler, ca, tmp_path)
    client = Http11()
    with trio.fail_after(10):
        for path in (b"/one", b"/two", b"/three"):
            status, _headers, data = await client.request(origin, b"GET", path, [], b"", 100)
            assert (status, data) == (200, b"ok")
    await client.aclose()
    assert len(connections) == 1
    assert [r.split(b" ")[1] for r in requests] == [b"/one", b"/two", b"/three"]
    assert all(b"\r\nHost: localhost:" in r for r in requests)


async def test_https_refuses_a_server_it_cannot_verify(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A certificate from an authority the trust store does not hold: a ConnectError
    naming no URL, and no request written to the impostor."""
    tls.trust(trustme.CA(), tmp_path, monkeypatch)
    requests: list[bytes] = []

    async def handler(stream: trio.abc.Stream) -> None:
        requests.append(await _read_request(stream))  # type: ignore[arg-type]

    origin = await _serve_tls(nursery, handler, trustme.CA(), tmp_path)
    client = Http11()
    with trio.fail_after(10), pytest.raises(ConnectError) as refused:
        await client.request(origin, b"POST", b"/bot-secret/sendMessage", [], b"x", 100)
    await client.aclose()
    assert requests == []
    assert "secret" not in str(refused.value) and "localhost" not in str(refused.value)
