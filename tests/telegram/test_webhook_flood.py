"""2,000 idle TCP connections to the webhook of a real ``prismd run`` limited to 1,024 file
descriptors (systemd's default soft limit): while they are held, Telegram's POST is
answered and its reply sent, ``prismctl health`` answers, the daemon's descriptors stay
far below the limit, and its log holds no traceback and no line per connection."""

from __future__ import annotations

import os
import resource
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.daemon.helpers import free_port, prismctl, running_daemon, write_config
from tests.fakes.telegram_api import FakeBotApi, start_fake
from tests.flood import closed_by_peer, idle_connections, wait_until

pytestmark = pytest.mark.slow

SECRET = "flood-webhook-secret"
NOFILE = 1024
FLOOD = 2000


def lower_nofile() -> None:
    """In the daemon's child process, before it starts: systemd's default soft limit."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, hard))


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def update(update_id: int, text: str) -> dict[str, Any]:
    return {
        "update_id": update_id,
        "message": {
            "message_id": update_id,
            "from": {"id": 202, "is_bot": False, "first_name": "Ada"},
            "chat": {"id": 101, "type": "private", "first_name": "Ada"},
            "date": 1_700_000_000,
            "text": text,
        },
    }


async def _wait_sent(fake: FakeBotApi, text: str) -> None:
    await wait_until(lambda: any(s.get("text") == text for s in fake.sent), step=0.05)


async def test_idle_connections_beyond_the_descriptor_limit_lock_nothing_out(
    tmp_path: Path,
) -> None:
    async with trio.open_nursery() as nursery:
        fake = await start_fake(nursery)
        fake.chats.add("101")  # the chat the update comes from: Telegram knows it
        port = free_port()
        layout = write_config(
            tmp_path,
            delay_ms=1,
            extra=f"""
[[connections]]
id = "tg"
kind = "telegram"
token_env = "TG_TOKEN"
api_origin = "{fake.origin}"
mode = "webhook"
webhook_listen = "127.0.0.1:{port}"
webhook_secret_env = "TG_SECRET"

[[grants]]
connection = "tg"
actors = ["202"]
aliases = ["slow"]
""",
        )
        env = {"TG_TOKEN": fake.token, "TG_SECRET": SECRET}
        url = f"http://127.0.0.1:{port}/telegram/tg"
        headers = {"x-telegram-bot-api-secret-token": SECRET}
        async with running_daemon(layout, extra_env=env, preexec=lower_nofile) as daemon:
            await daemon.wait_state("READY=1")
            pid = daemon.process.pid
            with trio.fail_after(45), idle_connections("127.0.0.1", port, FLOOD) as flood:
                # The daemon took them all from its accept queue and closed all but its cap.
                await wait_until(lambda: sum(map(closed_by_peer, flood)) >= FLOOD - 200, 0.2)
                held = descriptors(pid)
                assert held < NOFILE - 256, held
                async with httpx.AsyncClient(timeout=10) as client:
                    response = await client.post(
                        url, json=update(1, "through the flood"), headers=headers
                    )
                assert response.status_code == 204
                await _wait_sent(fake, "mock: through the flood")
                code, health, err = await prismctl(layout, "health")
                assert code == 0, err
                assert health["children"]["telegram:tg"]["state"] == "running"
                assert not any(closed_by_peer(sock) for sock in flood[-64:])  # still held
        nursery.cancel_scope.cancel()
    log = daemon.stderr()
    assert "Traceback" not in log
    flood_lines = [line for line in log.splitlines() if "telegram tg webhook" in line]
    assert len(flood_lines) <= 2, flood_lines  # once a minute, not per connection
    print(f"daemon descriptors while {FLOOD} connections were held: {held} (limit {NOFILE})")
