"""Logging for the daemon: plain lines (or JSON objects) on stderr, with secrets removed.

Guarantees once :func:`configure_logging` ran:

* Output is one line per record on stderr (or the given stream/file): ``TIME LEVEL logger:
  message`` (``TIME`` is UTC ISO 8601 with milliseconds), except when the stream is
  journald's (``$JOURNAL_STREAM`` names its device and inode): journald adds the time, so
  the line is bare ``LEVEL logger: message``. With ``fmt="json"`` one JSON object per line
  (``time``, ``level``, ``logger``, ``message``, ``exc``).
* Nothing that looks like a Telegram bot token (``<digits>:<30+ token chars>``), no
  ``bot<token>`` URL part (Telegram API and file URLs) and no value passed to
  :func:`register_secret` is ever written, at any level, in the message, its arguments
  or a traceback: every record is redacted by a handler filter, and the formatted line
  is redacted again before it is written.
* httpx and httpcore log every request URL (and Telegram URLs carry the token), so their
  records below WARNING are dropped, whatever level their loggers are set to; so are
  trio-websocket's per-frame records, so that ``debug`` shows prismd's own decisions.

:func:`reopen` re-opens a log file after rotation (SIGHUP); on stderr it only flushes.
Message text of users is never logged by prismd code in the first place (counters
instead); this module is the safety net for tokens.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import os
import re
import sys
import threading
from collections.abc import Mapping
from typing import Literal, TextIO

__all__ = [
    "REDACTED",
    "configure_logging",
    "is_journal_stream",
    "redact",
    "register_secret",
    "reopen",
]

REDACTED = "[REDACTED]"
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
_NOISY_LOGGERS = ("httpx", "httpcore", "hpack", "trio-websocket")
_MIN_SECRET_LEN = 4

# The Bot API token shape, and the `bot<token>` path segment of API and file URLs
# (matched even when the token part is truncated or unusual).
_TOKEN_RE = re.compile(r"\b\d{3,}:[A-Za-z0-9_-]{30,}")
_BOT_PATH_RE = re.compile(r"(/bot)[^/\s\"'?#]+")
_FILE_PATH_RE = re.compile(r"(/file/bot)[^\s\"'<>]*")

_secrets: set[str] = set()
_secrets_lock = threading.Lock()
_installed: list[logging.Handler] = []


def register_secret(value: str) -> None:
    """Never let ``value`` reach the logs (exact-string match; too-short values ignored)."""
    if isinstance(value, str) and len(value) >= _MIN_SECRET_LEN:
        with _secrets_lock:
            _secrets.add(value)


def redact(text: str) -> str:
    """``text`` with registered secrets, bot tokens and ``bot<token>`` URL parts removed."""
    with _secrets_lock:
        secrets = sorted(_secrets, key=len, reverse=True)
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    text = _FILE_PATH_RE.sub(rf"\1{REDACTED}", text)
    text = _BOT_PATH_RE.sub(rf"\1{REDACTED}", text)
    return _TOKEN_RE.sub(REDACTED, text)


class _RedactingFilter(logging.Filter):
    """Drops chatty HTTP client records; rewrites every other record without secrets."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.split(".", 1)[0] in _NOISY_LOGGERS and record.levelno < logging.WARNING:
            return False
        try:
            message = record.getMessage()
        except Exception:  # a bad format string must not lose the record
            message = f"{record.msg!r} (unformattable arguments)"
        record.msg = redact(message)
        record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact(record.exc_text)
        if record.stack_info:
            record.stack_info = redact(record.stack_info)
        return True


def _iso_time(record: logging.LogRecord) -> str:
    return _dt.datetime.fromtimestamp(record.created, tz=_dt.UTC).isoformat(timespec="milliseconds")


def is_journal_stream(stream: object, env: Mapping[str, str] = os.environ) -> bool:
    """``stream`` is the journald stream systemd connected (``$JOURNAL_STREAM`` is
    ``<device>:<inode>`` of it, as ``systemd.exec(5)`` says to check): an inherited
    variable with stderr redirected elsewhere does not count."""
    device, sep, inode = env.get("JOURNAL_STREAM", "").partition(":")
    if not sep or not device.isdigit() or not inode.isdigit():
        return False
    try:
        fileno = stream.fileno()  # type: ignore[attr-defined]
        stat = os.fstat(fileno)
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return False
    return (stat.st_dev, stat.st_ino) == (int(device), int(inode))


class _PlainFormatter(logging.Formatter):
    def __init__(self, *, timestamps: bool) -> None:
        super().__init__("%(levelname)s %(name)s: %(message)s")
        self._timestamps = timestamps

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        if self._timestamps:
            line = f"{_iso_time(record)} {line}"
        return redact(line)


class _JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": _iso_time(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": redact(record.getMessage()),
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            entry["exc"] = redact(record.exc_text)
        # Redacted field by field: rewriting the encoded line could break the JSON.
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(
    level: str = "info",
    fmt: Literal["plain", "json"] = "plain",
    *,
    stream: TextIO | None = None,
    path: str | None = None,
    timestamps: bool | None = None,
    env: Mapping[str, str] | None = None,
) -> None:
    """Install prismd's handler on the root logger (replacing one installed before).

    ``level`` is ``debug``, ``info``, ``warning`` or ``error``; ``fmt`` ``plain`` or
    ``json``. Output goes to ``path`` (appended; see :func:`reopen`) when given, else to
    ``stream``, else to ``sys.stderr``. Plain lines start with the time unless
    ``timestamps`` is false or, when it is ``None``, the output is journald's stream
    (:func:`is_journal_stream` with ``env``, default ``os.environ``). Raises
    ``ValueError`` for an unknown level or format.
    """
    numeric = LEVELS.get(level.lower()) if isinstance(level, str) else None
    if numeric is None:
        raise ValueError("log level must be debug, info, warning or error")
    if fmt not in ("plain", "json"):
        raise ValueError("log format must be plain or json")
    root = logging.getLogger()
    for old in _installed:
        root.removeHandler(old)
        if isinstance(old, logging.FileHandler):
            old.close()
    _installed.clear()
    handler: logging.Handler
    if path is not None:
        handler = logging.FileHandler(path, encoding="utf-8")
    else:
        handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.addFilter(_RedactingFilter())
    if timestamps is None:
        target = handler.stream if isinstance(handler, logging.StreamHandler) else None
        timestamps = path is not None or not is_journal_stream(
            target, os.environ if env is None else env
        )
    formatter = _PlainFormatter(timestamps=timestamps) if fmt == "plain" else _JsonFormatter()
    handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(numeric)
    for name in _NOISY_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    _installed.append(handler)


def reopen() -> None:
    """Re-open the log file after rotation (SIGHUP); flush when logging to a stream.

    Never raises: logging must not take the daemon down.
    """
    for handler in list(_installed):
        try:
            if isinstance(handler, logging.FileHandler):
                with handler.lock or contextlib.nullcontext():
                    stream = handler.stream
                    if stream is not None:
                        stream.flush()
                        stream.close()
                    # FileHandler opens the (new) file again on the next record.
                    handler.stream = None
            else:
                handler.flush()
        except Exception:
            pass
