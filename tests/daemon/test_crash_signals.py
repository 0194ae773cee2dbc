"""Signals on a real `prismd run`: a second SIGTERM forces the exit; debug logs keep secrets."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import trio
import trio_websocket

from .helpers import chat, prismctl, running_daemon, wait_runs, write_config

pytestmark = pytest.mark.slow

SECRET_TOKEN = "webchat-access-token-5a9c1e77d2"
SECRET_TEXT = "private words 0c1d2e3f"


async def test_second_sigterm_during_a_slow_stop_forces_exit_143(
    tmp_path: Path, store_url: str | None
) -> None:
    layout = write_config(
        tmp_path,
        delay_ms=10,
        stop_deadline_ms=60_000,
        agent_extra="shield_ms = 60000",
        store_url=store_url,
    )
    async with running_daemon(layout) as daemon:
        await daemon.wait_state("READY=1")
        async with chat(layout.port) as client:
            assert (await client.send_message("m1", "hello"))["status"] == "accepted"
        await wait_runs(layout, 1)
        daemon.send(signal.SIGTERM)
        await daemon.wait_state("STOPPING=1")
        # runtime.stop() now waits for the stubborn turn (up to 60 s); a second signal ends it.
        await trio.sleep(0.3)
        assert daemon.process.returncode is None
        daemon.send(signal.SIGTERM)
        assert await daemon.wait_exit(limit_s=10) == 128 + signal.SIGTERM
        assert "second SIGTERM" in daemon.stderr()


async def test_debug_logs_never_contain_the_access_token_or_message_text(
    tmp_path: Path, store_url: str | None
) -> None:
    layout = write_config(tmp_path, delay_ms=10, store_url=store_url)
    text = layout.config.read_text().replace(
        'listen = "127.0.0.1', 'access_token_env = "WEB_TOKEN"\nlisten = "127.0.0.1'
    )
    layout.config.write_text(text)
    async with running_daemon(
        layout, extra_env={"WEB_TOKEN": SECRET_TOKEN}, args=("--log-level", "debug")
    ) as daemon:
        await daemon.wait_state("READY=1")
        url = f"ws://127.0.0.1:{layout.port}/ws?token={SECRET_TOKEN}"
        with trio.fail_after(30):
            async with trio_websocket.open_websocket_url(url) as ws:
                await ws.send_message(json.dumps({"type": "hello", "actor": "debug-actor-01"}))
                while json.loads(await ws.get_message())["type"] != "ready":
                    pass
                await ws.send_message(
                    json.dumps({"type": "message", "id": "m1", "text": SECRET_TEXT})
                )
                while True:
                    frame = json.loads(await ws.get_message())
                    if frame["type"] == "reply":
                        break
        assert frame["text"] == f"mock: {SECRET_TEXT}"
        code, _, _ = await prismctl(layout, "diagnostics")
        assert code == 0
        daemon.send(signal.SIGTERM)
        assert await daemon.wait_exit() == 0
        log = daemon.stderr()
    assert "DEBUG" in log or "debug" in log.lower()
    assert SECRET_TOKEN not in log
    assert SECRET_TEXT not in log
    assert "private words" not in log


async def test_watchdog_pings_reach_a_real_notify_socket(
    tmp_path: Path, store_url: str | None
) -> None:
    layout = write_config(tmp_path, delay_ms=10, store_url=store_url)
    async with running_daemon(layout, extra_env={"WATCHDOG_USEC": "200000"}) as daemon:
        await daemon.wait_state("READY=1")
        await daemon.wait_state("WATCHDOG=1", limit_s=10)
        before = daemon.states.count("WATCHDOG=1")
        await trio.sleep(0.5)
        daemon.send(signal.SIGTERM)
        await daemon.wait_state("STOPPING=1")
        assert daemon.states.count("WATCHDOG=1") > before
        assert await daemon.wait_exit() == 0
