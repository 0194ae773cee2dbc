"""The control socket: permissions, peer credentials, JSON-RPC framing, every method."""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
import grp
import json
import os
import random
import resource
import shutil
import socket
import stat
import sys
import tempfile
import time
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest
import trio

from prismd.control import ControlConfig, Operator
from prismd.control._methods import ControlHandler, pairing_aliases_from_grants, to_wire
from prismd.control._server import ControlSocketError, ControlSocketInUseError, serve_control
from prismd.daemon._config import GrantConfig
from prismd.runtime.api import UnresolvedEntry
from stores import OwnershipScope
from stores.memory import MemoryStore
from tests.support.privileges import chown_group, needs_root

from .test_control_support import Client, RecordingRuntime, connect, running_server

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser

DEADLINE = 10


def control(tmp_path: Path, **kwargs: object) -> ControlConfig:
    return ControlConfig(socket=str(tmp_path / "run" / "control.sock"), **kwargs)  # type: ignore[arg-type]


async def test_directory_and_socket_permissions(tmp_path: Path) -> None:
    config = control(tmp_path)
    path = Path(config.socket)
    with trio.fail_after(DEADLINE):
        async with running_server(config):
            assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
            mode = os.stat(path).st_mode
            assert stat.S_ISSOCK(mode)
            assert stat.S_IMODE(mode) == 0o600
            # The process umask is restored after bind.
            previous = os.umask(0o022)
            os.umask(previous)
            assert previous != 0o077
        assert not os.path.exists(path), "the socket is removed on stop"  # noqa: ASYNC240


async def test_group_directory_and_socket(tmp_path: Path) -> None:
    gid = chown_group()
    config = control(tmp_path, group=grp.getgrgid(gid).gr_name)
    path = Path(config.socket)
    with trio.fail_after(DEADLINE):
        async with running_server(config):
            dir_stat = os.stat(path.parent)
            assert stat.S_IMODE(dir_stat.st_mode) == 0o750
            assert dir_stat.st_gid == gid
            sock_stat = os.stat(path)
            assert stat.S_IMODE(sock_stat.st_mode) == 0o660
            assert sock_stat.st_gid == gid


async def test_existing_directory_is_tightened(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir(mode=0o755)
    os.chmod(tmp_path / "run", 0o755)
    config = control(tmp_path)
    with trio.fail_after(DEADLINE):
        async with running_server(config):
            assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o700


async def test_directory_with_other_files_is_refused_not_tightened(tmp_path: Path) -> None:
    """``socket = "prismd.sock"`` in a project or home directory must not chmod it 0700."""
    project = tmp_path / "project"
    project.mkdir()
    os.chmod(project, 0o755)
    (project / "README.md").write_text("mine\n")
    config = ControlConfig(socket=str(project / "prismd.sock"))
    handler = ControlHandler(runtime=RecordingRuntime(), store=MemoryStore())
    with trio.fail_after(DEADLINE), pytest.raises(ControlSocketError, match="its own directory"):
        await serve_control(config, handler=handler, daemon_uid=os.getuid())
    assert stat.S_IMODE(os.stat(project).st_mode) == 0o755
    assert not os.path.exists(config.socket)  # noqa: ASYNC240


async def test_private_directory_with_other_files_is_used_as_is(tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir()
    os.chmod(private, 0o700)
    (private / "notes").write_text("x\n")
    config = ControlConfig(socket=str(private / "control.sock"))
    handler = ControlHandler(runtime=RecordingRuntime(), store=MemoryStore())
    with trio.fail_after(DEADLINE):
        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(serve_control, config, handler=handler, daemon_uid=os.getuid())
            )
            assert stat.S_IMODE(os.stat(config.socket).st_mode) == 0o600
            nursery.cancel_scope.cancel()
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o700


async def test_shared_directory_is_refused_not_tightened(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    config = ControlConfig(socket=str(shared / "control.sock"))
    handler = ControlHandler(runtime=RecordingRuntime(), store=MemoryStore())
    with trio.fail_after(DEADLINE), pytest.raises(ControlSocketError, match="shared directory"):
        await serve_control(config, handler=handler, daemon_uid=os.getuid())
    assert stat.S_IMODE(os.stat(shared).st_mode) == 0o1777
    assert not os.path.exists(config.socket)  # noqa: ASYNC240


async def test_stale_socket_is_replaced(tmp_path: Path) -> None:
    config = control(tmp_path)
    path = Path(config.socket)
    path.parent.mkdir(mode=0o700)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o022)
    try:
        stale.bind(str(path))
    finally:
        os.umask(previous)
    stale.close()  # the file stays; nobody listens: a crashed daemon's leftover
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o755
    with trio.fail_after(DEADLINE):
        async with running_server(config):
            # Replaced (inode numbers may be reused; the mode tells them apart).
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
            async with connect(path) as client:
                assert (await client.result("health"))["status"] == "ok"


async def test_live_socket_is_not_taken_over(tmp_path: Path) -> None:
    config = control(tmp_path)
    with trio.fail_after(DEADLINE):
        async with running_server(config):
            handler = ControlHandler(runtime=RecordingRuntime(), store=MemoryStore())
            with pytest.raises(ControlSocketInUseError):
                await serve_control(config, handler=handler, daemon_uid=os.getuid())
            # The first server still owns and serves its socket.
            async with connect(config.socket) as client:
                assert (await client.result("health"))["status"] == "ok"


async def test_path_that_is_not_a_socket_is_refused(tmp_path: Path) -> None:
    config = control(tmp_path)
    os.mkdir(tmp_path / "run")
    with open(config.socket, "w") as file:  # noqa: ASYNC230
        file.write("not a socket")
    handler = ControlHandler(runtime=RecordingRuntime(), store=MemoryStore())
    with trio.fail_after(DEADLINE), pytest.raises(ControlSocketError, match="not a socket"):
        await serve_control(config, handler=handler, daemon_uid=os.getuid())
    with open(config.socket) as file:  # noqa: ASYNC230
        assert file.read() == "not a socket"


BAD_INPUTS: list[tuple[bytes, int, str]] = [
    (b"\x00\x01garbage\n", -32700, "parse error"),
    (b"\xff\xfe\xfd\n", -32700, "not UTF-8"),
    (b"{not json\n", -32700, "parse error"),
    (b"[1, 2]\n", -32600, "invalid request"),
    (b"42\n", -32600, "invalid request"),
    (b'{"jsonrpc": "2.0", "method": "health"}\n', -32600, "id is required"),
    (b'{"jsonrpc": "2.0", "id": true, "method": "health"}\n', -32600, "id must be"),
    (b'{"jsonrpc": "1.0", "id": 1, "method": "health"}\n', -32600, "jsonrpc"),
    (b'{"jsonrpc": "2.0", "id": 1, "method": 5}\n', -32600, "method"),
    (b'{"jsonrpc": "2.0", "id": 1, "method": "health", "x": 1}\n', -32600, "'x'"),
    (b'{"jsonrpc": "2.0", "id": 1, "method": "nope"}\n', -32601, "method not found"),
    (b'{"jsonrpc": "2.0", "id": 1, "method": "health", "params": [1]}\n', -32602, "object"),
    (b"[" * 100_000 + b"\n", -32700, "parse error"),
]


async def test_bad_input_gets_an_error_and_the_connection_stays_up(tmp_path: Path) -> None:
    config = control(tmp_path, max_request_bytes=1_000_000)
    with trio.fail_after(DEADLINE):
        async with running_server(config), connect(config.socket) as client:
            for data, code, fragment in BAD_INPUTS:
                await client.send_raw(data)
                message = await client.read_message()
                assert message["jsonrpc"] == "2.0"
                assert message["error"]["code"] == code, (data[:40], message)
                assert fragment in message["error"]["message"]
                assert "result" not in message
                assert (await client.result("health"))["status"] == "ok"
            # Blank lines are ignored, string ids are echoed.
            await client.send_raw(b'\n\r\n{"jsonrpc":"2.0","id":"x","method":"health"}\n')
            assert (await client.read_message())["id"] == "x"


BAD_PARAMS: list[tuple[str, dict[str, object], str]] = [
    ("listUnresolved", {"limit": 0}, "'limit'"),
    ("listUnresolved", {"limit": "5"}, "'limit'"),
    ("listUnresolved", {"limt": 5}, "unknown param 'limt'"),
    ("reconcile", {"operationId": "op-1", "expectedVersion": 1}, "'connectionId' is required"),
    ("reconcile", {"connectionId": "web", "expectedVersion": 1}, "'operationId' is required"),
    ("reconcile", {"connectionId": "web", "operationId": "op"}, "'expectedVersion'"),
    (
        "reconcile",
        {"connectionId": "web", "operationId": "op", "expectedVersion": True},
        "'expectedVersion'",
    ),
    (
        "reconcile",
        {
            "connectionId": "web",
            "operationId": "op",
            "expectedVersion": 1,
            "acknowledgeDuplicateRisk": "yes",
        },
        "'acknowledgeDuplicateRisk'",
    ),
    ("prune", {"now": "yesterday"}, "'now' must be an ISO 8601"),
    ("diagnostics", {"verbose": True}, "unknown param 'verbose'"),
    ("notify", {"connectionId": "web", "externalConversationId": "c", "notifyId": "n"}, "'text'"),
    (
        "notify",
        {"connectionId": "web", "externalConversationId": 3, "notifyId": "n", "text": "t"},
        "'externalConversationId'",
    ),
    ("pair", {}, "'connectionId' is required"),
    ("pair", {"connectionId": "web", "aliases": "echo"}, "'aliases'"),
    ("pair", {"connectionId": "web", "ttlMs": -5}, "'ttlMs'"),
    ("events", {"after": -1}, "'after'"),
    ("events", {"follow": 1}, "'follow'"),
]


async def test_bad_params_name_the_param(tmp_path: Path) -> None:
    config = control(tmp_path)
    with trio.fail_after(DEADLINE):
        async with running_server(config) as (runtime, _store), connect(config.socket) as client:
            for method, params, fragment in BAD_PARAMS:
                message = await client.call(method, params)
                assert message["error"]["code"] == -32602, (method, message)
                assert fragment in message["error"]["message"], (method, message)
            assert runtime.calls == [], "no bad call reaches the runtime"


async def test_oversize_request_is_refused_and_connection_closed(tmp_path: Path) -> None:
    config = control(tmp_path, max_request_bytes=1024)
    with trio.fail_after(DEADLINE):
        async with running_server(config) as (runtime, _store):
            # One line far larger than the cap, sent without a newline at first: the
            # server must answer without waiting for the end of it.
            async with connect(config.socket) as client:
                try:
                    await client.send_raw(b'{"jsonrpc":"2.0","id":1,"method":"health","p":"')
                    await client.send_raw(b"x" * 200_000)
                except trio.BrokenResourceError:
                    pass
                message = await client.read_message()
                assert message["error"]["code"] == -32600
                assert "too large" in message["error"]["message"]
                assert await client.read_line() is None
            # A complete oversize line too.
            async with connect(config.socket) as client:
                await client.send_raw(b"{" + b" " * 2000 + b"}\n")
                assert (await client.read_message())["error"]["code"] == -32600
                assert await client.read_line() is None
            async with connect(config.socket) as client:
                assert (await client.result("health"))["status"] == "ok"
            assert runtime.calls == []


async def test_idle_connection_is_closed(tmp_path: Path) -> None:
    config = control(tmp_path, idle_timeout_ms=200)
    with trio.fail_after(DEADLINE):
        async with running_server(config), connect(config.socket) as client:
            assert (await client.result("health"))["status"] == "ok"
            start = trio.current_time()
            assert await client.read_line() is None
            assert trio.current_time() - start >= 0.15


async def test_partial_line_then_idle_is_closed(tmp_path: Path) -> None:
    config = control(tmp_path, idle_timeout_ms=200)
    with trio.fail_after(DEADLINE):
        async with running_server(config) as (runtime, _store):
            async with connect(config.socket) as client:
                await client.send_raw(b'{"jsonrpc":"2.0","id":1,"meth')
                assert await client.read_line() is None
            assert runtime.calls == []


async def test_internal_errors_are_opaque_and_not_fatal(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = control(tmp_path)
    runtime = RecordingRuntime(fail=True)
    with trio.fail_after(DEADLINE):
        async with running_server(config, runtime), connect(config.socket) as client:
            for method, params in [
                ("listUnresolved", {}),
                ("diagnostics", {}),
                ("prune", {}),
                ("pair", {"connectionId": "web", "aliases": ["echo"]}),
            ]:
                message = await client.call(method, params)
                assert message["error"] == {"code": -32603, "message": "internal error"}
            assert (await client.result("health"))["status"] == "ok"
    assert "RuntimeError" in caplog.text
    assert "secret detail" not in caplog.text
    assert "ABCDEFGHIJ" not in caplog.text


async def test_unencodable_results_are_internal_errors(tmp_path: Path) -> None:
    config = control(tmp_path)
    snapshots: list[dict[str, object]] = [
        {"status": object()},
        {"status": float("nan")},
        {"status": "caf\u00e9 \ud800"},
    ]
    with trio.fail_after(DEADLINE):
        async with running_server(config, health=snapshots[0]), connect(config.socket) as client:
            message = await client.call("health")
            assert message["error"] == {"code": -32603, "message": "internal error"}
            assert (await client.result("listUnresolved"))[0]["operationId"] == "op-1"
        for snapshot, expected in ((snapshots[1], None), (snapshots[2], "caf\u00e9 \ud800")):
            async with (
                running_server(config, health=snapshot),
                connect(config.socket) as client,
            ):
                message = await client.call("health")
                if expected is None:
                    assert message["error"]["code"] == -32603
                else:
                    assert message["result"]["status"] == expected


async def test_methods_reach_the_runtime_with_the_operator_identity(tmp_path: Path) -> None:
    config = control(tmp_path, operators=(Operator(uid=os.getuid(), tenant="acme", user="ann"),))
    with trio.fail_after(DEADLINE):
        async with running_server(config) as (runtime, _store), connect(config.socket) as client:
            entries = await client.result("listUnresolved", {"limit": 1})
            assert entries == [
                {
                    "operationId": "op-1",
                    "connectionId": "web",
                    "state": "executing",
                    "version": 3,
                    "updatedAt": "2026-01-01T00:00:00.000Z",
                    "replyState": None,
                }
            ]
            assert await client.result(
                "reconcile",
                {
                    "connectionId": "web",
                    "operationId": "op-1",
                    "expectedVersion": 3,
                    "acknowledgeDuplicateRisk": True,
                },
            ) == {
                "status": "resolved",
                "outcome": "execution_unknown",
                "state": "failed",
                "detail": "acknowledged",
            }
            assert await client.result("prune", {"now": "2026-02-01T00:00:00Z"}) == {
                "scanned": 4,
                "deleted": 2,
                "retained": 2,
            }
            await client.result("prune")
            diagnostics = await client.result("diagnostics", {})
            assert diagnostics["admitted"] == 7
            assert diagnostics["deliveryFailures"] == 1
            health = await client.result("health")
            # The process's own: its version, since when it runs (ISO) and for how long.
            assert health.pop("version") == version("prismd")
            started = health.pop("startedAt")
            uptime = health.pop("uptimeMs")
            assert isinstance(uptime, int) and 0 <= uptime < 3_600_000
            at = dt.datetime.fromisoformat(started.replace("Z", "+00:00")).timestamp()
            assert abs(at * 1000 + uptime - time.time() * 1000) < 5_000
            assert health == {
                "status": "ok",
                "children": {"web": "running"},
            }
            assert await client.result(
                "notify",
                {
                    "connectionId": "web",
                    "externalConversationId": "chat-1",
                    "threadId": "t-9",
                    "notifyId": "n-1",
                    "text": "deploy finished",
                },
            ) == {"status": "accepted", "reason": None, "operationId": "op-n", "duplicate": False}
            assert await client.result(
                "pair", {"connectionId": "web", "aliases": ["echo"], "ttlMs": 60000}
            ) == {
                "token": "pair-token-abc",
                "expiresAt": "2026-01-01T00:05:00.000Z",
                "connectionId": "web",
            }
    names = [name for name, _ in runtime.calls]
    assert names == [
        "list_unresolved",
        "reconcile",
        "prune",
        "prune",
        "diagnostics",
        "notify",
        "create_pairing",
    ]
    calls = dict(runtime.calls[:2])
    for _name, kwargs in runtime.calls:
        if "identity" in kwargs:
            identity = kwargs["identity"]
            assert identity.tenant_id == "acme"
            assert identity.user_id == "ann"
            assert identity.account_id is None
            assert identity.principal.kind == "operator"
            assert identity.principal.id == str(os.getuid())
    assert calls["list_unresolved"]["limit"] == 1
    assert calls["reconcile"]["expected_version"] == 3
    assert calls["reconcile"]["acknowledge_duplicate_risk"] is True
    assert runtime.calls[2][1]["now_ms"] == 1769904000000
    assert runtime.calls[3][1]["now_ms"] is None
    notify = runtime.calls[5][1]
    assert (notify["external_conversation_id"], notify["thread_id"], notify["text"]) == (
        "chat-1",
        "t-9",
        "deploy finished",
    )
    assert runtime.calls[6][1]["aliases"] == ("echo",)
    assert runtime.calls[6][1]["ttl_ms"] == 60000


async def test_daemon_uid_is_default_operator_and_others_need_a_listing(tmp_path: Path) -> None:
    uid = os.getuid()
    with trio.fail_after(DEADLINE):
        async with (
            running_server(control(tmp_path), daemon_uid=uid) as (runtime, _),
            connect(control(tmp_path).socket) as client,
        ):
            await client.result("listUnresolved")
            assert runtime.calls[0][1]["identity"].tenant_id == "default"
        # Not the daemon's uid and not listed: refused.
        other = tmp_path / "other"
        async with (
            running_server(control(other), daemon_uid=uid + 1) as (runtime, _),
            connect(control(other).socket) as client,
        ):
            await client.send_raw(b'{"jsonrpc":"2.0","id":1,"method":"health"}\n')
            message = await client.read_message()
            assert message == {
                "jsonrpc": "2.0",
                "id": None,
                "error": {"code": -32001, "message": "permission denied"},
            }
            assert await client.read_line() is None
            assert runtime.calls == []


async def _save(store: MemoryStore, key: str, scope: OwnershipScope) -> None:
    await store.checkpoints.save_checkpoint(
        namespace="test.ns", key=key, scope=scope, version=1, value={"n": 1}, category="cat"
    )


async def test_events_pages_and_scope(tmp_path: Path) -> None:
    store = MemoryStore()
    acme = OwnershipScope("acme", "web", "u1")
    await _save(store, "a", acme)
    await _save(store, "b", OwnershipScope("other", "web", "u2"))
    await _save(store, "c", OwnershipScope("acme", "web", "u3"))
    config = control(tmp_path, operators=(Operator(uid=os.getuid(), tenant="acme"),))
    with trio.fail_after(DEADLINE):
        async with running_server(config, store=store), connect(config.socket) as client:
            page = await client.result("events", {})
            assert [e["key"] for e in page["events"]] == ["a", "c"]
            first = page["events"][0]
            assert first["action"] == "save"
            assert first["namespace"] == "test.ns"
            assert first["scope"] == {"tenantId": "acme", "accountId": "web", "userId": "u1"}
            assert first["version"] == 1
            assert first["category"] == "cat"
            assert isinstance(first["seq"], int)
            assert isinstance(first["atMs"], int)
            assert page["cursor"] >= page["events"][1]["seq"]
            later = await client.result("events", {"after": page["events"][0]["seq"]})
            assert [e["key"] for e in later["events"]] == ["c"]
            empty = await client.result("events", {"after": page["cursor"]})
            assert empty["events"] == []
            assert empty["cursor"] == page["cursor"]
            limited = await client.result("events", {"limit": 1})
            assert [e["key"] for e in limited["events"]] == ["a"]


async def test_events_follow_streams_until_client_closes(tmp_path: Path) -> None:
    store = MemoryStore()
    await _save(store, "a", OwnershipScope("default", "web", "u1"))
    config = control(tmp_path)
    with trio.fail_after(DEADLINE):
        async with running_server(config, store=store):
            async with connect(config.socket) as client:
                await client.send_raw(
                    b'{"jsonrpc":"2.0","id":9,"method":"events","params":{"follow":true}}\n'
                )
                first = await client.read_message()
                assert first["id"] == 9
                assert [e["key"] for e in first["result"]["events"]] == ["a"]
                await _save(store, "b", OwnershipScope("default", "web", "u1"))
                await _save(store, "c", OwnershipScope("default", "web", "u1"))
                seen: list[str] = []
                while len(seen) < 2:
                    message = await client.read_message()
                    assert message["id"] == 9
                    assert message["result"]["events"], "only non-empty pages after the first"
                    seen += [e["key"] for e in message["result"]["events"]]
                assert seen == ["b", "c"]
                assert message["result"]["cursor"] == message["result"]["events"][-1]["seq"]
            # The follower ended when the client closed; the server keeps serving.
            async with connect(config.socket) as client:
                assert (await client.result("health"))["status"] == "ok"


async def test_out_of_file_descriptors_does_not_stop_the_server(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = control(tmp_path)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with trio.fail_after(DEADLINE):
        async with running_server(config):
            late = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            late.setblocking(False)
            lowest_free = os.dup(late.fileno())  # new descriptors take the lowest free number
            os.close(lowest_free)
            # No new descriptor can be allocated now: the server's accept() gets EMFILE.
            resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
            try:
                with contextlib.suppress(BlockingIOError):
                    late.connect(config.socket)
                await trio.sleep(0.3)
            finally:
                resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
            client_stream = trio.SocketStream(trio.socket.from_stdlib_socket(late))
            async with client_stream:
                client = Client(client_stream)
                assert (await client.result("health"))["status"] == "ok"
    assert "EMFILE" in caplog.text
    assert all(r.exc_info is None and not r.exc_text for r in caplog.records), "no traceback"


async def test_pair_aliases_default_from_the_pairing_grant(tmp_path: Path) -> None:
    grants = (
        GrantConfig(connection="web", actors=("*",), aliases=("echo",)),
        GrantConfig(connection="tg", pairing=True, aliases=("echo", "helper")),
        GrantConfig(connection="tg", pairing=True, aliases=("other",)),
    )
    config = control(tmp_path)
    with trio.fail_after(DEADLINE):
        async with (
            running_server(config, pair_aliases=pairing_aliases_from_grants(grants)) as (
                runtime,
                _,
            ),
            connect(config.socket) as client,
        ):
            await client.result("pair", {"connectionId": "tg"})
            assert runtime.calls[-1][1]["aliases"] == ("echo", "helper")
            await client.result("pair", {"connectionId": "tg", "aliases": ["x"]})
            assert runtime.calls[-1][1]["aliases"] == ("x",)
            # No pairing grant: the missing [[grants]] entry is named (it was "-32602
            # 'aliases' is required", which sent the operator looking for the wrong fix).
            message = await client.call("pair", {"connectionId": "web"})
            assert message["error"] == {
                "code": -32002,
                "message": "pairing unavailable: "
                "no [[grants]] entry for connection 'web' with pairing = true",
            }
    assert len(runtime.calls) == 2


def test_to_wire_converts_attrs_field_names_only() -> None:
    entry = UnresolvedEntry("op", "web", "accepted", 1, "2026-01-01T00:00:00.000Z")
    assert to_wire({"keep_snake": (entry,)}) == {
        "keep_snake": [
            {
                "operationId": "op",
                "connectionId": "web",
                "state": "accepted",
                "version": 1,
                "updatedAt": "2026-01-01T00:00:00.000Z",
                "replyState": None,
                "reason": None,
            }
        ]
    }


# ---------------------------------------------------------------- another uid, for real

# A refusal by uid without a second real uid is covered above (daemon_uid=uid + 1).
as_nobody = needs_root("connects as uid 65534 (nobody) to check SO_PEERCRED for real")

CLIENT = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
s.connect(sys.argv[1])
s.sendall(b'{"jsonrpc":"2.0","id":1,"method":"health"}\n')
data = b""
while True:
    chunk = s.recv(65536)
    if not chunk:
        break
    data += chunk
    if data.count(b"\n") and b"permission denied" not in data:
        break
print(json.dumps({"lines": data.decode().splitlines(), "closed": not chunk}))
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


async def _run_as_nobody(socket_path: str) -> dict[str, object]:
    python = shutil.which("python3", path="/usr/bin") or sys.executable
    result = await trio.run_process(
        [python, "-I", "-c", CLIENT, socket_path],
        user=65534,
        group=65534,
        extra_groups=[],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr.decode()
    decoded = json.loads(result.stdout)
    assert isinstance(decoded, dict)
    return decoded


@as_nobody
async def test_another_uid_is_refused(shared_dir: Path) -> None:
    # Group access lets nobody reach the socket; the uid check must still refuse it.
    config = ControlConfig(
        socket=str(shared_dir / "run" / "control.sock"), group=grp.getgrgid(65534).gr_name
    )
    with trio.fail_after(DEADLINE):
        async with running_server(config, daemon_uid=os.getuid()) as (runtime, _):
            outcome = await _run_as_nobody(config.socket)
            assert outcome["closed"] is True
            lines = outcome["lines"]
            assert isinstance(lines, list)
            assert [json.loads(line) for line in lines] == [
                {
                    "jsonrpc": "2.0",
                    "id": None,
                    "error": {"code": -32001, "message": "permission denied"},
                }
            ]
            assert runtime.calls == []
            async with connect(config.socket) as client:
                assert (await client.result("health"))["status"] == "ok"


@as_nobody
async def test_listed_uid_is_an_operator(shared_dir: Path) -> None:
    config = ControlConfig(
        socket=str(shared_dir / "run" / "control.sock"),
        group=grp.getgrgid(65534).gr_name,
        operators=(Operator(uid=65534, tenant="nobody-tenant"),),
    )
    with trio.fail_after(DEADLINE):
        async with running_server(config, daemon_uid=os.getuid()):
            outcome = await _run_as_nobody(config.socket)
            lines = outcome["lines"]
            assert isinstance(lines, list)
            assert json.loads(lines[0])["result"]["status"] == "ok"


@as_nobody
async def test_without_group_the_socket_is_unreachable_for_others(shared_dir: Path) -> None:
    config = ControlConfig(
        socket=str(shared_dir / "run" / "control.sock"),
        operators=(Operator(uid=65534),),
    )
    with trio.fail_after(DEADLINE):
        async with running_server(config, daemon_uid=os.getuid()):
            python = shutil.which("python3", path="/usr/bin") or sys.executable
            result = await trio.run_process(
                [python, "-I", "-c", CLIENT, config.socket],
                user=65534,
                group=65534,
                extra_groups=[],
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
            assert result.returncode != 0
            assert b"PermissionError" in result.stderr


# ---------------------------------------------------------------- fuzzing the framing


async def test_random_lines_each_get_one_answer(tmp_path: Path) -> None:
    rng = random.Random(4)
    lines: list[bytes] = []
    for _ in range(200):
        kind = rng.randrange(4)
        if kind == 0:
            raw = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 80)))
        elif kind == 1:
            raw = json.dumps(
                {"jsonrpc": "2.0", "id": rng.randrange(9), "method": rng.choice(METHODS)}
            ).encode()
        elif kind == 2:
            raw = json.dumps(
                {
                    "jsonrpc": "2.0",
                    "id": "x",
                    "method": rng.choice(METHODS),
                    "params": {rng.choice(PARAM_NAMES): rng.choice(VALUES)},
                }
            ).encode()
        else:
            raw = b'{"jsonrpc":"2.0","id":1,"method":"health","params":' + bytes(
                rng.randrange(32, 127) for _ in range(rng.randrange(0, 20))
            )
        raw = raw.replace(b"\n", b" ")
        if raw.strip():
            lines.append(raw + b"\n")
    config = control(tmp_path)
    with trio.fail_after(DEADLINE):
        async with running_server(config), connect(config.socket) as client:
            for raw in lines:
                await client.send_raw(raw)
                message = await client.read_message()
                assert message["jsonrpc"] == "2.0"
                assert ("result" in message) != ("error" in message)
            assert (await client.result("health"))["status"] == "ok"


METHODS = [
    "listUnresolved",
    "reconcile",
    "prune",
    "diagnostics",
    "health",
    "notify",
    "pair",
    "events",
    "bogus",
    "",
]
PARAM_NAMES = ["limit", "connectionId", "now", "after", "aliases", "ttlMs", "zzz"]
VALUES: list[object] = [None, 0, -1, 2**70, 1.5, "", "x", [], ["a"], {}, True]
