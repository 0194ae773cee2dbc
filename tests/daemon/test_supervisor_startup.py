"""Startup failures and early signals: a clear one-line message, or a clean exit 0."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

import prismd.daemon._startup as daemon_module
from prismd.daemon._config import Config, parse_config
from prismd.daemon._daemon import Daemon
from prismd.daemon._supervisor import RestartPolicy
from prismd.daemon._wiring import build_adapter

from .helpers import Layout, chat, child_env, free_port, running_daemon, wait_runs, write_config
from .helpers import inprocess_config as _config

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser

SECRET = "SuperSecretValue-0123456789"


async def _run(config: Config, env: dict[str, str]) -> tuple[int, str]:
    out = io.StringIO()
    notes: list[str] = []
    daemon = Daemon(config, env=env, install_signals=False, notify=notes.append, out=out)
    with trio.fail_after(30):
        code = await daemon.run()
    assert "READY=1" not in notes
    return code, out.getvalue()


async def test_invalid_telegram_webhook_secret_is_a_one_line_failure_without_the_secret(
    tmp_path: Path,
) -> None:
    config = _config(
        tmp_path,
        connections=[
            {
                "id": "tg",
                "kind": "telegram",
                "token_env": "PRISMD_T_TOKEN",
                "mode": "webhook",
                "webhook_listen": "127.0.0.1:0",
                "webhook_secret_env": "PRISMD_T_HOOK",
            }
        ],
        grants=[{"connection": "tg", "actors": ["*"], "aliases": ["echo"]}],
    )
    env = {"PRISMD_T_TOKEN": "123456:" + SECRET, "PRISMD_T_HOOK": "bad secret! " + SECRET}
    code, out = await _run(config, env)
    assert code == 1
    assert out.count("\n") == 1 and out.startswith("prismd: ")
    assert "tg" in out and "webhook_secret" in out
    assert SECRET not in out


async def test_a_python_agent_factory_raising_is_a_one_line_failure_without_its_text(
    tmp_path: Path,
) -> None:
    config = _config(
        tmp_path,
        agents={
            "boom": {
                "kind": "python",
                "factory": "tests.daemon.helpers:failing_factory",
                "secret_text": SECRET,
            }
        },
        grants=[{"connection": "web", "actors": ["*"], "aliases": ["boom"]}],
    )
    code, out = await _run(config, {})
    assert code == 1
    assert out.count("\n") == 1 and "agents.boom" in out and "RuntimeError" in out
    assert SECRET not in out


def _slow_start_layout(tmp_path: Path, *, sleep_s: float) -> tuple[Layout, Path]:
    """A config whose second agent blocks the start for ``sleep_s`` after touching the
    returned marker file (see ``slow_start_mock``)."""
    marker = tmp_path / "opening.marker"
    layout = write_config(
        tmp_path,
        extra=f"""
[agents.late]
kind = "python"
factory = "tests.daemon.helpers:slow_start_mock"
marker_file = "{marker}"
sleep_s = {sleep_s}
""",
    )
    return layout, marker


async def _signal_while_opening(tmp_path: Path, signum: int) -> None:
    layout, marker = _slow_start_layout(tmp_path, sleep_s=1.5)
    async with running_daemon(layout) as daemon:
        with trio.fail_after(30):
            while not marker.exists():
                assert daemon.process.returncode is None, daemon.stderr()
                await trio.sleep(0.02)
        daemon.send(signum)
        code = await daemon.wait_exit(20)
        err = daemon.stderr()
        assert code == 0, err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err
        with trio.move_on_after(0.3):
            data = await daemon.notify.recv(4096)
            daemon.states.extend(data.decode().splitlines())
        assert "READY=1" not in daemon.states
    # Nothing half-written: the next start gets the lock and the store and serves.
    marker.unlink()
    async with running_daemon(layout, tag="again") as again:
        await again.wait_state("READY=1")
        again.send(signal.SIGTERM)
        assert await again.wait_exit(20) == 0, again.stderr()


async def test_sigterm_while_opening_exits_0_cleanly_and_a_restart_serves(
    tmp_path: Path,
) -> None:
    await _signal_while_opening(tmp_path, signal.SIGTERM)


async def test_sigint_while_opening_exits_0_without_a_traceback(tmp_path: Path) -> None:
    await _signal_while_opening(tmp_path, signal.SIGINT)


async def test_files_the_daemon_creates_are_not_world_readable_under_umask_022(
    tmp_path: Path,
) -> None:
    """The journal holds message text: a fresh clone's `make run` under the usual umask
    022 must not leave it (or the state files) readable by other users, even when the
    directory it lives in is world-traversable."""
    layout = write_config(tmp_path)
    os.chmod(tmp_path, 0o755)
    old = os.umask(0o022)
    try:
        async with running_daemon(layout) as daemon:
            await daemon.wait_state("READY=1")
            daemon.send(signal.SIGTERM)
            assert await daemon.wait_exit(20) == 0, daemon.stderr()
    finally:
        os.umask(old)
    for path in (layout.db, layout.state_dir, layout.state_dir / "instance-id"):
        assert stat.S_IMODE(path.stat().st_mode) & 0o007 == 0, (path, oct(path.stat().st_mode))
    assert stat.S_IMODE(layout.control.parent.stat().st_mode) == 0o700


def _live_leases(db: Path) -> list[tuple[str, str, str]]:
    now_ms = int(time.time() * 1000)
    with contextlib.closing(sqlite3.connect(db)) as conn:
        rows = conn.execute(
            "SELECT namespace, key, owner_id FROM prism_leases WHERE expires_at > ?", (now_ms,)
        ).fetchall()
    return [(str(a), str(b), str(c)) for a, b, c in rows]


async def test_sigterm_with_a_claimed_turn_leaves_no_live_lease_in_the_store(
    tmp_path: Path,
) -> None:
    layout = write_config(tmp_path, delay_ms=60_000, lease_ttl_ms=120_000)
    async with running_daemon(layout) as daemon:
        await daemon.wait_state("READY=1")
        async with chat(layout.port) as client:
            assert (await client.send_message("m1", "hello"))["status"] == "accepted"
            await wait_runs(layout, 1)
            assert _live_leases(layout.db), "a claimed turn holds a binding lease"
            daemon.send(signal.SIGTERM)
            assert (await client.next_frame("reply", limit_s=10))["kind"] == "notice"
        assert await daemon.wait_exit(20) == 0, daemon.stderr()
    assert _live_leases(layout.db) == []


async def test_sighup_while_opening_does_not_kill_the_daemon(tmp_path: Path) -> None:
    """logrotate's SIGHUP can come at any time; before the receiver runs it must not have
    its default effect (terminate)."""
    layout, marker = _slow_start_layout(tmp_path, sleep_s=0.5)
    async with running_daemon(layout) as daemon:
        with trio.fail_after(30):
            while not marker.exists():
                assert daemon.process.returncode is None, daemon.stderr()
                await trio.sleep(0.02)
        daemon.send(signal.SIGHUP)
        await daemon.wait_state("READY=1")
        daemon.send(signal.SIGTERM)
        assert await daemon.wait_exit(20) == 0, daemon.stderr()


def test_early_handlers_make_sighup_harmless_and_record_a_stop_request() -> None:
    script = (
        "import os, signal, time\n"
        "from prismd import daemon\n"
        "daemon.install_early_signal_handlers()\n"
        "os.kill(os.getpid(), signal.SIGHUP)\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(0.05)\n"
        "print('alive', daemon.take_early_signal() == signal.SIGTERM)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "alive True"


async def test_a_platform_that_is_down_at_start_does_not_hold_back_ready(tmp_path: Path) -> None:
    """Telegram unreachable at boot (network not up yet, outage): its adapter keeps
    retrying getMe, but the daemon must still become READY (systemd would otherwise kill
    it at TimeoutStartSec) and the web chat must serve."""
    closed = free_port()  # nothing listens here: every Bot API call is refused
    config = _config(
        tmp_path,
        connections=[
            {"id": "web", "kind": "webchat", "listen": "127.0.0.1:0"},
            {
                "id": "tg",
                "kind": "telegram",
                "token_env": "PRISMD_T_TOKEN",
                "api_origin": f"http://127.0.0.1:{closed}",
            },
        ],
    )
    out = io.StringIO()
    notes: list[str] = []
    daemon = Daemon(
        config,
        env={"PRISMD_T_TOKEN": "123456:" + SECRET},
        install_signals=False,
        notify=notes.append,
        out=out,
        adapter_ready_within_s=0.5,
    )
    codes: list[int] = []
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            codes.append(await daemon.run())

        nursery.start_soon(run)
        with trio.fail_after(15):
            await daemon.ready.wait()
        assert notes.count("READY=1") == 1
        # systemctl status says so too.
        assert "STATUS=ready: 2 connections (1 starting), 0 unresolved" in notes
        health = daemon.health()["children"]
        assert health["telegram:tg"]["state"] == "starting"
        assert health["webchat:web"]["state"] == "running"
        assert "telegram tg: (polling) [starting]" in out.getvalue()
        url = daemon.endpoints["webchat:web"]
        async with chat(int(url.rsplit(":", 1)[1].rstrip("/")), actor="boot-actor-1") as client:
            assert (await client.send_message("m1", "still here"))["status"] == "accepted"
            assert (await client.next_frame("reply"))["text"] == "still here"
        daemon.request_stop()
    assert codes == [0]
    assert SECRET not in out.getvalue()


async def test_health_keeps_the_adapters_own_state_next_to_the_supervisor_state(
    tmp_path: Path,
) -> None:
    """A rejected bot token stops the Telegram adapter for good: health must say why
    (the adapter's ``unauthorized``), not only the supervisor's ``failed``."""
    from tests.fakes.telegram_api import start_fake

    async with trio.open_nursery() as outer:
        fake = await start_fake(outer)
        config = _config(
            tmp_path,
            connections=[
                {"id": "web", "kind": "webchat", "listen": "127.0.0.1:0"},
                {"id": "tg", "kind": "telegram", "token_env": "T", "api_origin": fake.origin},
            ],
        )
        daemon = Daemon(
            config,
            env={"T": "999999:" + SECRET},
            install_signals=False,
            notify=lambda _s: None,
            out=io.StringIO(),
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(daemon.run)
            with trio.fail_after(15):
                await daemon.ready.wait()
            health = daemon.health()["children"]
            assert health["telegram:tg"]["state"] == "failed"
            assert health["telegram:tg"]["adapterState"] == "unauthorized"
            assert health["webchat:web"]["state"] == "running"
            assert health["webchat:web"]["listener"] == "listening"
            daemon.request_stop()
        outer.cancel_scope.cancel()


async def test_too_many_crashes_exit_1_settles_claimed_work_and_releases_leases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restart-intensity exit is a stop too: the claimed turn is settled (not left
    executing for a reconcile), leases are released, the store is closed."""
    from prismd.channel import InboundEvent
    from prismd.journal._journal import NS_OPERATION
    from stores import open_store

    crash = trio.Event()

    class CrashOnDemand:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            # The rest of the adapter protocol (features, aclose…) is the real adapter's.
            return getattr(self.inner, name)

        @property
        def connection_id(self) -> str:
            return str(self.inner.connection_id)

        async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            task_status.started()
            await crash.wait()
            raise RuntimeError("down")

        async def send(self, reply: Any) -> Any:
            return await self.inner.send(reply)

        def health(self) -> dict[str, str]:
            return {}

    real_build = build_adapter
    monkeypatch.setattr(
        daemon_module, "build_adapter", lambda *a, **k: CrashOnDemand(real_build(*a, **k))
    )
    config = _config(
        tmp_path,
        agents={"slow": {"kind": "mock", "delay_ms": 60_000}},
        grants=[{"connection": "web", "actors": ["*"], "aliases": ["slow"]}],
    )
    out = io.StringIO()
    daemon = Daemon(
        config,
        env={},
        install_signals=False,
        notify=lambda _s: None,
        out=out,
        policy=RestartPolicy(initial_backoff_s=0.01, jitter=0.0, max_restarts=2, window_s=60),
    )
    codes: list[int] = []
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            codes.append(await daemon.run())

        nursery.start_soon(run)
        with trio.fail_after(15):
            await daemon.ready.wait()
        assert daemon.runtime is not None
        event = InboundEvent(
            connection_id="web",
            external_conversation_id="conv-1",
            external_actor_id="actor-1",
            event_id="e1",
            text="work",
        )
        assert (await daemon.runtime.admit(event)).status == "accepted"
        with trio.fail_after(15):
            for _ in range(100_000):
                if daemon.runtime.diagnostics().active == 1:
                    break
                await trio.sleep(0.02)
        crash.set()
    assert codes == [1]
    assert "webchat:web crashed 3 times" in out.getvalue()
    async with open_store("sqlite:///" + str(tmp_path / "journal.sqlite")) as store:
        page = await store.checkpoints.list_checkpoints(namespace=NS_OPERATION)
        states = [str(item.value["state"]) for item in page.items]
    assert states == ["cancelled"]
    assert _live_leases(tmp_path / "journal.sqlite") == []


async def test_an_unknown_control_group_is_a_clear_startup_failure(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        control={"socket": str(tmp_path / "run" / "control.sock"), "group": "no-such-grp-7f3a"},
    )
    code, out = await _run(config, {})
    assert code == 1
    assert out.count("\n") == 1
    assert "control" in out and "group" in out and "no-such-grp-7f3a" in out
    assert "KeyError" not in out


@pytest.mark.parametrize(
    ("factory", "expected"),
    [
        # Found before anything is opened (the check check-config runs too).
        ("no_such_module_7f3a:make", "[agents.x].factory: cannot import module"),
        # Found when the agent is built (the factory raised).
        ("tests.daemon.helpers:failing_factory", "[agents.x]: building the agent failed"),
    ],
)
async def test_wiring_errors_name_the_config_file(
    tmp_path: Path, factory: str, expected: str
) -> None:
    source = str(tmp_path / "prismd.toml")
    config = parse_config(
        {
            "daemon": {"state_dir": str(tmp_path / "state")},
            "store": {"url": "sqlite:///" + str(tmp_path / "journal.sqlite")},
            "control": {"socket": str(tmp_path / "run" / "control.sock")},
            "connections": [{"id": "web", "kind": "webchat", "listen": "127.0.0.1:0"}],
            "agents": {"x": {"kind": "python", "factory": factory}},
            "grants": [{"connection": "web", "actors": ["*"], "aliases": ["x"]}],
        },
        source=source,
    )
    code, out = await _run(config, {})
    assert code == 1
    assert out.startswith(f"prismd: {source}: {expected}")
    assert out.count("\n") == 1


async def test_web_chat_port_in_use_names_the_address(tmp_path: Path) -> None:
    """`make run` while something else has 8787: the one line says which address."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = _config(
            tmp_path, connections=[{"id": "web", "kind": "webchat", "listen": f"127.0.0.1:{port}"}]
        )
        code, out = await _run(config, {})
    assert code == 1
    assert out.count("\n") == 1
    assert f"127.0.0.1:{port}" in out and "Address already in use" in out
