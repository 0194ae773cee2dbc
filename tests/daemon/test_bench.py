"""``prismd bench``: every in-process scenario runs on a real SQLite store and reports the
figures the performance issue names; the CLI prints one JSON object or a table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from prismd.cli._bench import BenchOptions, render_table, run_bench
from prismd.cli._bench_live import process_cpu_s
from prismd.cli._figures import figures

pytestmark = pytest.mark.slow

SERIES_KEYS = {"count", "per_s", "p50_ms", "p95_ms", "p99_ms", "max_ms"}


def test_figures_are_percentiles_of_the_series() -> None:
    samples = [i / 1000 for i in range(1, 101)]  # 1 … 100 ms
    out = figures(samples, elapsed_s=2.0)
    assert out["count"] == 100 and out["per_s"] == 50.0
    assert out["p50_ms"] == pytest.approx(50.5, abs=1) and out["max_ms"] == 100.0
    assert out["p95_ms"] == pytest.approx(95, abs=1) and out["p99_ms"] == pytest.approx(99, abs=1)
    assert figures([], 1.0) == {"count": 0, "per_s": 0.0}


async def test_in_process_scenarios_report_every_figure(tmp_path: Path) -> None:
    options = BenchOptions(
        scenarios=("admission", "duplicate", "pipeline"), routes=8, duration_s=0.3, json=True
    )
    summary = await run_bench(options, str(tmp_path))
    scenarios = summary["scenarios"]
    assert set(scenarios) == {
        "admission",
        "admission_64",
        "duplicate",
        "pipeline",
        "pipeline_latency",
    }
    for name, fig in scenarios.items():
        assert set(fig) >= SERIES_KEYS, name
        assert fig["count"] > 0 and fig["p50_ms"] <= fig["p95_ms"] <= fig["max_ms"], name
    # Admission is measured alone: the turns it starts run between its rounds.
    assert scenarios["admission"]["answered_while_measured"] == 0
    assert scenarios["admission_64"]["answered_while_measured"] == 0
    pipeline = scenarios["pipeline"]
    # Counted by the store itself (shared transactions make it fractional, never zero).
    assert 0 < pipeline["commits_per_message"] < 20
    assert pipeline["cpu_ms_per_message"] > 0
    # The disk's stalls while each series was measured, as the store counted them.
    for name in ("admission", "admission_64", "pipeline", "pipeline_latency"):
        fig = scenarios[name]
        assert 0 <= fig["slow_commits"] <= fig["count"], name
        assert (fig["slow_commit_ms"] >= 10 * fig["slow_commits"]) and (
            fig["slow_commit_ms"] == 0 or fig["slow_commits"] > 0
        ), name
    assert set(summary["fsync"]) == {"count", "p50_ms", "p95_ms", "per_s"}
    assert summary["fsync"]["count"] >= 4 * 200
    assert summary["peak_rss_mb"] > 0
    table = render_table(summary)
    assert "pipeline_latency" in table and "fsync (baseline)" in table


def test_cli_prints_one_json_object(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "prismd", "bench", "--json", "--duration-s", "0.2",
         "--scenario", "duplicate"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert set(summary["scenarios"]) == {"duplicate"}
    assert summary["scenarios"]["duplicate"]["count"] > 0
    assert list(tmp_path.iterdir()) == []  # its temporary store directory is gone


def test_memory_is_measured_in_a_fresh_process_with_its_routes(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "prismd", "bench", "--json", "--scenario", "memory",
         "--memory-routes", "300"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    memory = json.loads(proc.stdout)["scenarios"]["memory"]
    assert memory["process"] == "fresh" and memory["routes"] == 300
    # The child's own figures: a Python process with the runtime imported and 300 routes.
    assert 10 < memory["rss_before_mb"] <= memory["rss_mb"] < 500
    assert list(tmp_path.iterdir()) == []


# Runs ``prismd bench`` in a current directory removed under it: one nobody can write in,
# root included.
IN_A_REMOVED_DIRECTORY = 'mkdir gone && cd gone && rmdir ../gone && exec "$0" -m prismd bench "$@"'


def test_a_directory_it_cannot_write_in_is_refused_and_dir_names_the_disk(
    tmp_path: Path,
) -> None:
    """The temporary store and the fsync baseline live in the current directory unless
    ``--dir`` names another (the system's temporary directory may be a tmpfs, where an
    fsync measures nothing). One it cannot write in is refused in one line, exit 2; with
    ``--dir`` the bench runs there, and so does its fresh ``memory`` process."""
    shell = ["sh", "-c", IN_A_REMOVED_DIRECTORY, sys.executable, "--json"]
    refused = subprocess.run(
        [*shell, "--scenario", "duplicate", "--duration-s", "0.2"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert refused.returncode == 2, refused.stderr
    assert refused.stdout == ""
    assert refused.stderr.startswith(
        "prismd bench: cannot create a working directory in the current directory"
    )
    assert "--dir" in refused.stderr and "Traceback" not in refused.stderr
    missing = subprocess.run(
        [*shell, "--scenario", "duplicate", "--dir", str(tmp_path / "absent")],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert missing.returncode == 2
    assert f"in {tmp_path / 'absent'} (" in missing.stderr and "Traceback" not in missing.stderr

    disk = tmp_path / "disk"
    disk.mkdir()
    proc = subprocess.run(
        [*shell, "--scenario", "memory", "--memory-routes", "300", "--dir", str(disk)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["scenarios"]["memory"]["routes"] == 300
    assert summary["fsync"]["count"] > 0
    assert list(disk.iterdir()) == []  # its working directory is gone again


PROBE = """
import sys
from prismd.cli import _prismd
from prismd.cli._bench import memory
from prismd.agents import build_agent
_prismd._parser()
print(sorted(m for m in ("prismd.daemon", "adapters.telegram", "httpx", "trio_websocket")
             if m in sys.modules))
from prismd.agents import OpenAIAgent
print(OpenAIAgent.__module__, "httpx" in sys.modules)
"""


def test_the_bench_process_holds_the_runtime_and_the_store_only(tmp_path: Path) -> None:
    """What ``memory`` measures: a ``prismd bench`` process imports neither the daemon nor
    the adapters nor the openai kind's HTTP stack (their modules are ~8 MB resident); the
    openai kind still loads when named."""
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == ["[]", "prismd.agents.openai True"], proc.stdout


def test_cli_refuses_bad_arguments(tmp_path: Path) -> None:
    for args in (
        ["--routes", "0"],
        ["--routes", "501"],  # more than the messages a process may hold pending
        ["--duration-s", "0"],
        ["--scenario", "nope"],
        ["--memory-routes", "0"],
    ):
        proc = subprocess.run(
            [sys.executable, "-m", "prismd", "bench", *args],
            cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert proc.returncode == 2, (args, proc.stderr)


def test_live_scenarios_drive_a_real_daemon(tmp_path: Path) -> None:
    """``webchat``, ``telegram`` and ``stop`` start a real ``prismd run`` each and report."""
    proc = subprocess.run(
        [sys.executable, "-m", "prismd", "bench", "--json", "--duration-s", "1",
         "--scenario", "webchat", "--scenario", "telegram", "--scenario", "stop"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    scenarios = json.loads(proc.stdout)["scenarios"]
    for name in ("webchat", "webchat_latency", "telegram"):
        assert set(scenarios[name]) >= SERIES_KEYS and scenarios[name]["count"] > 0, name
    # The daemon's own CPU per message (from /proc: this suite runs on Linux).
    assert scenarios["webchat"]["cpu_ms_per_message"] > 0
    # The Telegram row: the daemon's CPU and its Bot API requests per update (issue 40): the
    # echo answers at once, so no sendChatAction. In this closed loop (20 chats, each sends
    # its next message when answered) a getUpdates answer holds a few updates, not 100.
    telegram = scenarios["telegram"]
    assert telegram["cpu_ms_per_update"] > 0
    assert telegram["requests"].get("sendMessage", 0) >= telegram["count"]
    assert "sendChatAction" not in telegram["requests"]
    assert 1 <= telegram["requests_per_update"] <= 1.5, telegram
    stop = scenarios["stop"]
    assert stop["exit_code"] == 0 and stop["left_executing"] == 0
    assert stop["seconds_to_exit"] < stop["deadline_s"] + 5
    assert stop["states"] == {"cancelled": 100}
    assert list(tmp_path.iterdir()) == []


def test_a_process_cpu_time_is_read_whatever_its_name() -> None:
    """``/proc/PID/stat`` puts the command name in parentheses, and a name may hold
    parentheses, spaces and non-ASCII bytes itself: the fields are counted after the last
    parenthesis, over bytes."""
    script = (
        "import pathlib, sys, time\n"
        "pathlib.Path('/proc/self/comm').write_text('a) b (c\\u00e9')\n"
        "end = time.process_time() + 0.3\n"
        "while time.process_time() < end: pass\n"
        "print('spun', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdout.readline() == "spun\n"
        assert Path(f"/proc/{child.pid}/comm").read_text().strip() == "a) b (c\u00e9"
        spent = process_cpu_s(child.pid)
        assert spent is not None and 0.25 <= spent < 5
    finally:
        child.communicate("", timeout=30)
    assert process_cpu_s(child.pid) is None  # reaped: no such process
