"""The stop deadline is a deadline (issue 10): with an agent that ignores cancellation,
SIGTERM with ``stop_deadline_ms = 2000`` exits within the deadline plus a small bounded
margin; the stuck run is settled ``cancelled`` (``cancelled_at_shutdown``) and its route
lease released, and a message admitted just before the signal is settled too, never
left ``accepted`` with a lease nobody releases."""

from __future__ import annotations

import contextlib
import signal
import sqlite3
import time
from pathlib import Path

import pytest
import trio

from .helpers import chat, prismctl, running_daemon, write_config

pytestmark = pytest.mark.slow

DEADLINE_MS = 2_000
MARGIN_S = 2.5
"""What the test allows on top of the deadline: process start-up of the exit path, the
store's close and the interpreter's teardown on a loaded 2-core machine."""


def _rows(db: Path) -> tuple[list[tuple[str, str]], list[str]]:
    now_ms = int(time.time() * 1000)
    with contextlib.closing(sqlite3.connect(db)) as conn:
        ops = conn.execute(
            "SELECT json_extract(value, '$.state'),"
            " coalesce(json_extract(value, '$.errorCode'), '')"
            " FROM prism_checkpoints WHERE namespace = 'prism.channels.v1.operation'"
        ).fetchall()
        leases = conn.execute(
            "SELECT namespace FROM prism_leases WHERE expires_at > ?", (now_ms,)
        ).fetchall()
    return [(str(s), str(c)) for s, c in ops], [str(r[0]) for r in leases]


async def _executing(layout: object) -> None:
    with trio.fail_after(30):
        while True:
            code, entries, err = await prismctl(layout, "list-unresolved")  # type: ignore[arg-type]
            assert code == 0, err
            if any(e["state"] == "executing" for e in entries):
                return
            await trio.sleep(0.05)


async def test_sigterm_with_a_stuck_agent_exits_within_the_deadline(tmp_path: Path) -> None:
    layout = write_config(
        tmp_path, delay_ms=10, stop_deadline_ms=DEADLINE_MS, agent_extra="shield_ms = 600000"
    )
    async with running_daemon(layout) as daemon:
        await daemon.wait_state("READY=1")
        async with chat(layout.port) as client:
            assert (await client.send_message("m1", "stuck"))["status"] == "accepted"
            await _executing(layout)
            # And one more, admitted just before the signal (queued behind the stuck run).
            assert (await client.send_message("m2", "late"))["status"] == "accepted"
        sent = time.monotonic()
        daemon.send(signal.SIGTERM)
        code = await daemon.wait_exit(limit_s=30)
        took = time.monotonic() - sent
        log = daemon.stderr()
    assert code == 0, log
    assert took < DEADLINE_MS / 1000 + MARGIN_S, (took, log)
    ops, leases = _rows(layout.db)
    assert sorted(ops) == [("cancelled", "cancelled_at_shutdown")] * 2, ops
    assert leases == []
    assert "did not end" in log  # the stuck run is named in the log, not hidden
