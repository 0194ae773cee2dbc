"""`prismd run` failing in ways nobody planned: the output names what failed, never its text."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECRET_TEXT = "private words from a user 7f3a"

CRASH = f"""
import sys
import prismd.daemon as daemon

async def boom(config, **kwargs):
    try:
        raise KeyError({SECRET_TEXT!r})
    except KeyError:
        raise RuntimeError("while handling " + {SECRET_TEXT!r})

daemon.run_daemon = boom
from prismd.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_uncaught_daemon_error_exits_1_with_a_traceback_but_no_exception_text(
    tmp_path: Path,
) -> None:
    config = tmp_path / "prismd.toml"
    config.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n')
    done = subprocess.run(
        [sys.executable, "-c", CRASH, "run", "--config", str(config), "--log-level", "debug"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=str(tmp_path),
    )
    assert done.returncode == 1
    assert "RuntimeError" in done.stderr and "KeyError" in done.stderr
    assert "boom" in done.stderr  # the frames are there for the bug report
    assert SECRET_TEXT not in done.stderr
