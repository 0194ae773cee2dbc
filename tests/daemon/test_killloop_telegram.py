"""Kill loop over Telegram polling (issue 5 and issue 3 "Checked by").

A real ``prismd run`` subprocess (SQLite journal, polling the fake Bot API on loopback, a
mock agent with a random delay that records each run's idempotency key durably) is fed every
sample of ``fixtures/telegram`` plus generated private texts, and SIGKILLed ~9 times at
random moments (seed printed in every assertion; ``PRISM_KILLLOOP_SEED`` replays one), with
429 storms injected meanwhile and a competing poller started in one round while that
daemon's long poll is pending (so a 409 is certain, not a matter of timing). After a final
run stopped by SIGTERM, for every admitted message update: at most one agent run for its
operation, at most one answer, and either exactly one answer or the operation listed by
``prismctl --json list-unresolved`` — never lost silently, never answered twice. Plus: no hot
loop against the fake, no token in the daemon's stderr, ``PRAGMA integrity_check`` ok.
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

import httpx
import pytest
import trio

from prismd.journal import operation_id_for
from tests.conftest import FIXTURES as REPO_FIXTURES
from tests.fakes.telegram_api import FakeBotApi, start_fake

from .helpers import Layout, free_port, prismctl, run_keys, running_daemon

pytestmark = pytest.mark.slow

FIXTURES = REPO_FIXTURES / "telegram"
KILLS = 9
GENERATED = 48
ACTORS = (201, 202, 203, 204)
OPEN_STATES = {"accepted", "executing"}
"""Listed without a reply: ``accepted`` (admitted, never claimed: the kill emptied the memory
queue; nothing is replayed automatically, reconcile abandons it) or ``executing``."""
OPEN_REPLIES = {"pending", "delivery_unknown", "delivery_failed"}


def _config(root: Path, fake: FakeBotApi, seed: int) -> Layout:
    layout = Layout(root=root, port=free_port())
    layout.config.write_text(
        f"""
[daemon]
state_dir = "{layout.state_dir}"

[store]
url = "sqlite:///{layout.db}"

[limits]
stop_deadline_ms = 2000
lease_ttl_ms = 30000

[control]
socket = "{layout.control}"

[[connections]]
id = "tg"
kind = "telegram"
token_env = "TG_TOKEN"
api_origin = "{fake.origin}"
poll_timeout_s = 1

[agents.slow]
kind = "python"
factory = "tests.fakes.killloop_agent:jitter_counting_mock"
count_file = "{layout.runs}"
delay_min_ms = 5
delay_max_ms = 250
seed = "{seed}:agent"

[[grants]]
connection = "tg"
actors = ["*"]
aliases = ["slow"]
"""
    )
    return layout


def _fixture_updates() -> list[dict[str, Any]]:
    """Every sample as an update payload (bare messages wrapped), ids reassigned later."""
    out: list[dict[str, Any]] = []
    for path in sorted(FIXTURES.glob("tg*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "DERIVED" in path.name:
            continue
        if "message_id" in data and "chat" in data:
            data = {"message": data}
        data.pop("update_id", None)
        out.append(data)
    assert len(out) >= 6, f"telegram samples missing under {FIXTURES}"
    return out


def _private(actor: int, n: int) -> dict[str, Any]:
    return {
        "message": {
            "message_id": 1000 + n,
            "from": {"id": actor, "is_bot": False, "first_name": f"U{actor}"},
            "chat": {"id": actor, "type": "private", "first_name": f"U{actor}"},
            "date": 1_700_000_000 + n,
            "text": f"km{n}",
        }
    }


def _stream(rng: random.Random) -> list[tuple[int, dict[str, Any]]]:
    payloads = _fixture_updates() + [_private(rng.choice(ACTORS), n) for n in range(GENERATED)]
    head, tail = payloads[:3], payloads[3:]
    rng.shuffle(tail)
    return [(10_000 + i, p) for i, p in enumerate(head + tail)]


async def _second_poller(fake: FakeBotApi, seconds: float, own: Counter[int]) -> None:
    """Another bot instance with the same token: long polls without confirming anything.

    It stops between requests, never in the middle of one: a request cancelled while httpx
    sends its body leaves the body's async generator unexhausted (encode/httpx#3686), which
    trio reports as a ResourceWarning when it is collected. ``own`` counts its requests per
    second so the hot-loop bound measures the daemon only.
    """
    url = f"{fake.origin}/bot{fake.token}/getUpdates"
    end = trio.current_time() + seconds
    async with httpx.AsyncClient(timeout=10) as client:
        while trio.current_time() < end:
            own[int(trio.current_time())] += 1
            try:
                await client.post(url, json={"timeout": 1})
            except httpx.HTTPError:
                pass
            await trio.sleep(0.05)


async def _compete(
    fake: FakeBotApi,
    nursery: trio.Nursery,
    seconds: float,
    own: Counter[int],
    since: float,
    tag: str,
) -> None:
    """Start the competing poller while the running daemon's long poll is pending; return
    once that caused a 409 (the daemon is alive until then, so it gets the conflict).

    A poll that began after ``since`` is the running daemon's: the previous one has exited
    and the competitor is not started yet.
    """

    def daemon_polling() -> bool:
        began = fake.pending_poll_at
        return began is not None and began >= since

    with trio.move_on_after(30):
        await fake.wait_until(daemon_polling)
        before = fake.conflicts
        nursery.start_soon(_second_poller, fake, seconds, own)
        await fake.wait_until(lambda: fake.conflicts > before)
        return
    raise AssertionError(f"{tag}: no long poll of the daemon met by the competing poller")


async def _feed(
    fake: FakeBotApi, rng: random.Random, stream: list[tuple[int, dict[str, Any]]]
) -> None:
    pushed: list[tuple[int, dict[str, Any]]] = []
    for index, (update_id, payload) in enumerate(stream):
        fake.push_update(payload, update_id=update_id)
        pushed.append((update_id, payload))
        if rng.random() < 0.15:
            # Telegram redelivers what was not confirmed; re-push an earlier update as-is.
            again_id, again = rng.choice(pushed)
            if not any(u["update_id"] == again_id for u in fake.updates):
                fake.push_update(again, update_id=again_id)
        if index == 12:
            fake.rate_limit("getUpdates", 1, times=4)
            fake.rate_limit("sendMessage", 1, times=3)
        if index == 40:
            fake.rate_limit("sendMessage", 1, times=5)
        await trio.sleep(rng.uniform(0.02, 0.25))


def _sent_to(fake: FakeBotApi) -> Counter[tuple[str, str]]:
    return Counter((str(s.get("chat_id")), str(s.get("text"))) for s in fake.sent)


async def test_killloop_telegram(tmp_path: Path) -> None:
    seed = int(os.environ.get("PRISM_KILLLOOP_SEED", secrets.randbits(32)))
    rng = random.Random(seed)
    tag = f"seed={seed}"
    stream = _stream(rng)
    compete_round = rng.randrange(KILLS)
    logs: list[str] = []
    kills = 0
    own: Counter[int] = Counter()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            fake = await start_fake(nursery)
            layout = _config(tmp_path, fake, seed)
            env = {"TG_TOKEN": fake.token}
            # Its own generator: draws shared by concurrent tasks interleave by timing.
            nursery.start_soon(_feed, fake, random.Random(f"{seed}:feed"), stream)
            for round_ in range(KILLS):
                since = trio.current_time()
                async with running_daemon(
                    layout, tag=f"k{round_}", extra_env=env, args=("--log-level", "debug")
                ) as daemon:
                    if round_ == compete_round:
                        await _compete(fake, nursery, rng.uniform(2, 3.5), own, since, tag)
                    await trio.sleep(rng.uniform(0.3, 3.0))
                    if round_ % 3 == 2:
                        # Killed in the middle of a graceful stop (stop() settling work).
                        daemon.send(signal.SIGTERM)
                        await trio.sleep(rng.uniform(0.0, 0.4))
                    if daemon.process.returncode is None:
                        daemon.send(signal.SIGKILL)
                    code = await daemon.wait_exit()
                    logs.append(daemon.stderr())
                    # -SIGTERM only before the interpreter installed its handlers (no output).
                    early_term = code == -signal.SIGTERM and not logs[-1].strip()
                    assert code in (-signal.SIGKILL, 0) or early_term, (
                        f"{tag} exit {code}: {logs[-1]}"
                    )
                    kills += code == -signal.SIGKILL

            async with running_daemon(
                layout, tag="final", extra_env=env, args=("--log-level", "debug")
            ) as daemon:
                await daemon.wait_state("READY=1")
                entries = await _settle(fake, layout, stream, tag)
                daemon.send(signal.SIGTERM)
                assert await daemon.wait_exit() == 0, f"{tag}: {daemon.stderr()}"
                logs.append(daemon.stderr())
            nursery.cancel_scope.cancel()

    states = Counter(e["state"] for e in entries)
    print(f"killloop telegram {tag} kills={kills} unresolved={dict(states)}", file=sys.stderr)
    assert kills >= KILLS - 4, f"{tag}: only {kills} kills landed"
    assert fake.conflicts >= 1, f"{tag}: the competing poller never caused a 409"
    unresolved = {e["operationId"]: e for e in entries}
    runs = Counter(run_keys(layout.runs))
    sent = _sent_to(fake)
    problems: list[str] = []
    op_states = _op_states(layout)
    cancelled = 0
    for update_id, payload in stream:
        message = payload.get("message")
        if not isinstance(message, dict):
            continue
        op = operation_id_for("tg", str(update_id))
        chat_id = str(message["chat"]["id"])
        text = message.get("text")
        if isinstance(text, str) and text.startswith("km"):
            answers = sent[(chat_id, f"mock: {text}")]
        else:  # a fixture sample: any message to its own chat answers it
            answers = sum(n for (c, _t), n in sent.items() if c == chat_id)
        if runs[op] > 1:
            problems.append(f"{update_id} {op}: agent ran {runs[op]} times")
        if answers > 1:
            problems.append(f"{update_id} {op}: answered {answers} times")
        if answers == 0 and op not in unresolved:
            if op_states.get(op) == "cancelled":
                # A graceful stop (the SIGTERM rounds) settles queued and running work
                # ``cancelled`` by contract (§10 stop); counted and reported, not lost.
                cancelled += 1
            else:
                problems.append(f"{update_id} {op}: lost (no answer, not unresolved)")
        entry = unresolved.get(op)
        # ``succeeded``/``failed`` without a reply state: killed between the terminal write
        # and the reply staging (listed since that defect was fixed); never answered then.
        answerless = entry is not None and entry.get("replyState") is None and answers == 0
        if entry is not None and not (
            entry["state"] in OPEN_STATES
            or entry.get("replyState") in OPEN_REPLIES
            or (answerless and entry["state"] in ("succeeded", "failed"))
        ):
            problems.append(f"{update_id} {op}: listed as {entry}")
    assert not problems, f"{tag} kills={kills}: " + "; ".join(problems) + _records(layout, problems)

    # No hot loop. A loop repeats a request: in no one-second window is one request (its
    # method and parameters) made more than 5 times, getUpdates more than 20 times (one
    # long poll at a time, plus retries after 409/429 with backoff), or sendChatAction to
    # one chat more than 20 times (one per turn that starts: after a restart a chat's
    # backlog of up to 12 generated messages starts within a second). The daemon's total
    # per second is no measure of a loop: it answers its backlog at once, a sendChatAction
    # and a sendMessage per message (51 requests in one second on 2026-12-05).
    def per_second_of(calls: list[Any], key: Any) -> tuple[Any, int]:
        counts = Counter((int(c.at), key(c)) for c in calls)
        ((_, what), most), *_ = counts.most_common(1) or [((0, None), 0)]
        return what, most

    polls = Counter(int(c.at) for c in fake.calls if c.method == "getUpdates")
    polls.subtract(own)
    assert max(polls.values()) <= 20, f"{tag}: {max(polls.values())} getUpdates in one second"
    typing = [c for c in fake.calls if c.method == "sendChatAction"]
    chat, most = per_second_of(typing, lambda c: c.params.get("chat_id"))
    assert most <= 20, f"{tag}: {most} sendChatAction to chat {chat} in one second"
    others = [c for c in fake.calls if c.method not in ("getUpdates", "sendChatAction")]
    what, most = per_second_of(
        others, lambda c: (c.method, json.dumps(c.params, sort_keys=True, default=str))
    )
    assert most <= 5, f"{tag}: {what} made {most} times in one second"
    per_second = Counter(int(c.at) for c in fake.calls)
    per_second.subtract(own)
    busiest = max(per_second.values())
    assert busiest <= 300, f"{tag}: {busiest} requests in one second"
    print(
        f"killloop telegram {tag} busiest={busiest}/s conflicts={fake.conflicts}"
        f" cancelled_by_stop={cancelled}",
        file=sys.stderr,
    )
    for log in logs:
        assert fake.token not in log and "secret-token" not in log, tag
    with sqlite3.connect(layout.db) as db:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)], tag


async def _settle(
    fake: FakeBotApi, layout: Layout, stream: list[tuple[int, dict[str, Any]]], tag: str
) -> list[dict[str, Any]]:
    """Wait until every update is confirmed and answers and the unresolved list are stable."""
    last: tuple[Any, ...] | None = None
    entries: list[dict[str, Any]] = []
    with trio.move_on_after(40):
        while True:
            await trio.sleep(0.7)
            code, entries, err = await prismctl(layout, "list-unresolved")
            assert code == 0, f"{tag}: {err}"
            snapshot = (
                len(fake.sent),
                tuple(sorted((e["operationId"], e["state"], e["version"]) for e in entries)),
            )
            if not fake.updates and snapshot == last:
                return list(entries)
            last = snapshot
    pending = [u["update_id"] for u in fake.updates]
    raise AssertionError(f"{tag}: never settled; unconfirmed={pending} unresolved={entries}")


def _records(layout: Layout, problems: list[str]) -> str:
    """The journal rows of the operations named in ``problems`` (for the failure message)."""
    ops = {word.rstrip(":") for p in problems for word in p.split() if word.startswith("chan-op-")}
    with sqlite3.connect(layout.db) as db:
        rows = [
            row
            for op in sorted(ops)
            for row in db.execute(
                "SELECT namespace, value FROM prism_checkpoints WHERE key LIKE ?", (f"%{op}%",)
            )
        ]
    return f"\nrecords: {rows}"


def _op_states(layout: Layout) -> dict[str, str]:
    """Operation id → journal state, read from the SQLite file after the daemon exited."""
    with sqlite3.connect(layout.db) as db:
        rows = db.execute(
            "SELECT value FROM prism_checkpoints WHERE namespace = 'prism.channels.v1.operation'"
        ).fetchall()
    out: dict[str, str] = {}
    for (value,) in rows:
        record = json.loads(value)
        out[str(record.get("operationId"))] = str(record.get("state"))
    return out
