"""`prismd soak` (behaviours 118, 187–192): real SQLite, the mock agent, one JSON line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import trio

from prismd.cli._prismd import main
from prismd.cli._soak import SoakOptions, soak

from .helpers import child_env

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser

REPO = Path(__file__).resolve().parents[2]

FIELDS = {
    "ok",
    "durationMs",
    "iterations",
    "admitted",
    "repeatAttempts",
    "duplicates",
    "denied",
    "delivered",
    "uniqueReplies",
    "unsettled",
    "reconciled",
    "unresolvedSeen",
    "pruned",
    "lanes",
    "diagnostics",
    "unresolvedAtEnd",
    "interrupted",
    "lanesSeen",
}


def _assert_behaviour_118(summary: dict[str, object]) -> None:
    assert set(summary) >= FIELDS
    assert summary["ok"] is True
    assert isinstance(summary["iterations"], int) and summary["iterations"] >= 1
    assert isinstance(summary["delivered"], int) and summary["delivered"] >= 1
    assert summary["denied"] == 0
    assert summary["unsettled"] == 0
    assert summary["unresolvedAtEnd"] == 0
    diagnostics = summary["diagnostics"]
    assert isinstance(diagnostics, dict)
    assert diagnostics["failed"] == 0
    assert diagnostics["storageFailures"] == 0
    pruned = summary["pruned"]
    assert isinstance(pruned, dict)
    assert pruned["scanned"] > 0 and pruned["deleted"] > 0


def test_soak_subprocess_prints_one_json_line_and_exits_0(tmp_path: Path) -> None:
    env = child_env(TMPDIR=str(tmp_path))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "prismd",
            "soak",
            "--duration-ms",
            "1000",
            "--lanes",
            "3",
            "--prune-every",
            "5",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=str(tmp_path),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    summary = json.loads(lines[0])
    _assert_behaviour_118(summary)
    assert summary["lanes"] == 3
    assert summary["lanesSeen"] == min(3, summary["iterations"])
    assert summary["interrupted"] is False
    # Behaviour 190's accounting.
    assert summary["delivered"] == summary["admitted"] == summary["uniqueReplies"]
    assert summary["duplicates"] == summary["repeatAttempts"] >= 1
    assert summary["diagnostics"]["admitted"] == summary["admitted"] + summary["repeatAttempts"]
    assert summary["diagnostics"]["deliveries"] == summary["delivered"]
    # The temporary store is removed (behaviour 191).
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("prismd-soak-")]


async def test_soak_in_process_with_an_iteration_cap_and_a_given_store(tmp_path: Path) -> None:
    url = "sqlite:///" + str(tmp_path / "soak.sqlite")
    with trio.fail_after(30):
        summary = await soak(
            SoakOptions(duration_ms=30_000, iterations=40, lanes=2, prune_every=10, store=url),
            install_signals=False,
        )
    _assert_behaviour_118(summary)
    assert summary["iterations"] == 40
    assert summary["admitted"] == 40
    assert summary["repeatAttempts"] == summary["duplicates"] == 4
    assert summary["lanesSeen"] == 2
    # A given store is kept.
    assert (tmp_path / "soak.sqlite").exists()


def test_sigint_ends_a_long_soak_promptly_with_interrupted_true(tmp_path: Path) -> None:
    env = child_env(TMPDIR=str(tmp_path))
    process = subprocess.Popen(
        [sys.executable, "-m", "prismd", "soak", "--duration-ms", "600000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=str(tmp_path),
    )
    try:
        # Wait until the loop runs: the temp store appears and has been written to.
        deadline = 30.0
        start = time.monotonic()
        while time.monotonic() - start < deadline:
            dirs = [p for p in tmp_path.iterdir() if p.name.startswith("prismd-soak-")]
            if dirs and (dirs[0] / "soak.sqlite").exists():
                break
            time.sleep(0.05)
        time.sleep(0.5)
        sent_at = time.monotonic()
        process.send_signal(signal.SIGINT)
        out, err = process.communicate(timeout=30)
        assert time.monotonic() - sent_at < 15
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, out + err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["interrupted"] is True
    assert summary["ok"] is True
    assert summary["iterations"] >= 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("prismd-soak-")]


def test_soak_bad_flags_are_usage_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (
        ["soak", "--duration-ms", "50"],
        ["soak", "--lanes", "65"],
        ["soak", "--prune-every", "0"],
        ["soak", "--iterations", "-1"],
        ["soak", "--duration-ms", "abc"],
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
    assert "--duration-ms must be between 100" in capsys.readouterr().err


def test_soak_uncaught_error_prints_ok_false(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    handlers = [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)]
    code = main(["soak", "--duration-ms", "100", "--store", f"sqlite:///{blocker}/x.sqlite"])
    assert code == 1
    # In-process use leaves the caller's signal handlers as they were.
    assert [signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)] == (
        handlers
    )
    line = capsys.readouterr().out.strip()
    summary = json.loads(line)
    assert summary["ok"] is False and summary["uncaught"] is True
    # The failing leaf's type, not the nursery's wrapper.
    assert "Group" not in summary["error"] and summary["error"]
    assert str(blocker) not in line
    assert os.path.exists(tempfile.gettempdir())


SLOW_OPEN = """
import sys, time
from contextlib import asynccontextmanager
from pathlib import Path
import prismd.cli._soak as soak_module

real_open = soak_module.open_store

@asynccontextmanager
async def slow_open(url):
    Path(sys.argv[1]).write_text("opening")
    time.sleep(1.0)  # a slow filesystem: the signal arrives while the store opens
    async with real_open(url) as store:
        yield store

soak_module.open_store = slow_open
from prismd.cli import main
sys.exit(main(["soak", "--duration-ms", "600000"]))
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_store_opens_ends_the_soak_cleanly(
    tmp_path: Path, signum: signal.Signals
) -> None:
    marker = tmp_path / "marker"
    process = subprocess.Popen(
        [sys.executable, "-c", SLOW_OPEN, str(marker)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(TMPDIR=str(tmp_path)),
        cwd=str(tmp_path),
    )
    try:
        start = time.monotonic()
        while not marker.exists() and time.monotonic() - start < 30:
            time.sleep(0.02)
        process.send_signal(signum)
        out, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, out + err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["interrupted"] is True and summary["ok"] is True
    assert summary["iterations"] == 0
    assert "Traceback" not in err
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("prismd-soak-")]
