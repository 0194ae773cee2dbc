"""A hostile kill loop over Discord (issue 39 audit): a real ``prismd run`` SIGKILLed at
random moments while the gateway and the API misbehave in every way the reference allows,
at moments nobody picked — duplicated dispatches, dispatches lost on the way (a gap in
``s``), op 7, op 9 ``true`` and once ``false``, closes 4000/4001/4008/4009/1000 and TCP
drops, withheld heartbeat ACKs, heartbeat requests, sends that commit and lose their answer
(dropped, 500, or never answered: the daemon is killed while it waits), 502s and 429s —
while DMs from three users and guild mentions in both forms (``<@id>``, ``<@!id>``) flow,
beside guild chatter and another bot's posts that must not be answered. A final run
settles everything; then, as an operator sees it through ``prismctl``:

* every message to the bot is answered once, listed by ``list-unresolved``, or settled
  ``cancelled`` by a graceful stop — none lost;
* no agent run twice for one message, no reply posted twice;
* nothing addressed to someone else answered; the gateway never closed with 1000/1001;
  neither the token nor message text in the logs.

``PRISM_KILLLOOP_SEED`` replays one run.
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from prismd.journal import operation_id_for
from tests.daemon.helpers import run_keys, running_daemon
from tests.fakes.discord_api import FakeDiscord
from tests.support.waiting import wait_until

from .test_killloop_discord import _config, _connected, _op_states, _settle

pytestmark = pytest.mark.slow

ROUNDS = 4
MESSAGES = 48
USERS = ("2000000000000000001", "2000000000000000002", "2000000000000000003")
CHANNELS = {u: f"3{u[1:]}" for u in USERS}
GUILD = "4000000000000000001"
GUILD_CHANNEL = "5000000000000000001"
GUILD_USERS = ("2000000000000000004", "2000000000000000005")
OTHER_BOT = "2000000000000000009"
TOKEN = "discord-bot-token-secret"
GATEWAY_FAULTS = (
    "duplicate",
    "lose",
    "reconnect",
    "invalid_true",
    "close",
    "withhold_ack",
    "heartbeat_request",
)
REST_FAULTS = ("commit_drop", "commit_500", "502", "429", "commit_hang")
CLOSE_CODES = (4000, 4001, 4008, 4009, 1000, None)


def _post(
    fake: FakeDiscord,
    rng: random.Random,
    n: int,
    addressed: list[dict[str, Any]],
    ignored: list[str],
) -> None:
    """One message: a DM (most), a guild mention in either form, or one not for the bot."""
    roll = rng.random()
    if roll < 0.6:
        user = rng.choice(USERS)
        addressed.append(fake.user_message(CHANNELS[user], user, f"hk{n}"))
    elif roll < 0.85:
        user = rng.choice(GUILD_USERS)
        nickname = rng.random() < 0.5
        addressed.append(
            fake.user_message(
                GUILD_CHANNEL,
                user,
                f"hk{n}",
                guild_id=GUILD,
                mention_bot=True,
                nickname_mention=nickname,
            )
        )
    elif roll < 0.95:
        sent = fake.user_message(GUILD_CHANNEL, rng.choice(GUILD_USERS), f"hk{n}", guild_id=GUILD)
        ignored.append(sent["id"])
    else:
        sent = fake.user_message(
            GUILD_CHANNEL, OTHER_BOT, f"hk{n}", guild_id=GUILD, mention_bot=True, bot=True
        )
        ignored.append(sent["id"])


async def _feed(
    fake: FakeDiscord,
    rng: random.Random,
    addressed: list[dict[str, Any]],
    ignored: list[str],
    done: trio.Event,
) -> None:
    # Every channel's first message before any fault: a channel the bot has never seen
    # cannot be backfilled after a lost session (bots cannot list their DMs, §3).
    for user in USERS:
        addressed.append(fake.user_message(CHANNELS[user], user, f"hello {user[-1]}"))
    addressed.append(
        fake.user_message(
            GUILD_CHANNEL, GUILD_USERS[0], "hello g", guild_id=GUILD, mention_bot=True
        )
    )
    for n in range(MESSAGES):
        _post(fake, rng, n, addressed, ignored)
        await trio.sleep(rng.uniform(0.05, 0.4))
    done.set()


def _fault(fake: FakeDiscord, rng: random.Random, invalid_false: list[bool]) -> str:
    gateway = fake.gateway
    if not invalid_false[0] and rng.random() < 0.08:
        invalid_false[0] = True
        gateway.invalidate(resumable=False)
        return "invalid_false"
    if rng.random() < 0.4:
        fault = rng.choice(REST_FAULTS)
        fake.fail_next("POST /api/v10/channels/", fault)
        return fault
    fault = rng.choice(GATEWAY_FAULTS)
    if fault == "duplicate":
        gateway.duplicate_next += 1
    elif fault == "lose":
        gateway.lose_next += 1
    elif fault == "reconnect":
        gateway.reconnect()
    elif fault == "invalid_true":
        gateway.invalidate(resumable=True)
    elif fault == "close":
        code = rng.choice(CLOSE_CODES)
        gateway.close_all(code)
        fault = f"close {code}"
    elif fault == "withhold_ack":
        gateway.withhold_acks += 1
    else:
        gateway.request_heartbeat()
    return fault


async def _misbehave(
    fake: FakeDiscord, rng: random.Random, done: trio.Event, final: trio.Event, log: list[str]
) -> None:
    invalid_false = [False]
    await trio.sleep(1.0)
    while not (done.is_set() or final.is_set()):
        log.append(_fault(fake, rng, invalid_false))
        await trio.sleep(rng.uniform(0.2, 0.9))


async def test_hostile_killloop_discord(tmp_path: Path, nursery: trio.Nursery) -> None:
    seed = int(os.environ.get("PRISM_KILLLOOP_SEED", secrets.randbits(32)))
    rng = random.Random(seed)
    tag = f"seed={seed}"
    fake = FakeDiscord(token=TOKEN, heartbeat_interval_ms=1500)
    await nursery.start(fake.serve)
    layout = _config(tmp_path, fake, seed, connection="allow_guilds = true\n", delay_max_ms=150)
    env = {"PRISM_TEST_DISCORD_TOKEN": TOKEN}
    addressed: list[dict[str, Any]] = []
    ignored: list[str] = []
    faults: list[str] = []
    logs: list[str] = []
    fed = trio.Event()
    final = trio.Event()
    """The final run: no more faults (a hung send waits 15 s for its answer)."""
    kills = 0
    with trio.fail_after(59):
        for round_ in range(ROUNDS):
            async with running_daemon(layout, tag=f"h{round_}", extra_env=env) as daemon:
                if round_ == 0:  # Discord delivers nothing to a bot that never connected
                    await wait_until(lambda: bool(fake.gateway.sessions))
                    feed_rng = random.Random(f"{seed}:feed")
                    nursery.start_soon(_feed, fake, feed_rng, addressed, ignored, fed)
                    fault_rng = random.Random(f"{seed}:faults")
                    nursery.start_soon(_misbehave, fake, fault_rng, fed, final, faults)
                else:  # killed while it works, not while Python starts
                    await daemon.wait_state("READY=1")
                await trio.sleep(rng.uniform(0.5, 2.5))
                if round_ == 2:
                    daemon.send(signal.SIGTERM)
                    await trio.sleep(rng.uniform(0.0, 0.5))
                if daemon.process.returncode is None:
                    daemon.send(signal.SIGKILL)
                    kills += 1
                code = await daemon.wait_exit()
                logs.append(daemon.stderr())
                early_term = code == -signal.SIGTERM and not logs[-1].strip()
                assert code in (0, -signal.SIGKILL) or early_term, f"{tag} exit {code}: {logs[-1]}"
        final.set()
        # A fault armed at the end and not met yet (a send that would hang 15 s) would be
        # the final run's: settled is when nothing moves for 6 s.
        fake.clear_faults()
        async with running_daemon(layout, tag="final", extra_env=env) as daemon:
            await daemon.wait_state("READY=1")
            await fed.wait()
            await _connected(layout, tag)
            entries = await _settle(fake, layout, tag, addressed)
            daemon.send(signal.SIGTERM)
            assert await daemon.wait_exit() == 0, f"{tag}: {daemon.stderr()}"
            logs.append(daemon.stderr())

    runs = Counter(run_keys(layout.runs))
    replies = Counter(m["message_reference"]["message_id"] for m in fake.bot_messages())
    unresolved = {e["operationId"] for e in entries}
    states = _op_states(layout)
    problems: list[str] = []
    unanswered = cancelled = 0
    for message in addressed:
        op = operation_id_for("dc", message["id"])
        if runs[op] > 1:
            problems.append(f"{message['content']}: agent ran {runs[op]} times")
        if replies[message["id"]] > 1:
            problems.append(f"{message['content']}: answered {replies[message['id']]} times")
        if replies[message["id"]] == 0:
            unanswered += 1
            state = states.get(op, "no record")
            if state == "cancelled":
                cancelled += 1
            elif op not in unresolved:
                problems.append(f"{message['content']}: lost (not answered, not listed: {state})")
    for message_id in ignored:
        if replies[message_id]:
            problems.append(f"{message_id}: not addressed to the bot, answered")
    for entry in entries:
        if entry.get("replyState") == "pending":
            problems.append(f"{entry['operationId']}: reply still pending ({entry['state']})")
    summary = (
        f"hostile killloop discord {tag} kills={kills} addressed={len(addressed)} "
        f"ignored={len(ignored)} answered={sum(1 for m in addressed if replies[m['id']])} "
        f"unanswered={unanswered} (cancelled_by_stop={cancelled}) "
        f"identifies={len(fake.gateway.identifies())} resumes={len(fake.gateway.resumes)} "
        f"faults={Counter(faults)} closes={Counter(fake.gateway.client_close_codes)}"
    )
    print(summary, file=sys.stderr)
    assert not problems, f"{summary}: " + "; ".join(problems[:20])
    assert not {1000, 1001} & set(fake.gateway.client_close_codes), summary
    for log in logs:
        assert TOKEN not in log and "hk1" not in log and "hello" not in log, tag
