"""Telegram through the daemon: a SIGKILL + restart adopts the receiver lease at once.

Deliberate difference 8: the restarted daemon has the same instance id (state directory),
so it takes over its predecessor's receiver lease immediately instead of waiting out the
90 s TTL. Uses the fake Bot API on loopback (``http://`` origin is allowed for loopback).
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.fakes.telegram_api import FakeBotApi, start_fake

from .helpers import Layout, free_port, prismctl, running_daemon, write_config

pytestmark = pytest.mark.slow


def _private(update_text: str, message_id: int) -> dict[str, Any]:
    return {
        "message": {
            "message_id": message_id,
            "from": {"id": 202, "is_bot": False, "first_name": "Ada"},
            "chat": {"id": 101, "type": "private", "first_name": "Ada"},
            "date": 1_700_000_000,
            "text": update_text,
        }
    }


async def _wait_sent(fake: FakeBotApi, text: str, limit_s: float) -> None:
    with trio.fail_after(limit_s):
        for _ in range(1_000_000):
            if any(s.get("text") == text for s in fake.sent):
                return
            await trio.sleep(0.05)


def _layout(tmp_path: Path, fake: FakeBotApi, store_url: str | None) -> Layout:
    return write_config(
        tmp_path,
        store_url=store_url,
        delay_ms=1,
        extra=f"""
[[connections]]
id = "tg"
kind = "telegram"
token_env = "TG_TOKEN"
api_origin = "{fake.origin}"
poll_timeout_s = 1

[[grants]]
connection = "tg"
actors = ["202"]
aliases = ["slow"]
""",
    )


async def test_sigkill_and_restart_resume_polling_at_once(
    tmp_path: Path, store_url: str | None
) -> None:
    async with trio.open_nursery() as nursery:
        fake = await start_fake(nursery)
        layout = _layout(tmp_path, fake, store_url)
        env = {"TG_TOKEN": fake.token}
        async with running_daemon(
            layout, tag="first", extra_env=env, args=("--log-level", "debug")
        ) as first:
            await first.wait_state("READY=1")
            fake.push_update(_private("hello one", 1))
            await _wait_sent(fake, "mock: hello one", 30)
            code, health, _ = await prismctl(layout, "health")
            assert code == 0
            assert health["children"]["telegram:tg"]["state"] == "running"
            first.send(signal.SIGKILL)
            assert await first.wait_exit() == -signal.SIGKILL
            first_log = first.stderr()

        async with running_daemon(
            layout, tag="second", extra_env=env, args=("--log-level", "debug")
        ) as second:
            await second.wait_state("READY=1")
            fake.push_update(_private("hello two", 2))
            # Far below the 90 s receiver lease TTL: the lease was adopted, not waited out.
            await _wait_sent(fake, "mock: hello two", 15)
            second.send(signal.SIGTERM)
            assert await second.wait_exit() == 0
            second_log = second.stderr()
        nursery.cancel_scope.cancel()
    # Each update answered exactly once.
    texts = [s.get("text") for s in fake.sent]
    assert texts.count("mock: hello one") == 1
    assert texts.count("mock: hello two") == 1
    for log in (first_log, second_log):
        assert fake.token not in log
        assert "secret-token" not in log
        assert "hello one" not in log and "hello two" not in log


async def test_webhook_mode_through_the_daemon(tmp_path: Path, store_url: str | None) -> None:
    hook_port = free_port()
    secret = "hook_secret_42"
    async with trio.open_nursery() as nursery:
        fake = await start_fake(nursery)
        fake.chats.add("101")  # the chat is known to the bot (updates arrive by webhook)
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
mode = "webhook"
webhook_listen = "127.0.0.1:{hook_port}"
webhook_secret_env = "TG_HOOK_SECRET"

[[grants]]
connection = "tg"
actors = ["202"]
aliases = ["slow"]
""",
        )
        env = {"TG_TOKEN": fake.token, "TG_HOOK_SECRET": secret}
        async with running_daemon(layout, extra_env=env) as daemon:
            await daemon.wait_state("READY=1")
            assert "telegram tg: (webhook)" in daemon.stderr()
            update = {"update_id": 7, **_private("via hook", 7)}
            url = f"http://127.0.0.1:{hook_port}/telegram/tg"
            with trio.fail_after(30):
                async with httpx.AsyncClient() as client:
                    wrong = await client.post(
                        url, json=update, headers={"X-Telegram-Bot-Api-Secret-Token": "nope"}
                    )
                    assert wrong.status_code == 401
                    ok = await client.post(
                        url, json=update, headers={"X-Telegram-Bot-Api-Secret-Token": secret}
                    )
                    assert ok.status_code == 204
                    await _wait_sent(fake, "mock: via hook", 15)
                    again = await client.post(
                        url, json=update, headers={"X-Telegram-Bot-Api-Secret-Token": secret}
                    )
                    assert again.status_code == 204
            daemon.send(signal.SIGTERM)
            assert await daemon.wait_exit() == 0
            log = daemon.stderr()
        nursery.cancel_scope.cancel()
    # Telegram's redelivery of the same update is a duplicate: answered once.
    assert [s.get("text") for s in fake.sent].count("mock: via hook") == 1
    assert secret not in log and fake.token not in log
