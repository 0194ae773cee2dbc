"""Text commands in DMs and in mentions: answered by the runtime, never run by the agent."""

from __future__ import annotations

import trio

from stores import Store
from tests.fakes.discord_api import FakeDiscord
from tests.support.harness import Host
from tests.support.scripted import ScriptedAgent
from tests.support.waiting import wait_until

from .conftest import DM, GUILD, GUILD_CHANNEL, USER, AdapterFactory, serving

COMMANDS = ("/help", "/status", "/agent", "/new", "/cancel")


async def test_commands_in_dms_and_mentions_each_answered_once(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    agent = ScriptedAgent(answer="agent answer")
    host = Host(agent=agent)
    adapter = make_adapter(allow_guilds=True)
    with trio.fail_after(40):
        async with serving(store, adapter, host):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            for n, command in enumerate(COMMANDS):
                fake.user_message(DM, USER, command)
                await wait_until(lambda: len(fake.bot_messages(DM)) == n + 1)  # noqa: B023
                fake.user_message(GUILD_CHANNEL, USER, command, guild_id=GUILD, mention_bot=True)
                await wait_until(
                    lambda: len(fake.bot_messages(GUILD_CHANNEL)) == n + 1  # noqa: B023
                )
            await trio.sleep(0.3)
    assert agent.calls == []
    for channel in (DM, GUILD_CHANNEL):
        texts = [m["content"] for m in fake.bot_messages(channel)]
        assert len(texts) == len(COMMANDS)
        assert all(texts)
        assert "/new" in texts[0]  # /help lists the commands
    assert host.actions.count("command") == 2 * len(COMMANDS)
