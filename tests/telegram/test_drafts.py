"""Streaming previews as ``sendMessageDraft`` (behaviours 140–145, adapter side)."""

from __future__ import annotations

from typing import Any

import trio
from trio.testing import MockClock

from adapters.telegram._send import tail_units, utf16_units
from prismd.channel import Preview, Reply
from tests.fakes.telegram_api import FakeBotApi
from tests.support.waiting import wait_until

from .conftest import CONN


def preview(text: str, chat: str = "101", thread: str | None = None, conn: str = CONN) -> Preview:
    return Preview(connection_id=conn, external_conversation_id=chat, text=text, thread_id=thread)


def drafts(fake: FakeBotApi) -> list[tuple[Any, ...]]:
    return [
        (c.params["chat_id"], c.params["draft_id"], c.params["text"])
        for c in fake.calls_to("sendMessageDraft")
    ]


async def test_140_141_drafts_coalesce_latest_wins(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any
) -> None:
    """140: a slow (20 ms) sendMessageDraft and previews ``first ``, ``first second ``,
    ``first second third`` → exactly 2 drafts, the first and the latest. 141: then exactly
    one sendMessage with the final text."""
    fake.chats.add("101")
    fake.delay("sendMessageDraft", 0.02)
    adapter = make_adapter(send_drafts=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        adapter.send_draft(preview("first "))
        await wait_until(lambda: bool(fake.calls_to("sendMessageDraft")), step=0.001)
        adapter.send_draft(preview("first second "))
        adapter.send_draft(preview("first second third"))
        await trio.sleep(1)
        assert (await adapter.send(Reply(CONN, "101", "first second third", "final"))).delivered
        nursery.cancel_scope.cancel()
    assert drafts(fake) == [("101", 1, "first "), ("101", 1, "first second third")]
    assert [c.params["text"] for c in fake.calls_to("sendMessage")] == ["first second third"]


async def test_142_no_drafts_in_groups(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any
) -> None:
    """142: a supergroup topic preview sends no draft; the final keeps its thread."""
    fake.chats.add("-100123")
    adapter = make_adapter(send_drafts=True, allow_groups=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        adapter.send_draft(preview("first", chat="-100123", thread="77"))
        await trio.sleep(1)
        reply = Reply(CONN, "-100123", "first second third", "final", thread_id="77")
        assert (await adapter.send(reply)).delivered
        nursery.cancel_scope.cancel()
    assert fake.calls_to("sendMessageDraft") == []
    assert [c.params for c in fake.calls_to("sendMessage")] == [
        {"chat_id": "-100123", "text": "first second third", "message_thread_id": "77"}
    ]


async def test_143_drafts_off(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any
) -> None:
    """143: send_drafts off → previews are dropped."""
    fake.chats.add("101")
    adapter = make_adapter()
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        adapter.send_draft(preview("first"))
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    assert fake.calls_to("sendMessageDraft") == []


async def test_144_145_draft_tail_connection_and_stop(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any
) -> None:
    """144: 4,000 ``x`` + ``tail`` in thread 77 → one draft of exactly 3,500 units ending in
    ``tail``, thread "77", draft_id 1. 145: another connection, or after stop → no draft."""
    fake.chats.add("101")
    adapter = make_adapter(send_drafts=True)
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        adapter.send_draft(preview("x" * 4000 + "tail", thread="77"))
        adapter.send_draft(preview("other", conn="elsewhere"))
        await trio.sleep(1)
        nursery.cancel_scope.cancel()
    adapter.send_draft(preview("after stop"))
    await trio.sleep(1)
    [call] = fake.calls_to("sendMessageDraft")
    assert call.params["draft_id"] == 1 and call.params["message_thread_id"] == "77"
    assert utf16_units(call.params["text"]) == 3500 and call.params["text"].endswith("tail")


def test_tail_never_splits_a_surrogate_pair() -> None:
    text = "😀" * 1800
    tail = tail_units(text, 3500)
    assert utf16_units(tail) == 3500 and tail == "😀" * 1750
    assert utf16_units(tail_units("a" + "😀" * 1750, 3500)) == 3500
    assert tail_units("a😀", 2) == "😀"
    assert tail_units("😀a", 2) == "a"
