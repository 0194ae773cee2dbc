"""The control socket's connection limits: a request line must arrive whole before its
deadline (a client dripping a byte a second is closed there), refused uids are logged once
per interval and cannot starve operators, operator connections are bounded."""

from __future__ import annotations

import grp
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from prismd.control import ControlConfig, Operator
from prismd.control._server import MAX_OPERATOR_CONNECTIONS
from tests.support.flood import drip
from tests.support.privileges import needs_root

from .test_control_support import connect, running_server

HEALTH = b'{"jsonrpc":"2.0","id":1,"method":"health"}\n'


def control(tmp_path: Path, **kwargs: object) -> ControlConfig:
    return ControlConfig(socket=str(tmp_path / "run" / "control.sock"), **kwargs)  # type: ignore[arg-type]


def refusal_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if "control connection refused" in r.getMessage()
    ]


async def test_a_client_dripping_a_byte_a_second_is_closed_at_its_deadline(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    """The deadline counts the whole request line, not each read: each byte arrives well
    within 5 s, the line would take 42 s, the connection ends at 5 s unanswered."""
    config = control(tmp_path, idle_timeout_ms=5000)
    with trio.fail_after(120):
        async with running_server(config) as (runtime, _store):
            async with connect(config.socket) as client, trio.open_nursery() as nursery:
                started = trio.current_time()
                nursery.start_soon(drip, client.stream, HEALTH, 1.0)
                assert await client.read_line() is None
                closed_after = trio.current_time() - started
                nursery.cancel_scope.cancel()
            assert 5.0 <= closed_after < 6.0
            assert runtime.calls == []
            # Each line gets its own deadline: a prompt client is answered, twice.
            async with connect(config.socket) as client:
                assert (await client.result("health"))["status"] == "ok"
                await trio.sleep(4)
                assert (await client.result("health"))["status"] == "ok"


async def test_refused_connections_are_logged_once_per_interval_per_uid(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, autojump_clock: trio.abc.Clock
) -> None:
    caplog.set_level(logging.INFO)
    config = control(tmp_path)
    uid = os.getuid()
    with trio.fail_after(600):
        async with running_server(config, daemon_uid=uid + 1) as (runtime, _store):
            for _ in range(100):
                async with connect(config.socket) as client:
                    await client.send_raw(HEALTH)
                    assert (await client.read_message())["error"]["code"] == -32001
                    assert await client.read_line() is None
            assert refusal_lines(caplog) == [f"control connection refused for uid {uid}"]
            await trio.sleep(61)
            async with connect(config.socket) as client:
                assert (await client.read_message())["error"]["code"] == -32001
            assert runtime.calls == []
    assert refusal_lines(caplog)[1:] == [
        f"control connection refused for uid {uid} (99 more since the last line)"
    ]


async def ask_health(path: str) -> bytes | None:
    """The answer to a health request, ``None`` when the server closed unanswered."""
    async with connect(path) as client:
        try:
            await client.send_raw(HEALTH)
        except trio.BrokenResourceError:
            return None
        return await client.read_line()


async def test_operator_connections_are_bounded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Past the cap a connection is closed at accept (logged once); a freed place is used."""
    config = control(tmp_path)
    with trio.fail_after(20):
        async with running_server(config):
            held = [
                await trio.open_unix_socket(config.socket) for _ in range(MAX_OPERATOR_CONNECTIONS)
            ]
            try:
                assert await ask_health(config.socket) is None  # closed unanswered
                await held.pop().aclose()
                for _ in range(1000):  # until the server saw the close
                    line = await ask_health(config.socket)
                    if line is not None:
                        break
                    await trio.sleep(0.01)
                assert line is not None
                assert json.loads(line)["result"]["status"] == "ok"
            finally:
                for stream in held:
                    await stream.aclose()
    full = [r.getMessage() for r in caplog.records if "the cap" in r.getMessage()]
    assert full and full[0].startswith(
        f"control socket: {MAX_OPERATOR_CONNECTIONS} operator connections, the cap"
    )


# ---------------------------------------------------------------- a second uid, for real

as_nobody = needs_root("floods the socket as uid 65534 (nobody) while an operator connects")

FLOOD = r"""
import socket, sys
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    try:
        s.sendall(b'{"jsonrpc":"2.0","id":1,"method":"health"}\n')
    except OSError:
        pass  # beyond the refused budget the server closes at once: a broken pipe here
    held.append(s)
print("held", flush=True)
sys.stdin.readline()
answered = 0
for s in held:
    s.settimeout(5)
    try:
        answered += b"permission denied" in s.recv(65536)
    except OSError:
        pass
print(answered, flush=True)
"""


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    # tmp_path lives under a 0700 directory; the nobody user needs to reach the socket.
    path = Path(tempfile.mkdtemp(prefix="prismd-control-"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def read_line(stream: trio.abc.ReceiveStream) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        chunk = await stream.receive_some(1)
        assert chunk, "the flood process ended early"
        line += chunk
    return line[:-1]


@as_nobody
async def test_a_flood_of_refused_connections_cannot_starve_an_operator(
    shared_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """300 connections of a refused uid held open: the operator is still served, the flood
    is answered only as far as its own small budget reaches, and logged once."""
    caplog.set_level(logging.INFO)
    config = ControlConfig(
        socket=str(shared_dir / "run" / "control.sock"),
        group=grp.getgrgid(65534).gr_name,
        operators=(Operator(uid=os.getuid()),),
    )
    python = shutil.which("python3", path="/usr/bin") or sys.executable
    with trio.fail_after(30):
        async with running_server(config, daemon_uid=os.getuid()) as (runtime, _store):
            flood = await trio.lowlevel.open_process(
                [python, "-I", "-c", FLOOD, config.socket, "300"],
                user=65534,
                group=65534,
                extra_groups=[],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            try:
                assert flood.stdout is not None and flood.stdin is not None
                assert await read_line(flood.stdout) == b"held"
                async with connect(config.socket) as client:
                    assert (await client.result("health"))["status"] == "ok"
                await flood.stdin.send_all(b"\n")
                answered = int(await read_line(flood.stdout))
            finally:
                flood.kill()
                await flood.wait()
            assert runtime.calls == []
    assert 1 <= answered < 300  # the first ones got their error; the rest were closed
    assert refusal_lines(caplog) == ["control connection refused for uid 65534"]
