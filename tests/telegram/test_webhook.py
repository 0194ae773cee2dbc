"""Webhook mode (contract §11.7; behaviours 129–133, 151) and the set/delete-webhook CLI."""

from __future__ import annotations

import io
import json
from typing import Any

import httpx
import trio
from trio.testing import MockClock

from adapters.telegram import ReceiverLeaseLostError, TelegramAdapter
from prismd.channel import AdapterFatalError, Admission, InboundEvent
from prismd.cli._telegram import adelete_webhook, aset_webhook
from prismd.daemon._config import TelegramConnectionConfig
from tests.fakes.telegram_api import FakeBotApi
from tests.support.recorder import Recorder
from tests.support.waiting import raises_flat

from .conftest import CONN, SERVICE, TOKEN, TOKEN_43, callback, private_message

SECRET = "webhook-secret"
RECEIVER = "prism.channels.v1.telegram.receiver"


def webhook_adapter(make_adapter: Any, **kwargs: Any) -> TelegramAdapter:
    options = {
        "mode": "webhook",
        "webhook_listen": "127.0.0.1:0",
        "webhook_secret": SECRET,
        "max_request_bytes": 1024,
    }
    options.update(kwargs)
    adapter: TelegramAdapter = make_adapter(**options)
    return adapter


async def post(
    adapter: TelegramAdapter,
    body: bytes | dict[str, Any],
    *,
    secret: str | None = SECRET,
    content_type: str = "application/json",
    method: str = "POST",
    path: str | None = None,
) -> int:
    assert adapter.webhook_address is not None
    host, port = adapter.webhook_address
    headers = {"content-type": content_type}
    if secret is not None:
        headers["x-telegram-bot-api-secret-token"] = secret
    content = json.dumps(body).encode() if isinstance(body, dict) else body
    with trio.fail_after(10):
        async with httpx.AsyncClient() as client:
            response = await client.request(
                method,
                f"http://{host}:{port}{path or adapter.webhook_path}",
                content=content if method == "POST" else None,
                headers=headers,
            )
    return response.status_code


async def test_129_130_secret_body_and_admission(
    fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """129: wrong secret → 401. 130: ``{`` → 400, >1024 B → 413, valid → 204, admit once."""
    adapter = webhook_adapter(make_adapter)
    valid = {"update_id": 7, **private_message("hello")}
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        assert await post(adapter, valid, secret="wrong") == 401
        assert await post(adapter, valid, secret=None) == 401
        assert await post(adapter, b"{") == 400
        assert await post(adapter, b"x" * 2000) == 413
        assert await post(adapter, {"no": "update_id"}) == 400
        assert await post(adapter, valid) == 204
        nursery.cancel_scope.cancel()
    assert [e.event_id for e in recorder.events] == ["7"]


async def test_webhook_method_type_and_path(fake: FakeBotApi, make_adapter: Any) -> None:
    """405 for GET, 415 for a non-JSON type, 404 for another path (before the secret)."""
    adapter = webhook_adapter(make_adapter)
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        assert await post(adapter, b"", method="GET") == 405
        assert await post(adapter, b"a=b", content_type="text/plain") == 415
        assert await post(adapter, b"{}", path="/elsewhere") == 404
        assert await post(adapter, b"{}", content_type="application/json; charset=utf-8") == 400
        nursery.cancel_scope.cancel()


async def test_131_retryable_admission_is_503(fake: FakeBotApi, make_adapter: Any) -> None:
    """131: admit answers denied/capacity → 503 so Telegram redelivers."""
    recorder = Recorder(answer=lambda _e: Admission("denied", "capacity"))
    adapter = webhook_adapter(make_adapter, admit=recorder)
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        assert await post(adapter, {"update_id": 1, **private_message()}) == 503
        nursery.cancel_scope.cancel()
    assert len(recorder.events) == 1


async def test_132_not_admissible_is_204_without_admit(fake: FakeBotApi, make_adapter: Any) -> None:
    """132: a group message (groups off), a bot's message, a photo without file ids → 204."""

    async def refuse(event: InboundEvent) -> Admission:
        raise AssertionError("admit must not be called")

    adapter = webhook_adapter(make_adapter, admit=refuse)
    group = private_message()
    group["message"]["chat"] = {"id": -5, "type": "group", "title": "g"}
    bot = private_message()
    bot["message"]["from"]["is_bot"] = True
    photo = private_message()
    del photo["message"]["text"]
    photo["message"]["photo"] = [{"width": 1, "height": 1}]
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        for update_id, update in enumerate((group, bot, photo), start=1):
            assert await post(adapter, {"update_id": update_id, **update}) == 204
        nursery.cancel_scope.cancel()


async def test_133_poller_holds_lease_webhook_503(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """133: a started poller holds the receiver lease → the webhook answers 503."""
    poller = make_adapter(owner_id="daemon-a")
    adapter = webhook_adapter(make_adapter, owner_id="daemon-b")
    async with trio.open_nursery() as nursery:
        await nursery.start(poller.run)
        await nursery.start(adapter.run)
        assert adapter.health()["state"] == "standby"
        assert await post(adapter, {"update_id": 1, **private_message()}) == 503
        nursery.cancel_scope.cancel()
    assert recorder.events == []


async def test_webhook_callback_answered_or_503(fake: FakeBotApi, make_adapter: Any) -> None:
    """A callback query is answered before admission; if answering fails → 503."""
    recorder = Recorder()
    adapter = webhook_adapter(make_adapter, admit=recorder)
    update = {"update_id": 3, **callback(f"p:d:{TOKEN_43}")}
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        fake.fail_next("answerCallbackQuery", status=400, description="Bad Request: query is old")
        assert await post(adapter, update) == 503
        assert recorder.events == []
        assert await post(adapter, update) == 204
        nursery.cancel_scope.cancel()
    [event] = recorder.events
    assert event.approval is not None and event.approval.outcome == "reject_once"
    assert len(fake.calls_to("answerCallbackQuery")) == 2


async def test_151_webhook_voice_transcribed(fake: FakeBotApi, make_adapter: Any) -> None:
    """151: webhook + transcribe hook: 204, event text = transcript, voice ref kept."""
    fake.add_file("voice-9", b"OggS-audio", file_path="voice/file_9.oga")

    async def transcribe(data: bytes, mime: str) -> str:
        assert data == b"OggS-audio"
        return "transcript"

    recorder = Recorder()
    adapter = webhook_adapter(make_adapter, admit=recorder, transcribe=transcribe)
    update = private_message("")
    del update["message"]["text"]
    update["message"]["voice"] = {"file_id": "voice-9", "file_unique_id": "u", "duration": 1}
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        assert await post(adapter, {"update_id": 11, **update}) == 204
        nursery.cancel_scope.cancel()
    [event] = recorder.events
    assert event.text == "transcript" and [a.kind for a in event.attachments] == ["voice"]


async def test_keep_alive_connection_serves_several_updates(
    fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    adapter = webhook_adapter(make_adapter)
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        assert adapter.webhook_address is not None
        host, port = adapter.webhook_address
        headers = {"x-telegram-bot-api-secret-token": SECRET}
        with trio.fail_after(10):
            async with httpx.AsyncClient() as client:
                for update_id in (1, 2, 3):
                    response = await client.post(
                        f"http://{host}:{port}{adapter.webhook_path}",
                        json={"update_id": update_id, **private_message(str(update_id))},
                        headers=headers,
                    )
                    assert response.status_code == 204
        nursery.cancel_scope.cancel()
    assert [e.text for e in recorder.events] == ["1", "2", "3"]


# ---------------------------------------------------------------------- CLI


async def test_cli_set_and_delete_webhook(fake: FakeBotApi) -> None:
    connection = TelegramConnectionConfig(
        id="tg-main",
        token_env="TG_TOKEN",
        api_origin=fake.origin,
        mode="webhook",
        webhook_secret_env="TG_SECRET",
    )
    env = {"TG_TOKEN": TOKEN, "TG_SECRET": SECRET}
    out = io.StringIO()
    url = "https://bot.example.test/telegram/tg-main"
    assert await aset_webhook(connection, env, url=url, out=out) == 0
    assert (fake.webhook_url, fake.webhook_secret) == (url, SECRET)
    assert fake.calls_to("setWebhook")[0].params["allowed_updates"] == [
        "message",
        "callback_query",
        "my_chat_member",
    ]
    assert await adelete_webhook(connection, env, out=out) == 0
    assert fake.webhook_url == ""
    assert await aset_webhook(connection, env, out=out) == 2  # no URL
    bad = {"TG_TOKEN": "999:bad-token", "TG_SECRET": SECRET}
    assert await aset_webhook(connection, bad, url=url, out=out) == 1
    assert await aset_webhook(connection, {"TG_TOKEN": TOKEN}, url=url, out=out) == 2
    assert "secret-token" not in out.getvalue() and "bad-token" not in out.getvalue()
    assert "HTTP 401" in out.getvalue()


async def test_webhook_bad_token_is_fatal(fake: FakeBotApi, make_adapter: Any) -> None:
    adapter = webhook_adapter(make_adapter, token=lambda: "999:wrong-token")
    with raises_flat(AdapterFatalError):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            await trio.sleep_forever()
    assert adapter.health()["state"] == "unauthorized"


async def test_webhook_standby_takes_over_and_loses_lease(
    autojump_clock: MockClock, fake: FakeBotApi, store: Any, make_adapter: Any
) -> None:
    """A standby webhook server takes the lease when it frees (then answers 204), and stops
    with ReceiverLeaseLostError when the lease is taken from it."""
    recorder = Recorder()
    held = await store.leases.try_acquire_lease(
        namespace=RECEIVER, key=f"r1:{CONN}", scope=SERVICE, owner_id="other", ttl_ms=90_000
    )
    adapter = webhook_adapter(make_adapter, admit=recorder)
    with raises_flat(ReceiverLeaseLostError):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            assert adapter.health()["state"] == "standby"
            assert await post(adapter, {"update_id": 1, **private_message()}) == 503
            await store.leases.release_lease(
                namespace=RECEIVER, key=held.key, scope=SERVICE, owner_id="other", token=held.token
            )
            await trio.sleep(31)
            assert adapter.health()["state"] == "serving"
            assert await post(adapter, {"update_id": 2, **private_message()}) == 204
            mine = await store.leases.get_lease(namespace=RECEIVER, key=held.key, scope=SERVICE)
            await store.leases.release_lease(
                namespace=RECEIVER,
                key=held.key,
                scope=SERVICE,
                owner_id=mine.owner_id,
                token=mine.token,
            )
            await trio.sleep(60)
    assert [e.event_id for e in recorder.events] == ["2"]
