"""Hostile input to the Telegram adapter: updates it has never seen, poison values, oversized
batches and junk update ids. None of them may crash parsing, stall the poller on one update,
or turn polling into a hot loop."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
from trio.testing import MockClock

from adapters.telegram._api import TelegramApi, TelegramNetworkError, TelegramResponseError
from adapters.telegram._updates import parse_update
from prismd.channel import AttachmentRef, Button, Reply, SendResult
from tests.fakes.telegram_api import FakeBotApi
from tests.support.recorder import Recorder
from tests.support.waiting import wait_until, wait_until_async

from .conftest import CONN, ServeBotApi, callback, cursor_value, private_message, run_until_admitted
from .test_webhook import post, webhook_adapter

LONE = "\ud800"


def _update(update_id: int, payload: dict[str, Any]) -> dict[str, Any]:
    return {"update_id": update_id, **payload}


def test_unseen_update_kinds_parse_to_a_deliberate_ignore() -> None:
    """Bot API update kinds and message kinds we do not handle are ignored, never raised."""
    message = private_message("x")["message"]
    no_text = {k: v for k, v in message.items() if k != "text"}
    samples: list[dict[str, Any]] = [
        {"channel_post": {"chat": {"id": -1, "type": "channel"}, "text": "x"}},
        {"message_reaction": {"chat": {"id": 1, "type": "private"}, "date": 1}},
        {"chat_join_request": {"chat": {"id": -1, "type": "supergroup"}}},
        {"poll": {"id": "1"}},
        {"message": {**no_text, "sticker": {"file_id": "s", "width": 1}}},
        {"message": {**no_text, "location": {"latitude": 1.0, "longitude": 2.0}}},
        {"message": {**no_text, "contact": {"phone_number": "1"}}},
        {"message": {**no_text, "poll": {"id": "1"}}},
        {"message": {**no_text, "video": {"file_id": "v"}}},
        {"message": {**message, "chat": None}},
        {"message": {**message, "from": None}},
        {"message": []},
        {
            "callback_query": {
                "id": "q",
                "from": {"id": 2, "is_bot": False},
                "inline_message_id": "abc",
                "data": "p:a:" + "A" * 40,
            }
        },
    ]
    for index, sample in enumerate(samples, start=1):
        parsed = parse_update(_update(index, sample), connection_id="c")
        assert parsed is not None and parsed.event is None and parsed.ignored, sample


def test_lone_surrogates_never_raise_and_never_reach_the_journal() -> None:
    """JSON may carry a lone ``\\ud800``: ids holding one are refused, text gets U+FFFD."""
    message = private_message("x")["message"]
    bad_photo = {**message, "photo": [{"file_id": LONE, "file_size": 1}], "text": ""}
    parsed = parse_update(_update(1, {"message": bad_photo}), connection_id="c")
    assert parsed is not None and parsed.event is None and parsed.ignored == "empty"

    bad_chat = {**message, "chat": {"id": "a" + LONE, "type": "private"}}
    parsed = parse_update(_update(2, {"message": bad_chat}), connection_id="c")
    assert parsed is not None and parsed.event is None and parsed.ignored == "malformed"

    cb = callback("p:a:" + "A" * 40)
    cb["callback_query"]["id"] = LONE
    parsed = parse_update(_update(3, cb), connection_id="c")
    assert parsed is not None and parsed.callback_query_id is None

    text = {**message, "text": f"hi {LONE} there", "caption": None}
    parsed = parse_update(_update(4, {"message": text}), connection_id="c")
    assert parsed is not None and parsed.event is not None
    assert parsed.event.text == "hi \ufffd there"
    parsed.event.text.encode("utf-8")

    doc = {**message, "document": {"file_id": "d", "file_name": LONE, "mime_type": LONE}}
    parsed = parse_update(_update(5, {"message": doc}), connection_id="c")
    assert parsed is not None and parsed.event is not None
    (ref,) = parsed.event.attachments
    assert ref.file_name is None and ref.mime_type is None


async def test_poison_update_does_not_stall_the_poller(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """An update whose parsing once raised (lone surrogate id) is acknowledged; the next
    update still gets through."""
    message = private_message("x")["message"]
    fake.updates = [
        _update(1, {"message": {**message, "photo": [{"file_id": LONE}], "text": ""}}),
        _update(2, private_message("after the poison")),
    ]
    adapter = make_adapter()
    with trio.fail_after(120):
        await run_until_admitted(adapter, recorder)
    assert [e.text for e in recorder.events] == ["after the poison"]


async def test_junk_update_ids_never_hot_loop(
    autojump_clock: MockClock, make_adapter: Any, recorder: Recorder, serve_bot_api: ServeBotApi
) -> None:
    """A server that keeps answering updates without a usable ``update_id`` (string, float,
    negative, huge, not an object) is polled with backoff, not in a tight loop."""
    polls: list[float] = []
    junk: list[Any] = [
        {"update_id": "7", **private_message("a")},
        {"update_id": 8.0, **private_message("b")},
        {"update_id": -1, **private_message("c")},
        {"update_id": 2**60, **private_message("d")},
        None,
        [1, 2],
        "text",
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        method = request.url.path.rsplit("/", 1)[1]
        if method == "getUpdates":
            polls.append(trio.current_time())
            if len(polls) > 500:
                raise AssertionError("hot loop")
            return httpx.Response(200, json={"ok": True, "result": junk})
        if method == "getWebhookInfo":
            return httpx.Response(200, json={"ok": True, "result": {"url": ""}})
        return httpx.Response(200, json={"ok": True, "result": {"username": "b"}})

    adapter = make_adapter(api_origin=await serve_bot_api(handler))
    with trio.move_on_after(60):
        await adapter.run()
    assert recorder.events == []
    assert 2 <= len(polls) <= 60


async def test_backlog_larger_than_the_response_cap_is_drained(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder, store: Any
) -> None:
    """100 long non-ASCII messages (~2.4 MB of JSON) are one legitimate getUpdates answer; the
    poller must not retry that same oversized batch forever."""
    text = "й" * 4000
    for update_id in range(1, 101):
        fake.push_update(private_message(text), update_id=update_id)
    adapter = make_adapter()
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            await recorder.wait_for(100)
            await wait_until(lambda: not fake.updates or fake.updates[0]["update_id"] > 100)
            nursery.cancel_scope.cancel()
    assert [e.event_id for e in recorder.events] == [str(i) for i in range(1, 101)]
    cursor = await cursor_value(store)
    assert cursor is not None and cursor["lastEventId"] == "100"


async def test_webhook_deeply_nested_json_is_400(
    fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """JSON nested deeper than the parser's recursion limit is a 400 like any bad JSON (it used
    to drop the connection without an answer)."""
    adapter = webhook_adapter(make_adapter, max_request_bytes=256 * 1024)
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        assert await post(adapter, b"[" * 100_000 + b"]" * 100_000) == 400
        assert await post(adapter, b'{"update_id": 1, "x": ' + b"[" * 100_000 + b"}") == 400
        assert await post(adapter, json.dumps(_update(9, private_message("ok"))).encode()) == 204
        nursery.cancel_scope.cancel()
    assert [e.event_id for e in recorder.events] == ["9"]


async def test_api_deeply_nested_answer_is_a_response_error(serve_bot_api: ServeBotApi) -> None:
    """A 2xx body nested past the parser's recursion limit is a :class:`TelegramResponseError`
    (a Telegram error the poller backs off from), not a ``RecursionError`` escaping ``run``."""

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"[" * 50_000 + b"]" * 50_000)

    api = TelegramApi(
        token=lambda: "123456:secret-token",
        api_origin=await serve_bot_api(handler),
    )
    try:
        with pytest.raises(TelegramResponseError):
            await api.call("getUpdates", {})
    finally:
        await api.aclose()


async def test_send_with_a_lone_surrogate_is_delivered(fake: FakeBotApi, make_adapter: Any) -> None:
    """An agent's text holding a lone surrogate is sent with U+FFFD: before, httpx's JSON
    encoding raised and the runtime saw an ambiguous delivery for a request never sent."""
    fake.chats.add("101")
    adapter = make_adapter()
    with trio.fail_after(10):
        result = await adapter.send(
            Reply(
                connection_id=CONN,
                external_conversation_id="101",
                text=f"a{LONE}b",
                kind="final",
                buttons=(Button(label=f"x{LONE}", value="p:a:" + "A" * 40),),
            )
        )
    assert result == SendResult(delivered=False, reason="invalid_controls")
    with trio.fail_after(10):
        result = await adapter.send(
            Reply(
                connection_id=CONN, external_conversation_id="101", text=f"a{LONE}b", kind="final"
            )
        )
    assert result.delivered
    assert [c.params["text"] for c in fake.calls_to("sendMessage")] == ["a\ufffdb"]


async def test_trickling_download_is_cut_off(
    autojump_clock: MockClock, make_adapter: Any, serve_bot_api: ServeBotApi
) -> None:
    """A file server that drips one byte every 50 s (inside httpx's read timeout) used to hold
    ``fetch_attachment``, and with it the poller, for as long as it liked."""

    class Drip(httpx.AsyncByteStream):
        async def __aiter__(self) -> Any:
            for _ in range(1000):
                yield b"x"
                await trio.sleep(50)

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/getFile"):
            result = {"file_id": "f", "file_path": "documents/a.txt", "file_size": 1000}
            return httpx.Response(200, json={"ok": True, "result": result})
        return httpx.Response(200, stream=Drip())

    adapter = make_adapter(api_origin=await serve_bot_api(handler))
    start = trio.current_time()
    assert await adapter.fetch_attachment(AttachmentRef("document", "f", 1000)) is None
    assert trio.current_time() - start <= 61


async def test_trickling_api_answer_is_a_network_error(
    autojump_clock: MockClock, serve_bot_api: ServeBotApi
) -> None:
    """Any Bot API call has a whole-request deadline (read timeout + 30 s), so a dripping
    ``getUpdates`` or ``sendMessage`` answer cannot hold the adapter forever."""

    class Drip(httpx.AsyncByteStream):
        async def __aiter__(self) -> Any:
            yield b'{"ok": true, "result": ['
            for _ in range(1000):
                await trio.sleep(20)
                yield b" "

    api = TelegramApi(
        token=lambda: "123456:secret-token",
        api_origin=await serve_bot_api(lambda _r: httpx.Response(200, stream=Drip())),
        read_timeout_s=45.0,
    )
    start = trio.current_time()
    try:
        with pytest.raises(TelegramNetworkError):
            await api.call("getUpdates", {"timeout": 30})
        assert trio.current_time() - start <= 45 + 30 + 1
        start = trio.current_time()
        with pytest.raises(TelegramNetworkError):
            await api.call("sendMessage", {}, read_timeout_s=5.0)
        assert trio.current_time() - start <= 5 + 30 + 1
    finally:
        await api.aclose()


async def _raw_status(address: tuple[str, int], data: bytes) -> bytes:
    stream = await trio.open_tcp_stream(*address)
    async with stream:
        await stream.send_all(data)
        answer = b""
        while chunk := await stream.receive_some(65536):
            answer += chunk
    return answer.split(b"\r\n", 1)[0]


async def test_webhook_malformed_http_gets_400_not_silence(
    fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """Requests h11 cannot parse (bad or negative Content-Length, no Host, a TLS hello, a
    broken chunked body) were dropped without an answer; they get 400 and a close."""
    adapter = webhook_adapter(make_adapter)
    head = (
        b"POST /telegram/telegram-main HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nX-Telegram-Bot-Api-Secret-Token: webhook-secret\r\n"
    )
    cases = [
        head + b"Content-Length: abc\r\n\r\n{}",
        head + b"Content-Length: -5\r\n\r\n",
        b"POST /telegram/telegram-main HTTP/1.1\r\nContent-Type: application/json\r\n\r\n",
        b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 100,
        head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n",
    ]
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        assert adapter.webhook_address is not None
        with trio.fail_after(10):
            for data in cases:
                status_line = await _raw_status(adapter.webhook_address, data)
                assert status_line == b"HTTP/1.1 400 Bad Request", data
        nursery.cancel_scope.cancel()
    assert recorder.events == []


async def test_webhook_oversized_head_is_431_and_wrong_method_names_post(
    fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """The shared head reader (adapters.toolkit._http): a head over 16 KiB gets 431 whether it
    arrives in one piece or trickles; a GET gets 405 with ``Allow: POST``."""
    adapter = webhook_adapter(make_adapter)
    big = b"POST /telegram/telegram-main HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 17_000
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        assert adapter.webhook_address is not None
        with trio.fail_after(10):
            assert await _raw_status(adapter.webhook_address, big + b"\r\n\r\n") == (
                b"HTTP/1.1 431 Request Header Fields Too Large"
            )
            # within h11's incomplete-event bound, but whole: measured after parsing
            near = b"POST /telegram/telegram-main HTTP/1.1\r\nHost: x\r\n"
            near += b"".join(b"X-%d: %s\r\n" % (i, b"v" * 1000) for i in range(17))
            assert await _raw_status(adapter.webhook_address, near + b"\r\n") == (
                b"HTTP/1.1 431 Request Header Fields Too Large"
            )
            host, port = adapter.webhook_address
            async with httpx.AsyncClient() as client:
                response = await client.get(f"http://{host}:{port}{adapter.webhook_path}")
            assert response.status_code == 405 and response.headers["allow"] == "POST"
        nursery.cancel_scope.cancel()
    assert recorder.events == []


async def test_webhook_slow_head_is_408_and_slow_body_is_408(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """Slowloris: the whole head (and the body) must arrive within 30 s, however it drips."""
    adapter = webhook_adapter(make_adapter)
    head = (
        b"POST /telegram/telegram-main HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nX-Telegram-Bot-Api-Secret-Token: webhook-secret\r\n"
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        assert adapter.webhook_address is not None
        body_head = head + b"Content-Length: 100\r\n\r\n"
        for at_once, dripped in ((b"", head), (body_head, b'{"update_id": 1, ' * 10)):
            stream = await trio.open_tcp_stream(*adapter.webhook_address)
            await stream.send_all(at_once)
            started = trio.current_time()
            answer = b""
            async with stream, trio.open_nursery() as client:

                async def drip(stream: trio.SocketStream = stream, data: bytes = dripped) -> None:
                    for byte in data:  # a byte every 0.5 s: each read is quick, the whole is not
                        await stream.send_all(bytes([byte]))
                        await trio.sleep(0.5)

                client.start_soon(drip)
                with trio.fail_after(120):
                    while chunk := await stream.receive_some(65536):
                        # stop sending once answered: bytes to a closed socket reset it
                        client.cancel_scope.cancel()
                        answer += chunk
            assert answer.startswith(b"HTTP/1.1 408 Request Timeout"), answer
            assert 30 <= trio.current_time() - started <= 31
        nursery.cancel_scope.cancel()
    assert recorder.events == []


async def test_slow_hook_keeps_the_receiver_lease(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder, store: Any
) -> None:
    """A transcription taking longer than the lease TTL (a local model on a long voice note)
    used to let the receiver lease lapse mid-update: the adapter then died with
    ReceiverLeaseLostError (a supervisor restart per slow update) and a second daemon could
    start polling meanwhile. The lease is now renewed while an update is processed."""
    from tests.telegram.test_polling import _voice_update

    audio = b"OggS-bytes"
    fake.add_file("voice-1", audio, file_path="voice/file_1.oga")
    fake.push_update(_voice_update(len(audio)), update_id=1)
    fake.push_update(private_message("after"), update_id=2)

    async def transcribe(data: bytes, mime: str) -> str:
        await trio.sleep(150)
        return "slow words"

    adapter = make_adapter(transcribe=transcribe, lease_ttl_ms=40_000)
    rival = make_adapter(owner_id="daemon-b", lease_ttl_ms=40_000)
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            await nursery.start(rival.run)
            assert rival.health()["state"] == "standby"
            await recorder.wait_for(2)
            await wait_until_async(lambda: _cursor_is(store, "2"))
            assert rival.health()["state"] == "standby"
            nursery.cancel_scope.cancel()
    assert [e.text for e in recorder.events] == ["slow words", "after"]


async def _cursor_is(store: Any, last: str) -> bool:
    cursor = await cursor_value(store)
    return cursor is not None and cursor["lastEventId"] == last


async def test_webhook_answers_reach_a_client_still_uploading(
    fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """A 413 (declared too large) and a 401 (wrong secret, body never read) are answered
    before the body arrived; the server closes gracefully, so a client still sending gets
    the answer instead of a reset."""
    adapter = webhook_adapter(make_adapter)
    upload = 2 * 1024 * 1024

    async def status_while_uploading(secret: bytes) -> bytes:
        assert adapter.webhook_address is not None
        stream = await trio.open_tcp_stream(*adapter.webhook_address)
        head = (
            b"POST /telegram/telegram-main HTTP/1.1\r\nHost: x\r\n"
            b"Content-Type: application/json\r\nX-Telegram-Bot-Api-Secret-Token: "
            + secret
            + b"\r\n"
            b"Content-Length: %d\r\n\r\n" % upload
        )
        answer = bytearray()
        async with stream, trio.open_nursery() as nursery:
            await stream.send_all(head)

            async def send_body() -> None:
                try:
                    for _ in range(upload // 65536):
                        await stream.send_all(b"{" * 65536)
                    await stream.send_eof()
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

            nursery.start_soon(send_body)
            while chunk := await stream.receive_some(65536):
                answer += chunk
            nursery.cancel_scope.cancel()
        return bytes(answer).split(b"\r\n", 1)[0]

    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        with trio.fail_after(20):
            for _ in range(3):
                assert (await status_while_uploading(b"webhook-secret")).startswith(
                    b"HTTP/1.1 413 "
                )
                assert await status_while_uploading(b"wrong") == b"HTTP/1.1 401 Unauthorized"
        nursery.cancel_scope.cancel()
    assert recorder.events == []
