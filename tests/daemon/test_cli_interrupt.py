"""Ctrl-C while ``prismd`` starts — before the daemon's own signal handling is in place,
while its modules load — ends it quietly with exit 130, as ``prismctl`` does, instead of a
``KeyboardInterrupt`` traceback (a new user who presses Ctrl-C in the first second of
``make run`` saw one); and Ctrl-C ends a connected ``prismctl chat`` at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from tests.webchat._stack import chat_stack

from .helpers import child_env
from .test_prismctl import PRISMCTL

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


@pytest.mark.slow  # a real subprocess and signal
async def test_ctrl_c_ends_a_connected_chat_at_once(tmp_path: Path) -> None:
    """Ctrl-C on a connected ``prismctl chat`` took 2 s to end: the close waited for an
    answer its cancelled reader could never read."""
    with trio.fail_after(30):
        async with chat_stack() as (adapter, _):
            assert adapter.bound is not None
            read_end, write_end = os.pipe()  # stdin stays open: a person at the terminal
            try:
                process = await trio.lowlevel.open_process(
                    [*PRISMCTL, "chat", "--url", f"http://127.0.0.1:{adapter.bound[1]}/"],
                    stdin=read_end,
                    stderr=subprocess.PIPE,
                    env={**os.environ, "XDG_STATE_HOME": str(tmp_path)},
                )
            finally:
                os.close(read_end)
            try:
                assert process.stderr is not None
                said = b""
                while b"Ctrl-D to quit\n" not in said:
                    chunk = await process.stderr.receive_some(65536)
                    assert chunk, f"prismctl chat exited early: {said!r}"
                    said += chunk
                sent = trio.current_time()
                process.send_signal(signal.SIGINT)
                code = await process.wait()
                took = trio.current_time() - sent
            finally:
                os.close(write_end)
                if process.returncode is None:
                    process.kill()
                    await process.wait()
    assert code == 130
    assert took < 1.5, took
