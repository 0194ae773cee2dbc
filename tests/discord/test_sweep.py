"""A message the gateway never sent, in a live session ("may never be sent to a client",
reference §1.6): a sweep reads known channels over REST and admits it, once; the rest of
the channel is not answered again; a channel gone is forgotten; the sweep point survives a
restart."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import trio

from adapters.discord import DiscordAdapter
from adapters.discord._sweep import CHANNELS_PER_ROUND, Sweeps, sweep_round
from stores import Store
from tests.daemon.helpers import running_daemon
from tests.fakes.discord_api import FakeDiscord
from tests.support.waiting import wait_until, wait_until_async

from .conftest import DM, USER, AdapterFactory, serving
from .test_killloop_discord import CHANNELS, TOKEN, USERS, _config, _connected
from .test_resume import answered, stored_state

DEADLINE_S = 30
FAST = {"sweep_every_s": 0.3, "sweep_settle_s": 0.2}


@asynccontextmanager
async def _known_then_dropping(
    fake: FakeDiscord, store: Store, adapter: DiscordAdapter, first: str
) -> AsyncIterator[None]:
    """``adapter`` serving and connected, the DM channel known (``first`` answered), and
    the gateway's next dispatch never sent."""
    async with serving(store, adapter):
        await wait_until(lambda: adapter.health()["state"] == "connected")
        fake.user_message(DM, USER, first)
        await wait_until(lambda: len(fake.bot_messages()) == 1)
        fake.gateway.drop_next = 1
        yield


async def test_a_message_never_sent_is_read_by_a_sweep_and_answered_once(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter(**FAST)
        async with _known_then_dropping(fake, store, adapter, "one"):
            fake.user_message(DM, USER, "never sent")
            fake.user_message(DM, USER, "three")
            await wait_until(lambda: len(fake.bot_messages()) == 3)
            # Several more rounds: nothing is answered twice.
            await trio.sleep(1.5)
            status = adapter.shard_statuses[0]
    assert answered(fake) == ["echo: never sent", "echo: one", "echo: three"]
    assert status.swept == 1
    assert len(fake.gateway.identifies()) == 1  # found without a new session


async def test_a_lone_message_never_sent_in_a_quiet_channel_is_found(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """Nothing after it on the gateway: only the sweep can know of it."""
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter(**FAST)
        async with _known_then_dropping(fake, store, adapter, "hello"):
            fake.user_message(DM, USER, "are you there?")
            await wait_until(lambda: len(fake.bot_messages()) == 2)
    assert answered(fake) == ["echo: are you there?", "echo: hello"]


async def test_a_message_is_admitted_only_once_settled(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """A round finds a message unhandled: it may still be on its way on the gateway, so it
    is admitted only by a round at least the settle time after (local time, never the
    snowflake's against the host clock); meanwhile the sweep point stays before it."""
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter(sweep_every_s=0)  # rounds run by hand below
        async with _known_then_dropping(fake, store, adapter, "one"):
            dropped = fake.user_message(DM, USER, "later")
            shard, sweeps = adapter._shards[0], Sweeps()
            assert await sweep_round(shard, sweeps, settle_s=600) == 0
            assert await sweep_round(shard, sweeps, settle_s=600) == 0
            assert int(shard.cursor.state.swept[DM]) < int(dropped["id"])
            assert len(fake.bot_messages()) == 1
            await trio.sleep(0.2)
            assert await sweep_round(shard, sweeps, settle_s=0.1) == 1
            await wait_until(lambda: len(fake.bot_messages()) == 2)
            assert int(shard.cursor.state.swept[DM]) >= int(dropped["id"])
            assert await sweep_round(shard, sweeps, settle_s=0.1) == 0  # not twice
    assert answered(fake) == ["echo: later", "echo: one"]


async def test_the_sweep_point_survives_a_restart(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """Stored with the shard's state: a message dropped before the restart is found by the
    next daemon's sweep (the resume replays only what was sent), and the messages before it
    are not answered again."""
    with trio.fail_after(DEADLINE_S):
        first = make_adapter(sweep_every_s=600)
        async with _known_then_dropping(fake, store, first, "one"):
            fake.user_message(DM, USER, "dropped before the restart")
            await trio.sleep(0.3)
        assert len(fake.bot_messages()) == 1
        second = make_adapter(**FAST)
        async with serving(store, second):
            await wait_until(lambda: len(fake.bot_messages()) == 2)
            await trio.sleep(1.0)
    assert answered(fake) == ["echo: dropped before the restart", "echo: one"]
    assert second.shard_statuses[0].swept == 1


async def test_a_channel_gone_is_forgotten(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """10003 Unknown Channel: read once, then never again (invalid requests count toward
    Discord's ban); the other channels are still swept."""
    other_user, other_dm = str(int(USER) + 1), str(int(DM) + 1)
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter(**FAST)
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(DM, USER, "one")
            fake.user_message(other_dm, other_user, "two")
            await wait_until(lambda: len(fake.bot_messages()) == 2)
            del fake.channels[DM]  # (its messages, the bot's answer to "one" too)

            def unknown() -> int:
                return sum(1 for c in fake.calls("GET", f"/channels/{DM}/") if c.status == 404)

            async def forgotten() -> bool:
                return DM not in (await stored_state(store)).channels

            await wait_until(lambda: unknown() == 1)
            await wait_until_async(forgotten)
            fake.gateway.drop_next = 1
            fake.user_message(other_dm, other_user, "three")
            await wait_until(lambda: len(fake.bot_messages()) == 2)
            await trio.sleep(1.0)
            assert unknown() == 1
    assert answered(fake) == ["echo: three", "echo: two"]
    assert adapter.shard_statuses[0].swept == 1


async def test_a_round_reads_a_bounded_number_of_channels(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """With more known channels than a round reads, each round reads at most
    CHANNELS_PER_ROUND, those swept longest ago first: every channel is read in turn."""
    channels = CHANNELS_PER_ROUND + 5
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter(sweep_every_s=0.5, sweep_settle_s=0.0)
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            for n in range(channels):
                fake.user_message(str(int(DM) + n), str(int(USER) + n), f"m{n}")
            await wait_until(lambda: len(fake.bot_messages()) == channels)
            first = len(fake.calls("GET", "/messages"))
            await wait_until(lambda: len(fake.calls("GET", "/messages")) >= first + channels)
            reads = fake.calls("GET", "/messages")[first:]
    # Rounds are 0.5 s apart, a round's reads close together: none larger than the bound.
    sizes: list[int] = []
    last = -1.0
    for call in reads:
        if sizes and call.at - last < 0.25:
            sizes[-1] += 1
        else:
            sizes.append(1)
        last = call.at
    assert max(sizes) <= CHANNELS_PER_ROUND
    assert {c.path for c in reads} == {
        f"/api/v10/channels/{int(DM) + n}/messages" for n in range(channels)
    }


async def test_no_sweep_when_disabled(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """``sweep_every_s = 0``: no channel is read, and a message never sent stays unseen."""
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter(sweep_every_s=0)
        async with _known_then_dropping(fake, store, adapter, "one"):
            fake.user_message(DM, USER, "never sent")
            await trio.sleep(1.0)
    assert answered(fake) == ["echo: one"]
    assert fake.calls("GET", "/messages") == []


@pytest.mark.slow
async def test_prismd_run_answers_a_message_the_gateway_never_sent(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """Through ``prismd run`` (``sweep_every_s = 1``) as a user sees it: a DM dropped by the
    gateway in a live session is answered once, by the next rounds, with no new session;
    the daemon's log says so without the message's text."""
    fake = FakeDiscord(token=TOKEN, heartbeat_interval_ms=2000)
    await nursery.start(fake.serve)
    layout = _config(tmp_path, fake, seed=7)
    user = USERS[0]
    env = {"PRISM_TEST_DISCORD_TOKEN": TOKEN}
    with trio.fail_after(45):
        async with running_daemon(layout, extra_env=env) as daemon:
            await daemon.wait_state("READY=1")
            await _connected(layout, "sweep")
            fake.user_message(CHANNELS[user], user, "hello")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
            fake.gateway.drop_next = 1
            dropped = fake.user_message(CHANNELS[user], user, "secret-never-sent")
            await wait_until(lambda: len(fake.bot_messages()) == 2)
            await trio.sleep(2.5)  # more rounds: nothing twice
            daemon.send(signal.SIGTERM)
            assert await daemon.wait_exit() == 0
            log = daemon.stderr()
    replies = [m["message_reference"]["message_id"] for m in fake.bot_messages()]
    assert replies.count(dropped["id"]) == 1 and len(replies) == 2
    assert len(fake.gateway.identifies()) == 1
    assert "the gateway had not sent" in log
    assert "secret-never-sent" not in log and TOKEN not in log
