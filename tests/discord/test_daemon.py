"""``prismd run`` with a Discord connection: ``prismctl health`` shows the gateway state;
a bad token stops the connection (failed, stored) while the daemon keeps running."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.daemon.helpers import Layout, free_port, prismctl, running_daemon
from tests.fakes.discord_api import FakeDiscord
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

TOKEN = "discord-bot-token-secret"


def _config(root: Path, fake: FakeDiscord) -> Layout:
    layout = Layout(root=root, port=free_port())
    layout.config.write_text(
        f"""
[daemon]
state_dir = "{layout.state_dir}"

[store]
url = "sqlite:///{layout.db}"

[control]
socket = "{layout.control}"

[[connections]]
id = "dc"
kind = "discord"
token_env = "PRISM_TEST_DISCORD_TOKEN"
api_origin = "{fake.origin}"

[agents.echo]
kind = "echo"

[[grants]]
connection = "dc"
actors = ["*"]
aliases = ["echo"]
"""
    )
    return layout


async def _connection(layout: Layout, wanted: str) -> dict[str, Any]:
    while True:
        code, health, err = await prismctl(layout, "health")
        assert code == 0, err
        entry = next(v for k, v in health["children"].items() if "dc" in k)
        if entry.get("adapterState") == wanted:
            return dict(entry)
        await trio.sleep(0.2)


@pytest.mark.parametrize("token", [TOKEN, "a-token-discord-reset"])
async def test_health_shows_the_gateway_and_a_bad_token_fails_only_the_connection(
    token: str, tmp_path: Path, nursery: trio.Nursery
) -> None:
    fake = FakeDiscord(token=TOKEN)
    await nursery.start(fake.serve)
    layout = _config(tmp_path, fake)
    env = {"PRISM_TEST_DISCORD_TOKEN": token}
    with trio.fail_after(50):
        async with running_daemon(layout, tag="run", extra_env=env) as daemon:
            await daemon.wait_state("READY=1")
            if token == TOKEN:
                entry = await _connection(layout, "connected")
                assert entry["gateway"] == "resumable"
                fake.user_message("3000000000000000001", "2000000000000000001", "hi")
                await wait_until(lambda: bool(fake.bot_messages()))
                assert fake.bot_messages()[0]["content"] == "hi"
                assert "lastUpdateAt" not in entry  # none had come when it was read
                after = await _connection(layout, "connected")
                assert after["lastUpdateAt"].endswith("Z")
            else:
                entry = await _connection(layout, "failed")
                assert entry["state"] == "failed"
                code, _health, _err = await prismctl(layout, "health")
                assert code == 0  # the daemon runs on
                assert "token" in daemon.stderr()  # the log says why
            daemon.send(signal.SIGTERM)
            assert await daemon.wait_exit() == 0, daemon.stderr()
            assert token not in daemon.stderr()
    assert 1000 not in fake.gateway.client_close_codes
