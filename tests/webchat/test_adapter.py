"""The web chat adapter against a recording ``admit``: HTTP routes, WS protocol, access."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import re

import pytest
import trio
import trio.testing
import trio_websocket

from adapters.webchat._adapter import WebchatAdapter, parse_listen
from prismd.channel import AdapterFatalError, Admission, ApprovalInput, Button, Reply, SendResult

from ._support import (
    FIXED_NOW_MS,
    Recorder,
    connect,
    get,
    hello,
    http,
    recv,
    send,
    start,
    upgrade,
)

ACTOR = "actor_0123456789"
OTHER = "other-actor-abcdef"
TOKEN = "A" * 43
SECRET_TOKEN = "wc-secret-token-0123456789"


def reply(text: str = "hi there", **kwargs: object) -> Reply:
    fields: dict[str, object] = {
        "connection_id": "web",
        "external_conversation_id": ACTOR,
        "text": text,
        "kind": "final",
    }
    fields.update(kwargs)
    return Reply(**fields)  # type: ignore[arg-type]


# ---------------------------------------------------------------------- HTTP


async def test_page_is_served_with_strict_csp(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        adapter, _ = await start(nursery)
        status, headers, body = await http(adapter, get("/"))
    assert status == 200
    assert headers["content-type"] == "text/html; charset=utf-8"
    assert headers["cache-control"] == "no-store"
    csp = headers["content-security-policy"]
    assert "default-src 'none'" in csp
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    script = re.search(rb"<script>(.*?)</script>", body, re.S)
    assert script is not None
    digest = base64.b64encode(hashlib.sha256(script.group(1)).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in csp
    assert b'id="text"' in body and b'id="send"' in body
    assert b"http://" not in body and b"https://" not in body  # no external resources


async def test_healthz_and_health(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        adapter = WebchatAdapter(connection_id="web", listen="127.0.0.1:0", admit=Recorder())
        assert adapter.health() == {"listener": "stopped"}
        assert adapter.connection_id == "web"
        async with trio.open_nursery() as inner:
            await inner.start(adapter.run)
            assert adapter.health() == {"listener": "listening"}
            status, headers, body = await http(adapter, get("/healthz"))
            assert status == 200
            assert headers["content-type"] == "application/json"
            assert json.loads(body) == {"status": "ok", "listener": "listening"}
            inner.cancel_scope.cancel()
        assert adapter.health() == {"listener": "stopped"}
        with pytest.raises(OSError):
            await trio.open_tcp_stream(*adapter.bound)  # type: ignore[misc]


@pytest.mark.parametrize(
    ("request_bytes", "expected"),
    [
        (get("/nope"), 404),
        (get("/", method="POST"), 405),
        (get("/healthz", method="DELETE"), 405),
        (get("/ws"), 426),
        (b"GARBAGE\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"x" * 10_000 + b"\r\n\r\n", 431),
        (get("/", host="evil.example"), 421),
    ],
)
async def test_http_errors(nursery: trio.Nursery, request_bytes: bytes, expected: int) -> None:
    with trio.fail_after(10):
        adapter, recorder = await start(nursery)
        status, _, _ = await http(adapter, request_bytes)
        assert status == expected
        # the listener keeps serving
        assert (await http(adapter, get("/healthz")))[0] == 200
    assert recorder.events == []


async def test_a_server_name_is_told_how_to_reach_the_page(nursery: trio.Nursery) -> None:
    # A person who browses http://myserver:8787/ got "misdirected request" and no more.
    with trio.fail_after(10):
        adapter, _ = await start(nursery)
        status, _, body = await http(adapter, get("/", host="myserver:8787"))
    assert status == 421
    assert body == (
        b"misdirected request: this web chat answers only to a loopback name"
        b" (http://127.0.0.1:PORT/ or http://localhost:PORT/); from another machine, open an"
        b" SSH tunnel (ssh -L 8787:127.0.0.1:8787 HOST) and browse http://127.0.0.1:8787/\n"
    )


async def test_head_request_has_no_body(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        adapter, _ = await start(nursery)
        status, headers, body = await http(adapter, get("/", method="HEAD"))
    assert status == 200 and body == b""
    assert int(headers["content-length"]) > 1000


async def test_slow_request_head_is_cut_off(nursery: trio.Nursery, autojump_clock: object) -> None:
    adapter, _ = await start(nursery)
    assert adapter.bound is not None
    stream = await trio.open_tcp_stream(*adapter.bound)
    await stream.send_all(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")
    start_time = trio.current_time()
    data = bytearray()
    with trio.fail_after(60):
        while chunk := await stream.receive_some(4096):
            data += chunk
    assert 9 <= trio.current_time() - start_time <= 11
    assert b"<html" not in data  # never answered the half request with the page
    assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    await stream.aclose()


async def test_a_silent_connection_is_answered_408(
    nursery: trio.Nursery, autojump_clock: object
) -> None:
    """The web chat answers a connection that never sends a request with 408 (as it always
    did), where the metrics endpoint and the webhook close such a one silently."""
    adapter, _ = await start(nursery)
    assert adapter.bound is not None
    stream = await trio.open_tcp_stream(*adapter.bound)
    start_time = trio.current_time()
    data = bytearray()
    with trio.fail_after(60):
        while chunk := await stream.receive_some(4096):
            data += chunk
    assert 9 <= trio.current_time() - start_time <= 11
    assert data.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert b"connection: close" in data.lower()
    await stream.aclose()


# ---------------------------------------------------------------------- WebSocket


async def test_message_round_trip(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        adapter, recorder = await start(nursery)
        async with connect(adapter) as ws:
            await hello(ws, ACTOR)
            await send(ws, {"type": "message", "id": "m1", "text": "hello ünïcode"})
            assert await recv(ws) == {
                "type": "admission",
                "id": "m1",
                "status": "accepted",
                "reason": None,
                "duplicate": False,
            }
            [event] = recorder.events
            assert event.connection_id == "web"
            assert event.external_conversation_id == ACTOR
            assert event.external_actor_id == ACTOR
            assert event.event_id == f"{ACTOR}:m1"
            assert event.text == "hello ünïcode"
            assert event.approval is None
            assert event.received_at_ms == FIXED_NOW_MS
            assert dict(event.claims) == {"platform": "webchat"}

            buttons = (Button("Allow once", "p:a:" + TOKEN), Button("Deny", "p:d:" + TOKEN))
            result = await adapter.send(
                reply("the answer", in_reply_to=f"{ACTOR}:m1", kind="notice", buttons=buttons)
            )
            assert result.delivered and result.message_id
            assert await recv(ws) == {
                "type": "reply",
                "replyId": None,  # this reply names no operation
                "kind": "notice",
                "text": "the answer",
                "controls": [
                    {"label": "Allow once", "value": "p:a:" + TOKEN},
                    {"label": "Deny", "value": "p:d:" + TOKEN},
                ],
                "inReplyTo": "m1",
            }
        assert adapter.statistics().admissions == 1


async def test_duplicate_client_id_reports_duplicate(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        adapter, recorder = await start(nursery)
        async with connect(adapter) as ws:
            resume = await hello(ws, ACTOR)
            await send(ws, {"type": "message", "id": "m1", "text": "once"})
            assert (await recv(ws))["duplicate"] is False
        # a reconnect re-sends the unacknowledged message with the same client id
        async with connect(adapter) as ws:
            await hello(ws, ACTOR, resume)
            await send(ws, {"type": "message", "id": "m1", "text": "once"})
            frame = await recv(ws)
            assert frame["status"] == "accepted" and frame["duplicate"] is True
    assert [e.event_id for e in recorder.events] == [f"{ACTOR}:m1"] * 2


async def test_retryable_denial_is_reported(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        recorder = Recorder(answer=Admission("denied", reason="capacity"))
        adapter, _ = await start(nursery, admit=recorder)
        async with connect(adapter) as ws:
            await hello(ws, ACTOR)
            await send(ws, {"type": "message", "id": "m9", "text": "busy?"})
            frame = await recv(ws)
    assert frame == {
        "type": "admission",
        "id": "m9",
        "status": "denied",
        "reason": "capacity",
        "duplicate": False,
    }


async def test_approval_button_becomes_approval_event(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        adapter, recorder = await start(nursery)
        async with connect(adapter) as ws:
            await hello(ws, ACTOR)
            await send(ws, {"type": "approve", "value": "p:a:" + TOKEN, "id": "b1"})
            assert (await recv(ws))["id"] == "b1"
            await send(ws, {"type": "approve", "value": "p:d:" + TOKEN})
            frame = await recv(ws)
            assert frame["id"] is None and frame["status"] == "accepted"
    allow, deny = recorder.events
    assert allow.approval == ApprovalInput(token=TOKEN, outcome="allow_once")
    assert deny.approval == ApprovalInput(token=TOKEN, outcome="reject_once")
    assert allow.text == "" and deny.text == ""
    for event in (allow, deny):
        assert event.event_id.startswith(f"{ACTOR}:approve-")
        assert TOKEN not in event.event_id  # tokens never reach a journaled id
    assert allow.event_id != deny.event_id


BAD_AFTER_HELLO = [
    ("not json", "frame is not valid JSON"),
    ("[1, 2]", "frame must be a JSON object"),
    ('{"type": "shout", "text": "x"}', "unknown frame type"),
    ('{"type": "message", "text": "no id"}', "invalid message id"),
    ('{"type": "message", "id": "bad id!", "text": "x"}', "invalid message id"),
    ('{"type": "message", "id": "m1", "text": 5}', "message text must be a non-empty string"),
    ('{"type": "message", "id": "m1", "text": "   "}', "message text must be a non-empty string"),
    ('{"type": "approve", "value": "p:x:' + TOKEN + '"}', "invalid approval value"),
    ('{"type": "approve", "value": "p:a:short"}', "invalid approval value"),
    ('{"type": "approve", "value": "p:a:' + TOKEN + '", "id": 7}', "invalid message id"),
    ('{"type": "hello", "actor": "' + ACTOR + '"}', "hello was already received"),
    ('{"type": "message", "id": "m1", "text": "' + "x" * 2000 + '"}', "frame too large"),
]


@pytest.mark.parametrize(("raw", "error"), BAD_AFTER_HELLO)
async def test_bad_frames_get_an_error_and_admit_nothing(
    nursery: trio.Nursery, raw: str, error: str
) -> None:
    with trio.fail_after(10):
        adapter, recorder = await start(nursery, max_message_bytes=1024)
        async with connect(adapter) as ws:
            await hello(ws, ACTOR)
            await ws.send_message(raw)
            assert await recv(ws) == {"type": "error", "message": error}
            assert recorder.events == []
            # the socket stays usable
            await send(ws, {"type": "message", "id": "ok", "text": "fine"})
            assert (await recv(ws))["status"] == "accepted"
    assert len(recorder.events) == 1
    assert adapter.statistics().rejected_frames == 1


async def test_binary_frame_is_refused(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        adapter, recorder = await start(nursery)
        async with connect(adapter) as ws:
            await hello(ws, ACTOR)
            await ws.send_message(b'{"type": "message", "id": "m1", "text": "x"}')
            assert await recv(ws) == {"type": "error", "message": "binary frames are not supported"}
    assert recorder.events == []


async def test_huge_frame_closes_only_that_socket(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        adapter, recorder = await start(nursery, max_message_bytes=1024)
        async with connect(adapter) as ws:
            resume = await hello(ws, ACTOR)
            await ws.send_message("x" * 10_000)
            with pytest.raises(trio_websocket.ConnectionClosed) as info:
                await ws.get_message()
            assert info.value.reason is not None and info.value.reason.code == 1009
        async with connect(adapter) as ws:
            await hello(ws, ACTOR, resume)
    assert recorder.events == []


BAD_BEFORE_HELLO = [
    ('{"type": "message", "id": "m1", "text": "early"}', "the first frame must be a hello"),
    ('{"type": "hello"}', "invalid actor id"),
    ('{"type": "hello", "actor": "short"}', "invalid actor id"),
    ('{"type": "hello", "actor": "' + "a" * 65 + '"}', "invalid actor id"),
    ('{"type": "hello", "actor": "has space in it"}', "invalid actor id"),
    ("{{{", "frame is not valid JSON"),
]


@pytest.mark.parametrize(("raw", "error"), BAD_BEFORE_HELLO)
async def test_hello_is_required_first(nursery: trio.Nursery, raw: str, error: str) -> None:
    with trio.fail_after(10):
        adapter, recorder = await start(nursery)
        async with connect(adapter) as ws:
            await ws.send_message(raw)
            assert await recv(ws) == {"type": "error", "message": error}
            await hello(ws, ACTOR)
    assert recorder.events == []


async def test_no_hello_in_time_closes(nursery: trio.Nursery, autojump_clock: object) -> None:
    adapter, _ = await start(nursery)
    async with connect(adapter) as ws:
        assert await recv(ws) == {"type": "error", "message": "no hello received in time"}
        with pytest.raises(trio_websocket.ConnectionClosed) as info:
            await ws.get_message()
        assert info.value.reason is not None and info.value.reason.code == 1008


async def test_admit_failure_is_an_error_frame(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        adapter, _ = await start(nursery, admit=Recorder(fail=True))
        async with connect(adapter) as ws:
            await hello(ws, ACTOR)
            await send(ws, {"type": "message", "id": "m1", "text": "x"})
            assert await recv(ws) == {
                "type": "error",
                "message": "the message could not be admitted",
            }
            await send(ws, {"type": "message", "id": "m2", "text": "x"})
            assert (await recv(ws))["type"] == "error"
        assert (await http(adapter, get("/healthz")))[0] == 200


async def test_established_sockets_do_not_take_the_places_of_new_connections(
    nursery: trio.Nursery,
) -> None:
    """Two budgets: an established socket leaves the page and ``/healthz`` reachable, and a
    hello into a full set of sockets pushes out the idlest one (1013), not the newcomer."""
    with trio.fail_after(10):
        adapter, _ = await start(nursery, max_pending=1, max_sockets=1)
        async with connect(adapter) as first:
            await hello(first, ACTOR)
            assert (await http(adapter, get("/healthz")))[0] == 200
            async with connect(adapter) as second:
                await hello(second, "actor-b-000002")
                with pytest.raises(trio_websocket.ConnectionClosed) as info:
                    await first.get_message()
                assert info.value.reason is not None
                assert info.value.reason.code == 1013
                await send(second, {"type": "message", "id": "m1", "text": "still here"})
                assert (await recv(second))["status"] == "accepted"
        assert adapter.limiter.statistics()["established"].evicted == 1


async def test_stopping_closes_sockets_with_going_away(nursery: trio.Nursery) -> None:
    adapter = WebchatAdapter(connection_id="web", listen="127.0.0.1:0", admit=Recorder())
    serving = trio.CancelScope()
    stopped = trio.Event()

    async def serve(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with serving:
            await adapter.run(task_status=task_status)
        stopped.set()

    with trio.fail_after(10):
        await nursery.start(serve)
        async with connect(adapter) as ws:
            await hello(ws, ACTOR)
            serving.cancel()  # the daemon stops
            with pytest.raises(trio_websocket.ConnectionClosed) as info:
                await ws.get_message()
            assert info.value.reason is not None and info.value.reason.code == 1001
        started = trio.current_time()
        await stopped.wait()
    # the stop does not wait out the close handshake budget for each socket
    assert trio.current_time() - started < 1.5
    assert adapter.health() == {"listener": "stopped"}


# ---------------------------------------------------------------------- send


async def test_send_reaches_every_socket_of_the_actor_only(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        adapter, _ = await start(nursery)
        async with (
            connect(adapter) as tab1,
            connect(adapter) as tab2,
            connect(adapter) as other,
        ):
            resume = await hello(tab1, ACTOR)
            await hello(tab2, ACTOR, resume)  # a second tab of the same browser
            await hello(other, OTHER)
            assert adapter.statistics().open_sockets == 3
            assert adapter.statistics().actors == 2
            result = await adapter.send(reply("for you"))
            assert result.delivered
            for ws in (tab1, tab2):
                frame = await recv(ws)
                assert frame["text"] == "for you" and frame["inReplyTo"] is None
            await adapter.send(reply("for other", external_conversation_id=OTHER))
            assert (await recv(other))["text"] == "for other"


STALLING_TEXT = "x" * (16 * 1024 * 1024)
"""A reply larger than the kernel buffers of a loopback socket hold: its write to a tab
that reads nothing stalls."""


@pytest.mark.slow
async def test_a_stalled_tab_neither_blocks_nor_keeps_replies(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # jump virtual time only after real idleness, so loopback transfers are never "idle"
    autojump_clock.autojump_threshold = 0.2
    adapter, _ = await start(nursery)
    # a queue of 0 frames: the stalled client reads nothing once ready is consumed
    async with (
        connect(adapter, message_queue_size=0) as stalled,
        connect(adapter, max_message_size=32 * 1024 * 1024) as reader,
    ):
        await hello(reader, ACTOR, await hello(stalled, ACTOR))
        # a first reply fills the stalled client's zero-sized queue: its reader stops reading
        assert (await adapter.send(reply("first"))).delivered
        assert (await recv(reader))["text"] == "first"
        async with trio.open_nursery() as readers:

            async def read_it() -> None:
                frame = await recv(reader)
                assert len(frame["text"]) == len(STALLING_TEXT)

            readers.start_soon(read_it)
            started = trio.current_time()
            result = await adapter.send(reply(STALLING_TEXT))
        assert result.delivered  # the reading tab took it
        assert 9 <= trio.current_time() - started <= 12  # the stalled one was given up on
        await trio.sleep(1)  # virtual: the closed socket's session winds down
        assert adapter.statistics().open_sockets == 1


@pytest.mark.slow
async def test_a_lone_stalled_tab_is_given_up_on_and_the_reply_held(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    # The only tab of the actor is sent to directly (no nursery): its stalled write is
    # still bounded by the send timeout, and the reply is held for the next connection.
    autojump_clock.autojump_threshold = 0.2
    adapter, _ = await start(nursery)
    async with connect(adapter, message_queue_size=0) as stalled:
        await hello(stalled, ACTOR)
        assert (await adapter.send(reply("first"))).delivered  # fills the zero-sized queue
        started = trio.current_time()
        result = await adapter.send(reply(STALLING_TEXT))
        assert result == SendResult.hold("webchat_not_connected")
        assert 9 <= trio.current_time() - started <= 12
        await trio.sleep(1)  # virtual: the dropped socket's session winds down
        assert adapter.statistics().open_sockets == 0
        assert adapter.statistics().replies_held == 1


async def test_send_without_socket_is_held(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        adapter, _ = await start(nursery)
        # not sent and not failed: the runtime keeps it for the actor's next connection
        assert await adapter.send(reply()) == SendResult.hold("webchat_not_connected")
        async with connect(adapter) as ws:
            await hello(ws, ACTOR)
            assert (await adapter.send(reply())).delivered
        # the close handshake is done; let the server's session task finish its cleanup
        await trio.testing.wait_all_tasks_blocked()
        assert adapter.statistics().open_sockets == 0
        result = await adapter.send(reply())
        assert result.held and not result.delivered and result.reason == "webchat_not_connected"
        stats = adapter.statistics()
        assert (stats.replies_held, stats.replies_sent) == (2, 1)


def test_a_held_result_is_never_delivered() -> None:
    with pytest.raises(ValueError, match="held reply is not delivered"):
        SendResult(True, held=True)


# ---------------------------------------------------------------------- access


@pytest.mark.parametrize("listen", ["0.0.0.0:0", "[::]:0", "192.0.2.1:0", "example.org:0"])
async def test_non_loopback_without_token_is_fatal(listen: str) -> None:
    adapter = WebchatAdapter(connection_id="web", listen=listen, admit=Recorder())
    with pytest.raises(AdapterFatalError, match="non-loopback address needs an access token"):
        await adapter.run()
    assert adapter.health() == {"listener": "stopped"}


async def test_pairing_only_may_listen_off_loopback_without_token(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        adapter, recorder = await start(nursery, listen="0.0.0.0:0", pairing_only=True)
        assert adapter.bound is not None
        adapter.bound = ("127.0.0.1", adapter.bound[1])
        # reachable under its public name (no loopback Host check off loopback)
        assert (await http(adapter, get("/", host="chat.example")))[0] == 200
        async with connect(adapter) as ws:
            await hello(ws, ACTOR)
            await send(ws, {"type": "message", "id": "m1", "text": "pair me"})
            assert (await recv(ws))["status"] == "accepted"
    assert len(recorder.events) == 1


@pytest.mark.parametrize("listen", ["8787", "127.0.0.1:", "127.0.0.1:99999", ":8787"])
async def test_bad_listen_is_fatal(listen: str) -> None:
    adapter = WebchatAdapter(connection_id="web", listen=listen, admit=Recorder())
    with pytest.raises(AdapterFatalError, match="HOST:PORT"):
        await adapter.run()


def test_parse_listen() -> None:
    assert parse_listen("127.0.0.1:8787") == ("127.0.0.1", 8787)
    assert parse_listen("[::1]:0") == ("::1", 0)
    assert parse_listen("localhost:80") == ("localhost", 80)


async def test_token_guards_page_and_socket(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        adapter, recorder = await start(nursery, listen="0.0.0.0:0", access_token=SECRET_TOKEN)
        assert adapter.bound is not None
        port = adapter.bound[1]
        adapter.bound = ("127.0.0.1", port)  # reach the wildcard listener over loopback
        assert (await http(adapter, get("/")))[0] == 401
        assert (await http(adapter, get("/?token=wrong")))[0] == 401
        assert (await http(adapter, get("/", extra="Authorization: Bearer nope\r\n")))[0] == 401
        assert (await http(adapter, get(f"/?token={SECRET_TOKEN}")))[0] == 200
        bearer = f"Authorization: Bearer {SECRET_TOKEN}\r\n"
        assert (await http(adapter, get("/", extra=bearer)))[0] == 200
        # with a token any Host is fine (the token is the protection)
        assert (await http(adapter, get(f"/?token={SECRET_TOKEN}", host="chat.example")))[0] == 200

        assert (await http(adapter, upgrade()))[0] == 401
        assert (await http(adapter, upgrade("/ws?token=wrong")))[0] == 401
        assert (await http(adapter, upgrade(extra="Authorization: Bearer x\r\n")))[0] == 401
        async with connect(adapter, f"/ws?token={SECRET_TOKEN}") as ws:
            resume = await hello(ws, ACTOR)
        headers = [(b"authorization", f"Bearer {SECRET_TOKEN}".encode())]
        async with connect(adapter, headers=headers) as ws:
            await hello(ws, ACTOR, resume)
            await send(ws, {"type": "message", "id": "m1", "text": "x"})
            assert (await recv(ws))["status"] == "accepted"
    assert len(recorder.events) == 1


async def test_foreign_origin_is_refused(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        adapter, _ = await start(nursery)
        assert adapter.bound is not None
        host, port = adapter.bound
        refused = await http(adapter, upgrade(extra="Origin: http://evil.example\r\n"))
        assert refused[0] == 403
        # an Origin that only looks alike is refused too
        lookalike = f"Origin: http://{host}:{port}.evil.example\r\n"
        assert (await http(adapter, upgrade(host=f"{host}:{port}", extra=lookalike)))[0] == 403
        same = [(b"origin", f"http://{host}:{port}".encode())]
        async with connect(adapter, headers=same) as ws:
            await hello(ws, ACTOR)


async def test_logs_never_contain_text_or_tokens(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with trio.fail_after(10):
        adapter, _ = await start(nursery, admit=Recorder(fail=True), access_token=SECRET_TOKEN)
        async with connect(adapter, f"/ws?token={SECRET_TOKEN}") as ws:
            await hello(ws, ACTOR)
            await send(ws, {"type": "message", "id": "m1", "text": "secret-text-xyzzy"})
            await recv(ws)
        await http(adapter, get(f"/nope?token={SECRET_TOKEN}"))
    text = caplog.text
    assert "admit failed" in text  # something was logged, so the check below means something
    assert "secret-text-xyzzy" not in text
    assert SECRET_TOKEN not in text
