"""Kill loop with Discord's own faults at moments the test does not pick (issue 39 audit):
a real ``prismd run`` SIGKILLed at random while DMs flow, and meanwhile the fake gateway
and REST misbehave as the reference allows — op 7, op 9 ``true``/``false``, closes with
4000/4009/1000 or none, heartbeat requests, a zombie (silent) connection, duplicated
dispatches, a dispatch never sent (a sweep of its channel finds it), one dropped before
its session is invalidated (backfill), sessions
expired while no daemon runs, and sends whose response is lost, a 500 after the commit, a
502, a 429.

Every message is answered once, listed by ``list-unresolved``, or settled ``cancelled``
by a graceful stop; no agent runs twice for one message; no reply is posted twice; the
daemon never closes the gateway with 1000/1001; no token or message text in its logs.
``PRISM_CHAOS_SEED`` replays one run.
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

from .test_killloop_discord import CHANNELS, TOKEN, USERS, _config, _connected, _op_states, _settle

pytestmark = pytest.mark.slow

ROUNDS = 4
MESSAGES = 40
POSTS = "POST /api/v10/channels/"


def _fault(fake: FakeDiscord, rng: random.Random) -> str:
    """One fault the reference allows, applied now; its name."""
    gateway = fake.gateway
    choice = rng.choice(
        [
            "op7",
            "op9_true",
            "op9_false",
            "close_4000",
            "close_4009",
            "close_1000",
            "close_none",
            "heartbeat_request",
            "zombie",
            "duplicate",
            "drop",
            "drop_then_invalidate",
            "commit_drop",
            "commit_500",
            "502",
            "429",
        ]
    )
    if choice == "op7":
        gateway.reconnect()
    elif choice.startswith("op9"):
        gateway.invalidate(resumable=choice == "op9_true")
    elif choice.startswith("close_"):
        code = choice.removeprefix("close_")
        gateway.close_all(None if code == "none" else int(code))
    elif choice == "heartbeat_request":
        gateway.request_heartbeat()
    elif choice == "zombie":
        gateway.mute()
    elif choice == "duplicate":
        gateway.duplicate_next += 1
    elif choice == "drop":
        gateway.drop_next += 1  # never sent: found by a sweep of its (known) channel
    elif choice == "drop_then_invalidate":
        gateway.drop_next += 1
        fake.nursery.start_soon(_invalidate_later, fake)
    else:
        fake.fail_next(POSTS, choice)
    return choice


async def _invalidate_later(fake: FakeDiscord) -> None:
    await trio.sleep(0.3)
    fake.gateway.invalidate(resumable=False)


async def _feed(fake: FakeDiscord, rng: random.Random, sent: list[dict[str, Any]]) -> None:
    for n in range(MESSAGES):
        user = USERS[n] if n < len(USERS) else rng.choice(USERS)
        sent.append(fake.user_message(CHANNELS[user], user, f"cm{n}"))
        await trio.sleep(rng.uniform(0.02, 0.3))


async def _chaos(
    fake: FakeDiscord, rng: random.Random, sent: list[dict[str, Any]], applied: list[str]
) -> None:
    # Each user's DM channel known first (a reply posted, the cursor saved a second later):
    # a bot cannot list its DMs, so a channel no message was journaled from is recovered
    # only once its user writes again (test_reference_audit covers that).
    await wait_until(lambda: len({m["channel_id"] for m in fake.bot_messages()}) == len(USERS))
    await trio.sleep(1.5)
    while True:
        await trio.sleep(rng.uniform(0.3, 1.2))
        applied.append(_fault(fake, rng))


async def test_chaos_discord(tmp_path: Path, nursery: trio.Nursery) -> None:
    seed = int(os.environ.get("PRISM_CHAOS_SEED", secrets.randbits(32)))
    rng = random.Random(seed)
    tag = f"seed={seed}"
    fake = FakeDiscord(token=TOKEN, heartbeat_interval_ms=2000)
    await nursery.start(fake.serve)
    layout = _config(tmp_path, fake, seed)
    env = {"PRISM_TEST_DISCORD_TOKEN": TOKEN}
    sent: list[dict[str, Any]] = []
    applied: list[str] = []
    logs: list[str] = []
    with trio.fail_after(59):
        async with trio.open_nursery() as chaos:
            for round_ in range(ROUNDS):
                async with running_daemon(layout, tag=f"c{round_}", extra_env=env) as daemon:
                    if round_ == 0:
                        await wait_until(lambda: bool(fake.gateway.sessions))
                        chaos.start_soon(_feed, fake, random.Random(f"{seed}:feed"), sent)
                        chaos_rng = random.Random(f"{seed}:chaos")
                        chaos.start_soon(_chaos, fake, chaos_rng, sent, applied)
                    await trio.sleep(rng.uniform(1.0, 3.0))
                    if round_ % 2 == 1:
                        daemon.send(signal.SIGTERM)
                        await trio.sleep(rng.uniform(0.0, 0.5))
                    if daemon.process.returncode is None:
                        daemon.send(signal.SIGKILL)
                    await daemon.wait_exit()
                    logs.append(daemon.stderr())
                if rng.random() < 0.3:
                    fake.gateway.expire_sessions()  # the restart is outside the resume window
                    applied.append("expired_while_down")
            await wait_until(lambda: len(sent) == MESSAGES)
            chaos.cancel_scope.cancel()
        async with running_daemon(layout, tag="final", extra_env=env) as daemon:
            await daemon.wait_state("READY=1")
            await _connected(layout, tag)
            entries = await _settle(fake, layout, tag, sent)
            daemon.send(signal.SIGTERM)
            assert await daemon.wait_exit() == 0, f"{tag}: {daemon.stderr()}"
            logs.append(daemon.stderr())

    runs = Counter(run_keys(layout.runs))
    replies = Counter(m["message_reference"]["message_id"] for m in fake.bot_messages())
    unresolved = {e["operationId"] for e in entries}
    states = _op_states(layout)
    problems: list[str] = []
    for message in sent:
        op = operation_id_for("dc", message["id"])
        if runs[op] > 1:
            problems.append(f"{message['content']}: agent ran {runs[op]} times")
        if replies[message["id"]] > 1:
            problems.append(f"{message['content']}: answered {replies[message['id']]} times")
        state = states.get(op, "no record")
        if replies[message["id"]] == 0 and state != "cancelled" and op not in unresolved:
            problems.append(f"{message['content']}: lost (not answered, not listed: {state})")
    summary = (
        f"chaos discord {tag} messages={len(sent)} faults={Counter(applied)} "
        f"answered={sum(1 for m in sent if replies[m['id']])} "
        f"listed={Counter((e['state'], e.get('reason')) for e in entries)} "
        f"identifies={len(fake.gateway.identifies())} resumes={len(fake.gateway.resumes)}"
    )
    print(summary, file=sys.stderr)
    assert not problems, f"{summary}: " + "; ".join(problems[:20])
    assert not {1000, 1001} & set(fake.gateway.client_close_codes), summary
    for log in logs:
        assert TOKEN not in log and "cm1" not in log, tag
