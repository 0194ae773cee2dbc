"""Shutdown at moments nobody picked: SIGTERM during a Telegram long poll."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
import trio

from tests.fakes.telegram_api import start_fake

from .helpers import free_port, live_leases, running_daemon, write_config

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser


async def test_sigterm_during_a_long_poll_exits_0_promptly_and_releases_the_receiver_lease(
    tmp_path: Path,
    store_url: str | None,
) -> None:
    async with trio.open_nursery() as nursery:
        fake = await start_fake(nursery)
        layout = write_config(
            tmp_path,
            store_url=store_url,
            delay_ms=1,
            extra=f"""
[[connections]]
id = "tg"
kind = "telegram"
token_env = "TG_TOKEN"
api_origin = "{fake.origin}"
poll_timeout_s = 30

[[grants]]
connection = "tg"
actors = ["202"]
aliases = ["slow"]
""",
        )
        async with running_daemon(layout, extra_env={"TG_TOKEN": fake.token}) as daemon:
            await daemon.wait_state("READY=1")
            with trio.fail_after(15):
                for _ in range(1_000_000):
                    if fake.calls_to("getUpdates"):
                        break
                    await trio.sleep(0.05)
            await trio.sleep(0.3)  # inside the 30 s long poll
            assert any("receiver" in ns for ns in live_leases(layout))
            sent = trio.current_time()
            daemon.send(signal.SIGTERM)
            assert await daemon.wait_exit(20) == 0, daemon.stderr()
            # Not waiting out the poll: the stop deadline is 3 s.
            assert trio.current_time() - sent < 10
            log = daemon.stderr()
        nursery.cancel_scope.cancel()
    assert live_leases(layout) == []
    assert fake.token not in log


async def test_sigterm_while_an_adapter_is_still_starting_exits_0_promptly(
    tmp_path: Path,
    store_url: str | None,
) -> None:
    """Telegram unreachable: its adapter is still retrying getMe (before READY) when the
    SIGTERM comes; the daemon stops at once with exit 0 and leaves no live lease."""
    closed = free_port()
    layout = write_config(
        tmp_path,
        store_url=store_url,
        delay_ms=1,
        extra=f"""
[[connections]]
id = "tg"
kind = "telegram"
token_env = "TG_TOKEN"
api_origin = "http://127.0.0.1:{closed}"

[[grants]]
connection = "tg"
actors = ["202"]
aliases = ["slow"]
""",
    )
    async with running_daemon(layout, extra_env={"TG_TOKEN": "123456:" + "x" * 35}) as daemon:
        with trio.fail_after(20):
            for _ in range(1_000_000):
                if "web chat listening" in daemon.stderr():
                    break
                await trio.sleep(0.02)
        await trio.sleep(0.3)  # web chat and control up; telegram retrying getMe
        daemon.send(signal.SIGTERM)
        sent = trio.current_time()
        assert await daemon.wait_exit(20) == 0, daemon.stderr()
        assert trio.current_time() - sent < 8
        assert "Traceback" not in daemon.stderr()
    assert live_leases(layout) == []
