"""Files that go with a reply (``TelegramAdapter.send_file``, adapters/telegram/_files.py):
``sendPhoto`` for a JPEG or PNG, ``sendDocument`` otherwise, uploaded as multipart to the
fake Bot API; a rate limit waited out, a gateway's 5xx ambiguous, refusals named."""

from __future__ import annotations

from typing import Any

import pytest
import trio
from trio.testing import MockClock

from adapters.telegram._files import upload_name
from prismd.channel import DeliveryOutcomeUnknownError, OutboundFile, Reply
from tests.fakes.telegram_api import FakeBotApi

from .conftest import CONN

JPEG = b"\xff\xd8\xff\xe0" + bytes(range(256)) + b"\r\n"


def reply(chat: str = "101", **kwargs: Any) -> Reply:
    return Reply(CONN, chat, "here", "final", operation_id="op-1", **kwargs)


async def test_images_go_as_photos_and_the_rest_as_documents(
    fake: FakeBotApi, make_adapter: Any
) -> None:
    fake.chats.add("-100123")
    adapter = make_adapter()
    assert adapter.features.max_file_bytes == 1024 * 1024
    photo = await adapter.send_file(
        reply("-100123", thread_id="77"), OutboundFile("cat.jpg", "image/jpeg", JPEG)
    )
    document = await adapter.send_file(
        reply("-100123"), OutboundFile('a/b\\"notes".txt\n', "text/plain", b"\nnotes\n")
    )
    assert photo.delivered and document.delivered and photo.message_id != document.message_id
    sent_photo, sent_document = fake.sent
    assert sent_photo["photo"] == {
        "filename": "cat.jpg",
        "content_type": "image/jpeg",
        "data": JPEG,
    }
    assert (sent_photo["chat_id"], sent_photo["message_thread_id"]) == ("-100123", "77")
    assert sent_document["document"] == {
        "filename": "abnotes.txt",
        "content_type": "text/plain",
        "data": b"\nnotes\n",
    }
    assert "message_thread_id" not in sent_document


async def test_a_rate_limit_is_waited_out(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any
) -> None:
    fake.chats.add("101")
    fake.rate_limit("sendDocument", 2)
    start = trio.current_time()
    result = await make_adapter().send_file(reply(), OutboundFile("r.pdf", None, b"%PDF"))
    assert result.delivered and trio.current_time() - start >= 2
    assert len(fake.calls_to("sendDocument")) == 2


async def test_refusals_are_named_and_a_gateway_error_is_ambiguous(
    fake: FakeBotApi, make_adapter: Any
) -> None:
    adapter = make_adapter()
    file = OutboundFile("r.pdf", "application/pdf", b"%PDF")
    result = await adapter.send_file(reply(), file)  # a chat the bot does not know
    assert (result.delivered, result.reason) == (False, "telegram_api_error")
    fake.chats.add("101")
    fake.fail_next("sendDocument", status=403, description="Forbidden: bot was blocked")
    result = await adapter.send_file(reply(), file)
    assert (result.delivered, result.reason) == (False, "telegram_forbidden")
    fake.fail_next("sendDocument", status=502, description="", raw_body=b"<html>Bad Gateway</html>")
    with pytest.raises(DeliveryOutcomeUnknownError) as raised:
        await adapter.send_file(reply(), file)
    assert "r.pdf" not in str(raised.value) and raised.value.__cause__ is None
    empty = await adapter.send_file(reply(), OutboundFile("e", None, b""))
    assert (empty.delivered, empty.reason) == (False, "empty_file")
    other = Reply("another-connection", "101", "x", "final")
    assert (await adapter.send_file(other, file)).reason == "invalid_destination"


def test_upload_names_carry_no_path_quote_or_control() -> None:
    assert upload_name('../../etc/"passwd"\r\n') == "....etcpasswd"
    assert upload_name("\x00\x07") == "file"
    assert len(upload_name("n" * 500)) == 128
