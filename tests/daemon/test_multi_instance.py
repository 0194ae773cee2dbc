"""Several ``prismd run`` processes on one PostgreSQL database (issue 13 "Checked by").

* Three instances in webhook inbox mode behind :class:`~tests.support.spreader.Spreader`
  (Telegram and the load balancer: an unacknowledged update is retried on another instance,
  some acknowledged ones are delivered again), one of them SIGKILLed again and again and restarted
  while updates flow: every acknowledged update is answered exactly once or listed (an
  unresolved operation, an inbox dead letter), no agent run twice, no ``sendMessage`` twice.
* The same with the PostgreSQL server restarted mid-stream: nothing restarted by hand, nothing
  acknowledged lost.
* Polling: only one instance polls; a SIGSTOPped poller in the middle of a turn is replaced
  once its leases expire, and when it wakes its turn is fenced (no write, no send); a
  SIGKILLed poller is replaced within ``lease_ttl_ms`` from the durable offset, with no update
  admitted twice (a test of its own, so each waits for one lease expiry); one instance's
  ``prismctl events`` shows what the other wrote.

Real subprocesses, the suite's PostgreSQL server, the fake Bot API on loopback; the seed of
the random parts is printed in every assertion (``PRISM_MULTI_SEED`` replays one).
"""

from __future__ import annotations

import inspect
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from prismd.journal import operation_id_for
from tests.fakes.telegram_api import FakeBotApi, start_fake
from tests.support import pgserver
from tests.support.spreader import Spreader

from .helpers import DaemonProcess, Layout, free_port, prismctl, run_keys, running_daemon

pytestmark = pytest.mark.slow

HOOK_SECRET = "hook-secret-5b1e07"
LEASE_TTL_MS = 30_000
"""The smallest ``lease_ttl_ms`` there is: how long a dead instance's leases and claims last."""
CHATS = (301, 302, 303, 304, 305)
OPEN_STATES = {"accepted", "executing"}
OPEN_REPLIES = {"pending", "delivery_unknown", "delivery_failed"}


@pytest.fixture
def url() -> Iterator[str]:
    fresh = pgserver.fresh_url("m")
    yield fresh
    pgserver.drop_schema(fresh)


def _seed() -> int:
    return int(os.environ.get("PRISM_MULTI_SEED", secrets.randbits(32)))


def _instance(
    root: Path,
    fake: FakeBotApi,
    url: str,
    runs: Path,
    *,
    mode: str = "webhook",
    delay_ms: tuple[int, int] = (5, 250),
    seed: str = "",
) -> Layout:
    """One instance's own state directory and control socket, the shared store and agent
    run log; ``Layout.port`` is its webhook port."""
    root.mkdir()
    layout = Layout(root=root, port=free_port(), store_url=url)
    if mode == "webhook":
        receiving = f"""mode = "webhook"
webhook_listen = "127.0.0.1:{layout.port}"
webhook_secret_env = "TG_HOOK_SECRET"
webhook_inbox = true"""
    else:
        receiving = "poll_timeout_s = 1"
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
id = "tg"
kind = "telegram"
token_env = "TG_TOKEN"
api_origin = "{fake.origin}"
{receiving}

[agents.slow]
kind = "python"
factory = "tests.fakes.killloop_agent:jitter_counting_mock"
count_file = "{runs}"
delay_min_ms = {delay_ms[0]}
delay_max_ms = {delay_ms[1]}
seed = "{seed}:{root.name}"

[[grants]]
connection = "tg"
actors = ["*"]
aliases = ["slow"]
"""
    )
    return layout


def _private(chat: int, n: int, update_id: int) -> dict[str, Any]:
    return {
        "update_id": update_id,
        "message": {
            "message_id": 1000 + n,
            "from": {"id": chat, "is_bot": False, "first_name": f"U{chat}"},
            "chat": {"id": chat, "type": "private", "first_name": f"U{chat}"},
            "date": 1_700_000_000 + n,
            "text": f"mi{n}",
        },
    }


def _stream(rng: random.Random, count: int, first_id: int) -> list[dict[str, Any]]:
    return [_private(rng.choice(CHATS), n, first_id + n) for n in range(count)]


def _env(fake: FakeBotApi) -> dict[str, str]:
    return {"TG_TOKEN": fake.token, "TG_HOOK_SECRET": HOOK_SECRET}


async def _settle(layout: Layout, fake: FakeBotApi, tag: str) -> tuple[list[Any], list[Any]]:
    """Wait until the inbox has nothing pending or claimed and the answers, the unresolved
    operations and the dead letters stay the same; those two listings."""
    last: tuple[Any, ...] | None = None
    entries: list[Any] = []
    dead: list[Any] = []
    depth: Any = None
    # Up to a dead instance's claims and leases expiring, then admission and the turn.
    with trio.move_on_after(LEASE_TTL_MS / 1000 + 30):
        while True:
            await trio.sleep(0.7)
            code, health, err = await prismctl(layout, "health")
            assert code == 0, f"{tag}: {err}"
            depth = health.get("inbox")
            code, entries, err = await prismctl(layout, "list-unresolved")
            assert code == 0, f"{tag}: {err}"
            code, listed, err = await prismctl(layout, "list-inbox")
            assert code == 0, f"{tag}: {err}"
            dead = listed["items"]
            snapshot = (
                len(fake.sent),
                tuple(sorted((e["operationId"], e["state"], e["version"]) for e in entries)),
                len(dead),
            )
            idle = isinstance(depth, dict) and depth["pending"] == depth["claimed"] == 0
            if idle and snapshot == last:
                return list(entries), list(dead)
            last = snapshot
    raise AssertionError(f"{tag}: never settled; inbox {depth}, unresolved {entries}")


def _check_each_update_once(
    updates: Sequence[dict[str, Any]],
    fake: FakeBotApi,
    runs_file: Path,
    entries: Sequence[dict[str, Any]],
    dead: Sequence[dict[str, Any]],
    tag: str,
) -> Counter[str]:
    """Every update answered at most once and either answered or listed; no agent run
    twice. What happened to them, counted."""
    unresolved = {e["operationId"]: e for e in entries}
    dead_ids = {d["updateId"] for d in dead}
    runs = Counter(run_keys(runs_file))
    sent = Counter((str(s.get("chat_id")), str(s.get("text"))) for s in fake.sent)
    twice = [key for key, n in sent.items() if n > 1]
    assert not twice, f"{tag}: sent twice: {twice}"
    outcome: Counter[str] = Counter()
    problems: list[str] = []
    for update in updates:
        update_id = update["update_id"]
        message = update["message"]
        op = operation_id_for("tg", str(update_id))
        answers = sent[(str(message["chat"]["id"]), f"mock: {message['text']}")]
        if runs[op] > 1:
            problems.append(f"{update_id}: agent ran {runs[op]} times")
        entry = unresolved.get(op)
        if answers == 1:
            outcome["answered"] += 1
        elif str(update_id) in dead_ids:
            outcome["dead letter"] += 1
        elif entry is not None:
            listed = entry["state"] in OPEN_STATES or entry.get("replyState") in OPEN_REPLIES
            if not listed and entry.get("replyState") is None:
                listed = entry["state"] in ("succeeded", "failed")  # killed before staging
            if not listed:
                problems.append(f"{update_id}: listed as {entry}")
            outcome[f"unresolved {entry['state']}"] += 1
        else:
            problems.append(f"{update_id} {op}: lost (no answer, not listed)")
    assert not problems, f"{tag}: " + "; ".join(problems)
    return outcome


async def _stop(daemons: Sequence[DaemonProcess], tag: str) -> list[str]:
    for daemon in daemons:
        if daemon.process.returncode is None:
            daemon.send(signal.SIGTERM)
    logs = []
    for daemon in daemons:
        code = await daemon.wait_exit()
        logs.append(daemon.stderr())
        assert code == 0, f"{tag}: exit {code}: {logs[-1][-2000:]}"
    return logs


async def _health(layout: Layout) -> dict[str, Any]:
    code, health, err = await prismctl(layout, "health")
    assert code == 0, err
    assert isinstance(health, dict)
    return health


# --------------------------------------------------------------------------- webhook + kills


KILLS = 4
UPDATES = 48


async def test_three_webhook_instances_one_killed_again_and_again(tmp_path: Path, url: str) -> None:
    seed = _seed()
    tag = f"seed={seed}"
    rng = random.Random(seed)
    runs = tmp_path / "runs.log"
    updates = _stream(random.Random(f"{seed}:stream"), UPDATES, 5000)
    kills = 0
    started = time.monotonic()
    with trio.fail_after(150):
        async with trio.open_nursery() as nursery:
            fake = await start_fake(nursery)
            fake.chats.update(str(c) for c in CHATS)
            layouts = [
                _instance(tmp_path / name, fake, url, runs, seed=str(seed)) for name in "abc"
            ]
            spreader = Spreader(
                ports=[layout.port for layout in layouts],
                path="/telegram/tg",
                secret=HOOK_SECRET,
                rng=random.Random(f"{seed}:spread"),
            )
            env = _env(fake)
            async with AsyncExitStack() as stack:
                steady = [
                    await stack.enter_async_context(
                        running_daemon(layout, tag="run", extra_env=env)
                    )
                    for layout in layouts[:2]
                ]
                for daemon in steady:
                    await daemon.wait_state("READY=1", limit_s=60)
                fed = trio.Event()

                async def feed() -> None:
                    await spreader.run(updates, (0.05, 0.35))
                    fed.set()

                nursery.start_soon(feed)
                for round_ in range(KILLS):
                    async with running_daemon(
                        layouts[2], tag=f"k{round_}", extra_env=env
                    ) as victim:
                        if round_ % 2:
                            await victim.wait_state("READY=1", limit_s=60)
                        await trio.sleep(rng.uniform(0.5, 2.5))
                        victim.send(signal.SIGKILL)
                        code = await victim.wait_exit()
                        assert code == -signal.SIGKILL, f"{tag}: exit {code}: {victim.stderr()}"
                        kills += 1
                third = await stack.enter_async_context(
                    running_daemon(layouts[2], tag="final", extra_env=env)
                )
                await third.wait_state("READY=1", limit_s=60)
                with trio.fail_after(60):
                    await fed.wait()
                fed_after = time.monotonic() - started
                entries, dead = await _settle(layouts[0], fake, tag)
                healths = [await _health(layout) for layout in layouts]
                await _stop([*steady, third], tag)
            nursery.cancel_scope.cancel()

    assert len(spreader.acknowledged) == UPDATES, f"{tag}: {spreader.statuses}"
    outcome = _check_each_update_once(updates, fake, runs, entries, dead, tag)
    instances = [h["instance"] for h in healths]
    assert all(isinstance(i, str) and i for i in instances) and len(set(instances)) == 3, healths
    for health in healths:
        assert health["inbox"] == {"pending": 0, "claimed": 0, "dead": len(dead)}, tag
        assert health["leases"]["receiver"] == []  # inbox mode: no receiver lease
        assert isinstance(health["leases"]["binding"], int)
    by_instance = Counter(spreader.acknowledged.values())
    print(
        f"multi-instance kills {tag} kills={kills} outcome={dict(outcome)}"
        f" acknowledged_by={dict(sorted(by_instance.items()))} answers={spreader.statuses}"
        f" redelivered={spreader.redelivered} fed_in={fed_after:.1f}s"
        f" total={time.monotonic() - started:.1f}s",
        file=sys.stderr,
    )
    assert kills == KILLS
    assert spreader.statuses["refused"] > 0, f"{tag}: no delivery met a dead instance"
    assert outcome["answered"] >= UPDATES // 2, f"{tag}: {outcome}"


# --------------------------------------------------------------------------- server restart


@pytest.mark.serial
async def test_the_instances_ride_out_a_postgres_restart(tmp_path: Path, url: str) -> None:
    """The server stopped (``-m fast``) for two seconds and started again while updates flow
    to three instances: while it is away an update cannot be committed, so it is not
    acknowledged (503) and the spreader retries it; afterwards the same processes — none
    restarted — admit and answer, and every acknowledged update is answered once or listed
    (a turn cut by the outage stays ``executing`` for the operator)."""
    seed = _seed()
    tag = f"seed={seed}"
    runs = tmp_path / "runs.log"
    updates = _stream(random.Random(f"{seed}:stream"), 36, 7000)
    with trio.fail_after(150):
        async with trio.open_nursery() as nursery:
            fake = await start_fake(nursery)
            fake.chats.update(str(c) for c in CHATS)
            layouts = [
                _instance(tmp_path / name, fake, url, runs, seed=str(seed)) for name in "abc"
            ]
            spreader = Spreader(
                ports=[layout.port for layout in layouts],
                path="/telegram/tg",
                secret=HOOK_SECRET,
                rng=random.Random(f"{seed}:spread"),
            )
            async with AsyncExitStack() as stack:
                daemons = [
                    await stack.enter_async_context(running_daemon(layout, extra_env=_env(fake)))
                    for layout in layouts
                ]
                for daemon in daemons:
                    await daemon.wait_state("READY=1", limit_s=60)
                fed = trio.Event()

                async def feed() -> None:
                    await spreader.run(updates, (0.1, 0.3))
                    fed.set()

                nursery.start_soon(feed)
                await trio.sleep(2)
                stopped = await trio.to_thread.run_sync(
                    pgserver.pg_ctl, "stop", "-m", "fast", "-w", "-t", "60"
                )
                assert stopped.returncode == 0, stopped.stdout + stopped.stderr
                try:
                    stopped_at = len(spreader.acknowledged)
                    await trio.sleep(2)  # away long enough for every instance to notice
                    during = len(spreader.acknowledged) - stopped_at
                finally:
                    started = await trio.to_thread.run_sync(pgserver.pg_ctl_start_again)
                assert started.returncode == 0, started.stdout + started.stderr
                restarted_at = len(spreader.acknowledged)
                with trio.fail_after(90):
                    await fed.wait()
                entries, dead = await _settle(layouts[0], fake, tag)
                assert all(d.process.returncode is None for d in daemons), tag
                logs = await _stop(daemons, tag)
            nursery.cancel_scope.cancel()
    assert len(spreader.acknowledged) == len(updates), f"{tag}: {spreader.statuses}"
    outcome = _check_each_update_once(updates, fake, runs, entries, dead, tag)
    print(
        f"multi-instance pg restart {tag} outcome={dict(outcome)} answers={spreader.statuses}"
        f" acknowledged_before_stop={stopped_at} while_away={during}",
        file=sys.stderr,
    )
    assert stopped_at > 0 and restarted_at < len(updates), f"{tag}: not mid-stream"
    assert during == 0, f"{tag}: {during} update(s) acknowledged while the server was away"
    assert spreader.statuses["503"] > 0, f"{tag}: {spreader.statuses}"
    assert outcome["answered"] >= len(updates) // 2, f"{tag}: {outcome}"
    assert any("store" in log.lower() for log in logs), "the outage went unnoticed"


# --------------------------------------------------------------------------- polling


def _message(chat: int, n: int) -> dict[str, Any]:
    update = _private(chat, n, 0)
    del update["update_id"]
    return update


def _answered(fake: FakeBotApi, n: int) -> int:
    return sum(1 for s in fake.sent if s.get("text") == f"mock: mi{n}")


async def _until(condition: Any, limit_s: float, what: str) -> float:
    """Wait for ``condition()`` (sync or async), at most ``limit_s``; the seconds it took."""
    began = time.monotonic()
    with trio.move_on_after(limit_s):
        while True:
            done = condition()
            if inspect.isawaitable(done):
                done = await done
            if done:
                return time.monotonic() - began
            await trio.sleep(0.1)
    raise AssertionError(f"not within {limit_s} s: {what}")


async def _receiving(layout: Layout) -> bool:
    holders: list[str] = (await _health(layout))["leases"]["receiver"]
    return holders == ["tg"]


@asynccontextmanager
async def _a_polls_b_stands_by(
    tmp_path: Path, url: str, runs: Path, fake: FakeBotApi
) -> AsyncIterator[tuple[Layout, Layout, DaemonProcess, DaemonProcess]]:
    """Two polling instances on one database, the agent taking 2.5 s: A started and
    polling, then B ready and standing by (no receiver lease). Their layouts and processes;
    B is stopped first."""
    a_layout, b_layout = (
        _instance(tmp_path / name, fake, url, runs, mode="polling", delay_ms=(2500, 2500))
        for name in "ab"
    )
    env = _env(fake)
    async with running_daemon(a_layout, tag="a", extra_env=env) as a:
        await a.wait_state("READY=1", limit_s=60)
        await _until(lambda: _receiving(a_layout), 30, "A polls")
        async with running_daemon(b_layout, tag="b", extra_env=env) as b:
            await b.wait_state("READY=1", limit_s=60)
            assert (await _health(b_layout))["leases"]["receiver"] == []
            yield a_layout, b_layout, a, b


async def test_polling_fails_over_and_a_woken_poller_is_fenced(tmp_path: Path, url: str) -> None:
    """A polls and B stands by. A is SIGSTOPped in the middle of a turn: B takes over the
    polling once A's receiver lease expired (within ``lease_ttl_ms`` of the stop) and answers
    new messages, also in A's chat once A's route lease expired. Woken after that, A's turn
    is fenced: no reply, no write — the operation stays ``executing`` for the operator. Then B
    is SIGKILLed and A takes over from the durable offset within ``lease_ttl_ms``; nothing is
    admitted or answered twice. B's ``prismctl events --follow --from-now`` shows A's
    writes."""
    runs = tmp_path / "runs.log"
    ttl_s = LEASE_TTL_MS / 1000
    with trio.fail_after(150):
        async with trio.open_nursery() as nursery:
            fake = await start_fake(nursery)
            async with _a_polls_b_stands_by(tmp_path, url, runs, fake) as (
                a_layout,
                b_layout,
                a,
                b,
            ):
                follower = await trio.lowlevel.open_process(
                    [
                        sys.executable, "-m", "prismd.cli.prismctl", "--socket",
                        str(b_layout.control), "--json", "events", "--follow", "--from-now",
                    ],
                    stdout=subprocess.PIPE,
                )  # fmt: skip
                assert follower.stdout is not None
                first_page = b""
                with trio.fail_after(20):  # following once its first page, empty, is out
                    while not first_page.endswith(b"\n"):
                        first_page += await follower.stdout.receive_some(65536)
                assert json.loads(first_page)["events"] == [], first_page

                ids = {1: fake.push_update(_message(401, 1))}
                await _until(lambda: run_keys(runs) != [], 30, "A starts the turn")
                a.send(signal.SIGSTOP)
                stopped = time.monotonic()
                first_op = run_keys(runs)[0]
                takeover = await _until(lambda: _receiving(b_layout), ttl_s + 10, "B polls")
                ids[2] = fake.push_update(_message(402, 2))
                ids[3] = fake.push_update(_message(401, 3))  # A's chat: A's route lease first
                await _until(lambda: _answered(fake, 2) == _answered(fake, 3) == 1, 45, "B answers")
                chat_moved = time.monotonic() - stopped
                a.send(signal.SIGCONT)
                await trio.sleep(4)  # A's agent returns at once: its sleep ended long ago
                assert _answered(fake, 1) == 0, "the fenced turn sent its reply"
                await _until(lambda: _receiving_not(a_layout), 20, "A no longer polls")
                code, unresolved, err = await prismctl(b_layout, "list-unresolved")
                assert code == 0, err
                assert [(e["operationId"], e["state"]) for e in unresolved] == [
                    (first_op, "executing")
                ]

                seen = await _read_events(follower, first_op)
                code, events, err = await prismctl(a_layout, "events")
                assert code == 0, err
                logs = await _stop([a, b], "polling")
            nursery.cancel_scope.cancel()
    runs_per_op = Counter(run_keys(runs))
    assert max(runs_per_op.values()) == 1, runs_per_op
    assert len(runs_per_op) == 3
    assert [_answered(fake, n) for n in (1, 2, 3)] == [0, 1, 1]
    # A's control socket shows what B wrote (the operations of messages 2 and 3).
    keys = [e["key"] for e in events["events"]]
    for n in (2, 3):
        op = operation_id_for("tg", str(ids[n]))
        assert any(op in key for key in keys), (n, op)
    assert any(first_op in e["key"] for e in seen), "B's follower did not show A's write"
    print(
        f"multi-instance polling: takeover after SIGSTOP {takeover:.1f}s, A's chat answered"
        f" by B {chat_moved:.1f}s after the stop, lease_ttl_ms={LEASE_TTL_MS}",
        file=sys.stderr,
    )
    # From the stop, which is after the last renewal: the lease expires within the TTL, and
    # the standby tries right then (the rest is prismctl).
    assert takeover <= ttl_s + 4
    assert fake.token not in "".join(logs)


async def test_a_killed_poller_is_replaced_from_the_durable_offset(
    tmp_path: Path, url: str
) -> None:
    """A polls and has answered; B stands by. A is SIGKILLed: B takes over the polling from
    the durable offset within ``lease_ttl_ms`` of the kill and answers the next message;
    nothing is admitted or answered twice. (Apart from the SIGSTOP test above so that each
    waits for one lease expiry, not two.)"""
    runs = tmp_path / "runs.log"
    ttl_s = LEASE_TTL_MS / 1000
    with trio.fail_after(100):
        async with trio.open_nursery() as nursery:
            fake = await start_fake(nursery)
            async with _a_polls_b_stands_by(tmp_path, url, runs, fake) as (_, b_layout, a, b):
                ids = {1: fake.push_update(_message(401, 1))}
                await _until(lambda: _answered(fake, 1) == 1, 30, "A answers")

                a.send(signal.SIGKILL)
                killed = time.monotonic()
                assert await a.wait_exit() == -signal.SIGKILL
                ids[2] = fake.push_update(_message(402, 2))
                failover = await _until(lambda: _answered(fake, 2) == 1, ttl_s + 15, "B answers")
                failover_receiving = time.monotonic() - killed
                assert await _receiving(b_layout)
                await _until(lambda: not fake.updates, 20, "every update confirmed")
                logs = await _stop([b], "polling")
            nursery.cancel_scope.cancel()
    runs_per_op = Counter(run_keys(runs))
    assert max(runs_per_op.values()) == 1, runs_per_op
    assert sorted(runs_per_op) == sorted(operation_id_for("tg", str(i)) for i in ids.values())
    assert [_answered(fake, n) for n in (1, 2)] == [1, 1]
    print(
        f"multi-instance polling: failover after SIGKILL {failover:.1f}s"
        f" ({failover_receiving:.1f}s), lease_ttl_ms={LEASE_TTL_MS}",
        file=sys.stderr,
    )
    # From the kill, which is after the last renewal: the lease expires within the TTL, the
    # standby tries right then, and the agent takes 2.5 s.
    assert failover <= ttl_s + 2.5 + 4
    assert fake.token not in "".join(logs)


async def _receiving_not(layout: Layout) -> bool:
    holders: list[str] = (await _health(layout))["leases"]["receiver"]
    return holders == []


async def _read_events(follower: trio.Process, op: str) -> list[dict[str, Any]]:
    """The events printed by a ``prismctl --json events --follow`` until one names ``op``."""
    assert follower.stdout is not None
    seen: list[dict[str, Any]] = []
    buffer = b""
    try:
        with trio.move_on_after(10):
            while not any(op in e["key"] for e in seen):
                chunk = await follower.stdout.receive_some(65536)
                if not chunk:
                    break
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    seen += json.loads(line)["events"]
    finally:
        follower.terminate()
        await follower.wait()
        await follower.stdout.aclose()
    return seen
