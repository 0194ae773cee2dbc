"""The ``discord`` connection kind in the daemon's config: keys, defaults, errors naming
the key; and the message → event mapping."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
import trio.testing

from adapters.discord import DiscordConnectionConfig, default_intents
from adapters.discord._gateway import Shard
from adapters.discord._parse import parse_message
from adapters.discord._protocol import (
    Frame,
    Heartbeater,
    ProtocolError,
    StartLimit,
    close_action,
    identify_wait_ms,
    parse_frame,
)
from prismd.daemon._config import ConfigError, load_config
from prismd.daemon._runnable import check_runnable

BASE = """
[agents.echo]
kind = "echo"

[[connections]]
id = "dc"
kind = "discord"
"""
BOT = "1000000000000000001"


def load(tmp_path: Path, body: str) -> Any:
    path = tmp_path / "prismd.toml"
    path.write_text(BASE + body)
    return load_config(path, env={"DISCORD_TOKEN": "t"})


def error(tmp_path: Path, body: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, body)
    return info.value


def test_defaults(tmp_path: Path) -> None:
    config = load(tmp_path, 'token_env = "DISCORD_TOKEN"\n')
    [conn] = config.connections
    assert conn == DiscordConnectionConfig(id="dc", token_env="DISCORD_TOKEN")
    assert conn.intents == 1 | 512 | 4096  # no privileged message content: no 4014
    assert (conn.allow_guilds, conn.respond_to, conn.shards) == (False, "mentions", None)
    assert conn.api_origin == "https://discord.com"
    check_runnable(config, env={"DISCORD_TOKEN": "t"})


def test_keys(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        'token_file = "/run/credentials/prismd/discord"\nrespond_to = "all"\n'
        'allow_guilds = true\nshards = "auto"\napi_origin = "http://127.0.0.1:8080/"\n',
    )
    [conn] = config.connections
    assert conn.intents == default_intents("all") == 1 | 512 | 4096 | 32768
    assert (conn.allow_guilds, conn.shards, conn.api_origin) == (
        True,
        None,
        "http://127.0.0.1:8080",
    )
    config = load(
        tmp_path,
        'token_env = "DISCORD_TOKEN"\nshards = 3\nintents = ["direct_messages"]\npreviews = true\n',
    )
    conn = config.connections[0]
    assert (conn.shards, conn.intents, conn.previews) == (3, 4096, True)
    assert conn.typing_delay_ms == 1000  # the runtime's rule: typing only for a longer turn
    config = load(tmp_path, 'token_env = "DISCORD_TOKEN"\ntyping_delay_ms = 0\n')
    conn = config.connections[0]
    assert conn.typing_delay_ms == 0
    assert conn.sweep_every_s == 60  # channels read for messages the gateway never sent
    config = load(tmp_path, 'token_env = "DISCORD_TOKEN"\nsweep_every_s = 0\n')
    assert config.connections[0].sweep_every_s == 0


@pytest.mark.parametrize(
    ("body", "key", "text"),
    [
        ("", "token_env", "exactly one"),
        ('token_env = "A"\ntoken_file = "/x"\n', "token_env", "exactly one"),
        ('token_env = "A"\napi_origin = "http://discord.com"\n', "api_origin", "loopback"),
        ('token_env = "A"\napi_origin = "https://discord.com/api"\n', "api_origin", "origin"),
        ('token_env = "A"\napi_origin = "ftp://x"\n', "api_origin", "https://"),
        ('token_env = "A"\nrespond_to = "everyone"\n', "respond_to", "'mentions' or 'all'"),
        ('token_env = "A"\nshards = "many"\n', "shards", '"auto"'),
        ('token_env = "A"\nshards = 0\n', "shards", "between 1 and 64"),
        ('token_env = "A"\nintents = ["presence"]\n', "intents", "unknown intent 'presence'"),
        ('token_env = "A"\nintents = ["guilds"]\n', "intents", "guild_messages"),
        (
            'token_env = "A"\nrespond_to = "all"\nintents = ["direct_messages"]\n',
            "intents",
            "message_content",
        ),
        ('token_env = "A"\nallow_groups = true\n', "allow_groups", "unknown key"),
        ('token_env = "A"\ntyping_delay_ms = 60001\n', "typing_delay_ms", "60000"),
        ('token_env = "A"\nsweep_every_s = 3601\n', "sweep_every_s", "3600"),
        ('token_env = "A"\nsweep_every_s = "often"\n', "sweep_every_s", "integer"),
    ],
)
def test_errors_name_the_key(tmp_path: Path, body: str, key: str, text: str) -> None:
    failure = error(tmp_path, body)
    assert failure.key is not None and failure.key.endswith(f".{key}"), failure
    assert text in failure.message


def test_missing_token_refused_before_start(tmp_path: Path) -> None:
    config = load(tmp_path, 'token_env = "MISSING_TOKEN"\n')
    with pytest.raises(ConfigError) as info:
        check_runnable(config, env={})
    assert "token_env" in str(info.value)


def message(**extra: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "id": "1100000000000000001",
        "channel_id": "1200000000000000001",
        "author": {"id": "1300000000000000001", "username": "u"},
        "content": "hello",
        "type": 0,
        "mentions": [],
    }
    base.update(extra)
    return base


def parse(raw: dict[str, Any], **options: Any) -> Any:
    options.setdefault("allow_guilds", True)
    options.setdefault("respond_to", "mentions")
    return parse_message(raw, connection_id="dc", bot_user_id=BOT, **options)


def test_parse_dm_guild_mentions_and_ignored() -> None:
    event = parse(message())
    assert (event.event_id, event.external_conversation_id, event.text) == (
        "1100000000000000001",
        "1200000000000000001",
        "hello",
    )
    assert event.claims["chatType"] == "dm"
    assert parse(message(guild_id="9")) is None  # not mentioned
    mentioned = message(guild_id="9", content=f"<@{BOT}> /new", mentions=[{"id": BOT}])
    assert parse(mentioned).text == "/new"
    assert parse(mentioned, allow_guilds=False) is None
    assert parse(message(guild_id="9", content="hi"), respond_to="all").text == "hi"
    assert parse(message(author={"id": BOT})) is None  # our own reply
    assert parse(message(author={"id": "5", "bot": True})) is None
    assert parse(message(webhook_id="7")) is None
    assert parse(message(type=7)) is None  # a system message
    assert parse(message(content="")) is None
    assert parse(message(id="not-a-snowflake")) is None
    assert (
        parse(message(content=f"<@!{BOT}>  /help", guild_id="9", mentions=[{"id": BOT}])).text
        == "/help"
    )


def _forward(content: str, **extra: Any) -> dict[str, Any]:
    """A forward as Discord sends it: no content of its own, a reference of type 1, the
    forwarded message in ``message_snapshots`` (no author)."""
    inner = {"type": 0, "content": content, "attachments": [], "embeds": [], "flags": 0}
    inner.update(extra)
    return message(
        content="",
        message_reference={"type": 1, "channel_id": "1500000000000000001", "message_id": "16"},
        message_snapshots=[{"message": inner}],
    )


def test_a_forward_is_its_forwarded_text_and_images() -> None:
    event = parse(_forward("look at this"))
    assert (event.event_id, event.text) == ("1100000000000000001", "look at this")
    assert event.claims["forwarded"] is True and event.claims["chatType"] == "dm"
    assert "forwarded" not in parse(message()).claims
    image = {"id": "33", "size": 5, "content_type": "image/png", "filename": "a.png"}
    [ref] = parse(_forward("", attachments=[image])).attachments
    # Named by the forward's own ids: reading the forward again finds the image.
    assert ref.transport_file_id == "1200000000000000001/1100000000000000001/33"
    # Forwarded text is not the user's: a mention in it is neither stripped nor counted.
    assert parse(_forward(f"<@{BOT}> hi")).text == f"<@{BOT}> hi"
    in_guild = {**_forward(f"<@{BOT}> hi", mentions=[{"id": BOT}]), "guild_id": "9"}
    assert parse(in_guild) is None
    assert parse(in_guild, respond_to="all").text == f"<@{BOT}> hi"
    # Not a forward: a reply (type 0, the default), snapshots without a FORWARD reference,
    # a forward of nothing, snapshots of the wrong shape.
    reply = message(content="", message_reference={"message_id": "16"})
    assert parse({**reply, "message_snapshots": [{"message": {"content": "x"}}]}) is None
    assert parse(_forward("")) is None
    assert parse({**_forward("x"), "message_snapshots": ["x"]}) is None
    assert parse({**_forward("x"), "message_snapshots": {}}) is None
    # The user's own text wins over what a payload may carry besides it.
    assert parse({**_forward("forwarded"), "content": "mine"}).text == "mine"


def test_close_codes_and_identify_budget() -> None:
    assert [close_action(c) for c in (4004, 4013, 4014, 4010)] == ["fatal"] * 4
    assert close_action(4007) == "identify"
    # The session may still be alive after these: resumed first (tests/discord/test_hostile.py)
    assert [close_action(c) for c in (4003, 4005, 4008)] == ["resume"] * 3
    assert [close_action(c) for c in (None, 1000, 1006, 4000, 4009)] == ["resume"] * 5
    now = 10 * 86_400_000
    assert identify_wait_ms(now_ms=now, history=[], limit=None, own_daily_cap=50) == 0
    assert identify_wait_ms(now_ms=now, history=[now - 1000], limit=None, own_daily_cap=50) == 4000
    three = [now - 30_000, now - 20_000, now - 1_000]  # 5 s doubling: 20 s after the third
    assert identify_wait_ms(now_ms=now, history=three, limit=None, own_daily_cap=50) == 19_000
    full = [now - 86_000_000 + i for i in range(50)]
    assert identify_wait_ms(now_ms=now, history=full, limit=None, own_daily_cap=50) > 0
    low = StartLimit(total=1000, remaining=100, reset_after_ms=7_000_000, max_concurrency=1)
    assert identify_wait_ms(now_ms=now, history=[], limit=low, own_daily_cap=50) == 7_000_000


def test_frames_decode_only_what_is_handled() -> None:
    """A dispatch the connection does not read (``GUILD_CREATE``, ``TYPING_START`` …) is
    taken from its ``op``/``s``/``t`` prefix: its ``d`` is not decoded (so not even
    checked); a handled one, or one whose ``d`` comes first, is decoded whole."""
    skipped = parse_frame('{"t":"GUILD_CREATE","s":3,"op":0,"d":{"members":[' + "1," * 999)
    assert skipped == Frame(0, None, 3, "GUILD_CREATE")
    assert parse_frame('{"op":0,"t":"TYPING_START","s":4,"d":{}}') == Frame(
        0, None, 4, "TYPING_START"
    )
    message = '{"op":0,"t":"MESSAGE_CREATE","s":5,"d":{"id":"1","t":"GUILD_CREATE"}}'
    assert parse_frame(message) == Frame(0, {"id": "1", "t": "GUILD_CREATE"}, 5, "MESSAGE_CREATE")
    assert parse_frame('{"op":0,"d":{"a":1},"t":"GUILD_CREATE","s":6}') == Frame(
        0, {"a": 1}, 6, "GUILD_CREATE"
    )
    assert parse_frame('{"t":null,"s":null,"op":10,"d":{"heartbeat_interval":45000}}') == Frame(
        10, {"heartbeat_interval": 45000}
    )
    assert parse_frame('{"t":"READY","s":1,"op":0,"d":{"v":10}}').d == {"v": 10}
    for bad in ('{"t":"GUILD_CREATE","s":3,"s":4,"d":{}}', "not json", '{"op":"0","d":1}'):
        with pytest.raises(ProtocolError):
            parse_frame(bad)


def test_a_missing_ack_is_a_zombie_only_after_the_grace() -> None:
    """A beat due while the last is unacknowledged is a zombie — a short grace later, so an
    ACK that arrived while the process stalled, and is read just after the timer fired,
    is not taken for a dead connection."""
    beat = Heartbeater(40.0, random.Random(1))
    beat.start(0.0)
    first = beat.next_at
    assert 0.0 <= first < 40.0 and beat.due(first - 0.01) == "wait"
    assert beat.due(first) == "beat"
    beat.sent(first)
    assert beat.grace_s == 2.0 and beat.wake_at() == first + 42.0
    assert beat.due(first + 40.0) == "wait"  # due, unacknowledged, inside the grace
    assert beat.due(first + 41.99) == "wait"
    assert beat.due(first + 42.0) == "zombie"
    beat.ack()  # read late, inside the grace: the beat goes out
    assert beat.wake_at() == first + 40.0 and beat.due(first + 41.0) == "beat"
    short = Heartbeater(0.5, random.Random(1))
    assert short.grace_s == 0.125  # a quarter of a short interval


def test_a_missing_ack_waits_while_frames_are_still_read_and_no_longer() -> None:
    """An ACK queued behind a backlog (a burst of GUILD_CREATEs, a replay) comes only once
    the frames before it are read: while the reader still reads (a frame within the grace)
    the beat is not judged, up to three intervals after it was sent; a reader that stopped
    reading, or a stream that never ACKs, is a zombie as before."""
    beat = Heartbeater(40.0, random.Random(1))
    beat.start(0.0)
    beat.sent(10.0)  # due again at 50, judged at 52 when nothing is read
    assert beat.due(52.0) == "zombie"
    beat.heard(51.5)  # a frame read just before: the backlog is still being read
    assert beat.zombie_at() == 53.5 and beat.due(52.0) == "wait" and beat.due(53.5) == "zombie"
    for t in range(52, 140):  # frames keep coming, never the ACK: 10 + 3 × 40, then the grace
        beat.heard(float(t))
    assert beat.due(131.9) == "wait" and beat.due(132.0) == "zombie"
    beat.ack()  # came at last: the next beat goes out
    assert beat.due(132.0) == "beat"
    quiet = Heartbeater(40.0, random.Random(1))
    quiet.start(0.0)
    quiet.heard(5.0)  # frames long before the beat say nothing about its ACK
    quiet.sent(10.0)
    assert quiet.zombie_at() == 52.0 and quiet.wake_at() == 52.0


async def test_a_stall_of_the_process_defers_the_zombie_judgement(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The heartbeat timer waking late (this process stopped, a starved machine) finds every
    deadline past while the ACK that came meanwhile waits unread in the socket: the reader
    gets a grace from the end of the stall before the beat is judged, up to three intervals
    after it. The loop is the gateway's own (:meth:`Shard._heartbeat`)."""
    beat = Heartbeater(4.0, random.Random(1))
    beat.start(trio.current_time())
    beat.sent(trio.current_time())  # due again at 4, judged at 5 if nothing comes
    sent: list[str] = []

    class Socket:
        async def send_message(self, text: str) -> None:
            sent.append(text)

    shard = SimpleNamespace(_heartbeater=beat, label="shard", _received_seq=7)

    async def stall(scope: trio.CancelScope) -> None:
        await trio.sleep(0.5)
        autojump_clock.jump(9.5)  # the loop did not run for 9.5 s (SIGSTOP, a blocking call)
        await trio.sleep(0.1)
        beat.ack()  # what the reader reads once it runs, inside the grace
        await trio.sleep(1.5)
        scope.cancel()

    with trio.CancelScope() as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stall, scope)
            await Shard._heartbeat(shard, Socket())  # type: ignore[arg-type]
    assert sent == ['{"op":1,"d":7}']  # no zombie: the next beat went out once acknowledged
    assert beat.stalled_until == 10.0 and not beat.acked
    # Past three intervals after the beat, a stall defers nothing: judged at 12 + 1.
    beat.sent(20.0)
    beat.stalled(40.0)
    assert beat.zombie_at() == 33.0 and beat.due(40.0) == "zombie"
