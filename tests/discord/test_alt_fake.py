"""prismd against a second, independent fake Discord (tests/fakes/discord_alt.py, written
from the reference alone), driven as a user and an operator would: a real ``prismd run``
and ``prismctl`` (:mod:`tests.discord.alt_harness`). The gateway's side: kills, resumes,
invalid sessions, closes, duplicated, dropped and never-sent dispatches, zombies, tokens
refused, shards, backfills. The daemon scenarios are ``slow`` (5-25 s each;
``PRISM_ALT_SEED`` replays one). The REST side is :mod:`tests.discord.test_alt_fake_rest`.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from tests.daemon.helpers import running_daemon
from tests.discord.alt_harness import (
    CHANNELS,
    ENV,
    TOKEN,
    USERS,
    _adapter_state,
    _config,
    _connected,
    _connected_daemon,
    _health_entry,
    _replies,
    _say,
    _scenario,
    _settle,
    _state_is,
    _world,
)
from tests.fakes.discord_alt import AltDiscord
from tests.support.waiting import wait_until


@pytest.mark.slow
async def test_alt_basic_flow(tmp_path: Path, nursery: trio.Nursery) -> None:
    async with _world(tmp_path, nursery) as (fake, layout, rng, tag):
        sent: list[dict[str, Any]] = []
        with trio.fail_after(55):
            async with _connected_daemon(layout, "a") as daemon:
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
            async with _connected_daemon(layout, "a") as daemon:
                await _say(fake, sent, rng, 6)
                await _settle(fake, layout, sent, tag)
                daemon.send(signal.SIGKILL)
                await daemon.wait_exit()
            await _say(fake, sent, rng, 8)
            await trio.sleep(2.0)  # past the session's life (a restart may take over at once)
            async with _connected_daemon(layout, "b") as daemon:
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
                entry = await _health_entry(layout)
                assert entry["adapterState"] == "failed"
                # Why, in health: the close code's words (the log says it too).
                assert entry["lastError"].startswith("authentication failed"), entry
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
async def test_alt_new_user_during_gap_caught_up(tmp_path: Path, nursery: trio.Nursery) -> None:
    """A user the bot never saw writes while no session exists (op 9 false), then again
    once a new one does: the earlier messages are read back before the later one."""
    async with _world(tmp_path, nursery) as (fake, layout, rng, tag):
        sent: list[dict[str, Any]] = []
        newcomer, channel = "2100000000000000009", "3100000000000000009"
        fake.open_dm(newcomer, channel)
        with trio.fail_after(55):
            async with _connected_daemon(layout, "a"):
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
async def test_alt_token_reset_mid_run(tmp_path: Path, nursery: trio.Nursery) -> None:
    """The token is reset while connected: the Resume is closed 4004, the connection shows
    failed, the daemon stays up and answers prismctl."""
    async with _world(tmp_path, nursery) as (fake, layout, rng, tag):
        sent: list[dict[str, Any]] = []
        with trio.fail_after(40):
            async with _connected_daemon(layout, "a") as daemon:
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
            async with _connected_daemon(layout, "a"):
                sent.append(fake.user_message(CHANNELS[user], user, "first"))
                await _settle(fake, layout, sent, tag)
                fake.invalidate_all(False)
                for n in range(130):
                    sent.append(fake.user_message(CHANNELS[user], user, f"gap{n}"))
                summary = await _settle(fake, layout, sent, tag)
        assert len(fake.identifies) == 2, summary


@pytest.mark.slow
async def test_alt_heartbeat_requested_is_sent_at_once(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """Op 1 from the gateway: a heartbeat at once, not at the next interval (5 s here)."""
    async with _world(tmp_path, nursery, heartbeat_interval_ms=5000) as (fake, layout, _r, tag):
        with trio.fail_after(30):
            async with _connected_daemon(layout, "a"):
                await wait_until(lambda: len(fake.heartbeats) >= 1)
                await trio.sleep(0.5)
                before = len(fake.heartbeats)
                fake.request_heartbeat_all()
                with trio.fail_after(1.0):
                    await wait_until(lambda: len(fake.heartbeats) > before)
                assert fake.heartbeats[-1] == max(s for s in fake.sessions_seq()), tag


@pytest.mark.slow
async def test_alt_stalled_daemon(tmp_path: Path, nursery: trio.Nursery) -> None:
    """The daemon frozen (SIGSTOP) past its heartbeat and its lease while DMs flow, then
    thawed: the gateway closed the silent socket; the thawed daemon takes its lease again,
    resumes, and answers each message once."""
    async with _world(tmp_path, nursery) as (fake, layout, rng, tag):
        sent: list[dict[str, Any]] = []
        with trio.fail_after(55):
            async with _connected_daemon(layout, "a") as daemon:
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
            async with _connected_daemon(layout, "a") as daemon:
                await _say(fake, sent, rng, 3)
                await _settle(fake, layout, sent, tag)
                fake.invalidate_all(False)
                for n in range(90):
                    user = USERS[n % len(USERS)]
                    sent.append(fake.user_message(CHANNELS[user], user, f"gap{n}"))
                await wait_until(lambda: len(_replies(fake)) >= 3 + rng.randrange(3, 20))
                daemon.send(signal.SIGKILL)
                await daemon.wait_exit()
            async with _connected_daemon(layout, "b") as daemon:
                summary = await _settle(fake, layout, sent, tag)
        print(summary)
