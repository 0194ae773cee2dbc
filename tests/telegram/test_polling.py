"""Long polling against the fake Bot API (contract §11.3; behaviours 121–126, 134, 136–138,
146, 148–150), error handling without hot loops, and the receiver lease."""

from __future__ import annotations

import itertools
import logging
from typing import Any

import httpx
import pytest
import trio
import trio.lowlevel
from trio.testing import MockClock

from adapters.telegram import ReceiverLeaseLostError
from prismd.channel import AdapterFatalError, Admission, InboundEvent, Reply
from tests.fakes.telegram_api import CONFLICT_POLLER, FakeBotApi
from tests.support.recorder import Recorder
from tests.support.waiting import raises_flat, wait_until, wait_until_async

from .conftest import (
    CONN,
    SERVICE,
    TOKEN,
    TOKEN_43,
    ServeBotApi,
    callback,
    cursor_value,
    private_message,
    run_until_admitted,
    topic_message,
)


async def test_121_private_update_answered_once(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any
) -> None:
    """121: one private update → exactly one sendMessage ``{chat_id:"101", text:…}``."""
    adapter = None

    async def admit(event: InboundEvent) -> Admission:
        assert adapter is not None
        await adapter.send(
            Reply(
                connection_id=CONN,
                external_conversation_id=event.external_conversation_id,
                text="final answer",
                kind="final",
                in_reply_to=event.event_id,
            )
        )
        return Admission(status="accepted", operation_id="op")

    adapter = make_adapter(admit=admit)
    fake.push_update(private_message("hello Prism"))
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        await wait_until(lambda: bool(fake.sent))
        await trio.sleep(40)  # a further long poll must not re-deliver
        nursery.cancel_scope.cancel()
    assert [c.params for c in fake.calls_to("sendMessage")] == [
        {"chat_id": "101", "text": "final answer"}
    ]


async def test_122_123_sorted_deduplicated_cursor(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder, store: Any
) -> None:
    """122: [2 second, 1 first, 2 duplicate] → 1:first, 2:second. 123: cursor lastEventId "2"."""
    fake.updates = [
        {"update_id": 2, **private_message("second")},
        {"update_id": 1, **private_message("first")},
        {"update_id": 2, **private_message("duplicate")},
    ]
    fake.chats.add("101")
    adapter = make_adapter()
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        await recorder.wait_for(2)
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
    assert [f"{e.event_id}:{e.text}" for e in recorder.events] == ["1:first", "2:second"]
    cursor = await cursor_value(store)
    assert cursor is not None and cursor["lastEventId"] == "2" and cursor["admitted"] == 2
    assert adapter.capabilities["acknowledgement"] == "telegram_offset"
    polls = fake.calls_to("getUpdates")
    assert "offset" not in polls[0].params and polls[1].params["offset"] == 3
    assert polls[0].params["allowed_updates"] == ["message", "callback_query", "my_chat_member"]


async def test_124_stored_cursor_skips_old_updates(
    autojump_clock: MockClock,
    store: Any,
    recorder: Recorder,
    make_adapter: Any,
    serve_bot_api: ServeBotApi,
) -> None:
    """124: cursor at 5, updates [4 old, 900001] (returned even past the offset) → only 900001."""
    await store.checkpoints.save_checkpoint(
        namespace="prism.channels.v1.cursor",
        key=f"c1:{CONN}:prismd-service:{CONN}:-",
        scope=SERVICE,
        version=1,
        expected_version=0,
        value={"admitted": 5, "lastEventId": "5", "updatedAt": "2026-01-01T00:00:00.000Z"},
        category="channel-cursor",
    )
    offsets: list[Any] = []

    def handler(request: httpx.Request) -> httpx.Response:
        method = request.url.path.rsplit("/", 1)[1]
        if method == "getUpdates":
            body = httpx.Request("POST", "http://x", content=request.content).read()
            import json

            offsets.append(json.loads(body).get("offset"))
            if len(offsets) == 1:
                result = [
                    {"update_id": 4, **private_message("old")},
                    {"update_id": 900001, **private_message("week gap")},
                ]
                return httpx.Response(200, json={"ok": True, "result": result})
            return httpx.Response(200, json={"ok": True, "result": []})
        if method == "getWebhookInfo":
            return httpx.Response(200, json={"ok": True, "result": {"url": ""}})
        return httpx.Response(200, json={"ok": True, "result": {"username": "b"}})

    adapter = make_adapter(api_origin=await serve_bot_api(handler))
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        await recorder.wait_for(1)
        await wait_until(lambda: len(offsets) >= 2)
        nursery.cancel_scope.cancel()
    assert [e.text for e in recorder.events] == ["week gap"]
    assert offsets[:2] == [6, 900002]
    cursor = await cursor_value(store)
    assert cursor is not None and cursor["lastEventId"] == "900001" and cursor["admitted"] == 6


async def test_125_retryable_admission_never_acknowledged(
    autojump_clock: MockClock, fake: FakeBotApi, store: Any, make_adapter: Any
) -> None:
    """125: ``denied/unavailable`` → no cursor record, the same offset is re-polled, with
    backoff (no hot loop), and the update is admitted once the runtime accepts it."""
    answers = iter([Admission("denied", "unavailable")] * 4)
    recorder = Recorder(answer=lambda _e: next(answers, Admission("accepted")))
    adapter = make_adapter(admit=recorder)
    fake.push_update(private_message("hi"), update_id=10)
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        await recorder.wait_for(4)
        assert await cursor_value(store) is None
        start = trio.current_time()
        await recorder.wait_for(5)
        elapsed = trio.current_time() - start
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert elapsed >= 4  # the fourth retry waited a backed-off delay (>= 8 s * 0.5)
    assert {e.event_id for e in recorder.events} == {"10"}
    assert all("offset" not in c.params for c in fake.calls_to("getUpdates")[:5])
    cursor = await cursor_value(store)
    assert cursor is not None and cursor["lastEventId"] == "10"


async def test_126_webhook_active_refuses_polling(
    autojump_clock: MockClock, fake: FakeBotApi, store: Any, make_adapter: Any
) -> None:
    """126: getWebhookInfo shows a url → AdapterFatalError, getUpdates never called,
    the receiver lease is released."""
    fake.webhook_url = "https://example.test/hook"
    adapter = make_adapter()
    with raises_flat(AdapterFatalError, match="webhook is active"):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
    assert fake.calls_to("getUpdates") == []
    assert adapter.health()["state"] == "webhook_active"
    lease = await store.leases.get_lease(
        namespace="prism.channels.v1.telegram.receiver", key=f"r1:{CONN}", scope=SERVICE
    )
    assert lease is None


async def test_134_callback_query_answered_and_admitted(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """134: ``p:a:<43>`` callback from 202 in 101 → answerCallbackQuery + approval event."""
    fake.push_update(callback(f"p:a:{TOKEN_43}"))
    fake.push_update(callback("not-ours"))
    adapter = make_adapter()
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        await recorder.wait_for(1)
        await wait_until(lambda: len(fake.calls_to("answerCallbackQuery")) >= 2)
        nursery.cancel_scope.cancel()
    [event] = recorder.events
    assert event.text == "" and event.approval is not None
    assert (event.approval.token, event.approval.outcome) == (TOKEN_43, "allow_once")
    assert (event.external_conversation_id, event.external_actor_id) == ("101", "202")
    assert event.claims == {"platform": "telegram", "chatType": "private", "control": "approval"}
    assert [c.params for c in fake.calls_to("answerCallbackQuery")] == [
        {"callback_query_id": "cbq-1"}
    ] * 2


async def test_136_forum_topic_ignored_without_allow_groups(
    autojump_clock: MockClock, fake: FakeBotApi, store: Any, make_adapter: Any, recorder: Recorder
) -> None:
    """136: supergroup topic message with allow_groups off → nothing admitted, but acked."""
    uid = fake.push_update(topic_message())
    adapter = make_adapter()
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        await wait_until_async(lambda: cursor_value(store))
        nursery.cancel_scope.cancel()
    assert recorder.events == []
    assert (await cursor_value(store) or {})["lastEventId"] == str(uid)


async def test_137_138_groups_and_topics(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """137/138: allow_groups: topic (2), forwarded (3), sender_chat (4, refused), callback (5)."""
    fake.push_update(topic_message("t"), update_id=2)
    fake.push_update(topic_message("fwd", forward_date=1_699_999_999), update_id=3)
    fake.push_update(topic_message("anon", sender_chat={"id": -100123}), update_id=4)
    group = {"id": -100123, "type": "supergroup", "title": "G", "is_forum": True}
    fake.push_update(callback(f"p:a:{TOKEN_43}", chat=group, thread=77), update_id=5)
    adapter = make_adapter(allow_groups=True)
    await run_until_admitted(adapter, recorder, 3)
    assert [e.event_id for e in recorder.events] == ["2", "3", "5"]
    for event in recorder.events:
        assert (event.external_conversation_id, event.external_actor_id) == ("-100123", "202")
        assert event.thread_id == "77" and event.claims["chatType"] == "supergroup"
    first, forwarded, control = recorder.events
    assert first.claims.get("isForum") is True and "forwarded" not in first.claims
    assert forwarded.claims.get("forwarded") is True
    assert control.approval is not None and control.approval.outcome == "allow_once"


async def test_146_photo_largest_size_no_getfile(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """146: photo sizes {small,10} {large,900} + caption → one image ref, getFile unused."""
    update = private_message("")
    del update["message"]["text"]
    update["message"]["caption"] = "look"
    update["message"]["photo"] = [
        {"file_id": "small", "file_unique_id": "s", "file_size": 10, "width": 1, "height": 1},
        {"file_id": "large", "file_unique_id": "l", "file_size": 900, "width": 9, "height": 9},
    ]
    fake.push_update(update)
    adapter = make_adapter(transcribe=_never, extract_document_text=_never)
    await run_until_admitted(adapter, recorder)
    [event] = recorder.events
    assert event.text == "look"
    assert [(a.kind, a.transport_file_id, a.byte_length) for a in event.attachments] == [
        ("image", "large", 900)
    ]
    assert fake.calls_to("getFile") == []


async def _never(_data: bytes, _mime: str) -> str:
    raise AssertionError("hook must not be called")


def _voice_update(size: int) -> dict[str, Any]:
    update = private_message("")
    del update["message"]["text"]
    update["message"]["voice"] = {
        "file_id": "voice-1",
        "file_unique_id": "v",
        "duration": 2,
        "mime_type": "audio/ogg",
        "file_size": size,
    }
    return update


def _document_update() -> dict[str, Any]:
    update = private_message("")
    del update["message"]["text"]
    update["message"]["document"] = {
        "file_id": "doc-1",
        "file_unique_id": "d",
        "file_name": "notes.txt",
        "mime_type": "text/plain",
        "file_size": 5,
    }
    return update


async def test_147_voice_transcribed_before_admission(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """147 (adapter half): the transcribe hook gets ``audio/ogg`` and the exact bytes; the
    transcript becomes the event text, the bytes never reach ``admit``."""
    audio = b"OggS\x00fake-opus-bytes"
    fake.add_file("voice-1", audio, file_path="voice/file_1.oga")
    fake.push_update(_voice_update(len(audio)))
    seen: list[tuple[bytes, str]] = []

    async def transcribe(data: bytes, mime: str) -> str:
        seen.append((data, mime))
        return "spoken words"

    adapter = make_adapter(transcribe=transcribe)
    await run_until_admitted(adapter, recorder)
    assert seen == [(audio, "audio/ogg")]
    [event] = recorder.events
    assert event.text == "spoken words"
    assert [(a.kind, a.byte_length) for a in event.attachments] == [("voice", len(audio))]
    assert "OggS" not in repr(event)


async def test_148_oversized_voice_not_downloaded(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """148: cap 1024, voice of 4096 → getFile called, no download, admitted with empty text."""
    fake.add_file("voice-1", b"x" * 4096, file_path="voice/big.oga")
    fake.push_update(_voice_update(4096))
    adapter = make_adapter(max_attachment_bytes=1024, transcribe=_never)
    await run_until_admitted(adapter, recorder)
    [event] = recorder.events
    assert event.text == "" and event.attachments[0].byte_length == 4096
    assert len(fake.calls_to("getFile")) == 1 and fake.calls_to("<download>") == []


async def test_149_document_without_extractor(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """149: a document and no extractor → empty text, getFile not called."""
    fake.add_file("doc-1", b"hello")
    fake.push_update(_document_update())
    adapter = make_adapter()
    await run_until_admitted(adapter, recorder)
    assert recorder.events[0].text == "" and fake.calls_to("getFile") == []


async def test_150_document_text_extracted(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """150: extractor → attachment ref as declared, text = hook output, getFile then download."""
    fake.add_file("doc-1", b"hello", file_path="documents/file_7.txt")
    fake.push_update(_document_update())

    async def extract(data: bytes, mime: str) -> str:
        return f"{mime}:{data.decode()}"

    adapter = make_adapter(extract_document_text=extract)
    await run_until_admitted(adapter, recorder)
    [event] = recorder.events
    [ref] = event.attachments
    assert (ref.kind, ref.transport_file_id, ref.mime_type, ref.byte_length, ref.file_name) == (
        "document",
        "doc-1",
        "text/plain",
        5,
        "notes.txt",
    )
    assert event.text == "text/plain:hello"
    methods = [c.method for c in fake.calls if c.method in ("getFile", "<download>")]
    assert methods == ["getFile", "<download>"]


async def test_command_mention_of_this_bot_is_stripped(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """``/help@<our bot>`` → ``/help``; ``/help@otherbot`` is not for us (ignored, acked)."""
    fake.push_update(private_message("/help@Prism_Test_Bot now"))
    fake.push_update(private_message("/help@otherbot"))
    fake.push_update(private_message("/status"))
    adapter = make_adapter()
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        await recorder.wait_for(2)
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert [e.text for e in recorder.events] == ["/help now", "/status"]
    assert adapter.bot_username == "prism_test_bot"


# ---------------------------------------------------------------------- errors, no hot loop


async def test_429_storm_honours_retry_after(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """Ten 429s with retry_after 5 → ten spaced polls (≥5 s apart), then the update."""
    fake.rate_limit("getUpdates", 5, times=10)
    fake.push_update(private_message("after storm"))
    adapter = make_adapter()
    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        await nursery.start(adapter.run)
        await recorder.wait_for(1)
        elapsed = trio.current_time() - start
        nursery.cancel_scope.cancel()
    polls = fake.calls_to("getUpdates")
    assert len(polls) == 11 and elapsed >= 50
    gaps = [b.at - a.at for a, b in itertools.pairwise(polls)]
    assert min(gaps[:10]) >= 5


async def test_retry_after_header_alone_is_honoured(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """A 429 whose retry delay is only in the ``Retry-After`` header is honoured too."""
    fake.fail_next("getUpdates", status=429, description="Too Many Requests", retry_after_header=7)
    fake.push_update(private_message("x"))
    adapter = make_adapter()
    await run_until_admitted(adapter, recorder)
    first, second = fake.calls_to("getUpdates")[:2]
    assert second.at - first.at >= 7


async def test_5xx_backoff_is_exponential_and_bounded(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """Twelve 502s → growing gaps (jittered exponential), capped at 30 s, never a hot loop."""
    fake.fail_next("getUpdates", status=502, description="Bad Gateway", times=12)
    fake.push_update(private_message("x"))
    adapter = make_adapter()
    await run_until_admitted(adapter, recorder)
    polls = fake.calls_to("getUpdates")
    gaps = [b.at - a.at for a, b in itertools.pairwise(polls)]
    assert len(polls) == 13
    assert gaps[0] >= 0.5 and gaps[4] >= 8 and max(gaps) <= 30.5
    assert sum(gaps) > 100


async def test_network_errors_back_off(
    autojump_clock: MockClock, make_adapter: Any, recorder: Recorder, serve_bot_api: ServeBotApi
) -> None:
    """Connection failures are retried with backoff, not in a hot loop."""
    attempts: list[float] = []

    def handler(request: httpx.Request) -> httpx.Response:
        attempts.append(trio.current_time())
        raise httpx.ConnectError(f"cannot reach {request.url}")

    adapter = make_adapter(api_origin=await serve_bot_api(handler))
    with trio.move_on_after(120):
        await adapter.run()
    assert 4 <= len(attempts) <= 12
    assert adapter.health()["state"] == "stopped"


async def test_409_other_poller_survived(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """An outside poller steals getUpdates: 409s are spaced ≥3 s; we keep polling."""
    fake.fail_next("getUpdates", status=409, description=CONFLICT_POLLER, times=6)
    fake.push_update(private_message("x"))
    adapter = make_adapter()
    await run_until_admitted(adapter, recorder)
    polls = fake.calls_to("getUpdates")
    assert len(polls) == 7
    assert all(b.at - a.at >= 3 for a, b in itertools.pairwise(polls))
    assert len(fake.calls_to("getWebhookInfo")) == 7  # re-checked after every 409


async def test_real_concurrent_poller_conflict(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """A foreign poller on the same bot (a real second getUpdates) → fake's 409s, no hot loop."""
    adapter = make_adapter()
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)

        async def intruder() -> None:
            async with httpx.AsyncClient() as client:
                for _ in range(5):
                    await client.post(
                        f"{fake.origin}/bot{TOKEN}/getUpdates", json={"timeout": 10}, timeout=60
                    )

        await intruder()
        fake.push_update(private_message("after"))
        await recorder.wait_for(1)
        nursery.cancel_scope.cancel()
    assert fake.conflicts >= 2
    assert len(fake.calls_to("getUpdates")) < 40


async def test_webhook_set_while_polling_is_fatal(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any
) -> None:
    """setWebhook by someone else terminates our poll (409) → getWebhookInfo → fatal."""
    adapter = make_adapter()
    with raises_flat(AdapterFatalError):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            await trio.sleep(5)
            async with httpx.AsyncClient() as client:
                await client.post(
                    f"{fake.origin}/bot{TOKEN}/setWebhook", json={"url": "https://h.test/x"}
                )
    assert adapter.health()["state"] == "webhook_active"


async def test_401_is_fatal_and_unauthorized(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any
) -> None:
    """A rejected token → AdapterFatalError, health ``unauthorized`` while failing."""
    adapter = make_adapter(token=lambda: "999:wrong-token")
    states: list[str] = []
    with raises_flat(AdapterFatalError) as info:
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
    assert "wrong-token" not in repr(info.value)
    assert len(fake.calls) == 1 and fake.calls[0].method == "getMe"
    states.append(adapter.health()["state"])
    assert states == ["unauthorized"]


async def test_403_during_polling_is_fatal(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any
) -> None:
    fake.fail_next("getUpdates", status=403, description="Forbidden: bot was kicked")
    adapter = make_adapter()
    with raises_flat(AdapterFatalError):
        await adapter.run()
    assert adapter.health()["state"] == "unauthorized"


async def test_no_token_in_logs(
    autojump_clock: MockClock,
    fake: FakeBotApi,
    make_adapter: Any,
    recorder: Recorder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """caplog at DEBUG on every logger (httpx included): the token never appears."""
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.DEBUG, logger="httpx")
    caplog.set_level(logging.DEBUG, logger="httpcore")
    fake.fail_next("getUpdates", status=502, description="Bad Gateway")
    fake.push_update(private_message("x"))
    adapter = make_adapter()
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        await recorder.wait_for(1)
        await adapter.send(Reply(CONN, "101", "answer", "final"))
        nursery.cancel_scope.cancel()
    assert "secret-token" not in caplog.text and TOKEN not in caplog.text
    for record in caplog.records:
        assert "secret-token" not in str(record.args)


# ---------------------------------------------------------------------- receiver lease


async def test_two_adapters_one_store_one_poller(
    autojump_clock: MockClock, fake: FakeBotApi, store: Any, make_adapter: Any, recorder: Recorder
) -> None:
    """Only the lease holder polls; the other waits in standby and takes over on exit."""
    first = make_adapter(owner_id="daemon-a")
    second = make_adapter(owner_id="daemon-b")
    async with trio.open_nursery() as outer:
        first_scope = trio.CancelScope()

        async def run_first() -> None:
            with first_scope:
                await first.run()

        outer.start_soon(run_first)
        await trio.sleep(1)
        await outer.start(second.run)
        assert (first.health()["state"], second.health()["state"]) == ("polling", "standby")
        fake.push_update(private_message("one"))
        await recorder.wait_for(1)
        await trio.sleep(60)
        assert fake.conflicts == 0
        first_scope.cancel()
        await trio.sleep(40)
        assert second.health()["state"] == "polling"
        fake.push_update(private_message("two"))
        await recorder.wait_for(2)
        outer.cancel_scope.cancel()
    assert [e.text for e in recorder.events] == ["one", "two"]
    assert fake.conflicts == 0


async def test_restarted_daemon_adopts_its_own_lease(
    autojump_clock: MockClock, fake: FakeBotApi, store: Any, make_adapter: Any, recorder: Recorder
) -> None:
    """SPEC difference 8: a lease left by our own predecessor is taken over at once."""
    left = await store.leases.try_acquire_lease(
        namespace="prism.channels.v1.telegram.receiver",
        key=f"r1:{CONN}",
        scope=SERVICE,
        owner_id="daemon-a",
        ttl_ms=90_000,
    )
    assert left is not None
    adapter = make_adapter(owner_id="daemon-a")
    fake.push_update(private_message("x"))
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        assert adapter.health()["state"] == "polling"
        await recorder.wait_for(1)
        nursery.cancel_scope.cancel()
    assert trio.current_time() < 30
    other = make_adapter(owner_id="daemon-a", adopt=False)
    await store.leases.try_acquire_lease(
        namespace="prism.channels.v1.telegram.receiver",
        key=f"r1:{CONN}",
        scope=SERVICE,
        owner_id="daemon-a",
        ttl_ms=90_000,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(other.run)
        assert other.health()["state"] == "standby"
        nursery.cancel_scope.cancel()


async def test_lost_lease_stops_polling(
    autojump_clock: MockClock, fake: FakeBotApi, store: Any, make_adapter: Any
) -> None:
    """Someone else takes the lease (ours expired) → run raises ReceiverLeaseLostError."""
    adapter = make_adapter(lease_ttl_ms=45_000, poll_timeout_s=30)
    with raises_flat(ReceiverLeaseLostError):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            lease = await store.leases.get_lease(
                namespace="prism.channels.v1.telegram.receiver", key=f"r1:{CONN}", scope=SERVICE
            )
            await store.leases.release_lease(
                namespace=lease.namespace,
                key=lease.key,
                scope=SERVICE,
                owner_id=lease.owner_id,
                token=lease.token,
            )
            await store.leases.try_acquire_lease(
                namespace=lease.namespace,
                key=lease.key,
                scope=SERVICE,
                owner_id="intruder",
                ttl_ms=300_000,
            )
            await trio.sleep(100)
    assert len(fake.calls_to("getUpdates")) <= 2


async def test_restart_mid_batch_answers_each_update_once(
    autojump_clock: MockClock, fake: FakeBotApi, store: Any, make_adapter: Any
) -> None:
    """The adapter dies while admitting update 2 of 3; its successor re-polls from 2.
    With a journal-like admit (dedup by event id) every update is answered exactly once."""
    journal: set[str] = set()
    answered: list[str] = []
    block = trio.Event()

    async def admit(event: InboundEvent) -> Admission:
        if event.text == "two" and not block.is_set():
            block.set()
            await trio.sleep_forever()
        if event.event_id in journal:
            return Admission("accepted", operation_id="op", duplicate=True)
        journal.add(event.event_id)
        answered.append(event.text)
        return Admission("accepted", operation_id="op")

    for text in ("one", "two", "three"):
        fake.push_update(private_message(text))
    async with trio.open_nursery() as nursery:
        await nursery.start(make_adapter(admit=admit).run)
        await block.wait()
        nursery.cancel_scope.cancel()
    async with trio.open_nursery() as nursery:
        await nursery.start(make_adapter(admit=admit).run)
        await wait_until(lambda: len(answered) >= 3)
        await trio.sleep(35)
        nursery.cancel_scope.cancel()
    assert answered == ["one", "two", "three"]
    cursor = await cursor_value(store)
    assert cursor is not None and cursor["admitted"] == 3


async def test_slow_batch_keeps_the_lease(
    autojump_clock: MockClock, fake: FakeBotApi, store: Any, make_adapter: Any
) -> None:
    """A batch whose admits outlast the lease TTL renews between updates: an intruder
    trying every 5 s never gets the lease, and polling carries on."""
    done: list[str] = []

    async def slow_admit(event: InboundEvent) -> Admission:
        await trio.sleep(20)
        done.append(event.text)
        return Admission("accepted", operation_id="op")

    for text in ("a", "b", "c", "d"):
        fake.push_update(private_message(text))
    adapter = make_adapter(admit=slow_admit, lease_ttl_ms=40_000, poll_timeout_s=30)
    stolen: list[object] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)

        async def intruder() -> None:
            while True:
                await trio.sleep(5)
                lease = await store.leases.try_acquire_lease(
                    namespace="prism.channels.v1.telegram.receiver",
                    key=f"r1:{CONN}",
                    scope=SERVICE,
                    owner_id="intruder",
                    ttl_ms=40_000,
                )
                if lease is not None:
                    stolen.append(lease)

        nursery.start_soon(intruder)
        await wait_until(lambda: len(done) == 4)
        await trio.sleep(1)
        assert adapter.health()["state"] == "polling"
        nursery.cancel_scope.cancel()
    assert stolen == [] and done == ["a", "b", "c", "d"]


async def test_send_survives_run_restart(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any
) -> None:
    """``send`` uses its own client: a send in flight while ``run`` ends still completes."""
    fake.chats.add("101")
    fake.delay("sendMessage", 2)
    adapter = make_adapter()
    results: list[Any] = []
    async with trio.open_nursery() as outer:
        run_scope = trio.CancelScope()

        async def run() -> None:
            with run_scope:
                await adapter.run()

        outer.start_soon(run)
        await trio.sleep(1)

        async def send() -> None:
            results.append(await adapter.send(Reply(CONN, "101", "in flight", "final")))

        outer.start_soon(send)
        await trio.sleep(1)
        run_scope.cancel()
    assert results and results[0].delivered
