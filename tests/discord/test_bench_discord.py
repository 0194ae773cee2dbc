"""``prismd bench --scenario discord``: a real ``prismd run`` answers DMs from the bench's
loopback gateway and REST, and the row reports the figures docs/performance.md shows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_discord_scenario_drives_a_real_daemon(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "prismd", "bench", "--json", "--duration-s", "1",
         "--scenario", "discord"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    row = json.loads(proc.stdout)["scenarios"]["discord"]
    assert row["count"] > 0 and row["p50_ms"] <= row["p95_ms"] <= row["max_ms"], row
    assert row["cpu_ms_per_message"] > 0
    # One POST per answer (the echo answers at once: no typing request, issue 40's rule),
    # and Discord's global 50 requests a second kept by the daemon itself.
    requests = row["requests"]
    assert requests["POST /channels/{id}/messages"] >= row["count"]
    assert "POST /channels/{id}/typing" not in requests
    assert 1 <= row["requests_per_message"] <= 1.1, row
    assert 0 < row["peak_requests_per_s"] <= 50, row
    assert list(tmp_path.iterdir()) == []
