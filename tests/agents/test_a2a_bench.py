"""``prismd bench --scenario a2a`` measures what it says on a real SQLite store: every task
followed, polled, completed by a push and answered."""

from __future__ import annotations

from pathlib import Path

import trio

from prismd.cli._bench_a2a import a2a


async def test_the_a2a_bench_scenario_follows_pushes_and_answers_every_task(
    tmp_path: Path,
) -> None:
    with trio.fail_after(60):
        figures = await a2a(f"sqlite:///{tmp_path / 'b.sqlite'}", 20, 1.2)
    followed = figures["a2a_followed"]
    assert followed["count"] == 20 and followed["polls"] >= 20
    assert followed["rss_bytes_per_task"] > 0 and followed["cpu_ms_per_poll"] > 0
    assert figures["a2a_push_ingest"]["count"] == 20
    assert figures["a2a_push_ingest"]["cpu_ms_per_push"] > 0
    assert figures["a2a_push_apply"]["count"] == 20
    assert figures["a2a_push_apply"]["per_s"] > 0
    assert figures["a2a_completions"]["count"] == 20
    assert figures["a2a_completions"]["per_s"] > 0
