"""sd_notify over a real AF_UNIX datagram socket."""

from __future__ import annotations

import io
import os
import socket
from pathlib import Path

import pytest
import trio

from prismd.daemon import _sdnotify as sdnotify
from prismd.journal import NS_OPERATION
from tests.support.builders import write


def _receiver(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(5)
    return sock


def test_notify_sends_each_state_to_a_path_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify.sock")
    with _receiver(path) as sock:
        env = {"NOTIFY_SOCKET": path}
        for state in ("READY=1", "WATCHDOG=1", "STOPPING=1"):
            assert sdnotify.notify(state, env=env) is True
            assert sock.recv(256) == state.encode()


def test_notify_supports_abstract_socket_names() -> None:
    name = f"prismd-test-{os.getpid()}-{id(object())}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": "@" + name}) is True
        assert sock.recv(64) == b"READY=1"


def test_notify_never_raises(tmp_path: Path) -> None:
    assert sdnotify.notify("READY=1", env={}) is False
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": "relative/path"}) is False
    missing = str(tmp_path / "gone.sock")
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": missing}) is False
    # A path that is not a socket at all.
    plain = tmp_path / "plain"
    plain.write_text("x")
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": str(plain)}) is False


def test_notify_reads_the_process_environment(tmp_path: Path) -> None:
    path = str(tmp_path / "env.sock")
    with _receiver(path) as sock:
        os.environ["NOTIFY_SOCKET"] = path
        try:
            assert sdnotify.notify("STOPPING=1") is True
        finally:
            del os.environ["NOTIFY_SOCKET"]
        assert sock.recv(64) == b"STOPPING=1"


def test_watchdog_interval_is_half_of_watchdog_usec() -> None:
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "20000000"}) == 10.0
    pid = str(os.getpid())
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": pid}) == 1.5


def test_watchdog_interval_off_cases() -> None:
    assert sdnotify.watchdog_interval({}) is None
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "abc"}) is None
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "0"}) is None
    other = str(os.getpid() + 1)
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": other}) is None
    assert sdnotify.watchdog_interval({"WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "x"}) is None


async def test_notify_never_blocks_the_event_loop_when_the_receiver_is_full(
    tmp_path: Path,
) -> None:
    """A stalled systemd (its datagram queue full) must not wedge the Trio loop: once
    the queue is full, ``notify`` gives up at once instead of blocking in ``send``."""
    path = tmp_path / "full.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(path))
    try:
        env = {"NOTIFY_SOCKET": str(path)}

        def flood() -> list[bool]:
            return [sdnotify.notify("WATCHDOG=1", env=env) for _ in range(5000)]

        with trio.fail_after(10):
            results = await trio.to_thread.run_sync(flood, abandon_on_cancel=True)
        assert results[0] is True
        assert results[-1] is False  # the queue filled up; nothing blocked
    finally:
        receiver.close()


def test_status_is_one_status_assignment() -> None:
    assert sdnotify.status("ready: 2 connections, 0 unresolved") == (
        "STATUS=ready: 2 connections, 0 unresolved"
    )
    # A newline would start a second assignment (READY=1 from a message text): folded.
    assert sdnotify.status("failed: a\nREADY=1\n") == "STATUS=failed: a READY=1"


async def _datagrams_until(sock: trio.socket.SocketType, last: str, into: list[str]) -> None:
    with trio.fail_after(20):
        while last not in into:
            into.extend((await sock.recv(4096)).decode().splitlines())


async def _leave_executing(url: str, operation_id: str) -> None:
    """An operation a crash left ``executing`` (what ``list-unresolved`` shows)."""
    from prismd.journal._journal import ChannelJournal
    from prismd.journal._records import OperationRecord
    from stores import OwnershipScope, open_store

    async with open_store(url) as store:
        await write(
            ChannelJournal(store.checkpoints),
            NS_OPERATION,
            OwnershipScope(tenant_id="default", account_id="web", user_id="actor-1"),
            OperationRecord(
                operation_id=operation_id,
                event_id=operation_id,
                kind="message",
                connection_id="web",
                external_conversation_id="conv-1",
                external_actor_id="actor-1",
                agent_alias="echo",
                state="executing",
                created_at_ms=1,
                updated_at_ms=1,
            ),
        )


async def test_daemon_tells_systemd_its_status_through_a_real_notify_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What ``systemctl status`` shows: starting → ready with counts → stopping, each
    line a datagram on $NOTIFY_SOCKET. An unresolved operation left by an earlier run is
    counted, and one that appears while serving updates the line."""
    import prismd.daemon._serving as daemon_module
    from prismd.daemon._daemon import Daemon

    from .helpers import inprocess_config

    monkeypatch.setattr(daemon_module, "STATUS_REFRESH_S", 0.05)
    config = inprocess_config(tmp_path)
    await _leave_executing(config.store.url, "chan-op-left-by-a-crash")
    path = str(tmp_path / "notify.sock")
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    await sock.bind(path)
    states: list[str] = []
    with sock:
        daemon = Daemon(
            config, env={"NOTIFY_SOCKET": path}, install_signals=False, out=io.StringIO()
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(daemon.run)
            await _datagrams_until(sock, "READY=1", states)
            # A second store handle on the same SQLite file, as another process would be.
            await _leave_executing(config.store.url, "chan-op-while-serving")
            await _datagrams_until(sock, "STATUS=ready: 1 connection, 2 unresolved", states)
            daemon.request_stop()
            await _datagrams_until(sock, "STOPPING=1", states)
    assert states == [
        "STATUS=starting",
        "STATUS=ready: 1 connection, 1 unresolved",
        "READY=1",
        "STATUS=ready: 1 connection, 2 unresolved",
        "STATUS=stopping",
        "STOPPING=1",
    ]


async def test_a_fatal_start_says_why_in_the_status(tmp_path: Path) -> None:
    from prismd.daemon._daemon import Daemon

    from .helpers import inprocess_config

    control = {"socket": str(tmp_path / "run" / "c.sock"), "group": "no-such-group-7f3a"}
    config = inprocess_config(tmp_path, control=control)
    path = str(tmp_path / "notify.sock")
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    await sock.bind(path)
    states: list[str] = []
    with sock:
        daemon = Daemon(
            config, env={"NOTIFY_SOCKET": path}, install_signals=False, out=io.StringIO()
        )
        with trio.fail_after(20):
            assert await daemon.run() == 1
        failed = "STATUS=failed: [control].group: no such group 'no-such-group-7f3a'"
        await _datagrams_until(sock, failed, states)
    assert states == ["STATUS=starting", failed]
