"""Every sample in ``fixtures/telegram`` parses to the right event or a deliberate ignore;
every derived error body maps to the right client error and send outcome."""

from __future__ import annotations

import copy
import json
from typing import Any

import httpx
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from adapters.telegram._api import TelegramApi, TelegramApiError
from adapters.telegram._updates import MAX_ID_BYTES, parse_update, strip_bot_mention, update_id_of
from prismd.channel import AttachmentRef, Reply
from tests.fakes.telegram_api import FakeBotApi
from tests.support.recorder import Recorder

from .conftest import CONN, TG_FIXTURES, TOKEN, ServeBotApi, fixture, private_message


def parse(update: dict[str, Any], **kwargs: Any) -> Any:
    return parse_update(update, connection_id=CONN, bot_username="prism_test_bot", **kwargs)


def test_every_fixture_file_is_covered() -> None:
    names = sorted(p.name for p in TG_FIXTURES.glob("*.json"))
    assert names == [
        "tg01_update_private_text_link_preview.json",
        "tg02_update_private_text_plain.json",
        "tg04_update_my_chat_member_kicked.json",
        "tg06_message_photo_caption_entities.json",
        "tg11_update_edited_message_2017.json",
        "tg12_update_document_caption_2017.json",
        "tg17_update_callback_query.json",
        "tg_error_responses_DERIVED.json",
    ]


def test_tg01_private_text_with_link_preview() -> None:
    parsed = parse(fixture("tg01_update_private_text_link_preview.json"))
    event = parsed.event
    assert (event.event_id, event.text) == ("892252934", "hello there")
    assert (event.external_conversation_id, event.external_actor_id) == ("218485655", "218485655")
    assert event.thread_id is None and event.attachments == ()
    assert event.claims == {"platform": "telegram", "chatType": "private"}


def test_tg02_private_plain_text() -> None:
    event = parse(fixture("tg02_update_private_text_plain.json")).event
    assert (event.event_id, event.text, event.external_conversation_id) == (
        "306197398",
        "4",
        "408258968",
    )


def test_tg04_my_chat_member_is_ignored() -> None:
    parsed = parse(fixture("tg04_update_my_chat_member_kicked.json"))
    assert (parsed.update_id, parsed.event, parsed.ignored) == (0, None, "my_chat_member")


def test_tg06_photo_with_caption() -> None:
    message = fixture("tg06_message_photo_caption_entities.json")
    event = parse({"update_id": 60, "message": message}).event
    assert event.text == "www.example.com"
    largest = message["photo"][-1]
    assert event.attachments == (
        AttachmentRef(
            kind="image",
            transport_file_id=largest["file_id"],
            byte_length=162061,
            connection_id=CONN,
        ),
    )


def test_tg11_edited_message_is_ignored() -> None:
    parsed = parse(fixture("tg11_update_edited_message_2017.json"))
    assert (parsed.event, parsed.ignored) == (None, "edited_message")


def test_tg12_document_with_caption() -> None:
    event = parse(fixture("tg12_update_document_caption_2017.json")).event
    assert event.text == "doc description"
    assert event.attachments == (
        AttachmentRef(
            kind="document",
            transport_file_id="BQADAgADpgADy_JxS66XQTBRHFleAg",
            byte_length=21331,
            mime_type="application/vnd.openxmlformats-officedocument.wordprocessingml.document",
            file_name="test.docx",
            connection_id=CONN,
        ),
    )


def test_tg17_foreign_callback_answered_not_admitted() -> None:
    """Callback data that is not an approval never becomes input, but is answered."""
    parsed = parse(fixture("tg17_update_callback_query.json"))
    assert parsed.event is None and parsed.ignored == "callback_data"
    assert parsed.callback_query_id == "2518356809717642496"


async def test_all_update_fixtures_through_the_fake(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """Real samples served by getUpdates: three events, the rest acknowledged."""
    for name in (
        "tg01_update_private_text_link_preview.json",
        "tg02_update_private_text_plain.json",
        "tg04_update_my_chat_member_kicked.json",
        "tg11_update_edited_message_2017.json",
        "tg12_update_document_caption_2017.json",
        "tg17_update_callback_query.json",
    ):
        fake.push_update({k: v for k, v in fixture(name).items() if k != "update_id"})
    message = fixture("tg06_message_photo_caption_entities.json")
    fake.push_update({"message": message})
    adapter = make_adapter()
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        await recorder.wait_for(4)
        await trio.sleep(35)
        nursery.cancel_scope.cancel()
    # One getUpdates answer is admitted concurrently across chats (issue 40): the update
    # order holds within each chat, not across chats.
    expected = ["hello there", "4", "doc description", "www.example.com"]
    assert sorted(e.text for e in recorder.events) == sorted(expected)
    for chat in {e.external_conversation_id for e in recorder.events}:
        mine = [e.text for e in recorder.events if e.external_conversation_id == chat]
        assert mine == [t for t in expected if t in mine], chat
    assert len(fake.calls_to("answerCallbackQuery")) == 1
    assert fake.updates == []  # everything confirmed


# ---------------------------------------------------------------------- parse rules


def test_refusals_and_ignores() -> None:
    bot = private_message()
    bot["message"]["from"]["is_bot"] = True
    assert parse({"update_id": 1, **bot}).ignored == "bot_sender"
    channel = {"update_id": 2, "channel_post": {"chat": {"id": -1, "type": "channel"}}}
    assert parse(channel).ignored == "channel_post"
    sender_chat = private_message()
    sender_chat["message"]["sender_chat"] = {"id": -1, "type": "channel"}
    assert parse({"update_id": 3, **sender_chat}).ignored == "sender_chat"
    migrated = private_message()
    migrated["message"]["chat"] = {"id": -5, "type": "group", "title": "g"}
    del migrated["message"]["text"]
    migrated["message"]["migrate_to_chat_id"] = -1001555296434
    assert parse({"update_id": 4, **migrated}, allow_groups=True).ignored == "chat_migrated"
    assert parse({"update_id": 5, **private_message("")}).ignored == "empty"
    assert parse({"update_id": -1, **private_message()}) is None
    assert parse({"update_id": True, **private_message()}) is None
    assert parse({"update_id": 6, "poll": {}}).ignored == "unsupported_update"
    long_id = private_message()
    long_id["message"]["from"]["id"] = "x" * 129
    assert parse({"update_id": 7, **long_id}).ignored == "malformed"


def test_bot_mentions() -> None:
    assert strip_bot_mention("/help@Prism_Test_Bot", "prism_test_bot") == "/help"
    assert strip_bot_mention("/new@prism_test_bot  fresh", "prism_test_bot") == "/new  fresh"
    assert strip_bot_mention("/help@other_bot", "prism_test_bot") is None
    assert strip_bot_mention("/help@someone", None) == "/help"
    assert strip_bot_mention("mail me@prism_test_bot", "prism_test_bot") == (
        "mail me@prism_test_bot"
    )
    assert strip_bot_mention("/start TOKEN", "prism_test_bot") == "/start TOKEN"


# ---------------------------------------------------------------------- derived error bodies

ERRORS = json.loads((TG_FIXTURES / "tg_error_responses_DERIVED.json").read_text())
EXPECTED_REASON = {
    "flood_429": "telegram_rate_limited",
    "group_migrated_400": "telegram_chat_migrated",
    "bot_blocked_403": "telegram_forbidden",
    "invalid_token_local_server_401": "telegram_unauthorized",
}


@pytest.mark.parametrize("name", sorted(k for k in ERRORS if not k.startswith("_")))
async def test_derived_error_bodies(
    autojump_clock: MockClock, name: str, make_adapter: Any, serve_bot_api: ServeBotApi
) -> None:
    body = ERRORS[name]
    headers = {"Retry-After": "35"} if body["error_code"] == 429 else {}

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(body["error_code"], json=body, headers=headers)

    api = TelegramApi(token=lambda: TOKEN, api_origin=await serve_bot_api(handler))
    with pytest.raises(TelegramApiError) as info:
        await api.call("sendMessage", {"chat_id": "1", "text": "x"})
    await api.aclose()
    error = info.value
    assert str(error) == "Telegram API error" and error.status == body["error_code"]
    assert error.description == body["description"]
    assert error.retry_after == body.get("parameters", {}).get("retry_after")
    assert error.migrate_to_chat_id == body.get("parameters", {}).get("migrate_to_chat_id")
    if name in EXPECTED_REASON:
        adapter = make_adapter(
            api_origin=await serve_bot_api(handler),
        )
        start = trio.current_time()
        result = await adapter.send(Reply(CONN, "101", "x", "final"))
        await adapter.aclose()
        assert result.reason == EXPECTED_REASON[name]
        if body["error_code"] == 429:  # retry_after honoured between the five attempts
            assert trio.current_time() - start >= 4 * 35


def _updates_in(value: Any) -> list[dict[str, Any]]:
    """Every object with an ``update_id`` inside a fixture (a ``getUpdates`` answer holds
    several)."""
    found: list[dict[str, Any]] = []
    if isinstance(value, dict):
        if "update_id" in value:
            found.append(value)
        for child in value.values():
            found.extend(_updates_in(child))
    elif isinstance(value, list):
        for child in value:
            found.extend(_updates_in(child))
    return found


_REAL_UPDATES = [
    update
    for path in sorted(TG_FIXTURES.glob("*.json"))
    for update in _updates_in(json.loads(path.read_text()))
]
_FIELDS = [
    "update_id", "message", "callback_query", "edited_message", "channel_post", "my_chat_member",
    "chat", "from", "sender_chat", "id", "type", "is_bot", "username", "text", "caption",
    "entities", "photo", "document", "file_id", "file_unique_id", "file_size", "mime_type",
    "message_thread_id", "reply_to_message", "data", "migrate_to_chat_id", "date",
]  # fmt: skip
_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=True)
    | st.text(max_size=12),
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(st.sampled_from(_FIELDS), children, max_size=6)
    ),
    max_leaves=25,
)
_IGNORE_REASONS = {
    "bot_sender", "callback_data", "channel_post", "chat_migrated", "chat_type",
    "edited_channel_post", "edited_message", "empty", "malformed", "my_chat_member",
    "no_sender", "other_bot_command", "sender_chat", "unsupported_update",
}  # fmt: skip


@given(
    st.sampled_from(_REAL_UPDATES),
    st.lists(
        st.tuples(st.lists(st.sampled_from(_FIELDS), min_size=1, max_size=4), _JSON), max_size=4
    ),
    st.booleans(),
)
@settings(max_examples=300, deadline=None)
def test_real_updates_with_any_field_replaced_parse_without_raising(
    real: dict[str, Any], edits: list[tuple[list[str], Any]], allow_groups: bool
) -> None:
    """The real samples, with fields anywhere in them replaced by arbitrary JSON (wrong
    types, huge numbers, missing parts): an update without a valid ``update_id`` is
    ``None`` (the caller skips it), every other one is an event or a known ignore, and an
    event's ids stay bounded."""
    assert len(_REAL_UPDATES) >= 6
    update = copy.deepcopy(real)
    for path, value in edits:
        at: Any = update
        for name in path[:-1]:
            if not isinstance(at.get(name), dict):
                break
            at = at[name]
        at[path[-1]] = value
    parsed = parse(update, allow_groups=allow_groups)
    if update_id_of(update) is None:
        assert parsed is None
        return
    assert parsed is not None and parsed.update_id == update["update_id"]
    assert (parsed.event is None) != (parsed.ignored is None)
    if parsed.ignored is not None:
        assert parsed.ignored in _IGNORE_REASONS
        return
    event = parsed.event
    for value in (event.external_conversation_id, event.external_actor_id, event.event_id):
        assert 0 < len(value.encode()) <= MAX_ID_BYTES
