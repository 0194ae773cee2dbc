"""``prismctl health``: the daemon's version and uptime, and per connection its mode, the last
update seen and the last error (the Telegram adapter's status), camelCase on the wire; the
times and causes never become metric labels."""

from __future__ import annotations

import datetime as dt
import json
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from adapters.telegram._api import ReceiverStatus, TelegramApiError
from prismd.cli._ctltable import duration
from tests.fakes.telegram_api import start_fake

from .helpers import child_env, free_port, running_daemon, write_config

DEADLINE = 60


def _iso_ms(text: str) -> float:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp() * 1000


def test_the_receiver_status_keeps_the_last_update_and_error() -> None:
    status = ReceiverStatus("tg")
    assert status.health_fields() == {}
    before = time.time() * 1000
    status.log_retry("getUpdates", TelegramApiError(502), 1.0)
    fields = status.health_fields()
    assert fields["lastError"] == "Bot API error 502"
    assert before - 1 <= _iso_ms(fields["lastErrorAt"]) <= time.time() * 1000 + 1
    assert "lastUpdateAt" not in fields
    assert status.fatal(TelegramApiError(401)) is not None
    assert status.health_fields()["lastError"] == (
        "Telegram rejected the bot credentials: check the token this connection reads"
        " (token_env or token_file; the one @BotFather gave) and restart; prismd doctor tests it"
    )

    seen: list[str] = []

    async def admit(event: str) -> str:
        seen.append(event)
        return "ok"

    async def main() -> None:
        assert await status.seeing(admit)("update") == "ok"

    trio.run(main)
    assert seen == ["update"]
    assert before - 1 <= _iso_ms(status.health_fields()["lastUpdateAt"]) <= time.time() * 1000 + 1


def test_durations_read_as_people_say_them() -> None:
    assert [duration(ms) for ms in (0, 45_999, 302_000, 7_384_000, 273_900_000)] == [
        "0s", "45s", "5m 02s", "2h 03m 04s", "3d 04h 05m"
    ]  # fmt: skip


async def _prismctl(socket: Path, *args: str) -> tuple[int, str]:
    with trio.fail_after(30):
        done = await trio.run_process(
            [sys.executable, "-m", "prismd.cli.prismctl", "--socket", str(socket), *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=child_env(),
        )
    assert done.stderr == b""
    return done.returncode, done.stdout.decode()


@pytest.mark.slow
async def test_health_shows_version_uptime_and_each_connection(tmp_path: Path) -> None:
    metrics_port = free_port()
    async with trio.open_nursery() as nursery:
        fake = await start_fake(nursery)
        layout = write_config(
            tmp_path,
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

[metrics]
listen = "127.0.0.1:{metrics_port}"
""",
        )
        # One failed poll (a cause to show), then an update (a time to show).
        fake.fail_next("getUpdates", status=502, description="Bad Gateway", after=1)
        async with running_daemon(layout, extra_env={"TG_TOKEN": fake.token}) as daemon:
            await daemon.wait_state("READY=1")
            fake.push_update(
                {
                    "message": {
                        "message_id": 1,
                        "from": {"id": 202, "is_bot": False, "first_name": "Ada"},
                        "chat": {"id": 101, "type": "private", "first_name": "Ada"},
                        "date": 1_700_000_000,
                        "text": "hello",
                    }
                }
            )
            wire: dict[str, Any] = {}
            with trio.fail_after(DEADLINE):
                for _ in range(100_000):
                    code, out = await _prismctl(layout.control, "--json", "health")
                    assert code == 0
                    wire = json.loads(out)
                    tg = wire["children"]["telegram:tg"]
                    if (
                        "lastUpdateAt" in tg
                        and "lastError" in tg
                        and tg["adapterState"] == "polling"
                    ):
                        break
                    await trio.sleep(0.1)
            assert wire["version"] == version("prismd")
            assert 0 <= wire["uptimeMs"] < 600_000
            assert abs(_iso_ms(wire["startedAt"]) + wire["uptimeMs"] - time.time() * 1000) < 10_000
            tg = wire["children"]["telegram:tg"]
            assert (tg["state"], tg["mode"], tg["adapterState"]) == (
                "running",
                "polling",
                "polling",
            )
            assert tg["lastError"] == "Bot API error 502"
            assert _iso_ms(tg["lastUpdateAt"]) <= time.time() * 1000
            assert _iso_ms(tg["lastErrorAt"]) <= time.time() * 1000
            assert wire["children"]["webchat:web"]["listener"] == "listening"

            code, out = await _prismctl(layout.control, "health")
            assert code == 0
            lines = out.splitlines()
            pairs = dict(line.split(None, 1) for line in lines)
            assert [line.split()[0] for line in lines[:3]] == ["version", "uptime", "instance"]
            assert pairs["version"] == version("prismd")
            assert pairs["uptime"].endswith(" UTC)") and "(since " in pairs["uptime"]
            assert pairs["children.telegram:tg.mode"] == "polling"
            assert pairs["children.telegram:tg.lastUpdateAt"] == tg["lastUpdateAt"]
            assert pairs["children.telegram:tg.lastError"] == "Bot API error 502"

            async with httpx.AsyncClient() as client:
                scraped = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
            assert 'key="mode",value="polling"' in scraped
            for detail in ("lastUpdateAt", "lastError", "lastErrorAt"):
                assert detail not in scraped
            assert fake.token not in out + scraped
            daemon.send(15)
            assert await daemon.wait_exit() == 0
        nursery.cancel_scope.cancel()
