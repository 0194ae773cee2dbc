"""prismd.logs: plain/json output, and no token, bot URL or registered secret at any level."""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from prismd.daemon import _logs as logs
from prismd.grants import ownership_from_identity
from prismd.journal import operation_id_for
from prismd.journal._journal import NS_BINDING, binding_key
from prismd.runtime._leases import LoggedLeases, route_tag
from stores import OwnershipScope
from stores.memory import MemoryStore
from tests.support.builders import event, grant, identity
from tests.support.clocks import ManualClock, TrioClock
from tests.support.harness import Host, runtime
from tests.support.scripted import ScriptedAgent

from .helpers import chat, running_daemon, write_config

TOKEN = "123456789:AAHdqTcvCH1vGWJxfSeofSAs0K5PALDsaw"
SECRET_TEXT = "my-webchat-access-s3cret"


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    noisy = {name: logging.getLogger(name).level for name in ("httpx", "httpcore")}
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
            handler.close()
    root.setLevel(level)
    for name, value in noisy.items():
        logging.getLogger(name).setLevel(value)
    logs._installed.clear()


def emit_everything() -> None:
    """A debug-level run's worth of records that carry secrets in every possible place."""
    log = logging.getLogger("prismd.adapters.telegram")
    log.debug("calling https://api.telegram.org/bot%s/getUpdates?timeout=30", TOKEN)
    log.info("token in message %s and in text " + TOKEN, TOKEN)
    log.info("file at https://api.telegram.org/file/bot%s/photos/file_7.jpg", TOKEN)
    log.warning("registered secret %s appears", SECRET_TEXT)
    log.debug("plain %s", {"url": f"http://127.0.0.1:9/bot{TOKEN}/sendMessage"})
    try:
        raise RuntimeError(f"request to /bot{TOKEN}/sendMessage failed ({SECRET_TEXT})")
    except RuntimeError:
        log.exception("send failed")
    # httpx logs the request URL (with the token) at INFO.
    transport = httpx.MockTransport(lambda request: httpx.Response(200, json={"ok": True}))
    with httpx.Client(transport=transport) as client:
        client.get(f"https://api.telegram.org/bot{TOKEN}/getMe")
    logging.getLogger("httpx").setLevel(logging.DEBUG)  # someone re-enables it: still dropped
    logging.getLogger("httpx").info("HTTP Request: GET https://x/bot%s/getMe", TOKEN)
    logging.getLogger("httpcore.connection").debug("connect_tcp.started host='api'")
    logging.getLogger("httpx").warning("a warning from httpx with %s", TOKEN)
    log.info("ordinary record %d", 42)


def check_clean(output: str) -> None:
    assert TOKEN not in output
    assert TOKEN.split(":")[1] not in output
    assert SECRET_TEXT not in output
    assert "/bot1" not in output
    assert "file_7.jpg" not in output


def test_debug_run_never_prints_secrets_plain() -> None:
    stream = io.StringIO()
    logs.configure_logging("debug", "plain", stream=stream, timestamps=False)
    logs.register_secret(SECRET_TEXT)
    emit_everything()
    output = stream.getvalue()
    check_clean(output)
    lines = output.splitlines()
    assert lines[0] == (
        "DEBUG prismd.adapters.telegram: calling "
        "https://api.telegram.org/bot[REDACTED]/getUpdates?timeout=30"
    )
    assert "INFO prismd.adapters.telegram: ordinary record 42" in lines
    assert "ERROR prismd.adapters.telegram: send failed" in lines
    assert any("RuntimeError: request to /bot[REDACTED]/sendMessage" in line for line in lines)
    assert "registered secret [REDACTED] appears" in output
    assert "HTTP Request" not in output
    assert "connect_tcp" not in output
    assert "WARNING httpx: a warning from httpx with [REDACTED]" in lines
    assert all(not line[:4].isdigit() for line in lines)  # timestamps=False: bare lines


def test_debug_run_never_prints_secrets_json() -> None:
    stream = io.StringIO()
    logs.configure_logging("debug", "json", stream=stream)
    logs.register_secret(SECRET_TEXT)
    emit_everything()
    output = stream.getvalue()
    check_clean(output)
    records = [json.loads(line) for line in output.splitlines()]
    assert records[0]["level"] == "debug"
    assert records[0]["logger"] == "prismd.adapters.telegram"
    assert "time" in records[0]
    assert any("exc" in record and "RuntimeError" in record["exc"] for record in records)
    assert {"level": "info", "message": "ordinary record 42"}.items() <= records[-1].items()


def test_level_filters_and_bad_arguments() -> None:
    stream = io.StringIO()
    logs.configure_logging("warning", "plain", stream=stream, timestamps=False)
    logging.getLogger("prismd.x").info("hidden")
    logging.getLogger("prismd.x").warning("shown")
    assert stream.getvalue() == "WARNING prismd.x: shown\n"
    with pytest.raises(ValueError, match="log level"):
        logs.configure_logging("verbose", "plain")
    with pytest.raises(ValueError, match="log format"):
        logs.configure_logging("info", "xml")  # type: ignore[arg-type]


def test_reconfigure_replaces_the_handler() -> None:
    first, second = io.StringIO(), io.StringIO()
    logs.configure_logging("info", "plain", stream=first, timestamps=False)
    logs.configure_logging("info", "plain", stream=second, timestamps=False)
    logging.getLogger("prismd.x").info("once")
    assert first.getvalue() == ""
    assert second.getvalue() == "INFO prismd.x: once\n"


def test_reopen_after_rotation(tmp_path: Path) -> None:
    path = tmp_path / "prismd.log"
    logs.configure_logging("info", "plain", path=str(path), timestamps=False)
    logging.getLogger("prismd.x").info("before")
    path.rename(tmp_path / "prismd.log.1")
    logs.reopen()
    logging.getLogger("prismd.x").info("after %s", TOKEN)
    assert (tmp_path / "prismd.log.1").read_text() == "INFO prismd.x: before\n"
    assert path.read_text() == "INFO prismd.x: after [REDACTED]\n"
    stream = io.StringIO()
    logs.configure_logging("info", "plain", stream=stream)
    logs.reopen()  # a stream is only flushed


def test_redact_helper() -> None:
    assert logs.redact(f"x {TOKEN} y") == "x [REDACTED] y"
    assert logs.redact("https://h/botABC/getMe") == "https://h/bot[REDACTED]/getMe"
    assert logs.redact("short 12:abc") == "short 12:abc"
    logs.register_secret("ab")  # too short to redact safely: ignored
    assert logs.redact("abc") == "abc"


# ---------------------------------------------------------------------- timestamps

TIME_RE = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00"


def test_plain_lines_carry_a_utc_timestamp_off_journald(tmp_path: Path) -> None:
    stream = io.StringIO()
    before = dt.datetime.now(dt.UTC)
    logs.configure_logging("info", "plain", stream=stream, env={})
    logging.getLogger("prismd.x").info("stamped %s", TOKEN)
    line = stream.getvalue()
    match = re.fullmatch(rf"({TIME_RE}) INFO prismd\.x: stamped \[REDACTED\]\n", line)
    assert match is not None, line
    stamp = dt.datetime.fromisoformat(match.group(1))
    assert before - dt.timedelta(seconds=1) <= stamp <= dt.datetime.now(dt.UTC)
    # a log file is never journald's stream
    path = tmp_path / "prismd.log"
    logs.configure_logging("info", "plain", path=str(path), env={"JOURNAL_STREAM": "1:2"})
    logging.getLogger("prismd.x").info("to file")
    assert re.fullmatch(rf"{TIME_RE} INFO prismd\.x: to file\n", path.read_text())


def test_journald_stream_is_recognised_by_device_and_inode(tmp_path: Path) -> None:
    with open(tmp_path / "journal", "w") as journal, open(tmp_path / "other", "w") as other:
        stat = os.fstat(journal.fileno())
        env = {"JOURNAL_STREAM": f"{stat.st_dev}:{stat.st_ino}"}
        assert logs.is_journal_stream(journal, env)
        assert not logs.is_journal_stream(other, env)  # inherited variable, stderr elsewhere
        assert not logs.is_journal_stream(journal, {})
        assert not logs.is_journal_stream(journal, {"JOURNAL_STREAM": "garbage"})
        assert not logs.is_journal_stream(io.StringIO(), env)
        logs.configure_logging("info", "plain", stream=journal, env=env)
        logging.getLogger("prismd.x").info("bare")
        logs.configure_logging("info", "plain", stream=other, env=env)
        logging.getLogger("prismd.x").info("stamped")
    assert (tmp_path / "journal").read_text() == "INFO prismd.x: bare\n"
    assert re.fullmatch(rf"{TIME_RE} INFO prismd\.x: stamped\n", (tmp_path / "other").read_text())


# ---------------------------------------------------------------------- the runtime's decisions

RUNTIME_TEXT = "runtime-secret-text-51d0"


async def test_debug_shows_admissions_and_binding_lease_decisions(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    """Admission outcomes (accepted, duplicate, denied with reason) and lease acquire /
    renew / loss / release at DEBUG; the operation id and a route hash, never text or the
    platform's chat and actor ids."""
    caplog.set_level(logging.DEBUG, logger="prismd.runtime")
    clock = TrioClock()
    store = MemoryStore(clock=clock)
    gate = trio.Event()
    host = Host(
        agent=ScriptedAgent(gate=gate),
        grant_for=lambda inp: None if inp.event_id == "3" else grant(),
    )
    scope = ownership_from_identity(identity())
    key = binding_key("tg-1", scope, "chat-1", None, "user-1", "primary")
    async with runtime(host, store, clock=clock) as rt:
        assert (await rt.admit(event("1", RUNTIME_TEXT))).status == "accepted"
        assert (await rt.admit(event("1", RUNTIME_TEXT))).duplicate
        assert (await rt.admit(event("3", RUNTIME_TEXT))).reason == "rejected"
        await trio.sleep(25)  # the run holds the lease: renewed below a third of the TTL
        assert rt.leases_held() == 1
        lease = await store.leases.get_lease(namespace=NS_BINDING, key=key, scope=scope)
        assert lease is not None
        # taken away behind the runtime's back: the next renewal finds it lost
        await store.leases.release_lease(
            namespace=NS_BINDING, key=key, scope=scope, owner_id=lease.owner_id, token=lease.token
        )
        await trio.sleep(25)
        gate.set()
        await rt.drain()
        await trio.sleep(2)  # the idle route keeps its lease for lease_idle_ms, then releases
        assert rt.leases_held() == 0
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    op1, op3 = operation_id_for("tg-1", "1"), operation_id_for("tg-1", "3")
    assert f"admission accepted: connection tg-1, {op1}" in messages
    assert f"admission duplicate: connection tg-1, {op1}" in messages
    assert f"admission denied (rejected): connection tg-1, {op3}" in messages
    lease_lines = [m for m in messages if m.startswith("binding lease")]
    tags = {m.rsplit(" ", 1)[1] for m in lease_lines}
    assert len(tags) == 1 and re.fullmatch(r"[0-9a-f]{12}", tags.pop())
    kinds = [m.split(":")[0].removeprefix("binding lease ") for m in lease_lines]
    assert kinds[0] == "acquired" and kinds[-1] == "released"
    assert "renewed" in kinds
    lost = kinds.index("lost (not renewable)")
    assert kinds[lost + 1] == "acquired"  # taken again at once: nobody else held it
    text = caplog.text
    for absent in (RUNTIME_TEXT, "chat-1", "user-1", lease.token):
        assert absent not in text


# ---------------------------------------------------------------------- the CLI's stderr

DAEMON_TEXT = "daemon-secret-text-93ab"


@pytest.mark.slow
@pytest.mark.parametrize("journald", [False, True])
async def test_prismd_run_debug_stderr(tmp_path: Path, journald: bool) -> None:
    """``prismd run --log-level debug`` (a real subprocess): its own decisions are on stderr,
    timestamped unless stderr is journald's stream, and never the message text."""
    layout = write_config(tmp_path, delay_ms=0)
    stderr_path = tmp_path / "stderr-run.log"
    stderr_path.touch()
    stat = os.stat(stderr_path)  # running_daemon truncates the same file: same inode
    stream = f"{stat.st_dev}:{stat.st_ino}" if journald else ""
    async with running_daemon(
        layout, args=("--log-level", "debug"), extra_env={"JOURNAL_STREAM": stream}
    ) as daemon:
        await daemon.wait_state("READY=1")
        async with chat(layout.port, actor="logs-actor-0001") as client:
            assert (await client.send_message("m1", DAEMON_TEXT))["status"] == "accepted"
            await client.next_frame("reply")
            assert (await client.send_message("m1", DAEMON_TEXT))["duplicate"] is True
        daemon.send(signal.SIGTERM)
        assert await daemon.wait_exit() == 0
        output = daemon.stderr()
    log_lines = [line for line in output.splitlines() if not line.startswith("prismd:")]
    assert log_lines
    prefix = "" if journald else rf"{TIME_RE} "
    for line in log_lines:
        assert re.match(rf"{prefix}(DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: ", line), line
    op = operation_id_for("web", "logs-actor-0001:m1")
    for wanted in (
        rf"DEBUG prismd\.runtime: admission accepted: connection web, {op}$",
        rf"DEBUG prismd\.runtime: admission duplicate: connection web, {op}$",
        r"DEBUG prismd\.runtime: binding lease acquired: route [0-9a-f]{12}$",
        r"DEBUG prismd\.runtime: binding lease released: route [0-9a-f]{12}$",
    ):
        assert any(re.search(rf"^{prefix}{wanted}", line) for line in log_lines), wanted
    assert DAEMON_TEXT not in output and "logs-actor-0001" not in output


async def test_every_binding_lease_outcome_has_its_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="prismd.runtime")
    clock = ManualClock()
    store = MemoryStore(clock=clock)
    leases, other_runtime = LoggedLeases(store.leases), LoggedLeases(store.leases)
    scope = OwnershipScope(tenant_id="t", account_id="a", user_id="u")
    key = "b1:web:chat-9:actor-9"
    where: dict[str, Any] = {"namespace": NS_BINDING, "key": key, "scope": scope}
    first = await leases.try_acquire_lease(**where, owner_id="me", ttl_ms=30_000)
    assert first is not None
    assert await other_runtime.try_acquire_lease(**where, owner_id="other", ttl_ms=30_000) is None
    assert await leases.renew_lease(**where, owner_id="me", token=first.token, ttl_ms=30_000)
    clock.ms += 31_000  # expired before the renewal was due: the runtime acquires again
    second = await leases.try_acquire_lease(**where, owner_id="me", ttl_ms=30_000)
    assert second is not None
    assert await leases.renew_lease(**where, owner_id="me", token=first.token, ttl_ms=1) is None
    assert await leases.release_lease(**where, owner_id="me", token=second.token)
    assert not await leases.release_lease(**where, owner_id="me", token=second.token)
    assert await leases.get_lease(**where) is None
    tag = route_tag(where["key"])
    assert [r.getMessage() for r in caplog.records] == [
        f"binding lease acquired: route {tag}",
        f"binding lease held elsewhere: route {tag}",
        f"binding lease renewed: route {tag}",
        f"binding lease lost (expired before renewal): route {tag}",
        f"binding lease acquired: route {tag}",
        f"binding lease lost (not renewable): route {tag}",
        f"binding lease released: route {tag}",
        f"binding lease already gone at release: route {tag}",
    ]
    assert first.token not in caplog.text and "chat-9" not in caplog.text
