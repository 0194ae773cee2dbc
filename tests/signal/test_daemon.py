"""``prismd run`` with a Signal connection against the fake signal-cli: real subprocesses,
a real SQLite journal, real signals.

* direct messages are answered exactly once, every other kind is ignored, ``prismctl
  health`` shows the adapter's enums;
* signal-cli killed and restarted: the daemon reconnects and answers what came meanwhile;
* a SIGKILL + restart resumes receiving at once (the predecessor's lease is adopted,
  SPEC difference 8), and a SIGTERM loses nothing;
* two daemons on one SQLite file: only one subscribes at a time; SIGTERM the holder and
  the other takes over.
"""

from __future__ import annotations

import json
import signal
import sqlite3
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.daemon.helpers import Layout, free_port, prismctl, running_daemon
from tests.fakes.signal_cli import ACCOUNT, FakeSignalCli, other_envelope, text_envelope

from .conftest import fixture

pytestmark = pytest.mark.slow

USERS = (f"0f0f0f0f-1111-2222-3333-44444444444{n}" for n in range(10))


def _layout(
    root: Path, fake: FakeSignalCli, *, ttl_ms: int = 90_000, db: Path | None = None
) -> Layout:
    layout = Layout(root=root, port=free_port())
    root.mkdir(parents=True, exist_ok=True)
    layout.config.write_text(
        f"""
[daemon]
state_dir = "{layout.state_dir}"

[store]
url = "sqlite:///{db or layout.db}"

[limits]
stop_deadline_ms = 2000

[control]
socket = "{layout.control}"

[[connections]]
id = "sig"
kind = "signal"
account = "{ACCOUNT}"
socket = "{fake.socket_path}"
receiver_lease_ttl_ms = {ttl_ms}

[agents.echo]
kind = "echo"

[[grants]]
connection = "sig"
actors = ["*"]
aliases = ["echo"]
"""
    )
    return layout


def _dm(text: str, user: int = 0, ts: int = 0) -> dict[str, Any]:
    uuid = f"0f0f0f0f-1111-2222-3333-44444444444{user}"
    return text_envelope(text, uuid=uuid, number=None, timestamp=1_768_839_400_000 + ts)


def _answers(fake: FakeSignalCli) -> Counter[tuple[str, str]]:
    return Counter((s["recipient"][0], s["message"]) for s in fake.sends if "recipient" in s)


async def _wait(fake: FakeSignalCli, predicate: Any, limit_s: float, what: str) -> None:
    with trio.move_on_after(limit_s):
        await fake.wait_until(predicate)
        return
    raise AssertionError(f"timed out waiting for {what}")


async def _signal_health(layout: Layout) -> dict[str, str]:
    code, health, err = await prismctl(layout, "health")
    assert code == 0, err
    entry: dict[str, str] = health["children"]["signal:sig"]
    return entry


async def test_direct_messages_are_answered_exactly_once(
    tmp_path: Path, nursery: trio.Nursery, short_dir: Path
) -> None:
    fake = FakeSignalCli(socket_path=str(short_dir / "signal-cli.sock"))
    await fake.start(nursery)
    layout = _layout(tmp_path, fake)
    # every sample (the ones without a subscription as the manual notification they carry)
    for name in ("sg06_2021_text_only.json", "sg08_2021_attachments_video_and_image_no_text.json"):
        fake.push(fixture(name)["params"]["envelope"])
    fake.push(
        fixture("sg21_DERIVED_v0.14_manual_incoming_group_attachment.json")["params"]["result"][
            "envelope"
        ]
    )
    fake.push(other_envelope("receiptMessage", {"isDelivery": True, "timestamps": [1]}))
    fake.push(other_envelope("typingMessage", {"action": "STARTED", "timestamp": 1}))
    fake.push(_dm("hello one", 1, 1))
    fake.push(_dm("hello two", 2, 2))
    async with running_daemon(layout, tag="a", args=("--log-level", "debug")) as daemon:
        await daemon.wait_state("READY=1")
        await _wait(fake, lambda: len(fake.sends) >= 3, 30, "three answers")
        health = await _signal_health(layout)
        # When the last message reached it: an ISO time, as Telegram's health says it.
        assert health.pop("lastUpdateAt").endswith("Z")
        assert health == {
            "adapterState": "receiving",
            "bridge": "connected",
            "subscription": "active",
            "account": "ready",
            "state": "running",
        }
        fake.push(_dm("hello one", 1, 1))  # the same envelope again: a duplicate
        fake.push(_dm("and three", 3, 3))
        await _wait(fake, lambda: len(fake.sends) >= 4, 30, "the fourth answer")
        await trio.sleep(2)
        daemon.send(signal.SIGTERM)
        assert await daemon.wait_exit() == 0, daemon.stderr()
        log = daemon.stderr()
    answers = _answers(fake)
    assert answers == Counter(
        {
            ("+0000000000", "hello"): 1,
            ("0f0f0f0f-1111-2222-3333-444444444441", "hello one"): 1,
            ("0f0f0f0f-1111-2222-3333-444444444442", "hello two"): 1,
            ("0f0f0f0f-1111-2222-3333-444444444443", "and three"): 1,
        }
    )
    assert fake.max_concurrent_subscriptions == 1
    assert ACCOUNT not in log and "hello one" not in log
    assert "signal sig: receiving (manual subscription)" in log


async def test_signal_cli_killed_and_restarted_is_reconnected(
    tmp_path: Path, nursery: trio.Nursery, short_dir: Path
) -> None:
    fake = FakeSignalCli(socket_path=str(short_dir / "signal-cli.sock"))
    await fake.start(nursery)
    layout = _layout(tmp_path, fake)
    async with running_daemon(layout, tag="a") as daemon:
        await daemon.wait_state("READY=1")
        fake.push(_dm("before"))
        await _wait(fake, lambda: len(fake.sends) == 1, 30, "the first answer")
        await fake.kill()
        fake.push(_dm("while down", ts=1))
        await trio.sleep(3)
        health = await _signal_health(layout)
        assert health["bridge"] == "unavailable" and health["state"] == "running"
        await fake.start(nursery)
        await _wait(fake, lambda: len(fake.sends) == 2, 60, "the answer after the restart")
        daemon.send(signal.SIGTERM)
        assert await daemon.wait_exit() == 0
        log = daemon.stderr()
    assert [s["message"] for s in fake.sends] == ["before", "while down"]
    assert "reconnecting in" in log and "receiving again after" in log


async def test_sigkill_and_restart_resumes_receiving_at_once(
    tmp_path: Path, nursery: trio.Nursery, short_dir: Path
) -> None:
    fake = FakeSignalCli(socket_path=str(short_dir / "signal-cli.sock"))
    await fake.start(nursery)
    layout = _layout(tmp_path, fake)  # the default 90 s lease: waiting it out would show
    async with running_daemon(layout, tag="a") as daemon:
        await daemon.wait_state("READY=1")
        await _wait(fake, lambda: bool(fake.subscriptions), 30, "a subscription")
        daemon.send(signal.SIGKILL)
        assert await daemon.wait_exit() == -signal.SIGKILL
    await _wait(fake, lambda: not fake.subscriptions, 10, "the dead subscription to end")
    fake.push(_dm("after the kill"))
    started = trio.current_time()
    async with running_daemon(layout, tag="b") as daemon:
        await _wait(fake, lambda: len(fake.sends) == 1, 30, "the answer after the restart")
        took = trio.current_time() - started
        daemon.send(signal.SIGTERM)
        assert await daemon.wait_exit() == 0
    assert took < 20, f"took {took:.1f} s: the lease was waited out, not adopted"
    assert [s["message"] for s in fake.sends] == ["after the kill"]


async def test_two_daemons_on_one_journal_hand_over_the_receiver(
    tmp_path: Path, nursery: trio.Nursery, short_dir: Path
) -> None:
    fake = FakeSignalCli(socket_path=str(short_dir / "signal-cli.sock"))
    await fake.start(nursery)
    db = tmp_path / "shared.sqlite"
    first = _layout(tmp_path / "a", fake, ttl_ms=6000, db=db)
    second = _layout(tmp_path / "b", fake, ttl_ms=6000, db=db)
    async with running_daemon(first, tag="a") as a:
        await a.wait_state("READY=1")
        await _wait(fake, lambda: bool(fake.subscriptions), 30, "the first subscription")
        async with running_daemon(second, tag="b") as b:
            await b.wait_state("READY=1")
            await trio.sleep(4)  # B stands by (and keeps trying) while A holds the lease
            assert (await _signal_health(second))["adapterState"] == "standby"
            assert len(fake.subscribe_log) == 1
            fake.push(_dm("to whoever holds it"))
            await _wait(fake, lambda: len(fake.sends) == 1, 30, "A's answer")
            a.send(signal.SIGTERM)
            assert await a.wait_exit() == 0, a.stderr()
            handed = trio.current_time()
            await _wait(fake, lambda: len(fake.subscribe_log) == 2, 30, "B to subscribe")
            took = trio.current_time() - handed
            fake.push(_dm("after the handover", ts=1))
            await _wait(fake, lambda: len(fake.sends) == 2, 30, "B's answer")
            assert (await _signal_health(second))["adapterState"] == "receiving"
            b.send(signal.SIGTERM)
            assert await b.wait_exit() == 0, b.stderr()
    assert fake.max_concurrent_subscriptions == 1
    assert [s["message"] for s in fake.sends] == ["to whoever holds it", "after the handover"]
    assert fake.subscribe_log[0][1] != fake.subscribe_log[1][1]
    assert took < 6, f"the standby took {took:.1f} s"
    with sqlite3.connect(db) as conn:
        rows = conn.execute(
            "SELECT version, value FROM prism_checkpoints WHERE namespace = ?",
            ("prism.channels.v1.signal.receiver",),
        ).fetchall()
    assert len(rows) == 1 and rows[0][0] == 2 and json.loads(rows[0][1])["schema"] == 1


async def test_a_sigterm_loses_nothing_signal_cli_handed_over(
    tmp_path: Path, nursery: trio.Nursery, short_dir: Path
) -> None:
    """Messages written during the stop (the runtime already answers ``stopped``) are kept
    in the inbox and answered by the next run."""
    fake = FakeSignalCli(socket_path=str(short_dir / "signal-cli.sock"))
    await fake.start(nursery)
    layout = _layout(tmp_path, fake)
    async with running_daemon(layout, tag="a", args=("--log-level", "debug")) as daemon:
        await daemon.wait_state("READY=1")
        await _wait(fake, lambda: bool(fake.subscriptions), 30, "a subscription")
        daemon.send(signal.SIGTERM)
        await daemon.wait_state("STOPPING=1")
        for n in range(5):
            fake.push(_dm(f"during stop {n}", n % 3, 10 + n))
        assert await daemon.wait_exit() == 0, daemon.stderr()
    handed = [d.envelope["dataMessage"]["message"] for d in fake.deliveries]
    async with running_daemon(layout, tag="b") as daemon:
        await _wait(fake, lambda: len(fake.sends) == 5, 30, "five answers")
        daemon.send(signal.SIGTERM)
        assert await daemon.wait_exit() == 0
    assert sorted(s["message"] for s in fake.sends) == [f"during stop {n}" for n in range(5)]
    assert not fake.lost_in_write
    print(f"handed out during the stop: {len(handed)} of 5", flush=True)
