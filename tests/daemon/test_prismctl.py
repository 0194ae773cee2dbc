"""prismctl as a real subprocess against a real control server."""

from __future__ import annotations

import grp
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import trio

from prismd.channel import Admission
from prismd.cli import prismctl as ctl
from prismd.control import ControlConfig
from prismd.journal import _access as buttons
from prismd.runtime.api import ReconcileResult
from stores import OwnershipScope
from tests.support.privileges import needs_root

from .test_control_inbox import _dead_letters
from .test_control_support import RecordingRuntime, running_server

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser

DEADLINE = 20
PRISMCTL = [sys.executable, "-m", "prismd.cli.prismctl"]
REPO = Path(__file__).resolve().parents[2]


async def prismctl(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> tuple[int, str, str]:
    result = await trio.run_process(
        [*PRISMCTL, *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


def config_for(tmp_path: Path, **kwargs: Any) -> ControlConfig:
    return ControlConfig(socket=str(tmp_path / "run" / "control.sock"), **kwargs)


async def test_list_unresolved_table_and_json(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    with trio.fail_after(DEADLINE):
        async with running_server(config) as (runtime, _):
            code, out, err = await prismctl("--socket", config.socket, "list-unresolved")
            assert (code, err) == (0, "")
            lines = out.splitlines()
            assert lines[0].split() == [
                "OPERATION",
                "CONNECTION",
                "STATE",
                "REPLY",
                "VERSION",
                "UPDATED",
                "REASON",
            ]
            assert lines[1].split() == [
                "op-1",
                "web",
                "executing",
                "-",
                "3",
                "2026-01-01T00:00:00.000Z",
                "-",
            ]
            assert lines[2].split()[:4] == ["op-2", "web", "completed", "unknown"]
            assert lines[2].endswith("the user blocks direct messages")
            code, out, _ = await prismctl(
                "--socket", config.socket, "--json", "list-unresolved", "--limit", "1"
            )
            assert code == 0
            assert json.loads(out) == [
                {
                    "operationId": "op-1",
                    "connectionId": "web",
                    "state": "executing",
                    "version": 3,
                    "updatedAt": "2026-01-01T00:00:00.000Z",
                    "replyState": None,
                }
            ]
            assert runtime.calls[-1][1]["limit"] == 1
            runtime.entries = []
            code, out, _ = await prismctl("--socket", config.socket, "list-unresolved")
            assert (code, out) == (0, "no unresolved operations\n")


async def test_reconcile_exit_codes(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    with trio.fail_after(DEADLINE):
        async with running_server(config) as (runtime, _):
            args = ["--socket", config.socket, "reconcile", "op-1", "--connection", "web"]
            code, out, _ = await prismctl(*args, "--version", "3", "--acknowledge-duplicate-risk")
            assert code == 0
            assert "resolved" in out
            assert "execution_unknown" in out
            call = runtime.calls[-1][1]
            assert (call["operation_id"], call["connection_id"]) == ("op-1", "web")
            assert call["expected_version"] == 3
            assert call["acknowledge_duplicate_risk"] is True
            runtime.reconcile_status = "conflict"
            code, out, _ = await prismctl(*args, "--version", "2")
            assert code == 1
            assert "conflict" in out
            assert runtime.calls[-1][1]["acknowledge_duplicate_risk"] is False
            code, out, _ = await prismctl("--json", *args, "--version", "2")
            assert code == 1
            assert json.loads(out)["status"] == "conflict"


async def test_other_commands(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    env = {"PRISMD_CONTROL_SOCKET": config.socket}
    with trio.fail_after(DEADLINE):
        async with running_server(config) as (runtime, _):
            code, out, _ = await prismctl("prune", "--now", "2026-02-01T00:00:00Z", env=env)
            assert code == 0
            assert out.split() == ["scanned", "4", "deleted", "2", "retained", "2"]
            assert runtime.calls[-1][1]["now_ms"] == 1769904000000

            code, out, _ = await prismctl("diagnostics", env=env)
            assert code == 0
            assert "admitted" in out
            assert ["deliveryFailures", "1"] in [line.split() for line in out.splitlines()]

            code, out, _ = await prismctl("health", env=env)
            assert code == 0
            lines = [line.split() for line in out.splitlines()]
            # After the status, the process's own lines: its version and how long it runs.
            assert lines[1] == ["version", version("prismd")]
            assert lines[2][0] == "uptime" and lines[2][-1] == "UTC)", lines[2]
            assert lines[:1] + lines[3:] == [
                ["status", "ok"],
                ["children.web", "running"],
            ]

            code, out, _ = await prismctl(
                "notify",
                "--connection",
                "web",
                "--conversation",
                "chat-1",
                "--thread",
                "t1",
                "--id",
                "n-1",
                "--text",
                "backup done",
                env=env,
            )
            assert code == 0
            assert "accepted" in out
            call = runtime.calls[-1][1]
            assert (call["notify_id"], call["text"], call["thread_id"]) == (
                "n-1",
                "backup done",
                "t1",
            )

            code, out, _ = await prismctl(
                "pair", "--connection", "web", "--alias", "echo", "--alias", "b", env=env
            )
            assert code == 0
            assert "pair-token-abc" in out
            assert "/pair pair-token-abc" in out
            assert runtime.calls[-1][1]["aliases"] == ("echo", "b")
            code, out, _ = await prismctl(
                "--json", "pair", "--connection", "w", "--alias", "e", "--ttl-ms", "60000", env=env
            )
            assert code == 0
            assert json.loads(out)["token"] == "pair-token-abc"
            assert runtime.calls[-1][1]["ttl_ms"] == 60000


async def test_error_result_exits_1(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    with trio.fail_after(DEADLINE):
        async with running_server(config):
            code, out, err = await prismctl(
                "--socket", config.socket, "list-unresolved", "--limit", "0"
            )
            assert code == 1
            assert out == ""
            assert "error -32602" in err
            assert "'limit'" in err
        async with running_server(config, RecordingRuntime(fail=True)):
            code, _, err = await prismctl("--socket", config.socket, "diagnostics")
            assert code == 1
            assert "internal error" in err


async def test_daemon_not_running(tmp_path: Path) -> None:
    missing = str(tmp_path / "nope.sock")
    with trio.fail_after(DEADLINE):
        code, out, err = await prismctl("--socket", missing, "health")
    assert code == 1
    assert out == ""
    assert err == f"prismctl: daemon not running (no socket at {missing})\n"


async def test_permission_denied(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    with trio.fail_after(DEADLINE):
        async with running_server(config, daemon_uid=os.getuid() + 1) as (runtime, _):
            code, out, err = await prismctl("--socket", config.socket, "list-unresolved")
            assert code == 1
            assert out == ""
            assert "permission denied" in err
            assert runtime.calls == []


async def test_usage_errors_exit_2(tmp_path: Path) -> None:
    with trio.fail_after(DEADLINE):
        for args in (
            [],
            ["bogus"],
            ["reconcile", "op-1", "--connection", "web"],
            ["reconcile", "op-1", "--connection", "web", "--version", "three"],
            ["notify", "--connection", "web"],
            ["list-unresolved", "--limit", "x"],
        ):
            code, _out, err = await prismctl("--socket", str(tmp_path / "s"), *args)
            assert code == 2, args
            assert "usage: prismctl" in err


async def test_events_page_and_follow(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    with trio.fail_after(DEADLINE):
        async with running_server(config) as (_, store):
            scope = OwnershipScope("default", "web", "u1")
            for key in ("k1", "k2"):
                await store.checkpoints.save_checkpoint(
                    namespace="ns", key=key, scope=scope, version=1, value=1
                )
            long_key = "telegram-main/" + "x" * 80 + "/op-the-end"
            await store.checkpoints.save_checkpoint(
                namespace="prism.ops",
                key=long_key,
                scope=scope,
                version=3,
                value=1,
                metadata={"kind": "operation", "state": "execution_unknown"},
            )
            code, out, _ = await prismctl("--socket", config.socket, "events")
            assert code == 0
            lines = out.splitlines()
            assert lines[0].split() == [
                "SEQ", "TIME", "(UTC)", "ACTION", "KIND", "STATE", "VER", "KEY"
            ]  # fmt: skip
            assert all(len(line) <= 100 for line in lines), lines
            first = lines[1].split()
            assert first[0] == "1"
            assert first[1] == time.strftime("%Y-%m-%d", time.gmtime())
            assert first[-1] == "k1"
            assert [line.split()[-1] for line in lines[1:3]] == ["k1", "k2"]
            third = lines[3].split()
            assert third[4:7] == ["operation", "execution_unknown", "3"]
            assert third[7].startswith("telegram-ma") and third[7].endswith("/op-the-end")
            assert len(third[7]) == 24
            assert "…" in third[7]
            assert lines[-1].startswith("cursor ")
            end = int(lines[-1].split()[1])
            assert end == 3
            code, out, _ = await prismctl("--socket", config.socket, "events", "--from-now")
            assert (code, out) == (0, "cursor 3\n")
            code, _, err = await prismctl(
                "--socket", config.socket, "events", "--from-now", "--after", "1"
            )
            assert code == 2 and "not allowed with" in err
            code, out, _ = await prismctl(
                "--socket", config.socket, "--json", "events", "--after", "1"
            )
            assert [e["key"] for e in json.loads(out)["events"]] == ["k2", long_key]

            process = await trio.lowlevel.open_process(
                [*PRISMCTL, "--socket", config.socket, "--json", "events", "--follow"],
                stdout=subprocess.PIPE,
            )
            assert process.stdout is not None
            buffer = b""

            async def next_page() -> dict[str, Any]:
                nonlocal buffer
                while b"\n" not in buffer:
                    assert process.stdout is not None
                    chunk = await process.stdout.receive_some(65536)
                    assert chunk, "prismctl exited early"
                    buffer += chunk
                line, _, buffer = buffer.partition(b"\n")
                page = json.loads(line)
                assert isinstance(page, dict)
                return page

            try:
                first_page = await next_page()
                assert [e["key"] for e in first_page["events"]] == ["k1", "k2", long_key]
                await store.checkpoints.save_checkpoint(
                    namespace="ns", key="k3", scope=scope, version=1, value=1
                )
                page = await next_page()
                assert [e["key"] for e in page["events"]] == ["k3"]
            finally:
                process.terminate()
                await process.wait()
                await process.stdout.aclose()


def test_default_socket_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert ctl.default_socket_path({}) == "/run/prismd/control.sock"
    (tmp_path / "var" / "run").mkdir(parents=True)
    (tmp_path / "var" / "run" / "control.sock").touch()
    assert ctl.default_socket_path({}) == "var/run/control.sock"
    assert ctl.default_socket_path({"PRISMD_CONTROL_SOCKET": "/x.sock"}) == "/x.sock"


def test_chat_calls_the_chat_client(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls: list[tuple[str, dict[str, Any]]] = []

    def run_chat_cli(url: str, **kwargs: Any) -> int:
        calls.append((url, kwargs))
        return 0

    fake = types.ModuleType("prismd.cli._chat")
    fake.run_chat_cli = run_chat_cli  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "prismd.cli._chat", fake)
    monkeypatch.setenv("CHAT_TOKEN", "tok-1")
    assert (
        ctl.main(["chat", "--url", "http://h:1/", "--actor", "me", "--token-env", "CHAT_TOKEN"])
        == 0
    )
    assert calls == [("http://h:1/", {"actor": "me", "token": "tok-1"})]
    assert ctl.main(["chat"]) == 0
    assert calls[-1] == ("http://127.0.0.1:8787/", {"actor": None, "token": None})
    monkeypatch.delenv("CHAT_TOKEN")
    assert ctl.main(["chat", "--token-env", "CHAT_TOKEN"]) == 1
    assert "CHAT_TOKEN is not set" in capsys.readouterr().err
    assert len(calls) == 2


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    # tmp_path lives under a 0700 directory; the nobody user needs to reach the socket.
    path = Path(tempfile.mkdtemp(prefix="prismctl-"))
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def prismctl_as_nobody(shared: Path, *args: str, cwd: str = "/") -> tuple[int, str, str]:
    # The system interpreter (the venv's lives under root's home): prismctl needs only the
    # standard library, so the package on PYTHONPATH is enough. A copy of it in ``shared``:
    # the clone itself may sit under a directory nobody cannot enter (``mktemp -d``).
    code = shared / "code"
    if not code.exists():
        shutil.copytree(
            REPO / "prismd", code / "prismd", ignore=shutil.ignore_patterns("__pycache__")
        )
        for directory, _dirs, files in os.walk(code):
            os.chmod(directory, 0o755)
            for name in files:
                os.chmod(os.path.join(directory, name), 0o644)
    python = shutil.which("python3", path="/usr/bin") or sys.executable
    result = await trio.run_process(
        [python, "-m", "prismd.cli.prismctl", *args],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(code)},
        user=65534,
        group=65534,
        extra_groups=[],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        cwd=cwd,
    )
    return result.returncode, result.stdout.decode(), result.stderr.decode()


@needs_root("runs prismctl as uid 65534 (nobody) against the socket")
async def test_permission_messages_for_another_user(shared_dir: Path) -> None:
    private = ControlConfig(socket=str(shared_dir / "private" / "control.sock"))
    with trio.fail_after(DEADLINE):
        async with running_server(private, daemon_uid=os.getuid()):
            code, out, err = await prismctl_as_nobody(
                shared_dir, "--socket", private.socket, "health"
            )
            assert (code, out) == (1, "")
            assert err == (
                f"prismctl: permission denied: cannot open {private.socket} as uid 65534; the"
                " control socket is open to the daemon's own user (and to its [control].group"
                " when set): run prismctl as that user, or see docs/install.md#operators\n"
            )
            # Found by the search from the directory of a `make run` daemon that nobody
            # cannot enter: the same answer, not "no control socket found".
            clone = shared_dir / "clone"
            (clone / "var" / "run").mkdir(parents=True)
            os.chmod(clone, 0o755)
            os.chmod(clone / "var", 0o750)
            (clone / "var" / "run" / "control.sock").symlink_to(private.socket)
            code, out, searched = await prismctl_as_nobody(shared_dir, "health", cwd=str(clone))
            assert (code, out) == (1, "")
            assert searched == err.replace(private.socket, "var/run/control.sock")
        grouped = ControlConfig(
            socket=str(shared_dir / "grouped" / "control.sock"),
            group=grp.getgrgid(65534).gr_name,
        )
        async with running_server(grouped, daemon_uid=os.getuid()) as (runtime, _):
            code, out, err = await prismctl_as_nobody(
                shared_dir, "--socket", grouped.socket, "health"
            )
            assert (code, out) == (1, "")
            assert err == (
                "prismctl: permission denied: uid 65534 is not an operator of this daemon;"
                " list it in the daemon's config ([[control.operators]] uid = 65534, tenant ="
                ' "default") and restart it, or run prismctl as the daemon\'s user\n'
            )
            assert runtime.calls == []


async def test_a_path_that_is_no_socket_is_named(tmp_path: Path) -> None:
    """``--socket prismd.toml`` or a directory was "connection refused … is prismd running?"."""
    config = tmp_path / "prismd.toml"
    config.write_text("[daemon]\n")
    with trio.fail_after(DEADLINE):
        for path, what in ((config, "a file"), (tmp_path, "a directory")):
            code, out, err = await prismctl("--socket", str(path), "health")
            assert (code, out) == (1, "")
            assert err == (
                f"prismctl: {path} is {what}, not a socket: name prismd's control socket"
                " ([control].socket of its config) with --socket PATH, or use --config FILE\n"
            )


def test_socket_path_too_long_names_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    """An over-long socket path (OSError without errno) printed ``...: None``."""
    path = "/" + "a" * 200
    assert ctl.main(["--socket", path, "health"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"prismctl: cannot connect to {path}: ")
    assert not err.rstrip().endswith("None") and "too long" in err


async def test_global_options_after_the_command(tmp_path: Path) -> None:
    """`prismctl diagnostics --json --socket PATH` works like `prismctl --json --socket
    PATH diagnostics` (a new user types options after the command)."""
    config = config_for(tmp_path)
    with trio.fail_after(DEADLINE):
        async with running_server(config):
            code, out, err = await prismctl("diagnostics", "--json", "--socket", config.socket)
            assert code == 0, err
            assert json.loads(out)["deliveryFailures"] == 1
            code, before, _ = await prismctl("--json", "--socket", config.socket, "diagnostics")
            assert code == 0 and json.loads(before) == json.loads(out)


async def test_pair_ttl_outside_the_bounds_is_a_usage_error(tmp_path: Path) -> None:
    """``--ttl-ms 3600000`` was clamped to 5 minutes without a word; now it is refused
    before anything is sent, stating the bounds. The bounds are prismd.journal's own."""
    assert (ctl.PAIRING_TTL_MIN_MS, ctl.PAIRING_TTL_MAX_MS) == (
        buttons.PAIRING_TTL_MIN_MS,
        buttons.PAIRING_TTL_MAX_MS,
    )
    config = config_for(tmp_path)
    with trio.fail_after(DEADLINE):
        async with running_server(config) as (runtime, _):
            pair = ["--socket", config.socket, "pair", "--connection", "tg", "--alias", "a"]
            for ttl in ("3600000", "300001", "999", "0", "-5"):
                code, out, err = await prismctl(*pair, "--ttl-ms", ttl)
                assert (code, out) == (2, ""), ttl
                assert err.startswith("usage: prismctl pair")
                assert err.splitlines()[-1] == (
                    f"prismctl pair: error: argument --ttl-ms: {ttl} is outside 1000..300000"
                    " (milliseconds; a pairing token lives at most 5 minutes)"
                )
            code, _, err = await prismctl(*pair, "--ttl-ms", "5min")
            assert code == 2 and "not an integer: '5min'" in err
            assert runtime.calls == []
            for ttl in ("1000", "300000"):
                code, _, err = await prismctl(*pair, "--ttl-ms", ttl)
                assert (code, err) == (0, "")
                assert runtime.calls[-1][1]["ttl_ms"] == int(ttl)


async def test_socket_help_names_the_default_and_the_variable(tmp_path: Path) -> None:
    """The help said "default: see prismctl docs"; it names the lookup order and the path
    this invocation would use."""
    code, out, _ = await prismctl("--help", env={"PRISMD_CONTROL_SOCKET": ""}, cwd=tmp_path)
    assert code == 0
    flat = " ".join(out.split())
    assert (
        "--socket PATH control socket path (default: $PRISMD_CONTROL_SOCKET, else "
        "./var/run/control.sock when it exists, else /run/prismd/control.sock; here: "
        "/run/prismd/control.sock)"
    ) in flat
    code, out, _ = await prismctl(
        "--help", env={"PRISMD_CONTROL_SOCKET": "/srv/p%d/ctl.sock"}, cwd=tmp_path
    )
    assert code == 0 and "here: /srv/p%d/ctl.sock)" in " ".join(out.split())


async def test_the_socket_variable_wins_over_the_local_socket(tmp_path: Path) -> None:
    """``$PRISMD_CONTROL_SOCKET`` is used even where ``./var/run/control.sock`` exists (here
    a dead socket file), and ``--socket`` wins over both."""
    config = config_for(tmp_path)
    workdir = tmp_path / "work"
    (workdir / "var" / "run").mkdir(parents=True)
    (workdir / "var" / "run" / "control.sock").touch()
    env = {"PRISMD_CONTROL_SOCKET": config.socket}
    with trio.fail_after(DEADLINE):
        async with running_server(config):
            code, out, err = await prismctl("health", env=env, cwd=workdir)
            assert (code, err) == (0, "")
            assert out.startswith("status")
            code, _, err = await prismctl(
                "--socket", str(tmp_path / "elsewhere.sock"), "health", env=env, cwd=workdir
            )
            assert (code, err) == (
                1,
                f"prismctl: daemon not running (no socket at {tmp_path / 'elsewhere.sock'})\n",
            )
            code, _, err = await prismctl("health", env={"PRISMD_CONTROL_SOCKET": ""}, cwd=workdir)
            assert code == 1 and "var/run/control.sock" in err


async def test_reconcile_advice_for_an_unsettled_reply(tmp_path: Path) -> None:
    """A reply that may have landed needs the acknowledgement to be resent: prismctl says
    so with the command (at the daemon's current version), the ``--socket`` given after the
    command included; ``--json`` prints the result alone."""
    config = config_for(tmp_path)
    runtime = RecordingRuntime(
        reconcile_result=ReconcileResult(
            "conflict", state="succeeded", detail="duplicate_risk", current_version=5
        )
    )
    with trio.fail_after(DEADLINE):
        async with running_server(config, runtime):
            args = ["reconcile", "op-2", "--connection", "web", "--version", "5"]
            code, out, err = await prismctl(*args, "--socket", config.socket)
            assert code == 1
            assert "hint" not in out
            assert err == (
                "prismctl: the reply of op-2 may have been delivered already; to resend the"
                " stored reply (the user may get it twice), add --acknowledge-duplicate-risk:\n"
                f"  prismctl --socket {config.socket} reconcile op-2 --connection web"
                " --version 5 --acknowledge-duplicate-risk\n"
            )
            code, out, err = await prismctl("--json", "--socket", config.socket, *args)
            assert (code, err) == (1, "")
            assert json.loads(out)["hint"].startswith("the reply may have been delivered")


async def test_daemon_hints_are_passed_on(tmp_path: Path) -> None:
    """A hint prismctl has no words of its own for (a notify refusal, an ambiguous
    reconcile) is printed as the daemon sent it, on stderr; the table keeps the result."""
    config = config_for(tmp_path)
    runtime = RecordingRuntime(
        notify_admission=Admission("denied", "rejected", hint="add the grant"),
        reconcile_result=ReconcileResult("conflict", state="executing", detail="ambiguous"),
    )
    with trio.fail_after(DEADLINE):
        async with running_server(config, runtime):
            code, out, err = await prismctl(
                "--socket", config.socket, "notify", "--connection", "web",
                "--conversation", "c", "--id", "n", "--text", "t",
            )  # fmt: skip
            assert (code, err) == (1, "prismctl: add the grant\n")
            assert [line.split() for line in out.splitlines()] == [
                ["status", "denied"],
                ["reason", "rejected"],
                ["operationId", "-"],
                ["duplicate", "no"],
            ]
            code, _, err = await prismctl(
                "--socket", config.socket, "reconcile", "op-1", "--connection", "web",
                "--version", "3",
            )  # fmt: skip
            assert code == 1
            assert err == (
                "prismctl: the operation id matches records of several scopes inside yours;"
                " an operator scoped to one account and user can settle it\n"
            )


async def test_follow_from_now_prints_only_new_events_under_one_heading(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    scope = OwnershipScope("default", "web", "u1")
    with trio.fail_after(DEADLINE):
        async with running_server(config) as (_, store):
            await store.checkpoints.save_checkpoint(
                namespace="ns", key="old", scope=scope, version=1, value=1
            )
            process = await trio.lowlevel.open_process(
                [*PRISMCTL, "--socket", config.socket, "events", "--follow", "--from-now"],
                stdout=subprocess.PIPE,
            )
            assert process.stdout is not None
            text = b""

            async def read_output() -> None:
                nonlocal text
                assert process.stdout is not None
                while text.count(b"\n") < 3:
                    chunk = await process.stdout.receive_some(65536)
                    assert chunk, "prismctl exited early"
                    text += chunk

            try:
                # Nothing shows when prismctl has started following: write until two new
                # events are printed; whatever was written before it started is not.
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(read_output)
                    for n in range(1, 200):
                        if text.count(b"\n") >= 3:
                            break
                        await store.checkpoints.save_checkpoint(
                            namespace="ns", key=f"new{n}", scope=scope, version=1, value=1
                        )
                        await trio.sleep(0.1)
            finally:
                process.terminate()
                await process.wait()
                await process.stdout.aclose()
    lines = text.decode().splitlines()
    assert lines[0].startswith("SEQ")
    rows = [line.split() for line in lines[1:3]]
    first = int(rows[0][0])
    assert first >= 2  # "old" (seq 1) was before --from-now
    assert [row[0] for row in rows] == [str(first), str(first + 1)]
    assert [row[-1] for row in rows] == [f"new{first - 1}", f"new{first}"]


async def test_list_and_settle_inbox_dead_letters(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    with trio.fail_after(DEADLINE):
        async with running_server(config, inbox_sources=("tg",)) as (_, store):
            code, out, _ = await prismctl("--socket", config.socket, "list-inbox")
            assert (code, out) == (0, "no inbox rows in that state\n")
            await _dead_letters(store, "tg", ["41", "42", "43"])
            code, out, err = await prismctl("--socket", config.socket, "list-unresolved")
            assert code == 0 and out.startswith("OPERATION")
            assert err == (
                "prismctl: and 3 dead letter(s) in the webhook inbox: prismctl list-inbox\n"
            )
            code, out, err = await prismctl("--socket", config.socket, "list-inbox")
            assert (code, err) == (0, "")
            lines = out.splitlines()
            assert lines[0].split() == [
                "CONNECTION", "UPDATE", "STATE", "ATTEMPTS", "ERROR", "UPDATED"
            ]  # fmt: skip
            assert [line.split()[:5] for line in lines[1:]] == [
                ["tg", key, "dead", "1", "admit_failed"] for key in ("41", "42", "43")
            ]
            code, out, err = await prismctl(
                "--socket", config.socket, "--json", "list-inbox", "--limit", "2"
            )
            assert code == 0
            assert [i["updateId"] for i in json.loads(out)["items"]] == ["41", "42"]
            assert "more: prismctl list-inbox --state dead --limit 2 --after " in err
            after = err.rsplit("--after ", 1)[1].strip()
            code, out, _ = await prismctl(
                "--socket", config.socket, "--json", "list-inbox", "--after", after
            )
            assert [i["updateId"] for i in json.loads(out)["items"]] == ["43"]

            code, out, _ = await prismctl(
                "--socket", config.socket, "settle-inbox", "42", "--connection", "tg", "--retry"
            )
            assert (code, out) == (0, "settled\n")
            code, out, err = await prismctl(
                "--socket", config.socket, "settle-inbox", "42", "--connection", "tg", "--discard"
            )
            assert (code, out) == (1, "not_found\n")
            assert "prismctl list-inbox" in err
            code, _, err = await prismctl(
                "--socket", config.socket, "settle-inbox", "41", "--connection", "tg"
            )
            assert code == 2 and "--retry" in err
            code, out, _ = await prismctl(
                "--socket", config.socket, "list-inbox", "--state", "pending"
            )
            assert [line.split()[1] for line in out.splitlines()[1:]] == ["42"]


async def test_health_names_the_instance_its_leases_and_the_inbox_depth(tmp_path: Path) -> None:
    config = config_for(tmp_path)
    snapshot = {
        "instance": "inst-7f3a",
        "ready": True,
        "leases": {"binding": 2, "receiver": ["tg", "tg2"]},
        "children": {"telegram:tg": {"state": "running"}},
    }
    with trio.fail_after(DEADLINE):
        async with running_server(config, health=snapshot, inbox_sources=("tg",)) as (_, store):
            await _dead_letters(store, "tg", ["5"])
            code, out, err = await prismctl("--socket", config.socket, "health")
    assert (code, err) == (0, "")
    pairs = dict(line.split(None, 1) for line in out.splitlines())
    assert pairs["instance"] == "inst-7f3a"
    assert pairs["leases.binding"] == "2"
    assert pairs["leases.receiver"] == "tg,tg2"
    assert (pairs["inbox.pending"], pairs["inbox.dead"]) == ("0", "1")
    assert pairs["children.telegram:tg.state"] == "running"
