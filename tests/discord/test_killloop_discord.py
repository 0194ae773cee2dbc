"""Kill loop over Discord: a real ``prismd run`` (SQLite journal, the fake Discord on
loopback, a mock agent with random delays that records each run durably) SIGKILLed at
random moments while direct messages flow from three users (every third round stopped by
SIGTERM); a final run settles everything. Inside the resume window:

* every message is answered once, listed by ``list-unresolved``, or settled ``cancelled``
  by a graceful stop — none is lost, and no reply is listed ``pending`` (each start sends
  a killed daemon's unmarked replies again, same nonces: issue 39) — because
  each restart **resumes** the stored session from the watermark of committed admissions
  and Discord replays the rest (one Identify in the whole run);
* no agent run twice for one message, no reply posted twice (nonces + enforce_nonce);
* the daemon never closes the gateway with 1000/1001.

``PRISM_KILLLOOP_SEED`` replays one run.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import sqlite3
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from prismd.journal import operation_id_for
from tests.daemon.helpers import Layout, free_port, prismctl, run_keys, running_daemon
from tests.fakes.discord_alt import AltDiscord
from tests.fakes.discord_api import FakeDiscord
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

KILLS = 5
SETTLED_S = 6.0
"""Nothing moved for this long: longer than the fake's per-channel window (5 s)."""
MESSAGES = 60
USERS = ("2000000000000000001", "2000000000000000002", "2000000000000000003")
CHANNELS = {u: f"3{u[1:]}" for u in USERS}
TOKEN = "discord-bot-token-secret"


def _config(
    root: Path,
    fake: FakeDiscord | AltDiscord,
    seed: int,
    *,
    connection: str = "sweep_every_s = 1\n",
    delay_max_ms: int = 200,
    shards: int = 1,
) -> Layout:
    """A daemon's config on ``fake`` (either fake Discord): the ``slow`` jittering agent
    (``delay_max_ms``) for everyone, ``connection`` added to the Discord connection's
    keys."""
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


async def _feed(fake: FakeDiscord, rng: random.Random, sent: list[dict[str, Any]]) -> None:
    for n in range(MESSAGES):
        user = rng.choice(USERS)
        sent.append(fake.user_message(CHANNELS[user], user, f"km{n}"))
        await trio.sleep(rng.uniform(0.02, 0.3))


async def test_killloop_discord(tmp_path: Path, nursery: trio.Nursery) -> None:
    seed = int(os.environ.get("PRISM_KILLLOOP_SEED", secrets.randbits(32)))
    rng = random.Random(seed)
    tag = f"seed={seed}"
    fake = FakeDiscord(token=TOKEN, heartbeat_interval_ms=2000)
    await nursery.start(fake.serve)
    layout = _config(tmp_path, fake, seed)
    env = {"PRISM_TEST_DISCORD_TOKEN": TOKEN}
    sent: list[dict[str, Any]] = []
    logs: list[str] = []
    kills = 0
    with trio.fail_after(59):
        for round_ in range(KILLS):
            async with running_daemon(layout, tag=f"k{round_}", extra_env=env) as daemon:
                if round_ == 0:  # Discord delivers nothing to a bot that never connected
                    await wait_until(lambda: bool(fake.gateway.sessions))
                    nursery.start_soon(_feed, fake, random.Random(f"{seed}:feed"), sent)
                await trio.sleep(rng.uniform(1.0, 3.0))
                if round_ % 3 == 2:
                    daemon.send(signal.SIGTERM)
                    await trio.sleep(rng.uniform(0.0, 0.5))
                if daemon.process.returncode is None:
                    daemon.send(signal.SIGKILL)
                    kills += 1
                code = await daemon.wait_exit()
                logs.append(daemon.stderr())
                early_term = code == -signal.SIGTERM and not logs[-1].strip()
                assert code in (0, -signal.SIGKILL) or early_term, f"{tag} exit {code}: {logs[-1]}"
        async with running_daemon(layout, tag="final", extra_env=env) as daemon:
            await daemon.wait_state("READY=1")
            await wait_until(lambda: len(sent) == MESSAGES)
            # Not before the final daemon holds the gateway: right after a SIGKILL it
            # stands by until the dead one's lease expires, and nothing moves meanwhile.
            await _connected(layout, tag)
            entries = await _settle(fake, layout, tag, sent)
            daemon.send(signal.SIGTERM)
            assert await daemon.wait_exit() == 0, f"{tag}: {daemon.stderr()}"
            logs.append(daemon.stderr())

    runs = Counter(run_keys(layout.runs))
    replies = Counter(m["message_reference"]["message_id"] for m in fake.bot_messages())
    unresolved = {e["operationId"] for e in entries}
    problems: list[str] = []
    unanswered = cancelled = 0
    states = _op_states(layout)
    for message in sent:
        op = operation_id_for("dc", message["id"])
        if runs[op] > 1:
            problems.append(f"{message['content']}: agent ran {runs[op]} times")
        if replies[message["id"]] > 1:
            problems.append(f"{message['content']}: answered {replies[message['id']]} times")
        if replies[message["id"]] == 0:
            unanswered += 1
            state = states.get(op, "no record")
            if state == "cancelled":
                cancelled += 1  # settled by a graceful stop (SIGTERM) while it ran
            elif op not in unresolved:
                problems.append(f"{message['content']}: lost (not answered, not listed: {state})")
    # The whole loop is inside Discord's nonce window: a reply a killed daemon left pending
    # (staged, sent or not, never marked) is sent again by the next start, with the same
    # nonce (issue 39), so none is left for the operator.
    for entry in entries:
        if entry.get("replyState") == "pending":
            problems.append(f"{entry['operationId']}: reply still pending ({entry['state']})")
    identifies = len(fake.gateway.identifies())
    summary = (
        f"killloop discord {tag} kills={kills} messages={len(sent)} "
        f"answered={sum(1 for m in sent if replies[m['id']])} unanswered={unanswered} "
        f"(cancelled_by_stop={cancelled}, listed={unanswered - cancelled}) "
        f"identifies={identifies} resumes={len(fake.gateway.resumes)} "
        f"closes={Counter(fake.gateway.client_close_codes)}"
    )
    print(summary, file=sys.stderr)
    assert not problems, f"{summary}: " + "; ".join(problems[:20])
    assert identifies == 1, summary  # every restart resumed
    assert not {1000, 1001} & set(fake.gateway.client_close_codes), summary
    for log in logs:
        assert TOKEN not in log and "km1" not in log, tag


async def _connected(layout: Layout, tag: str) -> None:
    """Until ``prismctl health`` shows the connection's gateway connected (resumed)."""
    while True:
        code, health, err = await prismctl(layout, "health")
        assert code == 0, f"{tag}: {err}"
        entry = next(v for k, v in health["children"].items() if "dc" in k)
        if entry.get("adapterState") == "connected":
            return
        await trio.sleep(0.2)


async def _settle(
    fake: FakeDiscord, layout: Layout, tag: str, sent: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Wait until every message sent has reached the journal and the answers, the
    unresolved list and the operations' states have not moved for longer than a
    per-channel rate-limit window (the fake's, as Discord's: 5 sends per 5 s), so a
    backlog answered in bursts is not taken for a settled one."""
    ops = {operation_id_for("dc", m["id"]) for m in sent}
    last: tuple[Any, ...] | None = None
    stable_since = trio.current_time()
    entries: list[dict[str, Any]] = []
    with trio.move_on_after(30):
        while True:
            await trio.sleep(1.0)
            code, entries, err = await prismctl(layout, "list-unresolved")
            assert code == 0, f"{tag}: {err}"
            states = _op_states(layout)
            snapshot = (
                len(fake.bot_messages()),
                tuple(sorted((e["operationId"], e["state"], e["version"]) for e in entries)),
                tuple(sorted(states.items())),
            )
            if snapshot != last:
                last, stable_since = snapshot, trio.current_time()
            elif ops <= states.keys() and trio.current_time() - stable_since >= SETTLED_S:
                return list(entries)
    raise AssertionError(f"{tag}: never settled; unresolved={entries}")


def _op_states(layout: Layout) -> dict[str, str]:
    with sqlite3.connect(layout.db) as db:
        rows = db.execute(
            "SELECT value FROM prism_checkpoints WHERE namespace = 'prism.channels.v1.operation'"
        ).fetchall()
    return {str(json.loads(v).get("operationId")): str(json.loads(v).get("state")) for (v,) in rows}
