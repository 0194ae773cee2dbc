"""prismctl as a Unix tool, tested with real subprocesses and real signals: Ctrl-C is a
quiet exit 130 (``events --follow`` and ``chat`` included), a closed pipe is quiet, the
socket search says where it looked, a refused connection asks whether prismd runs, the
events table never cuts the kind, and a mistyped command gets "did you mean"."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest
import trio

from stores import OwnershipScope
from tests.webchat._stack import chat_stack

from .test_control_support import running_server
from .test_prismctl import DEADLINE, PRISMCTL, config_for, prismctl

pytestmark = pytest.mark.slow  # real subprocesses and signals


async def _read_until(process: trio.Process, wanted: bytes) -> bytes:
    assert process.stdout is not None
    seen = b""
    while wanted not in seen:
        chunk = await process.stdout.receive_some(65536)
        assert chunk, f"prismctl exited early: {seen!r}"
        seen += chunk
    return seen


async def _interrupt(process: trio.Process) -> tuple[int, str]:
    """SIGINT as a terminal's Ctrl-C sends it; the exit code and whatever went to stderr."""
    assert process.stderr is not None
    process.send_signal(signal.SIGINT)
    err = b""
    while chunk := await process.stderr.receive_some(65536):
        err += chunk
    return await process.wait(), err.decode()


async def test_ctrl_c_ends_events_follow_quietly(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    with trio.fail_after(DEADLINE):
        async with running_server(config) as (_, store):
            await store.checkpoints.save_checkpoint(
                namespace="ns", key="k1", scope=OwnershipScope("default"), version=1, value=1
            )
            process = await trio.lowlevel.open_process(
                [*PRISMCTL, "--socket", config.socket, "events", "--follow"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            try:
                await _read_until(process, b"k1\n")
                code, err = await _interrupt(process)
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
    assert (code, err) == (130, "")


async def test_ctrl_c_ends_chat_quietly(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        async with chat_stack() as (adapter, _):
            assert adapter.bound is not None
            url = f"http://127.0.0.1:{adapter.bound[1]}/"
            read_end, write_end = os.pipe()  # stdin stays open: a person at the terminal
            try:
                process = await trio.lowlevel.open_process(
                    [*PRISMCTL, "chat", "--url", url, "--actor", "interrupted-actor-1"],
                    stdin=read_end,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env={**os.environ, "XDG_STATE_HOME": str(tmp_path)},
                )
            finally:
                os.close(read_end)
            try:
                # Interrupted once the chat said it is connected (the server counts the
                # socket open before the client has read its ``ready`` and said so).
                assert process.stderr is not None
                said = b""
                while b"Ctrl-D to quit\n" not in said:
                    chunk = await process.stderr.receive_some(65536)
                    assert chunk, f"prismctl chat exited early: {said!r}"
                    said += chunk
                assert adapter.statistics().open_sockets
                code, rest = await _interrupt(process)
                err = said.decode() + rest
            finally:
                os.close(write_end)
                if process.returncode is None:
                    process.kill()
                    await process.wait()
    assert code == 130
    # Only what the chat said when it connected: no traceback, no "KeyboardInterrupt".
    assert err.splitlines() == [
        f"connected to ws://127.0.0.1:{adapter.bound[1]}/ws as interrupted-actor-1;"
        " type a message, Ctrl-D to quit"
    ], err


async def test_chat_to_a_daemon_that_is_down_asks_whether_it_runs() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with trio.fail_after(DEADLINE):
        code, _, err = await prismctl("chat", "--url", f"http://127.0.0.1:{port}/")
    assert code == 1
    assert err == (
        f"prismctl chat: cannot connect to ws://127.0.0.1:{port}/ws: connection refused"
        " — is prismd running?\n"
    )


async def test_a_closed_pipe_is_quiet(tmp_path: Path) -> None:
    """``prismctl health | head -1`` with more output than a pipe holds: prismctl is cut
    off mid-write and says nothing about it (exit 141, as a tool killed by SIGPIPE)."""
    config = config_for(tmp_path)
    children = {f"child-{n:05}": {"state": "running"} for n in range(4000)}
    with trio.fail_after(DEADLINE):
        async with running_server(config, health={"status": "ok", "children": children}):
            script = (
                f"{' '.join(PRISMCTL)} --socket {config.socket} health | head -1;"
                " echo ${PIPESTATUS[0]} >&2"
            )
            done = await trio.run_process(
                ["bash", "-c", script], capture_stdout=True, capture_stderr=True, check=False
            )
    assert done.stdout.decode() == "status    ok\n" or done.stdout.decode().startswith("status")
    assert len(done.stdout.decode().splitlines()) == 1
    assert done.stderr.decode() == "141\n"


async def test_the_socket_search_says_where_it_looked(tmp_path: Path) -> None:
    env = {"PRISMD_CONTROL_SOCKET": ""}
    with trio.fail_after(DEADLINE):
        code, out, err = await prismctl("health", env=env, cwd=tmp_path)
    assert (code, out) == (1, "")
    assert err == (
        "prismctl: no control socket found: is prismd running? Tried:\n"
        f"  var/run/control.sock  (make run's, relative to {tmp_path})\n"
        "  /run/prismd/control.sock  (the systemd unit's)\n"
        "Name it with --socket PATH or PRISMD_CONTROL_SOCKET=PATH (or --config FILE for"
        " that config's [control].socket).\n"
    )


async def test_the_config_names_the_socket(tmp_path: Path) -> None:
    """``--config FILE`` finds the daemon of that file from any directory (a relative
    ``[control].socket`` is relative to the working directory, as for the daemon)."""
    config = config_for(tmp_path)
    toml = tmp_path / "prismd.toml"
    toml.write_text(f'[control]\nsocket = "{config.socket}"\n')
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PRISMD_CONTROL_SOCKET": ""}
    with trio.fail_after(DEADLINE):
        async with running_server(config):
            code, out, err = await prismctl("--config", str(toml), "health", env=env, cwd=elsewhere)
            assert (code, err) == (0, "")
            assert out.startswith("status")
            code, out, err = await prismctl("health", "--config", str(toml), env=env, cwd=elsewhere)
            assert (code, err) == (0, "")
        code, _, err = await prismctl("--config", str(toml), "health", env=env, cwd=elsewhere)
        assert (code, err) == (1, f"prismctl: daemon not running (no socket at {config.socket})\n")
        missing = tmp_path / "nope.toml"
        code, _, err = await prismctl("--config", str(missing), "health", env=env)
        assert (code, err) == (1, f"prismctl: --config {missing}: file not found\n")
        # The default [control].socket, relative to where prismctl runs.
        toml.write_text("[daemon]\n")
        code, _, err = await prismctl("--config", str(toml), "health", env=env, cwd=elsewhere)
        assert (code, err) == (
            1,
            "prismctl: daemon not running (no socket at var/run/control.sock)\n",
        )


async def test_a_refused_connection_asks_whether_prismd_runs(tmp_path: Path) -> None:
    stale = tmp_path / "stale.sock"
    left = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    left.bind(str(stale))  # bound, never listening: a socket file nobody answers on
    try:
        with trio.fail_after(DEADLINE):
            code, out, err = await prismctl("--socket", str(stale), "health")
    finally:
        left.close()
    assert (code, out) == (1, "")
    assert err == (
        f"prismctl: connection refused at {stale} — is prismd running? (nothing listens on"
        " that socket file)\n"
    )
    assert "OSError" not in err


async def test_a_mistyped_command_gets_did_you_mean(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        code, _, err = await prismctl("helth")
        assert code == 2
        assert err.splitlines()[-1].endswith("; did you mean 'health'?")
        code, _, err = await prismctl("list-unresolvd")
        assert code == 2 and err.endswith("did you mean 'list-unresolved'?\n")
        code, _, err = await prismctl("xyzzy")
        assert code == 2 and "did you mean" not in err


async def test_the_events_table_never_cuts_the_kind(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    scope = OwnershipScope("default", "web", "u1")
    with trio.fail_after(DEADLINE):
        async with running_server(config) as (_, store):
            await store.checkpoints.save_checkpoint(
                namespace="prismd.session.log", key="s-1", scope=scope, version=1, value=1
            )
            await store.checkpoints.save_checkpoint(
                namespace="ns", key="k-2", scope=scope, version=1, value=1,
                metadata={"kind": "operation", "state": "awaiting_reconciliation_x"},
            )  # fmt: skip
            code, out, _ = await prismctl("--socket", config.socket, "events")
    assert code == 0
    heading, first, second = out.splitlines()[:3]
    assert first.split()[4] == "prismd.session.log"
    assert second.split()[4:6] == ["operation", "awaiting_reconciliation_x"]
    # Each column starts where its heading does.
    for word, line in (("KIND", first), ("STATE", second), ("KEY", second)):
        column = heading.index(word)
        assert line[column - 2 : column] == "  " and line[column] != " ", (word, line)
