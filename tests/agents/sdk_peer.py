"""The official a2a-sdk agent (``tests/fakes/a2a_sdk_agent.py``) as a subprocess on
loopback, for the tests that drive prismd against it."""

from __future__ import annotations

import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import trio

ROOT = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def running_sdk_agent(
    tmp_path: Path, delay_s: float = 1.0, port: int = 0
) -> AsyncIterator[str]:
    """The SDK agent answering after ``delay_s`` (on ``port``, else a free one): its URL.
    Stopped (SIGTERM, else SIGKILL) when the block ends; its tasks live in its memory."""
    port_file = tmp_path / f"sdk-port-{trio.current_time()}"
    proc = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-m",
            "tests.fakes.a2a_sdk_agent",
            str(port_file),
            str(delay_s),
            str(port),
        ],
        cwd=ROOT,
    )
    try:
        with trio.fail_after(30):
            while not port_file.exists() or not port_file.read_text():
                if proc.poll() is not None:
                    raise AssertionError("the a2a-sdk agent did not start")
                await trio.sleep(0.05)
        yield f"http://127.0.0.1:{port_file.read_text()}/"
    finally:
        proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(5) as waited:
            await proc.wait()
        if waited.cancelled_caught:
            proc.kill()
            await proc.wait()
