"""Sending (contract §11.6; behaviours 127, 128, 135, 139, 154–156), typing, and attachments
(§11.5; behaviours 152, 153)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from adapters.telegram._send import chunk_text, utf16_units
from prismd.channel import AttachmentRef, Button, DeliveryOutcomeUnknownError, Reply, SendResult
from tests.fakes.telegram_api import FakeBotApi

from .conftest import CONN, TOKEN, TOKEN_43, ServeBotApi


def final(text: str, chat: str = "101", **kwargs: Any) -> Reply:
    return Reply(
        connection_id=CONN, external_conversation_id=chat, text=text, kind="final", **kwargs
    )


async def test_127_rate_limited_chunked_emoji(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any
) -> None:
    """127: first sendMessage 429 (retry_after 1); 1,800 emoji → 3 calls, 2 chunks ≤3,500
    units, no chunk ending in a high surrogate."""
    fake.chats.add("101")
    fake.rate_limit("sendMessage", 1)
    adapter = make_adapter()
    start = trio.current_time()
    result = await adapter.send(final("😀" * 1800))
    assert result.delivered and trio.current_time() - start >= 1
    calls = fake.calls_to("sendMessage")
    assert len(calls) == 3
    for call in calls[1:]:
        text = call.params["text"]
        units = text.encode("utf-16-le")
        assert len(units) // 2 <= 3500
        assert not 0xD800 <= int.from_bytes(units[-2:], "little") <= 0xDBFF
    assert "".join(c.params["text"] for c in calls[1:]) == "😀" * 1800
    await adapter.aclose()


def test_chunking_counts_utf16_units() -> None:
    assert chunk_text("") == []
    assert [utf16_units(c) for c in chunk_text("a" + "😀" * 1750)] == [3499, 2]
    assert chunk_text("x" * 7000) == ["x" * 3500] * 2


async def test_128_network_error_is_ambiguous_without_token(
    make_adapter: Any, serve_bot_api: ServeBotApi
) -> None:
    """128: a transport error whose text holds the URL → exactly
    ``Telegram delivery outcome unknown``; neither the message nor the chain holds the token."""

    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"boom at {request.url}")

    adapter = make_adapter(api_origin=await serve_bot_api(handler))
    with pytest.raises(DeliveryOutcomeUnknownError) as info:
        await adapter.send(final("hi"))
    assert str(info.value) == "Telegram delivery outcome unknown"
    chain: list[BaseException] = []
    error: BaseException | None = info.value
    while error is not None:
        chain.append(error)
        error = error.__cause__ or error.__context__
    assert all("secret-token" not in repr(e) for e in chain)


async def test_135_controls_inline_keyboard(fake: FakeBotApi, make_adapter: Any) -> None:
    """135: controls → one-row inline keyboard on the (last) chunk; messageId "1"."""
    fake.chats.add("101")
    adapter = make_adapter()
    value = f"p:a:{TOKEN_43}"
    result = await adapter.send(final("approve?", buttons=(Button("Allow once", value),)))
    assert result == SendResult(delivered=True, message_id="1")
    [call] = fake.calls_to("sendMessage")
    assert call.params["reply_markup"] == {
        "inline_keyboard": [[{"text": "Allow once", "callback_data": value}]]
    }
    long = await adapter.send(final("y" * 4000, buttons=(Button("Deny", "p:d:" + "B" * 43),)))
    assert long.delivered
    first, last = fake.calls_to("sendMessage")[1:]
    assert "reply_markup" not in first.params and "reply_markup" in last.params
    await adapter.aclose()


async def test_139_thread_id_sent(fake: FakeBotApi, make_adapter: Any) -> None:
    """139: a final to -100123 thread 77 → body with ``message_thread_id "77"``."""
    fake.chats.add("-100123")
    adapter = make_adapter()
    result = await adapter.send(final("answer", chat="-100123", thread_id="77"))
    assert result == SendResult(delivered=True, message_id="1")
    assert [c.params for c in fake.calls_to("sendMessage")] == [
        {"chat_id": "-100123", "text": "answer", "message_thread_id": "77"}
    ]
    await adapter.aclose()


@pytest.mark.parametrize(
    ("status", "description", "parameters", "reason"),
    [
        (403, "Forbidden: bot was blocked by the user", None, "telegram_forbidden"),
        (400, "Bad Request: chat not found", None, "telegram_api_error"),
        (401, "Unauthorized", None, "telegram_unauthorized"),
        (
            400,
            "Bad Request: group chat was upgraded to a supergroup chat",
            {"migrate_to_chat_id": -1001555296434},
            "telegram_chat_migrated",
        ),
    ],
)
async def test_known_failures_map_to_reasons(
    fake: FakeBotApi,
    make_adapter: Any,
    status: int,
    description: str,
    parameters: Any,
    reason: str,
) -> None:
    fake.chats.add("101")
    fake.fail_next("sendMessage", status=status, description=description, parameters=parameters)
    adapter = make_adapter()
    assert await adapter.send(final("hi")) == SendResult(delivered=False, reason=reason)
    await adapter.aclose()


async def test_unknown_chat_and_rate_limit_exhaustion(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any
) -> None:
    """The fake's own validation (chat not found) and five 429s → rate_limited, 5 attempts."""
    adapter = make_adapter()
    assert (await adapter.send(final("hi", chat="555"))).reason == "telegram_api_error"
    fake.chats.add("101")
    fake.rate_limit("sendMessage", 2, times=5)
    assert (await adapter.send(final("hi"))).reason == "telegram_rate_limited"
    assert len(fake.calls_to("sendMessage")) == 6
    await adapter.aclose()


async def test_second_chunk_failure_is_ambiguous(fake: FakeBotApi, make_adapter: Any) -> None:
    fake.chats.add("101")
    adapter = make_adapter()
    fake.fail_next("sendMessage", status=400, description="Bad Request: chat not found")
    assert (await adapter.send(final("x"))).reason == "telegram_api_error"
    fake.fail_next(
        "sendMessage", status=403, description="Forbidden: bot was blocked by the user", after=1
    )
    with pytest.raises(DeliveryOutcomeUnknownError, match=r"^Telegram delivery outcome unknown$"):
        await adapter.send(final("z" * 5000))
    await adapter.aclose()


async def test_garbled_success_body_is_ambiguous(fake: FakeBotApi, make_adapter: Any) -> None:
    """An unreadable 200 answer may hide a posted message: ambiguous, not a failure
    (a deliberate fix of the reference's quirk 11)."""
    fake.chats.add("101")
    fake.fail_next("sendMessage", status=200, description="", raw_body=b"<html>oops")
    adapter = make_adapter()
    with pytest.raises(DeliveryOutcomeUnknownError):
        await adapter.send(final("hi"))
    await adapter.aclose()


@pytest.mark.parametrize("status", [500, 502, 503, 504])
async def test_gateway_5xx_without_telegram_body_is_ambiguous(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, status: int
) -> None:
    """A 5xx whose body is not Telegram's JSON envelope (a proxy/gateway page) is ambiguous.

    Why: the gateway may have forwarded ``sendMessage`` and lost Telegram's answer, so the
    message may already be in the chat. Reporting ``delivery_failed`` would let reconcile
    resend without ``acknowledge_duplicate_risk`` and the user could see the answer twice;
    ``delivery_unknown`` makes the operator decide. It is also not retried in-process even
    with a ``Retry-After`` header (a retry is exactly the duplicate we avoid): one call only.
    """
    fake.chats.add("101")
    fake.fail_next(
        "sendMessage",
        status=status,
        description="",
        raw_body=b"<html>Bad Gateway</html>",
        retry_after_header=1,
    )
    adapter = make_adapter()
    with pytest.raises(DeliveryOutcomeUnknownError, match=r"^Telegram delivery outcome unknown$"):
        await adapter.send(final("hi"))
    assert len(fake.calls_to("sendMessage")) == 1
    await adapter.aclose()


async def test_telegram_5xx_envelope_stays_a_failure(fake: FakeBotApi, make_adapter: Any) -> None:
    """A parsable ``{"ok": false, "error_code": 5xx}`` is Telegram's own verdict that the call
    failed (contract: a known API error is a definite failure), so it stays
    ``telegram_api_error``; only an unreadable gateway answer is ambiguous."""
    fake.chats.add("101")
    fake.fail_next("sendMessage", status=500, description="Internal Server Error")
    adapter = make_adapter()
    assert (await adapter.send(final("hi"))).reason == "telegram_api_error"
    fake.fail_next("sendMessage", status=400, description="", raw_body=b"<html>Bad Request")
    assert (await adapter.send(final("hi"))).reason == "telegram_api_error"
    await adapter.aclose()


async def test_invalid_replies_refused_without_calls(fake: FakeBotApi, make_adapter: Any) -> None:
    adapter = make_adapter()
    assert (await adapter.send(Reply("other", "101", "x", "final"))).reason == (
        "invalid_destination"
    )
    assert (await adapter.send(final("x", chat=""))).reason == "invalid_destination"
    assert (await adapter.send(final(""))).reason == "empty_reply"
    assert (await adapter.send(final("x", buttons=(Button("", "v"),)))).reason == (
        "invalid_controls"
    )
    many = tuple(Button(str(i), "v") for i in range(9))
    assert (await adapter.send(final("x", buttons=many))).reason == "invalid_controls"
    assert (await adapter.send(final("x", buttons=(Button("a", "v" * 65),)))).reason == (
        "invalid_controls"
    )
    assert fake.calls == []


async def test_send_typing(fake: FakeBotApi, make_adapter: Any) -> None:
    fake.chats.add("-100123")
    adapter = make_adapter()
    await adapter.send_typing("-100123", "77")
    await adapter.send_typing("999")  # unknown chat: 400 swallowed
    assert [c.params for c in fake.calls_to("sendChatAction")] == [
        {"chat_id": "-100123", "action": "typing", "message_thread_id": "77"},
        {"chat_id": "999", "action": "typing"},
    ]
    await adapter.aclose()


# ---------------------------------------------------------------------- voice (154–156)


async def test_154_synthesized_voice_after_text(fake: FakeBotApi, make_adapter: Any) -> None:
    """154: synthesize → OGG: text message, then sendVoice (multipart) with chat, thread."""
    fake.chats.add("101")
    audio = b"OggS" + b"\x01" * 60

    async def synthesize(text: str) -> tuple[bytes, str]:
        return audio, "ogg"

    adapter = make_adapter(synthesize=synthesize)
    result = await adapter.send(final("spoken", thread_id="77"))
    assert result.delivered and result.message_id == "1"
    [voice] = fake.calls_to("sendVoice")
    assert voice.params["chat_id"] == "101" and voice.params["message_thread_id"] == "77"
    blob = voice.params["voice"]
    assert (blob["filename"], blob["content_type"], blob["data"]) == (
        "reply.ogg",
        "audio/ogg",
        audio,
    )
    assert len(fake.calls_to("sendMessage")) == 1
    await adapter.aclose()


async def test_155_failing_hook_or_notice_sends_no_voice(
    fake: FakeBotApi, make_adapter: Any
) -> None:
    """155: the hook raises → delivered, no voice; a notice → delivered, no voice."""
    fake.chats.add("101")
    calls: list[str] = []

    async def broken(text: str) -> tuple[bytes, str]:
        calls.append(text)
        raise RuntimeError("tts down")

    adapter = make_adapter(synthesize=broken)
    assert (await adapter.send(final("a"))).delivered
    assert (await adapter.send(Reply(CONN, "101", "notice", "notice"))).delivered
    assert calls == ["a"] and fake.calls_to("sendVoice") == []
    await adapter.aclose()


async def test_156_unsupported_voice_format_skipped(fake: FakeBotApi, make_adapter: Any) -> None:
    """156: format ``wav`` → only sendMessage."""
    fake.chats.add("101")

    async def wav(text: str) -> tuple[bytes, str]:
        return b"RIFF....", "wav"

    adapter = make_adapter(synthesize=wav)
    assert (await adapter.send(final("a"))).delivered
    assert [c.method for c in fake.calls] == ["sendMessage"]
    await adapter.aclose()


# ---------------------------------------------------------------------- attachments


async def test_152_153_fetch_attachment(fake: FakeBotApi, make_adapter: Any) -> None:
    """152: a well-formed ref → bytes + the ref's mime; bad refs → None with no call;
    153: after stop → None."""
    fake.add_file("doc-1", b"hello", file_path="documents/file_1.txt")
    adapter = make_adapter()
    ref = AttachmentRef("document", "doc-1", 5, "text/plain", "notes.txt")
    fetched = await adapter.fetch_attachment(ref)
    assert fetched is not None
    assert (fetched.data, fetched.mime_type, fetched.file_name) == (
        b"hello",
        "text/plain",
        "notes.txt",
    )
    assert await adapter.fetch_attachment(AttachmentRef("document", "", 5)) is None
    assert await adapter.fetch_attachment(AttachmentRef("video", "doc-1", 5)) is None  # type: ignore[arg-type]
    assert await adapter.fetch_attachment(AttachmentRef("document", "doc-1", -1)) is None
    assert len(fake.calls_to("getFile")) == 1
    await adapter.aclose()
    assert await adapter.fetch_attachment(ref) is None
    assert len(fake.calls_to("getFile")) == 1


@pytest.mark.parametrize(
    "file_path", ["../secret", "a/b/c/d/e", "docs/./x", "docs/x y", "/abs", "a" * 257]
)
async def test_fetch_refuses_bad_paths(fake: FakeBotApi, make_adapter: Any, file_path: str) -> None:
    fake.add_file("f", b"data", file_path=file_path)
    adapter = make_adapter()
    assert await adapter.fetch_attachment(AttachmentRef("document", "f", 4)) is None
    assert fake.calls_to("<download>") == []
    await adapter.aclose()


async def test_fetch_caps_and_redirects(fake: FakeBotApi, make_adapter: Any) -> None:
    """Declared too large → no download; understated size → cut off while streaming;
    a redirect is never followed."""
    adapter = make_adapter(max_attachment_bytes=1024)
    fake.add_file("big", b"x" * 2048, file_path="documents/big.bin")
    assert await adapter.fetch_attachment(AttachmentRef("document", "big", 10)) is None
    assert fake.calls_to("<download>") == []
    fake.add_file("liar", b"x" * 4096, file_path="documents/liar.bin", size=10)
    assert await adapter.fetch_attachment(AttachmentRef("document", "liar", 10)) is None
    assert len(fake.calls_to("<download>")) == 1
    fake.add_file("moved", b"x", file_path="documents/moved.bin")
    fake.redirect_paths.add("documents/moved.bin")
    assert await adapter.fetch_attachment(AttachmentRef("document", "moved", 1)) is None
    assert [c.params["path"] for c in fake.calls_to("<download>")][-1] == "documents/moved.bin"
    assert all(c.token_ok for c in fake.calls)
    await adapter.aclose()


async def test_token_is_read_per_request(fake: FakeBotApi, make_adapter: Any) -> None:
    """The credential source is called on every request (rotation works without restart)."""
    fake.chats.add("101")
    tokens = iter([TOKEN, "999:rotated-bad", TOKEN])
    adapter = make_adapter(token=lambda: next(tokens))
    assert (await adapter.send(final("a"))).delivered
    assert (await adapter.send(final("b"))).reason == "telegram_unauthorized"
    assert (await adapter.send(final("c"))).delivered

    def broken() -> str:
        raise OSError("credential file at /run/secret-token gone")

    adapter2 = make_adapter(token=broken)
    assert (await adapter2.send(final("d"))).reason == "telegram_credential"
    await adapter.aclose()
    await adapter2.aclose()


@given(st.text(min_size=0, max_size=9000), st.integers(min_value=2, max_value=4000))
@settings(max_examples=60, deadline=None)
def test_chunking_property(text: str, limit: int) -> None:
    """Chunks rebuild the text, stay within the unit budget, and never start or end inside
    a surrogate pair (every chunk encodes to valid UTF-16 on its own)."""
    chunks = chunk_text(text, limit)
    assert "".join(chunks) == text
    for chunk in chunks:
        assert 0 < utf16_units(chunk) <= limit
        assert chunk.encode("utf-16-le").decode("utf-16-le") == chunk


async def test_construction_is_inert_and_validated(fake: FakeBotApi, make_adapter: Any) -> None:
    """§11.1: constructing reads no credential and makes no request; bad options raise."""
    reads: list[int] = []

    def token() -> str:
        reads.append(1)
        return TOKEN

    make_adapter(token=token)
    make_adapter(token=token, mode="webhook", webhook_secret="s3cret_-", webhook_listen="h:1")
    await trio.sleep(0.1)
    assert reads == [] and fake.calls == []
    bad_options: list[dict[str, Any]] = [
        {"api_origin": "http://api.telegram.org"},
        {"api_origin": "https://api.telegram.org/path"},
        {"api_origin": "https://user@api.telegram.org"},
        {"api_origin": "https://api.telegram.org/"},
        {"connection_id": ""},
        {"poll_timeout_s": 0},
        {"poll_timeout_s": 51},
        {"poll_limit": 101},
        {"lease_ttl_ms": 30_000},
        {"max_attachment_bytes": 5 * 1024 * 1024},
        {"mode": "webhook"},
        {"mode": "webhook", "webhook_secret": "has space"},
        {"mode": "carrier-pigeon"},
        {"max_request_bytes": 10},
    ]
    for options in bad_options:
        with pytest.raises(ValueError):
            make_adapter(**options)
