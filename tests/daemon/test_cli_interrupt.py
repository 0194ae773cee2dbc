"""Ctrl-C while ``prismd`` starts — before the daemon's own signal handling is in place,
while its modules load — ends it quietly with exit 130, as ``prismctl`` does, instead of a
``KeyboardInterrupt`` traceback (a new user who presses Ctrl-C in the first second of
``make run`` saw one)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import child_env

# The SIGINT is delivered from an import hook at the moment `prismd.daemon` starts to load:
# the same point a terminal's Ctrl-C hit in the first second of `prismd run`, made certain.
INTERRUPTED_DURING_IMPORT = """
import os, signal, sys

class Interrupt:
    def find_spec(self, name, path, target=None):
        if name == "prismd.daemon":
            os.kill(os.getpid(), signal.SIGINT)
        return None

sys.meta_path.insert(0, Interrupt())
from prismd.cli import main
sys.exit(main(sys.argv[1:]))
"""

WEB = """
[[connections]]
id = "web"
kind = "webchat"
listen = "127.0.0.1:0"

[agents.echo]
kind = "echo"

[[grants]]
connection = "web"
actors = ["*"]
aliases = ["echo"]
"""


@pytest.mark.parametrize("command", ["run", "check-config", "doctor"])
def test_ctrl_c_while_prismd_starts_is_quiet(tmp_path: Path, command: str) -> None:
    config = tmp_path / "prismd.toml"
    config.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n' + WEB)
    done = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_DURING_IMPORT, command, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env=child_env(),
    )
    assert (done.returncode, done.stderr, done.stdout) == (130, "", "")
    assert not (tmp_path / "state").exists()  # interrupted before anything was made
