"""A message from the fake Discord through the real runtime and back, on loopback sockets."""

from __future__ import annotations

import trio

from stores import Store
from tests.fakes.discord_api import FakeDiscord
from tests.support.waiting import wait_until

from .conftest import DM, GUILD, GUILD_CHANNEL, USER, AdapterFactory, serving


async def test_dm_answered_once_as_a_reply_with_a_nonce(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    adapter = make_adapter()
    with trio.fail_after(20):
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            inbound = fake.user_message(DM, USER, "hello")
            await wait_until(lambda: len(fake.bot_messages(DM)) == 1)
            await trio.sleep(0.3)
    [reply] = fake.bot_messages(DM)
    assert reply["content"] == "echo: hello"
    assert reply["message_reference"]["message_id"] == inbound["id"]
    [post] = [r for r in fake.calls("POST", "/messages") if r.status == 200]
    assert post.body["enforce_nonce"] is True
    assert len(post.body["nonce"]) <= 25
    assert post.body["message_reference"]["fail_if_not_exists"] is False
    assert len(fake.gateway.identifies()) == 1
    # A graceful stop closes with a resumable code: never 1000/1001.
    assert fake.gateway.client_close_codes == [4000]
    assert adapter.health()["state"] == "stopped"


async def test_guild_mention_stripped_and_unmentioned_ignored(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    adapter = make_adapter(allow_guilds=True)
    with trio.fail_after(20):
        async with serving(store, adapter) as (_rt, host):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(GUILD_CHANNEL, USER, "not for the bot", guild_id=GUILD)
            fake.user_message(
                GUILD_CHANNEL, USER, "what time is it", guild_id=GUILD, mention_bot=True
            )
            await wait_until(lambda: len(fake.bot_messages(GUILD_CHANNEL)) == 1)
            await trio.sleep(0.3)
    assert [m["content"] for m in fake.bot_messages()] == ["echo: what time is it"]
    assert [c.text for c in host.authorize_calls] == ["what time is it"]


async def test_guild_messages_ignored_unless_allowed(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    adapter = make_adapter()
    with trio.fail_after(20):
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(GUILD_CHANNEL, USER, "hi", guild_id=GUILD, mention_bot=True)
            fake.user_message(DM, USER, "dm")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
            await trio.sleep(0.3)
    assert [m["content"] for m in fake.bot_messages()] == ["echo: dm"]


async def test_two_shards_each_under_its_own_lease_and_session(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """``shards = "auto"`` with Discord recommending 2: two sessions, identified one bucket
    after the other; a guild of shard 1 and a DM (always shard 0) are each answered once."""
    fake.recommended_shards = 2
    fake.max_concurrency, fake.identify_window_s = 1, 0.25
    guild_1 = str(4000000000000000001 + (1 << 22))  # (guild_id >> 22) % 2 == 1
    adapter = make_adapter(allow_guilds=True, shards=None, identify_spacing_ms=300)
    with trio.fail_after(20):
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            assert [s.shard for s in adapter._shards] == [(0, 2), (1, 2)]
            fake.user_message(DM, USER, "dm")
            fake.user_message("5000000000000000009", USER, "g1", guild_id=guild_1, mention_bot=True)
            await wait_until(lambda: len(fake.bot_messages()) == 2)
            await trio.sleep(0.3)
    assert sorted(m["content"] for m in fake.bot_messages()) == ["echo: dm", "echo: g1"]
    identifies = fake.gateway.identifies()
    assert sorted(tuple(i.d["shard"]) for i in identifies) == [(0, 2), (1, 2)]
    assert identifies[1].at - identifies[0].at >= 0.3  # the second bucket waited
    assert adapter.health()["gateway"] == "resumable"
