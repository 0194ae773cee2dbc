"""`prismd telegram set-webhook|delete-webhook` as a real subprocess against the fake Bot API."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import trio

from tests.fakes.telegram_api import start_fake

from .helpers import child_env

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser

SECRET = "hook-secret_0123"


def _config(tmp_path: Path, origin: str) -> Path:
    path = tmp_path / "prismd.toml"
    path.write_text(
        f"""
[[connections]]
id = "tg"
kind = "telegram"
token_env = "TG_TOKEN"
api_origin = "{origin}"
mode = "webhook"
webhook_secret_env = "TG_HOOK_SECRET"

[agents.echo]
kind = "echo"

[[grants]]
connection = "tg"
pairing = true
aliases = ["echo"]
"""
    )
    return path


async def _prismd(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[int, str]:
    with trio.fail_after(60):
        done = await trio.run_process(
            [sys.executable, "-m", "prismd", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=env,
            cwd=str(tmp_path),
        )
    return done.returncode, done.stdout.decode() + done.stderr.decode()


async def test_set_and_delete_webhook(tmp_path: Path) -> None:
    async with trio.open_nursery() as nursery:
        fake = await start_fake(nursery)
        config = str(_config(tmp_path, fake.origin))
        env = child_env(TG_TOKEN=fake.token, TG_HOOK_SECRET=SECRET)
        code, out = await _prismd(
            tmp_path,
            env,
            "telegram",
            "set-webhook",
            "--config",
            config,
            "--url",
            "https://bot.example.test/telegram/tg",
        )
        assert code == 0, out
        assert "tg: webhook set" in out
        assert fake.webhook_url == "https://bot.example.test/telegram/tg"
        assert fake.webhook_secret == SECRET

        code, out = await _prismd(tmp_path, env, "telegram", "delete-webhook", "--config", config)
        assert code == 0, out
        assert fake.webhook_url == ""

        # Bad token: Telegram refuses (exit 1); neither token is ever printed.
        bad_env = child_env(TG_TOKEN="999:wrong-token-value", TG_HOOK_SECRET=SECRET)
        code, out = await _prismd(
            tmp_path, bad_env, "telegram", "delete-webhook", "--config", config
        )
        assert code == 1, out
        assert "wrong-token-value" not in out and fake.token not in out
        nursery.cancel_scope.cancel()


async def test_config_problems_exit_2(tmp_path: Path) -> None:
    env = child_env()
    code, out = await _prismd(
        tmp_path, env, "telegram", "delete-webhook", "--config", str(tmp_path / "missing.toml")
    )
    assert code == 2 and "file not found" in out
    config = str(_config(tmp_path, "http://127.0.0.1:9"))
    # The token variable is not set.
    code, out = await _prismd(tmp_path, env, "telegram", "delete-webhook", "--config", config)
    assert code == 2 and "TG_TOKEN" in out
    # set-webhook needs an https:// URL.
    env = child_env(TG_TOKEN="1:x", TG_HOOK_SECRET=SECRET)
    code, out = await _prismd(
        tmp_path, env, "telegram", "set-webhook", "--config", config, "--url", "http://x"
    )
    assert code == 2 and "https://" in out
