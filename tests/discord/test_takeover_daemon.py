"""Two ``prismd run`` instances on one PostgreSQL database and one Discord bot (issue 39 audit,
"one gateway session per shard across instances"): the instance holding the shard's receiver
lease is SIGKILLed at random moments while DMs flow, and restarted; the other takes the
lease over once it expires and **resumes** the stored session (Discord replays what the dead
one left), or the restarted one adopts its own lease at once. Checked as an operator sees it
(``prismctl``), with the journal's states read beside:

* every message answered once or listed by ``list-unresolved`` — none lost;
* no agent run twice, no reply posted twice;
* one Identify in the whole run (every takeover and restart resumed), and no close with
  1000/1001 (which would end the session for the next holder);
* only one instance ever holds the gateway at a time in ``prismctl health``.

``PRISM_KILLLOOP_SEED`` replays one run.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import signal
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from prismd.journal import operation_id_for
from tests.daemon.helpers import (
    DaemonProcess,
    Layout,
    free_port,
    prismctl,
    run_keys,
    running_daemon,
)
from tests.fakes.discord_api import FakeDiscord
from tests.support import pgserver
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

KILLS = 3
MESSAGES = 36
LEASE_TTL_MS = 5_000
USERS = ("2000000000000000001", "2000000000000000002", "2000000000000000003")
CHANNELS = {u: f"3{u[1:]}" for u in USERS}
TOKEN = "discord-bot-token-secret"
SETTLED_S = 6.0


@pytest.fixture
def url() -> Iterator[str]:
    fresh = pgserver.fresh_url("dc")
    yield fresh
    pgserver.drop_schema(fresh)


def _instance(root: Path, fake: FakeDiscord, url: str, runs: Path, seed: int) -> Layout:
    root.mkdir()
    layout = Layout(root=root, port=free_port(), store_url=url)
    layout.config.write_text(
        f"""
[daemon]
state_dir = "{layout.state_dir}"

[store]
url = "{url}"
pool_size = 3

[limits]
stop_deadline_ms = 2000
lease_ttl_ms = {LEASE_TTL_MS}

[control]
socket = "{layout.control}"

[[connections]]
id = "dc"
kind = "discord"
token_env = "PRISM_TEST_DISCORD_TOKEN"
api_origin = "{fake.origin}"
shards = 1

[agents.slow]
kind = "python"
factory = "tests.fakes.killloop_agent:jitter_counting_mock"
count_file = "{runs}"
delay_min_ms = 5
delay_max_ms = 200
seed = "{seed}:{root.name}"

[[grants]]
connection = "dc"
actors = ["*"]
aliases = ["slow"]
"""
    )
    return layout


async def _holds_gateway(layout: Layout) -> bool:
    code, health, _err = await prismctl(layout, "health")
    if code != 0 or not isinstance(health, dict):
        return False
    children: dict[str, dict[str, Any]] = health.get("children", {})
    entry = next((v for k, v in children.items() if "dc" in k), {})
    return entry.get("adapterState") == "connected"


async def _op_states(url: str) -> dict[str, str]:
    table = f'"{pgserver.schema_of(url)}".prism_checkpoints'
    rows = await pgserver.query(
        url, f"SELECT value FROM {table} WHERE namespace = 'prism.channels.v1.operation'"
    )
    states: dict[str, str] = {}
    for (value,) in rows:
        record = json.loads(value) if isinstance(value, str) else value
        assert isinstance(record, dict)
        states[str(record.get("operationId"))] = str(record.get("state"))
    return states


async def _feed(fake: FakeDiscord, rng: random.Random, sent: list[dict[str, Any]]) -> None:
    for n in range(MESSAGES):
        user = USERS[n] if n < len(USERS) else rng.choice(USERS)
        sent.append(fake.user_message(CHANNELS[user], user, f"tk{n}"))
        await trio.sleep(rng.uniform(0.05, 0.4))


async def _settle(
    fake: FakeDiscord, layout: Layout, url: str, tag: str, sent: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Until every message reached the journal and nothing moved for :data:`SETTLED_S`."""
    ops = {operation_id_for("dc", m["id"]) for m in sent}
    last: tuple[Any, ...] | None = None
    stable_since = trio.current_time()
    entries: list[dict[str, Any]] = []
    with trio.move_on_after(25):
        while True:
            await trio.sleep(1.0)
            code, entries, err = await prismctl(layout, "list-unresolved")
            assert code == 0, f"{tag}: {err}"
            states = await _op_states(url)
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


async def test_instances_take_the_gateway_over_and_resume(
    tmp_path: Path, url: str, nursery: trio.Nursery
) -> None:
    seed = int(os.environ.get("PRISM_KILLLOOP_SEED", secrets.randbits(32)))
    rng = random.Random(seed)
    tag = f"seed={seed}"
    fake = FakeDiscord(token=TOKEN, heartbeat_interval_ms=2000)
    await nursery.start(fake.serve)
    runs = tmp_path / "runs.log"
    layouts = [_instance(tmp_path / name, fake, url, runs, seed) for name in "ab"]
    env = {"PRISM_TEST_DISCORD_TOKEN": TOKEN}
    sent: list[dict[str, Any]] = []
    logs: list[str] = []
    kills = 0
    with trio.fail_after(59):
        async with running_daemon(layouts[0], tag="a0", extra_env=env) as first:
            await wait_until(lambda: bool(fake.gateway.sessions))
            async with running_daemon(layouts[1], tag="b0", extra_env=env) as second:
                await second.wait_state("READY=1")
                nursery.start_soon(_feed, fake, random.Random(f"{seed}:feed"), sent)
                running: dict[int, DaemonProcess] = {0: first, 1: second}
                async with trio.open_nursery() as restarts:
                    for kill in range(KILLS):
                        await trio.sleep(rng.uniform(0.5, 2.5))
                        holders = [i for i in (0, 1) if await _holds_gateway(layouts[i])]
                        assert len(holders) <= 1, f"{tag}: both hold the gateway"
                        victim = holders[0] if holders else rng.choice((0, 1))
                        running[victim].send(signal.SIGKILL)
                        kills += 1
                        assert await running[victim].wait_exit() == -signal.SIGKILL, tag
                        logs.append(running[victim].stderr())
                        ready = trio.Event()
                        restarts.start_soon(
                            _run_until_stopped, layouts[victim], f"{victim}{kill}", env, running,
                            victim, ready, logs,
                        )  # fmt: skip
                        await ready.wait()
                    await wait_until(lambda: len(sent) == MESSAGES)
                    await wait_until_holder(layouts, tag)
                    entries = await _settle(fake, layouts[0], url, tag, sent)
                    for process in running.values():
                        process.send(signal.SIGTERM)
                    restarts.cancel_scope.deadline = trio.current_time() + 10
    _check(fake, runs, url, sent, entries, await _op_states(url), tag, kills, logs)


async def _run_until_stopped(
    layout: Layout,
    tag: str,
    env: dict[str, str],
    running: dict[int, DaemonProcess],
    index: int,
    ready: trio.Event,
    logs: list[str],
) -> None:
    async with running_daemon(layout, tag=f"r{tag}", extra_env=env) as daemon:
        running[index] = daemon
        await daemon.wait_state("READY=1")
        ready.set()
        await daemon.wait_exit(limit_s=60)
        logs.append(daemon.stderr())


async def wait_until_holder(layouts: list[Layout], tag: str) -> None:
    with trio.fail_after(20):
        while True:
            held = [await _holds_gateway(layout) for layout in layouts]
            assert sum(held) <= 1, f"{tag}: both hold the gateway"
            if any(held):
                return
            await trio.sleep(0.3)


def _check(
    fake: FakeDiscord,
    runs: Path,
    url: str,
    sent: list[dict[str, Any]],
    entries: list[dict[str, Any]],
    states: dict[str, str],
    tag: str,
    kills: int,
    logs: list[str],
) -> None:
    per_op = Counter(run_keys(runs))
    replies = Counter(m["message_reference"]["message_id"] for m in fake.bot_messages())
    unresolved = {e["operationId"] for e in entries}
    problems: list[str] = []
    for message in sent:
        op = operation_id_for("dc", message["id"])
        if per_op[op] > 1:
            problems.append(f"{message['content']}: agent ran {per_op[op]} times")
        if replies[message["id"]] > 1:
            problems.append(f"{message['content']}: answered {replies[message['id']]} times")
        state = states.get(op, "no record")
        if replies[message["id"]] == 0 and state != "cancelled" and op not in unresolved:
            problems.append(f"{message['content']}: lost (not answered, not listed: {state})")
    summary = (
        f"discord takeover {tag} kills={kills} messages={len(sent)} "
        f"answered={sum(1 for m in sent if replies[m['id']])} "
        f"listed={Counter((e['state'], e.get('replyState')) for e in entries)} "
        f"identifies={len(fake.gateway.identifies())} "
        f"resumes={Counter(r[2] for r in fake.gateway.resumes)} "
        f"closes={Counter(fake.gateway.client_close_codes)}"
    )
    print(summary, file=sys.stderr)
    assert not problems, f"{summary}: " + "; ".join(problems[:20])
    assert len(fake.gateway.identifies()) == 1, summary
    assert not {1000, 1001} & set(fake.gateway.client_close_codes), summary
    for log in logs:
        assert TOKEN not in log and "tk1" not in log, tag
