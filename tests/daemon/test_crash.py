"""Crash fixtures (contract behaviours 181–186, 117, 119–120 adapted to the daemon).

Real `prismd run` subprocesses on a SQLite file and on PostgreSQL (every test of the
``test_crash*`` files runs on both: the ``store_url`` fixture), the mock agent with a long
delay (wrapped to count run starts durably), driven through the web chat WebSocket and
`prismctl`.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import trio

from prismd.journal._journal import NS_OPERATION
from stores import open_store

from .helpers import (
    Layout,
    chat,
    prismctl,
    run_count,
    run_keys,
    running_daemon,
    wait_runs,
    write_config,
)

pytestmark = pytest.mark.slow

SECRET_TEXT = "secret-message-text-7f3a"


async def _wait_executing(layout: Layout) -> dict[str, Any]:
    """Poll `prismctl list-unresolved` until the claimed operation shows `executing`."""
    with trio.fail_after(30):
        while True:
            code, entries, err = await prismctl(layout, "list-unresolved")
            assert code == 0, err
            executing = [e for e in entries if e["state"] == "executing"]
            if executing:
                assert len(entries) == 1
                return dict(executing[0])
            await trio.sleep(0.05)


async def _operation_states(layout: Layout) -> list[str]:
    async with open_store(layout.url) as store:
        page = await store.checkpoints.list_checkpoints(namespace=NS_OPERATION)
        return [str(item.value["state"]) for item in page.items]


async def test_sigterm_while_a_turn_is_claimed_cancels_it_and_exits_0(
    tmp_path: Path, store_url: str | None
) -> None:
    layout = write_config(tmp_path, delay_ms=60_000, stop_deadline_ms=3_000, store_url=store_url)
    async with running_daemon(layout) as daemon:
        await daemon.wait_state("READY=1")
        async with chat(layout.port) as client:
            admission = await client.send_message("m1", SECRET_TEXT)
            assert admission["status"] == "accepted"
            await _wait_executing(layout)
            daemon.send(signal.SIGTERM)
            sent = trio.current_time()
            # The adapters stay up while runtime.stop() settles the turn, so the
            # cancellation notice still reaches the browser.
            notice = await client.next_frame("reply", limit_s=10)
            assert notice["kind"] == "notice"
            assert notice["inReplyTo"] == "m1"
        assert await daemon.wait_exit(limit_s=20) == 0
        # Within the stop deadline (3 s) plus process teardown.
        assert trio.current_time() - sent < 10
        await daemon.wait_state("STOPPING=1", limit_s=5)
        assert daemon.states.index("READY=1") < daemon.states.index("STOPPING=1")
        log = daemon.stderr()
    assert await _operation_states(layout) == ["cancelled"]
    assert run_count(layout.runs) == 1
    assert SECRET_TEXT not in log
    # Restarted: nothing unresolved, nothing re-run, the lock was released.
    async with running_daemon(layout, tag="after") as again:
        await again.wait_state("READY=1")
        code, entries, _ = await prismctl(layout, "list-unresolved")
        assert code == 0 and entries == []
        again.send(signal.SIGTERM)
        assert await again.wait_exit() == 0
    assert run_count(layout.runs) == 1


async def test_sigkill_while_claimed_then_restart_reconcile_and_no_rerun(
    tmp_path: Path, store_url: str | None
) -> None:
    # A long lease TTL: the restarted daemon must adopt its predecessor's binding lease
    # at once (deliberate difference 8), not wait it out.
    layout = write_config(tmp_path, delay_ms=60_000, lease_ttl_ms=120_000, store_url=store_url)
    async with running_daemon(layout, tag="first") as first:
        await first.wait_state("READY=1")
        async with chat(layout.port) as client:
            assert (await client.send_message("m1", "hello"))["status"] == "accepted"
        claimed = await _wait_executing(layout)
        first.send(signal.SIGKILL)
        assert await first.wait_exit() == -signal.SIGKILL
    assert run_count(layout.runs) == 1
    assert await _operation_states(layout) == ["executing"]

    async with running_daemon(layout, tag="second") as second:
        await second.wait_state("READY=1")
        assert "1 unresolved operation(s)" in second.stderr()
        code, entries, err = await prismctl(layout, "list-unresolved")
        assert code == 0, err
        assert len(entries) == 1
        entry = entries[0]
        assert entry["state"] == "executing"
        assert entry["operationId"] == claimed["operationId"]
        assert entry["connectionId"] == "web"

        # The same event again is a duplicate: never admitted twice.
        async with chat(layout.port) as client:
            again = await client.send_message("m1", "hello")
            assert again["status"] == "accepted" and again["duplicate"] is True

        code, result, err = await prismctl(
            layout,
            "reconcile",
            entry["operationId"],
            "--connection",
            "web",
            "--version",
            str(entry["version"]),
            "--acknowledge-duplicate-risk",
        )
        assert code == 0, err
        assert result["status"] == "resolved"
        assert result["outcome"] == "execution_unknown"
        code, entries, _ = await prismctl(layout, "list-unresolved")
        assert code == 0 and entries == []

        # A new message in the same conversation runs at once: the binding lease of the
        # killed predecessor (same instance id) was adopted, not waited out (120 s TTL).
        async with chat(layout.port) as client:
            fresh = await client.send_message("m2", "next")
            assert fresh["status"] == "accepted" and fresh["duplicate"] is False
        with trio.fail_after(15):
            await wait_runs(layout, 2)
        second.send(signal.SIGTERM)
        assert await second.wait_exit() == 0
    # The first event's agent run happened exactly once in total, across the kill, the
    # restart, the duplicate and the reconcile.
    keys = run_keys(layout.runs)
    assert len(keys) == 2 and keys[0] != keys[1]
    assert sorted(await _operation_states(layout)) == ["cancelled", "execution_unknown"]


async def test_second_daemon_on_the_same_state_dir_is_refused(
    tmp_path: Path, store_url: str | None
) -> None:
    layout = write_config(tmp_path, store_url=store_url)
    async with running_daemon(layout, tag="owner") as owner:
        await owner.wait_state("READY=1")
        async with running_daemon(layout, tag="intruder") as intruder:
            assert await intruder.wait_exit() == 1
            assert "another prismd is already running" in intruder.stderr()
            assert "READY=1" not in intruder.states
        # The owner is unaffected.
        code, health, _ = await prismctl(layout, "health")
        assert code == 0
        assert health["children"]["webchat:web"]["state"] == "running"
        owner.send(signal.SIGINT)
        assert await owner.wait_exit() == 0


async def test_sigkill_with_queued_messages_runs_them_once_after_restart(
    tmp_path: Path, store_url: str | None
) -> None:
    """Nothing acknowledged is dropped (SPEC difference 8, issue 3): messages the web chat
    already acknowledged but that were still queued (`accepted`, never claimed) when the
    daemon was SIGKILLed get their first — and only — run after the restart. The claimed
    one stays `executing` for the operator; nothing is run twice."""
    layout = write_config(tmp_path, delay_ms=3_000, store_url=store_url)
    async with running_daemon(layout, tag="first") as first:
        await first.wait_state("READY=1")
        async with chat(layout.port) as client:
            for n in (1, 2, 3):
                admission = await client.send_message(f"m{n}", f"message {n}")
                assert admission["status"] == "accepted" and not admission["duplicate"]
        claimed = await _wait_executing_or_more(layout)
        first.send(signal.SIGKILL)
        assert await first.wait_exit() == -signal.SIGKILL
    assert run_count(layout.runs) == 1
    assert sorted(await _operation_states(layout)) == ["accepted", "accepted", "executing"]

    async with running_daemon(layout, tag="second") as second:
        await second.wait_state("READY=1")
        with trio.fail_after(30):
            while True:
                states = sorted(await _operation_states(layout))
                if states == ["executing", "succeeded", "succeeded"]:
                    break
                await trio.sleep(0.1)
        code, entries, err = await prismctl(layout, "list-unresolved")
        assert code == 0, err
        assert [(e["operationId"], e["state"]) for e in entries if e.get("replyState") is None] == [
            (claimed["operationId"], "executing")
        ]
        second.send(signal.SIGTERM)
        assert await second.wait_exit() == 0
    keys = run_keys(layout.runs)
    assert len(keys) == 3 and len(set(keys)) == 3


async def _wait_executing_or_more(layout: Layout) -> dict[str, Any]:
    with trio.fail_after(30):
        while True:
            code, entries, err = await prismctl(layout, "list-unresolved")
            assert code == 0, err
            executing = [e for e in entries if e["state"] == "executing"]
            if executing:
                return dict(executing[0])
            await trio.sleep(0.05)
