"""prismd against a second, independent fake Discord (tests/fakes/discord_alt.py, written
from the reference alone), driven as a user and an operator would: a real ``prismd run``
and ``prismctl``. After each scenario every user message is answered exactly once or
listed by ``prismctl list-unresolved``, and no reply is posted twice. The daemon
scenarios are ``slow`` (5-25 s each, ``PRISM_ALT_SEED`` replays one); the two in-process
tests pin the bugs the fake found.
"""

from __future__ import annotations

import os
import random
import secrets
import signal
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing

from adapters.discord import DiscordAdapter
from adapters.discord._previews import PreviewEditor
from adapters.discord._rest import DiscordRest, DiscordTransportError
from prismd.channel import Admission, InboundEvent, Preview
from prismd.journal import operation_id_for
from stores import Store
from tests.daemon.helpers import Layout, free_port, prismctl, running_daemon
from tests.discord.test_killloop_discord import _op_states
from tests.fakes.discord_alt import AltDiscord
from tests.support.waiting import wait_until

TOKEN = "alt-discord-token-secret"
USERS = ("2100000000000000001", "2100000000000000002", "2100000000000000003")
CHANNELS = {u: f"31{u[2:]}" for u in USERS}
ENV = {"PRISM_TEST_DISCORD_TOKEN": TOKEN}


def _config(
    root: Path,
    fake: AltDiscord,
    seed: int,
    connection: str = "",
    sweep_every_s: int = 2,
    shards: int = 1,
    delay_max_ms: int = 150,
) -> Layout:
    layout = Layout(root=root, port=free_port())
    layout.config.write_text(
        f"""
[daemon]
state_dir = "{layout.state_dir}"

[store]
url = "sqlite:///{layout.db}"

[limits]
stop_deadline_ms = 2000
lease_ttl_ms = 5000

[control]
socket = "{layout.control}"

[[connections]]
id = "dc"
kind = "discord"
token_env = "PRISM_TEST_DISCORD_TOKEN"
api_origin = "{fake.origin}"
shards = {shards}
sweep_every_s = {sweep_every_s}
{connection}
[agents.slow]
kind = "python"
factory = "tests.fakes.killloop_agent:jitter_counting_mock"
count_file = "{layout.runs}"
delay_min_ms = 5
delay_max_ms = {delay_max_ms}
seed = "{seed}:agent"

[[grants]]
connection = "dc"
actors = ["*"]
aliases = ["slow"]
"""
    )
    return layout


@asynccontextmanager
async def _world(
    tmp_path: Path, nursery: trio.Nursery, **knobs: Any
) -> AsyncIterator[tuple[AltDiscord, Layout, random.Random, str]]:
    seed = int(os.environ.get("PRISM_ALT_SEED", secrets.randbits(32)))
    knobs.setdefault("heartbeat_interval_ms", 1000)
    fake = AltDiscord(token=TOKEN, rng=random.Random(seed), **knobs)
    await nursery.start(fake.serve)
    for user, channel in CHANNELS.items():
        fake.open_dm(user, channel)
    yield fake, _config(tmp_path, fake, seed), random.Random(f"{seed}:test"), f"seed={seed}"


async def _adapter_state(layout: Layout) -> str:
    code, health, err = await prismctl(layout, "health")
    assert code == 0, err
    entry = next(v for k, v in health["children"].items() if "dc" in k)
    return str(entry.get("adapterState"))


async def _state_is(layout: Layout, wanted: str) -> None:
    """Until ``prismctl health`` shows the connection in state ``wanted``."""
    while True:
        if await _adapter_state(layout) == wanted:
            return
        await trio.sleep(0.2)


async def _connected(layout: Layout) -> None:
    await _state_is(layout, "connected")


async def _settle(fake: AltDiscord, layout: Layout, sent: list[dict[str, Any]], tag: str) -> str:
    """Until every message is answered or listed and nothing moved for 3 s; then the
    checks: none answered twice, none lost. A summary line."""
    last: Any = None
    stable = trio.current_time()
    entries: list[dict[str, Any]] = []
    deadline = trio.current_time() + 30
    while True:
        await trio.sleep(0.5)
        if trio.current_time() > deadline:
            replies = _replies(fake)
            states = _op_states(layout)
            missing = [
                (m["content"][:12], states.get(operation_id_for("dc", m["id"]), "no record"))
                for m in sent
                if not replies[m["id"]]
            ]
            raise AssertionError(f"{tag}: never settled; unanswered {missing}; {entries}")
        code, entries, err = await prismctl(layout, "list-unresolved")
        assert code == 0, f"{tag}: {err}"
        replies = _replies(fake)
        listed = {str(e.get("externalEventId", "")) for e in entries} | {
            str(e.get("operationId", "")) for e in entries
        }
        # A reply still pending is on its way (a rate limit's wait): not settled yet.
        pending = any(e.get("replyState") == "pending" for e in entries)
        done = not pending and all(replies[m["id"]] or _listed(m, entries) for m in sent)
        snapshot = (len(fake.bot_messages()), len(entries), tuple(sorted(listed)))
        if snapshot != last:
            last, stable = snapshot, trio.current_time()
        elif done and trio.current_time() - stable >= 3.0:
            break
    contents = Counter(
        (m.get("message_reference", {}).get("message_id"), m["content"])
        for m in fake.bot_messages()
    )
    twice = [c[1][:40] for c, n in contents.items() if n > 1]
    lost = [m["content"] for m in sent if not replies[m["id"]] and not _listed(m, entries)]
    multi = [m["content"][:40] for m in sent if replies[m["id"]] > 1 and len(m["content"]) < 1900]
    summary = (
        f"{tag} sent={len(sent)} answered={sum(1 for m in sent if replies[m['id']])} "
        f"listed={len(entries)} identifies={len(fake.identifies)} resumes={len(fake.resumes)} "
        f"closes={Counter(fake.client_close_codes)} "
        f"listed_as={Counter((e.get('state'), e.get('replyState')) for e in entries)}"
    )
    assert not twice and not multi, f"{summary}: posted twice {twice} {multi}"
    assert not lost, f"{summary}: lost {lost}"
    assert not {1000, 1001} & set(fake.client_close_codes), summary
    return summary


def _replies(fake: AltDiscord) -> Counter[str]:
    """Bot messages per inbound message they answer (a preview answers none)."""
    return Counter(
        m["message_reference"]["message_id"]
        for m in fake.bot_messages()
        if "message_reference" in m
    )


def _listed(message: dict[str, Any], entries: list[dict[str, Any]]) -> bool:
    op = operation_id_for("dc", message["id"])
    return any(e.get("operationId") == op for e in entries)


async def _say(fake: AltDiscord, sent: list[dict[str, Any]], rng: random.Random, n: int) -> None:
    for _ in range(n):
        # Each user first in turn: a DM channel the bot never saw cannot be read back.
        user = USERS[len(sent)] if len(sent) < len(USERS) else rng.choice(USERS)
        sent.append(fake.user_message(CHANNELS[user], user, f"alt{len(sent)}"))
        await trio.sleep(rng.uniform(0.02, 0.15))


async def _scenario(
    tmp_path: Path,
    nursery: trio.Nursery,
    fault: Callable[[AltDiscord], None],
    *,
    heal: Callable[[AltDiscord], None] | None = None,
    knobs: dict[str, Any] | None = None,
    connection: str = "",
    before: int = 6,
    after: int = 10,
    hold_s: float = 2.0,
) -> tuple[AltDiscord, Layout, str]:
    """A daemon connected to the fake: ``before`` messages, ``fault``, ``after`` more while
    it holds, ``heal`` after ``hold_s``; settled and checked (:func:`_settle`)."""
    async with _world(tmp_path, nursery, **(knobs or {})) as (fake, layout, rng, tag):
        if connection:
            layout = _config(layout.root, fake, rng.randrange(1 << 30), connection)
        sent: list[dict[str, Any]] = []
        with trio.fail_after(55):
            async with running_daemon(layout, tag="a", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _connected(layout)
                await _say(fake, sent, rng, before)
                fault(fake)
                await _say(fake, sent, rng, after)
                await trio.sleep(hold_s)
                if heal is not None:
                    heal(fake)
                try:
                    summary = await _settle(fake, layout, sent, tag)
                except AssertionError:
                    print(daemon.stderr()[-6000:])
                    raise
                if os.environ.get("ALT_DEBUG"):
                    print("DEBUG", daemon.stderr())
                daemon.send(signal.SIGTERM)
                assert await daemon.wait_exit() == 0, daemon.stderr()
                assert TOKEN not in daemon.stderr()
                assert not [m for m in sent if m["content"] in daemon.stderr()]
        print(summary)
        return fake, layout, summary


@pytest.mark.slow
async def test_alt_basic_flow(tmp_path: Path, nursery: trio.Nursery) -> None:
    async with _world(tmp_path, nursery) as (fake, layout, rng, tag):
        sent: list[dict[str, Any]] = []
        with trio.fail_after(55):
            async with running_daemon(layout, tag="a", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _connected(layout)
                await _say(fake, sent, rng, 10)
                summary = await _settle(fake, layout, sent, tag)
                daemon.send(signal.SIGTERM)
                assert await daemon.wait_exit() == 0
                assert TOKEN not in daemon.stderr()
        print(summary)
        assert not fake.server_close_codes, summary  # heartbeats in time, nothing refused


@pytest.mark.slow
async def test_alt_killloop(tmp_path: Path, nursery: trio.Nursery) -> None:
    """SIGKILLs at random moments while DMs flow: every restart resumes (one Identify in
    all), the gap is replayed, nothing is answered twice; a resent reply's nonce dedupes."""
    async with _world(tmp_path, nursery) as (fake, layout, rng, tag):
        sent: list[dict[str, Any]] = []
        with trio.fail_after(58):
            for round_ in range(4):
                async with running_daemon(layout, tag=f"k{round_}", extra_env=ENV) as daemon:
                    if round_ == 0:
                        await wait_until(lambda: bool(fake.sessions))
                        nursery.start_soon(_say, fake, sent, rng, 50)
                    await trio.sleep(rng.uniform(0.5, 3.0))
                    daemon.send(signal.SIGKILL)
                    assert await daemon.wait_exit() == -signal.SIGKILL
            async with running_daemon(layout, tag="final", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await wait_until(lambda: len(sent) == 50)
                await _connected(layout)
                summary = await _settle(fake, layout, sent, tag)
        print(summary, f"nonce_hits={fake.nonce_hits}")
        assert len(fake.identifies) == 1, summary


@pytest.mark.slow
async def test_alt_invalid_session_false_backfills(tmp_path: Path, nursery: trio.Nursery) -> None:
    """Op 9 false mid-stream: what was written while no session existed is read back."""
    await _scenario(tmp_path, nursery, lambda f: f.invalidate_all(False), hold_s=0.5)


@pytest.mark.slow
async def test_alt_invalid_session_true(tmp_path: Path, nursery: trio.Nursery) -> None:
    fake, _layout, summary = await _scenario(tmp_path, nursery, lambda f: f.invalidate_all(True))
    assert len(fake.identifies) == 1, summary


@pytest.mark.slow
async def test_alt_reconnect_op7(tmp_path: Path, nursery: trio.Nursery) -> None:
    fake, _layout, summary = await _scenario(tmp_path, nursery, lambda f: f.reconnect_all())
    assert len(fake.identifies) == 1 and fake.resumes, summary
    # Resumed through READY's resume_gateway_url, with the first connection's v and encoding
    assert fake.resume_targets and all(
        t.startswith("/resume?") and "v=10" in t and "encoding=json" in t
        for t in fake.resume_targets
    ), fake.resume_targets


@pytest.mark.slow
async def test_alt_duplicated_dispatches(tmp_path: Path, nursery: trio.Nursery) -> None:
    def fault(fake: AltDiscord) -> None:
        fake.duplicate_same_s = 5
        fake.duplicate_new_s = 5

    await _scenario(tmp_path, nursery, fault)


@pytest.mark.slow
async def test_alt_dropped_on_the_wire(tmp_path: Path, nursery: trio.Nursery) -> None:
    """Dispatches numbered but never written: the gap resumes and the replay fills it."""

    def fault(fake: AltDiscord) -> None:
        fake.drop_wire = 3

    fake, _layout, summary = await _scenario(tmp_path, nursery, fault)
    assert fake.resumes, summary


@pytest.mark.slow
async def test_alt_never_sent(tmp_path: Path, nursery: trio.Nursery) -> None:
    """Messages the gateway never sends at all: the sweep reads them."""

    def fault(fake: AltDiscord) -> None:
        fake.never_send = 3

    await _scenario(tmp_path, nursery, fault, hold_s=4.0)


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
async def test_alt_withheld_heartbeat_acks(tmp_path: Path, nursery: trio.Nursery) -> None:
    def fault(fake: AltDiscord) -> None:
        fake.withhold_acks = True

    def heal(fake: AltDiscord) -> None:
        fake.withhold_acks = False

    fake, _layout, summary = await _scenario(tmp_path, nursery, fault, heal=heal, hold_s=3.0)
    assert fake.resumes and len(fake.identifies) == 1, summary


@pytest.mark.slow
@pytest.mark.parametrize("code", [4000, 4001, 4002, 4003, 4005, 4007, 4008, 4009, 1000, None])
async def test_alt_server_closes(tmp_path: Path, nursery: trio.Nursery, code: int | None) -> None:
    """Each reconnectable close Discord may send (``None``: TCP dropped); 4003, 4007 and
    4009 end the session in the fake, so those identify again and backfill."""
    fake, _layout, summary = await _scenario(
        tmp_path, nursery, lambda f: f.close_all(code), hold_s=0.5
    )
    if code not in (4003, 4007, 4009):
        assert len(fake.identifies) == 1, summary


@pytest.mark.slow
async def test_alt_reconnect_before_hello_and_heartbeat_request(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    def fault(fake: AltDiscord) -> None:
        fake.reconnect_before_hello = 2
        fake.request_heartbeat_all()
        fake.reconnect_all()

    fake, _layout, summary = await _scenario(tmp_path, nursery, fault)
    assert len(fake.identifies) == 1, summary


@pytest.mark.slow
async def test_alt_restart_after_resume_window(tmp_path: Path, nursery: trio.Nursery) -> None:
    """Down longer than the session lives: op 9 false on Resume, a new session, and what
    was written meanwhile read back over REST (known channels)."""
    async with _world(tmp_path, nursery, resume_ttl_s=1.0) as (fake, layout, rng, tag):
        sent: list[dict[str, Any]] = []
        with trio.fail_after(55):
            async with running_daemon(layout, tag="a", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _connected(layout)
                await _say(fake, sent, rng, 6)
                await _settle(fake, layout, sent, tag)
                daemon.send(signal.SIGKILL)
                await daemon.wait_exit()
            await _say(fake, sent, rng, 8)
            await trio.sleep(2.0)  # past the session's life (a restart may take over at once)
            async with running_daemon(layout, tag="b", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _connected(layout)
                await _say(fake, sent, rng, 4)
                summary = await _settle(fake, layout, sent, tag)
        print(summary)
        assert len(fake.identifies) == 2 and fake.resumes, summary


@pytest.mark.slow
async def test_alt_replay_buffer_overflow(tmp_path: Path, nursery: trio.Nursery) -> None:
    """A Resume whose ``seq`` fell out of the replay buffer: 4007, then a new session."""

    def fault(fake: AltDiscord) -> None:
        fake.drop_wire = 8  # the gap resumes from below what the buffer still holds

    fake, _layout, summary = await _scenario(tmp_path, nursery, fault, knobs={"replay_max": 4})
    assert 4007 in fake.server_close_codes and len(fake.identifies) == 2, summary


@pytest.mark.slow
async def test_alt_gateway_token_reset_4004(tmp_path: Path, nursery: trio.Nursery) -> None:
    """The gateway rejects the token (4004) while REST still answers: the daemon stays up
    and ``prismctl health`` shows the connection failed; no identify storm."""
    async with _world(tmp_path, nursery, gateway_token="another") as (fake, layout, _rng, tag):
        with trio.fail_after(30):
            async with running_daemon(layout, tag="a", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _state_is(layout, "failed")
                await trio.sleep(2.0)
                assert daemon.process.returncode is None
                assert await _adapter_state(layout) == "failed"
                assert len(fake.identifies) == 0 and 4004 in fake.server_close_codes, tag
                assert fake.server_close_codes.count(4004) == 1, fake.server_close_codes
                daemon.send(signal.SIGTERM)
                assert await daemon.wait_exit() == 0
                assert TOKEN not in daemon.stderr()


@pytest.mark.slow
async def test_alt_rest_token_rejected_401(tmp_path: Path, nursery: trio.Nursery) -> None:
    async with _world(tmp_path, nursery) as (fake, layout, _rng, _tag):
        fake.token = "other-token"
        with trio.fail_after(30):
            async with running_daemon(layout, tag="a", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _state_is(layout, "failed")
                await trio.sleep(1.0)
                assert daemon.process.returncode is None
                assert fake.invalid_requests <= 2, fake.invalid_requests
                daemon.send(signal.SIGTERM)
                assert await daemon.wait_exit() == 0


def _random_fault(fake: AltDiscord, rng: random.Random) -> str:
    """One fault of the fake's, drawn by ``rng``; its name."""
    faults: dict[str, Callable[[], None]] = {
        "lose_post": lambda: setattr(fake, "lose_post_response", 2),
        "post_500": lambda: setattr(fake, "post_500_after_commit", 2),
        "post_502": lambda: setattr(fake, "post_502", 2),
        "route_429": lambda: setattr(fake, "route_429", 4),
        "global_429": lambda: setattr(fake, "global_429", 4),
        "drop_wire": lambda: setattr(fake, "drop_wire", 2),
        "dup_same": lambda: setattr(fake, "duplicate_same_s", 3),
        "dup_new": lambda: setattr(fake, "duplicate_new_s", 3),
        "never_send": lambda: setattr(fake, "never_send", 1),
        "op7": fake.reconnect_all,
        "op9_true": lambda: fake.invalidate_all(True),
        "op9_false": lambda: fake.invalidate_all(False),
        "close_4009": lambda: fake.close_all(4009),
        "close_none": lambda: fake.close_all(None),
        "op1": fake.request_heartbeat_all,
    }
    name = rng.choice(sorted(faults))
    faults[name]()
    return name


@pytest.mark.slow
async def test_alt_chaos_killloop(tmp_path: Path, nursery: trio.Nursery) -> None:
    """SIGKILLs (and a SIGTERM) at random moments while DMs flow and the fake misbehaves
    at random: every message answered once or listed, no reply posted twice."""
    async with _world(tmp_path, nursery) as (fake, layout, rng, tag):
        sent: list[dict[str, Any]] = []
        faults: list[str] = []

        async def misbehave() -> None:
            while True:
                await trio.sleep(rng.uniform(0.3, 1.2))
                faults.append(_random_fault(fake, rng))

        with trio.fail_after(58):
            async with trio.open_nursery() as chaos:
                for round_ in range(4):
                    async with running_daemon(layout, tag=f"k{round_}", extra_env=ENV) as daemon:
                        if round_ == 0:
                            await wait_until(lambda: bool(fake.sessions))
                            nursery.start_soon(_say, fake, sent, rng, 40)
                            chaos.start_soon(misbehave)
                        await trio.sleep(rng.uniform(0.5, 3.0))
                        daemon.send(signal.SIGTERM if round_ == 2 else signal.SIGKILL)
                        await daemon.wait_exit()
                chaos.cancel_scope.cancel()
            for knob in ("lose_post_response", "post_500_after_commit", "post_502", "route_429"):
                setattr(fake, knob, 0)
            fake.global_429 = fake.drop_wire = fake.never_send = 0
            async with running_daemon(layout, tag="final", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await wait_until(lambda: len(sent) == 40)
                await _connected(layout)
                try:
                    summary = await _settle(fake, layout, sent, f"{tag} faults={faults}")
                except AssertionError:
                    for path in sorted(layout.root.glob("stderr-*.log")):
                        print("DEBUG", path.name, path.read_text()[-5000:])
                    raise
        print(summary, f"nonce_hits={fake.nonce_hits}")


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
            async with running_daemon(layout, tag="a", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _connected(layout)
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
async def test_alt_new_user_during_gap_caught_up(tmp_path: Path, nursery: trio.Nursery) -> None:
    """A user the bot never saw writes while no session exists (op 9 false), then again
    once a new one does: the earlier messages are read back before the later one."""
    async with _world(tmp_path, nursery) as (fake, layout, rng, tag):
        sent: list[dict[str, Any]] = []
        newcomer, channel = "2100000000000000009", "3100000000000000009"
        fake.open_dm(newcomer, channel)
        with trio.fail_after(55):
            async with running_daemon(layout, tag="a", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _connected(layout)
                await _say(fake, sent, rng, 3)
                await _settle(fake, layout, sent, tag)
                fake.invalidate_all(False)
                for n in range(3):
                    sent.append(fake.user_message(channel, newcomer, f"gap{n}"))
                await wait_until(lambda: len(fake.sessions) == 1)  # identified again
                await _connected(layout)
                sent.append(fake.user_message(channel, newcomer, "after"))
                summary = await _settle(fake, layout, sent, tag)
        replies = _replies(fake)
        assert all(replies[m["id"]] == 1 for m in sent), summary


@pytest.mark.slow
async def test_alt_disallowed_intents_4014(tmp_path: Path, nursery: trio.Nursery) -> None:
    async with _world(tmp_path, nursery, privileged_enabled=False) as (fake, layout, _rng, tag):
        layout = _config(layout.root, fake, 1, 'respond_to = "all"\n')
        with trio.fail_after(30):
            async with running_daemon(layout, tag="a", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _state_is(layout, "failed")
                assert fake.server_close_codes == [4014], tag
                daemon.send(signal.SIGTERM)
                assert await daemon.wait_exit() == 0
                assert "disallowed intents" in daemon.stderr()  # why, for the operator


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
            async with running_daemon(layout, tag="a", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _connected(layout)
                await _say(fake, sent, rng, 6)
                await wait_until(lambda: all(_replies(fake)[m["id"]] for m in sent))
                await trio.sleep(1.5)  # the watermark saved: nothing replayed
                daemon.send(signal.SIGKILL)
                await daemon.wait_exit()
            layout = _config(layout.root, fake, seed)
            async with running_daemon(layout, tag="b", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _connected(layout)
                await trio.sleep(6.0)  # sweeps every 2 s, a message settles 1 s
                summary = await _settle(fake, layout, sent, tag)
                assert "the gateway had not sent" not in daemon.stderr(), daemon.stderr()
        assert [e for e in fake.requests if e[0] == "GET" and "/messages" in e[1]], summary


@pytest.mark.slow
async def test_alt_token_reset_mid_run(tmp_path: Path, nursery: trio.Nursery) -> None:
    """The token is reset while connected: the Resume is closed 4004, the connection shows
    failed, the daemon stays up and answers prismctl."""
    async with _world(tmp_path, nursery) as (fake, layout, rng, tag):
        sent: list[dict[str, Any]] = []
        with trio.fail_after(40):
            async with running_daemon(layout, tag="a", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _connected(layout)
                await _say(fake, sent, rng, 3)
                await _settle(fake, layout, sent, tag)
                fake.gateway_token = "reset"
                fake.close_all(None)
                await _state_is(layout, "failed")
                await trio.sleep(2.0)
                assert await _adapter_state(layout) == "failed"
                assert fake.server_close_codes.count(4004) == 1, fake.server_close_codes
                daemon.send(signal.SIGTERM)
                assert await daemon.wait_exit() == 0
                assert "authentication failed" in daemon.stderr()
                assert TOKEN not in daemon.stderr()


@pytest.mark.slow
async def test_alt_two_shards(tmp_path: Path, nursery: trio.Nursery) -> None:
    """Two shards: DMs reach shard 0 only; both identify (5 s apart), all answered."""
    async with _world(tmp_path, nursery) as (fake, layout, rng, tag):
        layout = _config(layout.root, fake, 7, shards=2)
        sent: list[dict[str, Any]] = []
        with trio.fail_after(55):
            async with running_daemon(layout, tag="a", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await wait_until(lambda: len(fake.sessions) == 2)
                await _connected(layout)
                await _say(fake, sent, rng, 6)
                fake.reconnect_all()
                await _say(fake, sent, rng, 6)
                summary = await _settle(fake, layout, sent, tag)
        assert len(fake.identifies) == 2, summary


@pytest.mark.slow
async def test_alt_long_gap_backfill_pages(tmp_path: Path, nursery: trio.Nursery) -> None:
    """Op 9 false while one user writes 130 messages: the backfill reads them in pages
    (100, then 30) and all are answered."""
    knobs = {"bucket_limit": 200, "bucket_window_s": 1.0}
    async with _world(tmp_path, nursery, **knobs) as (fake, layout, _rng, tag):
        sent: list[dict[str, Any]] = []
        user = USERS[0]
        with trio.fail_after(58):
            async with running_daemon(layout, tag="a", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _connected(layout)
                sent.append(fake.user_message(CHANNELS[user], user, "first"))
                await _settle(fake, layout, sent, tag)
                fake.invalidate_all(False)
                for n in range(130):
                    sent.append(fake.user_message(CHANNELS[user], user, f"gap{n}"))
                summary = await _settle(fake, layout, sent, tag)
        assert len(fake.identifies) == 2, summary


@pytest.mark.slow
async def test_alt_kill_while_answers_are_lost(tmp_path: Path, nursery: trio.Nursery) -> None:
    """Every POST's answer lost (each committed), the daemon SIGKILLed while it posts them
    again: the next start sends the unmarked replies with the same nonces — Discord
    answers with the originals — and none is posted twice."""
    async with _world(tmp_path, nursery, lose_post_response=1_000) as (fake, layout, rng, tag):
        sent: list[dict[str, Any]] = []
        with trio.fail_after(55):
            async with running_daemon(layout, tag="a", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _connected(layout)
                await _say(fake, sent, rng, 6)
                await wait_until(lambda: len(fake.bot_messages()) >= 4)
                await trio.sleep(rng.uniform(0.0, 1.0))
                daemon.send(signal.SIGKILL)
                await daemon.wait_exit()
            fake.lose_post_response = 0
            async with running_daemon(layout, tag="b", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _connected(layout)
                summary = await _settle(fake, layout, sent, tag)
        assert fake.nonce_hits >= 4, summary


@pytest.mark.slow
async def test_alt_heartbeat_requested_is_sent_at_once(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """Op 1 from the gateway: a heartbeat at once, not at the next interval (5 s here)."""
    async with _world(tmp_path, nursery, heartbeat_interval_ms=5000) as (fake, layout, _r, tag):
        with trio.fail_after(30):
            async with running_daemon(layout, tag="a", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _connected(layout)
                await wait_until(lambda: len(fake.heartbeats) >= 1)
                await trio.sleep(0.5)
                before = len(fake.heartbeats)
                fake.request_heartbeat_all()
                with trio.fail_after(1.0):
                    await wait_until(lambda: len(fake.heartbeats) > before)
                assert fake.heartbeats[-1] == max(s for s in fake.sessions_seq()), tag


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


@pytest.mark.slow
async def test_alt_stalled_daemon(tmp_path: Path, nursery: trio.Nursery) -> None:
    """The daemon frozen (SIGSTOP) past its heartbeat and its lease while DMs flow, then
    thawed: the gateway closed the silent socket; the thawed daemon takes its lease again,
    resumes, and answers each message once."""
    async with _world(tmp_path, nursery) as (fake, layout, rng, tag):
        sent: list[dict[str, Any]] = []
        with trio.fail_after(55):
            async with running_daemon(layout, tag="a", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _connected(layout)
                await _say(fake, sent, rng, 4)
                daemon.send(signal.SIGSTOP)
                await _say(fake, sent, rng, 6)
                await trio.sleep(7.0)  # past the heartbeat (1 s) and the lease (5 s)
                daemon.send(signal.SIGCONT)
                await _say(fake, sent, rng, 4)
                summary = await _settle(fake, layout, sent, tag)
                assert 4000 in fake.server_close_codes, summary  # the silent socket closed
                daemon.send(signal.SIGTERM)
                assert await daemon.wait_exit() == 0, daemon.stderr()
        print(summary)


@pytest.mark.slow
async def test_alt_large_fragmented_dispatch(tmp_path: Path, nursery: trio.Nursery) -> None:
    """A GUILD_CREATE of hundreds of KiB in fragments after a ping: read through, no
    reconnect, the messages around it answered."""
    fake, _layout, summary = await _scenario(
        tmp_path, nursery, lambda f: f.large_guild(), knobs={"heartbeat_interval_ms": 4000}
    )
    assert not fake.resumes and len(fake.identifies) == 1, summary


@pytest.mark.slow
async def test_alt_kill_during_backfill(tmp_path: Path, nursery: trio.Nursery) -> None:
    """SIGKILL while the backfill after op 9 false is admitting a long gap: the next start
    resumes the new session and backfills again (it was still due); each message answered
    once or listed."""
    knobs = {"bucket_limit": 200, "bucket_window_s": 1.0}
    async with _world(tmp_path, nursery, **knobs) as (fake, layout, rng, tag):
        sent: list[dict[str, Any]] = []
        with trio.fail_after(58):
            async with running_daemon(layout, tag="a", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _connected(layout)
                await _say(fake, sent, rng, 3)
                await _settle(fake, layout, sent, tag)
                fake.invalidate_all(False)
                for n in range(90):
                    user = USERS[n % len(USERS)]
                    sent.append(fake.user_message(CHANNELS[user], user, f"gap{n}"))
                await wait_until(lambda: len(_replies(fake)) >= 3 + rng.randrange(3, 20))
                daemon.send(signal.SIGKILL)
                await daemon.wait_exit()
            async with running_daemon(layout, tag="b", extra_env=ENV) as daemon:
                await daemon.wait_state("READY=1")
                await _connected(layout)
                summary = await _settle(fake, layout, sent, tag)
        print(summary)
