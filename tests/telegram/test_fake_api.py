"""The fake Bot API itself follows ``protocols-telegram-signal.md`` §1 (so the adapter tests
mean something): envelopes, offsets, long polls, anti-spin, conflicts, bodies."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
from trio.testing import MockClock

from tests.fakes.telegram_api import CONFLICT_POLLER, CONFLICT_WEBHOOK, FakeBotApi

from .conftest import TOKEN, private_message


async def call(fake: FakeBotApi, method: str, token: str = TOKEN, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.post(f"{fake.origin}/bot{token}/{method}", timeout=120, **kwargs)


@pytest.mark.slow
async def test_envelopes_and_errors(fake: FakeBotApi) -> None:
    ok = await call(fake, "getMe", json={})
    assert ok.json()["ok"] is True and ok.json()["result"]["is_bot"] is True
    bad = await call(fake, "getMe", token="1:nope", json={})
    assert bad.status_code == 401
    assert bad.json() == {
        "ok": False,
        "error_code": 401,
        "description": "Unauthorized: invalid token specified",
    }
    missing = await call(fake, "noSuchMethod", json={})
    assert (missing.status_code, missing.json()["description"]) == (
        404,
        "Not Found: method not found",
    )
    fake.rate_limit("getMe", 35)
    limited = await call(fake, "getMe", json={})
    assert limited.status_code == 429 and limited.headers["retry-after"] == "35"
    assert limited.json()["parameters"] == {"retry_after": 35}
    fake.chats.add("101")
    empty = await call(fake, "sendMessage", data={"chat_id": "101", "text": ""})
    assert empty.json()["description"] == "Bad Request: message text is empty"
    long = await call(fake, "sendMessage", json={"chat_id": 101, "text": "x" * 4097})
    assert long.json()["description"] == "Bad Request: message is too long"
    unknown = await call(fake, "sendMessage", json={"chat_id": 5, "text": "x"})
    assert unknown.json()["description"] == "Bad Request: chat not found"
    form = await call(fake, "sendMessage", data={"chat_id": "101", "text": "form body"})
    assert form.json()["result"]["text"] == "form body"
    action = await call(fake, "sendChatAction", json={"chat_id": 101, "action": "dance"})
    assert action.status_code == 400


async def test_offsets_confirm_and_forget(autojump_clock: MockClock, fake: FakeBotApi) -> None:
    ids = [fake.push_update(private_message(str(i))) for i in range(5)]
    first = (await call(fake, "getUpdates", json={"limit": 2})).json()["result"]
    assert [u["update_id"] for u in first] == ids[:2]
    again = (await call(fake, "getUpdates", json={"offset": ids[2]})).json()["result"]
    assert [u["update_id"] for u in again] == ids[2:]
    assert [u["update_id"] for u in fake.updates] == ids[2:]  # earlier ones confirmed
    last = (await call(fake, "getUpdates", json={"offset": -1})).json()["result"]
    assert [u["update_id"] for u in last] == ids[4:]


async def test_long_poll_wakes_and_times_out(autojump_clock: MockClock, fake: FakeBotApi) -> None:
    start = trio.current_time()
    empty = await call(fake, "getUpdates", json={"timeout": 20})
    assert empty.json() == {"ok": True, "result": []}
    assert trio.current_time() - start >= 20
    async with trio.open_nursery() as nursery:
        results: list[Any] = []

        async def poll() -> None:
            results.append((await call(fake, "getUpdates", json={"timeout": 50})).json())

        nursery.start_soon(poll)
        await trio.sleep(5)
        begin = trio.current_time()
        fake.push_update(private_message("wake"))
    assert trio.current_time() - begin < 1
    assert results[0]["result"][0]["message"]["text"] == "wake"


async def test_anti_spin(autojump_clock: MockClock, fake: FakeBotApi) -> None:
    """Same offset within 3 s with timeout < 3 → the server waits 3 s."""
    await call(fake, "getUpdates", json={"offset": 1, "timeout": 0})
    start = trio.current_time()
    await call(fake, "getUpdates", json={"offset": 1, "timeout": 0})
    assert trio.current_time() - start >= 3


async def test_conflicts(autojump_clock: MockClock, fake: FakeBotApi) -> None:
    """A second poller terminates the pending one with 409; a webhook blocks getUpdates."""
    async with trio.open_nursery() as nursery:
        results: list[httpx.Response] = []

        async def poll() -> None:
            results.append(await call(fake, "getUpdates", json={"timeout": 30}))

        nursery.start_soon(poll)
        await trio.sleep(1)
        nursery.start_soon(poll)
    first, second = results
    assert first.status_code == 409 and first.json()["description"] == CONFLICT_POLLER
    assert second.status_code == 200 and fake.conflicts == 1
    hook = await call(fake, "setWebhook", json={"url": "https://h.test/x", "secret_token": "s"})
    assert hook.json() == {"ok": True, "result": True, "description": "Webhook was set"}
    blocked = await call(fake, "getUpdates", json={})
    assert (blocked.status_code, blocked.json()["description"]) == (409, CONFLICT_WEBHOOK)
    bad = await call(fake, "setWebhook", json={"url": "https://h.test/x", "secret_token": "a b"})
    assert bad.json()["description"] == "Bad Request: secret token contains unallowed characters"
    info = (await call(fake, "getWebhookInfo", json={})).json()["result"]
    assert info["url"] == "https://h.test/x"
    gone = await call(fake, "deleteWebhook", json={})
    assert gone.json()["description"] == "Webhook was deleted"


async def test_a_test_can_wait_for_a_pending_poll(
    autojump_clock: MockClock, fake: FakeBotApi
) -> None:
    """``pending_poll_at`` shows the waiting long poll; ``wait_until`` wakes when a poll
    begins and when a competing one terminates it, so a test can force the 409."""
    assert fake.pending_poll_at is None
    results: list[httpx.Response] = []

    async def poll() -> None:
        results.append(await call(fake, "getUpdates", json={"timeout": 30}))

    with trio.fail_after(20):  # virtual seconds; the first poll alone would wait 30
        async with trio.open_nursery() as nursery:
            await trio.sleep(5)
            nursery.start_soon(poll)
            await fake.wait_until(lambda: fake.pending_poll_at is not None)
            began = fake.pending_poll_at
            assert began is not None and began >= 5
            await trio.sleep(1)
            nursery.start_soon(poll)
            await fake.wait_until(lambda: fake.conflicts == 1)
            now_pending = fake.pending_poll_at
            assert now_pending is not None and now_pending >= began + 1, "the second poll waits"
            fake.push_update(private_message("x"))
    assert [r.status_code for r in results] == [409, 200]
    assert results[0].json()["description"] == CONFLICT_POLLER
    assert fake.pending_poll_at is None


async def test_files_and_multipart(fake: FakeBotApi) -> None:
    fake.chats.add("101")
    fake.add_file("f1", b"bytes!", file_path="documents/file_1.txt")
    info = (await call(fake, "getFile", json={"file_id": "f1"})).json()["result"]
    assert info == {
        "file_id": "f1",
        "file_unique_id": "u-f1",
        "file_path": "documents/file_1.txt",
        "file_size": 6,
    }
    async with httpx.AsyncClient() as client:
        data = await client.get(f"{fake.origin}/file/bot{TOKEN}/documents/file_1.txt")
    assert data.content == b"bytes!"
    voice = await call(
        fake,
        "sendVoice",
        data={"chat_id": "101"},
        files={"voice": ("reply.ogg", b"OggS", "audio/ogg")},
    )
    assert voice.json()["ok"] is True
    assert fake.sent[-1]["voice"] == {
        "filename": "reply.ogg",
        "content_type": "audio/ogg",
        "data": b"OggS",
    }
