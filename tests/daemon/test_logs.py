"""prismd.logs: plain/json output, and no token, bot URL or registered secret at any level."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from prismd import logs

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
    logs.configure_logging("debug", "plain", stream=stream)
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
    # No timestamps: journald adds them.
    assert all(not line[:4].isdigit() for line in lines)


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
    logs.configure_logging("warning", "plain", stream=stream)
    logging.getLogger("prismd.x").info("hidden")
    logging.getLogger("prismd.x").warning("shown")
    assert stream.getvalue() == "WARNING prismd.x: shown\n"
    with pytest.raises(ValueError, match="log level"):
        logs.configure_logging("verbose", "plain")
    with pytest.raises(ValueError, match="log format"):
        logs.configure_logging("info", "xml")  # type: ignore[arg-type]


def test_reconfigure_replaces_the_handler() -> None:
    first, second = io.StringIO(), io.StringIO()
    logs.configure_logging("info", "plain", stream=first)
    logs.configure_logging("info", "plain", stream=second)
    logging.getLogger("prismd.x").info("once")
    assert first.getvalue() == ""
    assert second.getvalue() == "INFO prismd.x: once\n"


def test_reopen_after_rotation(tmp_path: Path) -> None:
    path = tmp_path / "prismd.log"
    logs.configure_logging("info", "plain", path=str(path))
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
