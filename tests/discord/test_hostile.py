"""A hostile audit of the Discord connection (issue 39): what another faithful fake may
legally do that ours did not, and whether prismd still answers every message once.

Each test names the reference section (reference/discord-protocol.md) that makes the
input legal, and what prismd did before its fix."""

from __future__ import annotations

import pytest
import trio

from adapters.discord._parse import parse_message
from stores import Store
from tests.fakes.discord_api import FakeDiscord
from tests.support.waiting import wait_until

from .conftest import DM, GUILD, GUILD_CHANNEL, USER, AdapterFactory, serving
from .test_resume import answered

DEADLINE_S = 20
OTHER_USER = "2000000000000000002"
OTHER_DM = "3000000000000000002"


# ---------------------------------------------------------------------------- gateway


@pytest.mark.parametrize("code", [4009, 4003, 4006])
async def test_a_resume_refused_by_a_close_falls_back_to_identify(
    code: int, fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """§1.5/§1.6: a gateway may turn an expired session's Resume down by closing (4009
    "Session timed out … start a new one", 4003 "this session has been invalidated", or a
    code it does not document) instead of op 9 ``false``. Before: 4009 and unknown codes
    meant "resume", so the shard resumed the dead session forever and never answered
    again."""
    fake.gateway.refuse_resume_with = code
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(DM, USER, "before")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
            fake.gateway.expire_sessions()
            fake.gateway.close_all(4000)
            await wait_until(lambda: len(fake.gateway.identifies()) == 2)
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(DM, USER, "after")
            await wait_until(lambda: len(fake.bot_messages()) == 2)
    assert answered(fake) == ["echo: after", "echo: before"]
    refused = [r for r in fake.gateway.resumes if r[2] == "invalid"]
    assert 1 <= len(refused) <= 2
    assert not {1000, 1001} & set(fake.gateway.client_close_codes)


@pytest.mark.parametrize("code", [4008, 4003, 4005])
async def test_a_close_that_leaves_the_session_alive_is_resumed_not_reidentified(
    code: int, fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """§1.5/§1.6/§9: "the session will remain active" after a close other than 1000/1001
    (DPY resumes after any reconnectable close; a gateway whose session is in fact gone
    answers the Resume with op 9). A new user's first message sent while the shard was
    away is in the session's replay and nowhere else (bots cannot list DMs, §3). Before:
    4003/4005/4008 dropped the session and identified — that message was never answered
    nor listed."""
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(DM, USER, "before")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
            fake.gateway.close_all(code)
            await wait_until(lambda: not fake.gateway.live())
            fake.user_message(OTHER_DM, OTHER_USER, "in the gap")
            await wait_until(lambda: len(fake.bot_messages()) == 2)
    assert answered(fake) == ["echo: before", "echo: in the gap"]
    assert len(fake.gateway.identifies()) == 1
    assert [outcome for _s, _q, outcome in fake.gateway.resumes] == ["replayed"]


# ---------------------------------------------------------------------------- payloads

BOT = "1000000000000000001"


@pytest.mark.parametrize("form", [f"<@{BOT}>", f"<@!{BOT}>"])
def test_a_mention_in_the_text_is_a_mention_without_the_mentions_array(form: str) -> None:
    """§3: a message's ``<@id>`` / ``<@!id>`` is how it mentions a user; ``mentions`` is the
    parsed list, which a gateway may leave out of a payload (optional fields absent, as
    GWE's "extra fields"). Before: a guild message mentioning the bot in its text, without
    the array, was ignored (never answered nor listed)."""
    message = {
        "id": "6000000000000000001",
        "channel_id": GUILD_CHANNEL,
        "guild_id": GUILD,
        "author": {"id": USER, "username": "u"},
        "content": f"{form} hello",
        "type": 0,
    }
    event = parse_message(
        message,
        connection_id="dc",
        bot_user_id=BOT,
        allow_guilds=True,
        respond_to="mentions",
    )
    assert event is not None and event.text == "hello"
    other = dict(message, content="<@2999999999999999999> hello")
    assert (
        parse_message(
            other, connection_id="dc", bot_user_id=BOT, allow_guilds=True, respond_to="mentions"
        )
        is None
    )
