"""prismd against the second fake Discord (:mod:`tests.discord.test_alt_fake`), the REST
side: POST answers lost or 5xx after the commit, 429 storms, closed DMs, previews, replies
of several chunks, sweeps after a restart. The daemon scenarios are ``slow``; the two
in-process tests pin the bugs the fake found (a preview left beside the reply, a
duplicate counted as a message the gateway never sent).
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing

from adapters.discord import DiscordAdapter
from adapters.discord._previews import PreviewEditor
from adapters.discord._rest import DiscordRest, DiscordTransportError
from prismd.channel import Admission, InboundEvent, Preview
from stores import Store
from tests.discord.alt_harness import (
    CHANNELS,
    TOKEN,
    USERS,
    _config,
    _connected_daemon,
    _replies,
    _say,
    _scenario,
    _settle,
    _world,
)
from tests.fakes.discord_alt import AltDiscord
from tests.support.waiting import wait_until


@pytest.mark.slow
async def test_alt_lost_send_responses(tmp_path: Path, nursery: trio.Nursery) -> None:
    """POSTs committed whose answer is lost or a 500, and 502s that committed nothing."""

    def fault(fake: AltDiscord) -> None:
        fake.lose_post_response = 3
        fake.post_500_after_commit = 2
        fake.post_502 = 2

    fake, _layout, summary = await _scenario(tmp_path, nursery, fault)
    assert fake.nonce_hits >= 5, summary


@pytest.mark.slow
async def test_alt_429_storms(tmp_path: Path, nursery: trio.Nursery) -> None:
    def fault(fake: AltDiscord) -> None:
        fake.route_429 = 8
        fake.global_429 = 8
        fake.shared_429 = 4

    await _scenario(tmp_path, nursery, fault, knobs={"bucket_limit": 3, "bucket_window_s": 2.0})


@pytest.mark.slow
async def test_alt_dms_closed_listed(tmp_path: Path, nursery: trio.Nursery) -> None:
    """A user whose DMs refuse the bot (50007): their messages are listed, not retried
    forever, not answered; the others are answered."""
    closed = CHANNELS[USERS[0]]

    def fault(fake: AltDiscord) -> None:
        fake.closed_dms.add(closed)

    fake, _layout, summary = await _scenario(tmp_path, nursery, fault, before=0)
    assert not [m for m in fake.bot_messages() if m["channel_id"] == closed], summary


@pytest.mark.slow
async def test_alt_previews_lost_answers(tmp_path: Path, nursery: trio.Nursery) -> None:
    """Streamed previews whose POST answers are lost: no preview is left behind beside
    the reply (the answer's text shown twice)."""

    def fault(fake: AltDiscord) -> None:
        fake.lose_post_response = int(os.environ.get("ALT_LOSE", "6"))

    fake, _layout, summary = await _scenario(
        tmp_path, nursery, fault, connection="previews = true\n", before=3, after=6
    )
    left = [m["content"] for m in fake.bot_messages() if "message_reference" not in m]
    assert not left, f"{summary}: previews left behind {left}"


class _LosingRest:
    """Makes one message per nonce on POST and loses the first POST's answer."""

    def __init__(self) -> None:
        self.made: dict[str, str] = {}
        self.deleted: list[str] = []
        self.lose = 1

    async def request(self, method: str, path: str, **kwargs: Any) -> Any:
        if method == "POST":
            nonce = kwargs["json_body"]["nonce"]
            message_id = self.made.setdefault(nonce, str(1000 + len(self.made)))
            if self.lose:
                self.lose -= 1
                raise DiscordTransportError("Discord unreachable (deadline)")
            return {"id": message_id}
        if method == "DELETE":
            self.deleted.append(path.rsplit("/", 1)[1])
        return None


async def test_preview_whose_answer_was_lost_is_deleted(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A preview POST committed without an answer: the final reply's ``finish`` posts it
    again with its nonce (Discord names the message it made) and deletes it."""
    rest = _LosingRest()
    editor = PreviewEditor(connection_id="c", rest=cast(DiscordRest, rest))
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(editor.run)
            await trio.sleep(0.01)
            editor.offer(Preview(connection_id="c", external_conversation_id="123", text="mock"))
            await wait_until(lambda: bool(rest.made) and rest.lose == 0)
            await trio.sleep(0.5)
            await editor.finish("123")
            nursery.cancel_scope.cancel()
    assert rest.deleted == list(rest.made.values()) == ["1000"]


@pytest.mark.slow
async def test_alt_long_replies_lost_answers(tmp_path: Path, nursery: trio.Nursery) -> None:
    """Replies of two chunks whose POST answers are lost, or 500 after the commit: each
    chunk is posted once (its nonce), none twice."""
    async with _world(tmp_path, nursery) as (fake, layout, rng, tag):
        sent: list[dict[str, Any]] = []
        with trio.fail_after(55):
            async with _connected_daemon(layout, "a"):
                await _say(fake, sent, rng, 3)
                fake.lose_post_response = 3
                fake.post_500_after_commit = 2
                for n in range(4):
                    user = USERS[n % len(USERS)]
                    long = " ".join(f"w{n}x{i}" for i in range(500))
                    sent.append(fake.user_message(CHANNELS[user], user, long))
                summary = await _settle(fake, layout, sent, tag)
        chunks = Counter(_replies(fake))
        for message in sent[3:]:
            assert chunks[message["id"]] in (0, 2), f"{summary}: {chunks}"
        print(summary)


@pytest.mark.slow
async def test_alt_sweep_after_restart_counts_no_duplicates(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """After a restart the first sweeps read again what the journal has (nothing in memory
    says it was handled): those are duplicates, not messages the gateway never sent —
    neither logged nor counted as such."""
    async with _world(tmp_path, nursery) as (fake, layout, rng, tag):
        sent: list[dict[str, Any]] = []
        seed = rng.randrange(1 << 30)
        with trio.fail_after(55):
            layout = _config(layout.root, fake, seed, sweep_every_s=600)  # no sweep in a
            async with _connected_daemon(layout, "a") as daemon:
                await _say(fake, sent, rng, 6)
                await wait_until(lambda: all(_replies(fake)[m["id"]] for m in sent))
                await trio.sleep(1.5)  # the watermark saved: nothing replayed
                daemon.send(signal.SIGKILL)
                await daemon.wait_exit()
            layout = _config(layout.root, fake, seed)
            async with _connected_daemon(layout, "b") as daemon:
                await trio.sleep(6.0)  # sweeps every 2 s, a message settles 1 s
                summary = await _settle(fake, layout, sent, tag)
                assert "the gateway had not sent" not in daemon.stderr(), daemon.stderr()
        assert [e for e in fake.requests if e[0] == "GET" and "/messages" in e[1]], summary


@pytest.mark.slow
async def test_alt_kill_while_answers_are_lost(tmp_path: Path, nursery: trio.Nursery) -> None:
    """Every POST's answer lost (each committed), the daemon SIGKILLed while it posts them
    again: the next start sends the unmarked replies with the same nonces — Discord
    answers with the originals — and none is posted twice."""
    async with _world(tmp_path, nursery, lose_post_response=1_000) as (fake, layout, rng, tag):
        sent: list[dict[str, Any]] = []
        with trio.fail_after(55):
            async with _connected_daemon(layout, "a") as daemon:
                await _say(fake, sent, rng, 6)
                await wait_until(lambda: len(fake.bot_messages()) >= 4)
                await trio.sleep(rng.uniform(0.0, 1.0))
                daemon.send(signal.SIGKILL)
                await daemon.wait_exit()
            fake.lose_post_response = 0
            async with _connected_daemon(layout, "b") as daemon:
                summary = await _settle(fake, layout, sent, tag)
        assert fake.nonce_hits >= 4, summary


async def test_a_duplicate_admission_is_not_a_new_message(store: Store) -> None:
    """What the sweep counts as "the gateway had not sent": an admission the journal
    accepted as new, never one it acknowledged as a duplicate."""
    answers = [
        Admission("accepted", operation_id="op-1"),
        Admission("accepted", operation_id="op-1", duplicate=True),
    ]

    async def admit(_event: InboundEvent) -> Admission:
        return answers.pop(0)

    adapter = DiscordAdapter(
        connection_id="c", token=lambda: TOKEN, admit=admit, store=store, owner_id="owner"
    )
    shard = adapter._shard(0, 1)
    message = {
        "id": "1300000000000000001",
        "channel_id": CHANNELS[USERS[0]],
        "author": {"id": USERS[0], "username": "u"},
        "content": "hello",
        "type": 0,
    }
    with trio.fail_after(10):
        await shard.lease.acquire(on_standby=lambda: None)
        try:
            assert await adapter._handle_message(message, shard) is True
            assert await adapter._handle_message(message, shard) is False
        finally:
            await shard.lease.release()
