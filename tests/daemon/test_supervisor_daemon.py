"""The daemon in-process: real runtime, SQLite, web chat, control socket, signals."""

from __future__ import annotations

import io
import json
import os
import signal
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

import prismd.daemon._logs as daemon_logs
import prismd.daemon._startup as daemon_module
from adapters.webchat import WebchatConnectionConfig
from prismd.channel import Reply, SendResult
from prismd.daemon._config import default_config
from prismd.daemon._daemon import Daemon
from prismd.daemon._supervisor import RestartPolicy
from prismd.daemon._wiring import build_adapter

from .helpers import chat
from .helpers import inprocess_config as _config

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser


def _port(daemon: Daemon) -> int:
    url = daemon.endpoints["webchat:web"]
    return int(url.rsplit(":", 1)[1].rstrip("/"))


async def _control(path: Path, method: str, params: dict[str, Any] | None = None) -> Any:
    with trio.fail_after(10):
        stream = await trio.open_unix_socket(str(path))
        async with stream:
            request = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params or {}}
            await stream.send_all(json.dumps(request).encode() + b"\n")
            buffer = b""
            while b"\n" not in buffer:
                chunk = await stream.receive_some(65536)
                assert chunk
                buffer += chunk
            return json.loads(buffer.split(b"\n", 1)[0])


async def test_daemon_serves_chat_and_control_then_stops_cleanly(tmp_path: Path) -> None:
    notes: list[str] = []
    out = io.StringIO()
    daemon = Daemon(_config(tmp_path), env={}, install_signals=False, notify=notes.append, out=out)
    async with trio.open_nursery() as nursery:
        codes: list[int] = []

        async def run() -> None:
            codes.append(await daemon.run())

        nursery.start_soon(run)
        with trio.fail_after(20):
            await daemon.ready.wait()
        assert notes == ["STATUS=starting", "STATUS=ready: 1 connection, 0 unresolved", "READY=1"]
        line = out.getvalue()
        assert f"http://127.0.0.1:{_port(daemon)}/" in line
        assert str(tmp_path / "run" / "control.sock") in line

        async with chat(_port(daemon), actor="inproc-actor-1") as client:
            admission = await client.send_message("m1", "hello daemon")
            assert admission["status"] == "accepted" and admission["duplicate"] is False
            reply = await client.next_frame("reply")
            assert reply["text"] == "hello daemon"
            again = await client.send_message("m1", "hello daemon")
            assert again["duplicate"] is True

        health = await _control(tmp_path / "run" / "control.sock", "health")
        assert "result" in health, health
        children = health["result"]["children"]
        assert children["webchat:web"] == {"listener": "listening", "state": "running"}
        assert children["control"]["state"] == "running"
        assert children["watchdog"]["state"] == "running"

        daemon.request_stop()
        with trio.fail_after(20):
            await daemon.stopped.wait()
    assert codes == [0]
    assert notes[-2:] == ["STATUS=stopping", "STOPPING=1"]
    # The lock was released: a new daemon may start on the same state directory.
    second = Daemon(_config(tmp_path), env={}, install_signals=False, notify=notes.append)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(second.run)
        with trio.fail_after(20):
            await second.ready.wait()
        second.request_stop()


async def test_sigterm_in_process_stops_with_exit_0(tmp_path: Path) -> None:
    notes: list[str] = []
    daemon = Daemon(_config(tmp_path), env={}, install_signals=True, notify=notes.append)
    codes: list[int] = []
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            codes.append(await daemon.run())

        nursery.start_soon(run)
        with trio.fail_after(20):
            await daemon.ready.wait()
        os.kill(os.getpid(), signal.SIGTERM)
        with trio.fail_after(20):
            await daemon.stopped.wait()
    assert codes == [0]
    assert notes[-1] == "STOPPING=1"


async def test_crashing_adapter_is_restarted_and_the_daemon_stays_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    crashes: list[int] = []
    restarted = trio.Event()

    class CrashOnce:
        """Wraps the real web chat adapter; its first run crashes after starting."""

        def __init__(self, inner: Any) -> None:
            self.inner = inner
            self.runs = 0

        def __getattr__(self, name: str) -> Any:
            # The rest of the adapter protocol (features, aclose…) is the real adapter's.
            return getattr(self.inner, name)

        @property
        def connection_id(self) -> str:
            return str(self.inner.connection_id)

        @property
        def bound(self) -> Any:
            return self.inner.bound

        async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            self.runs += 1
            if self.runs == 1:
                task_status.started()
                await trio.sleep(0.05)
                crashes.append(1)
                raise RuntimeError("adapter blew up with secret text")
            outer = task_status

            class Status:
                def started(self, value: Any = None) -> None:
                    outer.started()
                    restarted.set()

            await self.inner.run(task_status=Status())

        async def send(self, reply: Reply) -> SendResult:
            result: SendResult = await self.inner.send(reply)
            return result

        def health(self) -> dict[str, str]:
            return dict(self.inner.health())

    real_build = build_adapter

    def build(*args: Any, **kwargs: Any) -> Any:
        return CrashOnce(real_build(*args, **kwargs))

    monkeypatch.setattr(daemon_module, "build_adapter", build)
    out = io.StringIO()
    daemon = Daemon(
        _config(tmp_path),
        env={},
        install_signals=False,
        notify=lambda _s: None,
        out=out,
        policy=RestartPolicy(initial_backoff_s=0.05, jitter=0.0),
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(daemon.run)
        with trio.fail_after(20):
            await daemon.ready.wait()
            await restarted.wait()
        assert crashes == [1]
        child = daemon.supervisor.children["webchat:web"]
        assert child.restarts == 1 and child.state == "running"
        assert daemon.adapters is not None
        web = daemon.adapters["web"]
        assert isinstance(web, CrashOnce)
        async with chat(web.bound[1], actor="inproc-actor-2") as client:
            assert (await client.send_message("m1", "still up"))["status"] == "accepted"
            assert (await client.next_frame("reply"))["text"] == "still up"
        daemon.request_stop()


async def test_unopenable_store_is_a_clean_startup_failure(tmp_path: Path) -> None:
    out = io.StringIO()
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    config = _config(tmp_path, store={"url": "sqlite:///" + str(blocker / "j.sqlite")})
    daemon = Daemon(config, env={}, install_signals=False, notify=lambda _s: None, out=out)
    with trio.fail_after(20):
        assert await daemon.run() == 1
    # The store's own reason, once (the path is the operator's, not a secret).
    assert out.getvalue() == (
        f"prismd: cannot open the store: SQLite store {blocker / 'j.sqlite'}: "
        "cannot create its directory (FileExistsError)\n"
    )


async def test_watchdog_pings_at_half_of_watchdog_usec(tmp_path: Path) -> None:
    notes: list[str] = []
    daemon = Daemon(
        _config(tmp_path),
        env={"WATCHDOG_USEC": "100000"},
        install_signals=False,
        notify=notes.append,
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(daemon.run)
        with trio.fail_after(20):
            await daemon.ready.wait()
        await trio.sleep(0.3)
        daemon.request_stop()
    pings = notes.count("WATCHDOG=1")
    # 50 ms interval over ~0.3 s (plus startup): several pings, and not a busy loop.
    assert 3 <= pings <= 40, notes
    assert notes.index("READY=1") < notes.index("STOPPING=1")


async def test_an_adapter_crashing_too_often_ends_the_daemon_with_exit_1(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class AlwaysCrash:
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
            await trio.sleep(0.01)
            raise RuntimeError("token 123456:ABCDEFGHIJKLMNOPQRSTUVWXYZabcdef0123")

        async def send(self, reply: Reply) -> SendResult:
            return SendResult(False, reason="down")

        def health(self) -> dict[str, str]:
            return {}

    real_build = build_adapter
    monkeypatch.setattr(
        daemon_module, "build_adapter", lambda *a, **k: AlwaysCrash(real_build(*a, **k))
    )
    out = io.StringIO()
    notes: list[str] = []
    daemon = Daemon(
        _config(tmp_path),
        env={},
        install_signals=False,
        notify=notes.append,
        out=out,
        policy=RestartPolicy(initial_backoff_s=0.01, jitter=0.0, max_restarts=3, window_s=60),
    )
    with trio.fail_after(20):
        assert await daemon.run() == 1
    text = out.getvalue()
    assert "webchat:web crashed 4 times within 60 s; giving up" in text
    assert "123456:" not in text
    assert daemon.supervisor.children["webchat:web"].state == "failed"
    assert [n for n in notes if not n.startswith("STATUS=")] == ["READY=1", "STOPPING=1"]
    # systemctl status says why it is going down (the same one line as stderr).
    assert notes[-2:] == [
        "STATUS=failed: webchat:web crashed 4 times within 60 s; giving up "
        "(see the log lines above for each crash)",
        "STOPPING=1",
    ]


async def test_sighup_keeps_serving_and_reopens_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reopened = trio.Event()
    monkeypatch.setattr(daemon_logs, "reopen", reopened.set)
    daemon = Daemon(_config(tmp_path), env={}, install_signals=True, notify=lambda _s: None)
    codes: list[int] = []
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            codes.append(await daemon.run())

        nursery.start_soon(run)
        with trio.fail_after(20):
            await daemon.ready.wait()
        os.kill(os.getpid(), signal.SIGHUP)
        with trio.fail_after(10):
            await reopened.wait()
        assert not daemon.stopped.is_set()
        async with chat(_port(daemon), actor="inproc-actor-3") as client:
            assert (await client.send_message("m1", "after hup"))["status"] == "accepted"
        os.kill(os.getpid(), signal.SIGINT)
    assert codes == [0]


async def test_default_config_runs_under_var_in_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `make run` uses: SQLite, state and control socket under ./var, echo agent."""
    monkeypatch.chdir(tmp_path)
    config = default_config({})
    (web,) = config.connections
    assert isinstance(web, WebchatConnectionConfig)
    config = attrs.evolve(config, connections=(attrs.evolve(web, listen="127.0.0.1:0"),))
    out = io.StringIO()
    daemon = Daemon(config, env={}, install_signals=False, notify=lambda _s: None, out=out)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(daemon.run)
        with trio.fail_after(20):
            await daemon.ready.wait()
        assert (tmp_path / "var" / "instance-id").is_file()
        assert (tmp_path / "var" / "journal.sqlite").is_file()
        assert (tmp_path / "var" / "run" / "control.sock").is_socket()
        assert "control socket: var/run/control.sock" in out.getvalue()
        assert f"web chat web: http://127.0.0.1:{_port(daemon)}/" in out.getvalue()
        async with chat(_port(daemon), actor="default-actor-1") as client:
            assert (await client.send_message("m1", "echo me"))["status"] == "accepted"
            assert (await client.next_frame("reply"))["text"] == "echo me"
        daemon.request_stop()
    assert not (tmp_path / "var" / "run" / "control.sock").exists()


async def test_pairing_through_the_control_socket_grants_the_actor(tmp_path: Path) -> None:
    config = _config(
        tmp_path,
        grants=[{"connection": "web", "pairing": True, "aliases": ["echo"]}],
    )
    daemon = Daemon(config, env={}, install_signals=False, notify=lambda _s: None)
    socket_path = tmp_path / "run" / "control.sock"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(daemon.run)
        with trio.fail_after(20):
            await daemon.ready.wait()
        async with chat(_port(daemon), actor="pairing-actor-1") as client:
            refused = await client.send_message("m1", "hello before pairing")
            assert refused["status"] == "denied"
            ticket = await _control(socket_path, "pair", {"connectionId": "web"})
            assert "result" in ticket, ticket
            token = ticket["result"]["token"]
            paired = await client.send_message("m2", f"/pair {token}")
            assert paired["status"] == "accepted"
            await client.next_frame("reply")
            hello = await client.send_message("m3", "hello after pairing")
            assert hello["status"] == "accepted" and hello["duplicate"] is False
            reply = await client.next_frame("reply")
            while reply.get("inReplyTo") != "m3":
                reply = await client.next_frame("reply")
            assert reply["text"] == "hello after pairing"
        daemon.request_stop()
