"""``prismd run`` with a Discord connection: ``prismctl health`` shows the gateway state;
a bad token stops the connection (failed, stored) while the daemon keeps running."""

from __future__ import annotations

import datetime
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from tests.daemon.helpers import Layout, free_port, prismctl, running_daemon
from tests.fakes.discord_api import FakeDiscord
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

TOKEN = "discord-bot-token-secret"


def _config(root: Path, fake: FakeDiscord, metrics_port: int = 0) -> Layout:
    layout = Layout(root=root, port=free_port())
    metrics = f'[metrics]\nlisten = "127.0.0.1:{metrics_port}"' if metrics_port else ""
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
{metrics}
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
                # The gateway's own times: its last event, and when the session began.
                assert after["lastEventAt"].endswith("Z")
                assert after["sessionStartedAt"].endswith("Z")
                assert after["sessionStartedAt"] <= after["lastEventAt"]
            else:
                entry = await _connection(layout, "failed")
                assert entry["state"] == "failed"
                assert "sessionStartedAt" not in entry
                # Why, in health too (the close code's fixed words, never the token).
                assert "token" in entry["lastError"], entry
                code, _health, _err = await prismctl(layout, "health")
                assert code == 0  # the daemon runs on
                assert "token" in daemon.stderr()  # the log says why
            daemon.send(signal.SIGTERM)
            assert await daemon.wait_exit() == 0, daemon.stderr()
            assert token not in daemon.stderr()
    assert 1000 not in fake.gateway.client_close_codes


async def test_a_restart_resumes_the_session_its_age_kept_and_metrics_show_the_gateway(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    """``prismctl health`` and ``/metrics`` per connection: the gateway's state (connected,
    resuming, failed), its last event and the session's start, which a SIGKILL and a
    restart (a resume, not a new session) keep."""
    fake = FakeDiscord(token=TOKEN, heartbeat_interval_ms=500)
    await nursery.start(fake.serve)
    metrics_port = free_port()
    layout = _config(tmp_path, fake, metrics_port)
    env = {"PRISM_TEST_DISCORD_TOKEN": TOKEN}
    with trio.fail_after(50):
        async with running_daemon(layout, tag="first", extra_env=env) as daemon:
            await daemon.wait_state("READY=1")
            first = await _connection(layout, "connected")
            daemon.send(signal.SIGKILL)
            await daemon.wait_exit()
        async with running_daemon(layout, tag="second", extra_env=env) as daemon:
            await daemon.wait_state("READY=1")
            second = await _connection(layout, "connected")
            await trio.sleep(1.2)  # a heartbeat ACK or two later
            third = await _connection(layout, "connected")
            found = samples(await _scrape(metrics_port))
            daemon.send(signal.SIGTERM)
            assert await daemon.wait_exit() == 0, daemon.stderr()
    # One session: the restart resumed it (a heartbeat ACK late under a loaded machine may
    # make a second, zombie, resume of the same session: still no new identify).
    assert len(fake.gateway.identifies()) == 1 and fake.gateway.resumes
    assert {(session, how) for session, _seq, how in fake.gateway.resumes} == {
        (fake.gateway.resumes[0][0], "replayed")
    }
    assert second["sessionStartedAt"] == first["sessionStartedAt"]  # the same session
    assert third["lastEventAt"] > second["lastEventAt"] >= second["sessionStartedAt"]
    children = {dict(labels)["child"] for name, labels in found if name == "prismd_child_state"}
    name = next(c for c in children if c.endswith(":dc"))
    gateway = frozenset({("child", name), ("key", "adapterState"), ("value", "connected")})
    assert found[("prismd_child_health", gateway)] == 1
    started = found[("prismd_child_health_time_seconds", _labels(name, "sessionStartedAt"))]
    last = found[("prismd_child_health_time_seconds", _labels(name, "lastEventAt"))]
    assert iso_seconds(first["sessionStartedAt"]) == pytest.approx(started, abs=0.01)
    assert started <= last <= time.time()
    # Times are values, never labels (a label per millisecond would grow without bound).
    assert not any(
        dict(labels).get("key", "").endswith("At")
        for metric, labels in found
        if metric == "prismd_child_health"
    )


def _labels(child: str, key: str) -> frozenset[tuple[str, str]]:
    return frozenset({("child", child), ("key", key)})


def iso_seconds(text: str) -> float:
    return datetime.datetime.fromisoformat(text).timestamp()


async def _scrape(port: int) -> str:
    async with httpx.AsyncClient() as client:
        response = await client.get(f"http://127.0.0.1:{port}/metrics")
    assert response.status_code == 200
    return response.text


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """``{(metric name, labels): value}`` of a Prometheus text exposition."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return out
