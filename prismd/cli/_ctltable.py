"""prismctl's tables: left-aligned columns, nested results as dotted ``key  value`` pairs,
the event stream's columns and the health summary. Standard library only."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any, TextIO


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, Mapping):
        return ",".join(f"{k}={cell(v)}" for k, v in value.items() if v is not None) or "-"
    if isinstance(value, list | tuple):
        return ",".join(cell(v) for v in value) or "-"
    return str(value)


def print_table(
    rows: Sequence[Mapping[str, Any]],
    columns: Sequence[tuple[str, str]],
    out: TextIO,
    *,
    heading: bool = True,
    widths: Sequence[int] | None = None,
) -> None:
    """Left-aligned columns; ``columns`` are (key, heading) pairs. Fixed ``widths`` (a
    followed stream's pages line up) shorten longer cells in the middle."""
    cells = [[cell(row.get(key)) for key, _ in columns] for row in rows]
    headings = [heading for _, heading in columns]
    if widths is None:
        widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headings)]
    else:
        cells = [[_shorten(c, w) for c, w in zip(r, widths, strict=True)] for r in cells]
    for line in [headings, *cells] if heading else cells:
        out.write("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() + "\n")


def _shorten(text: str, width: int) -> str:
    """``text`` in at most ``width`` characters: both ends kept (ids differ at either)."""
    if len(text) <= width:
        return text
    head = (width - 1) // 2
    return f"{text[:head]}…{text[len(text) - (width - 1 - head) :]}"


def print_pairs(pairs: Mapping[str, Any], out: TextIO, prefix: str = "") -> None:
    """``key  value`` lines; nested mappings are flattened with dotted keys."""
    flat: list[tuple[str, str]] = []

    def walk(mapping: Mapping[str, Any], prefix: str) -> None:
        for key, value in mapping.items():
            if isinstance(value, Mapping) and value:
                walk(value, f"{prefix}{key}.")
            else:
                flat.append((f"{prefix}{key}", cell(value)))

    walk(pairs, prefix)
    width = max((len(k) for k, _ in flat), default=0)
    for key, value in flat:
        out.write(f"{key.ljust(width)}  {value}\n")


UNRESOLVED_COLUMNS = [
    ("operationId", "OPERATION"),
    ("connectionId", "CONNECTION"),
    ("state", "STATE"),
    ("replyState", "REPLY"),
    ("version", "VERSION"),
    ("updatedAt", "UPDATED"),
    ("reason", "REASON"),
]
EVENT_COLUMNS = [
    ("seq", "SEQ"),
    ("time", "TIME (UTC)"),
    ("action", "ACTION"),
    ("kind", "KIND"),
    ("state", "STATE"),
    ("version", "VER"),
    ("key", "KEY"),
]
EVENT_WIDTHS = (9, 19, 6, 9, 17, 4, 24)
"""The least width of each column: the pages of ``events --follow`` line up while their
cells fit; a longer cell widens its column (never cut), except the key, which is shortened
in the middle to its width."""
EVENT_KEY_COLUMN = len(EVENT_COLUMNS) - 1
REMOTE_TASK_COLUMNS = [
    ("alias", "ALIAS"),
    ("remoteTaskId", "REMOTE TASK"),
    ("phase", "PHASE"),
    ("state", "STATE"),
    ("lastObservation", "LAST OBSERVATION"),
    ("nextPoll", "NEXT POLL"),
    ("owner", "OWNER"),
    ("operationId", "OPERATION"),
    ("connectionId", "CONNECTION"),
    ("version", "VERSION"),
]
INBOX_COLUMNS = [
    ("connectionId", "CONNECTION"),
    ("updateId", "UPDATE"),
    ("state", "STATE"),
    ("attempts", "ATTEMPTS"),
    ("error", "ERROR"),
    ("updatedAt", "UPDATED"),
]


def event_row(event: Mapping[str, Any]) -> dict[str, Any]:
    """An event as the table shows it: its time, and what the journal's metadata says it
    is (the namespace when it says nothing)."""
    metadata = event.get("metadata")
    meta: Mapping[str, Any] = metadata if isinstance(metadata, Mapping) else {}
    at = event.get("atMs")
    shown = None
    if isinstance(at, int) and not isinstance(at, bool):
        shown = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at // 1000))
    return {
        "seq": event.get("seq"),
        "time": shown,
        "action": event.get("action"),
        "kind": meta.get("kind") or event.get("namespace"),
        "state": meta.get("state"),
        "version": event.get("version"),
        "key": event.get("key"),
    }


def print_events(
    events: Sequence[Mapping[str, Any]],
    out: TextIO,
    *,
    heading: bool,
    widths: Sequence[int] = EVENT_WIDTHS,
) -> tuple[int, ...]:
    """The events as a table; returns the widths used (pass them to the next page of a
    followed stream, so its columns stay where they were unless a cell needs more)."""
    rows = [event_row(e) for e in events]
    used = list(widths)
    for row in rows:
        for index, (key, _) in enumerate(EVENT_COLUMNS):
            if index != EVENT_KEY_COLUMN:
                used[index] = max(used[index], len(cell(row.get(key))))
    print_table(rows, EVENT_COLUMNS, out, heading=heading, widths=used)
    return tuple(used)


def duration(ms: int) -> str:
    """``ms`` for people: ``45s``, ``5m 02s``, ``2h 03m 04s``, ``3d 04h 05m``."""
    seconds = max(0, ms) // 1000
    days, rest = divmod(seconds, 86_400)
    hours, rest = divmod(rest, 3600)
    minutes, seconds = divmod(rest, 60)
    if days:
        return f"{days}d {hours:02}h {minutes:02}m"
    if hours:
        return f"{hours}h {minutes:02}m {seconds:02}s"
    if minutes:
        return f"{minutes}m {seconds:02}s"
    return f"{seconds}s"


def print_health(health: Mapping[str, Any], out: TextIO) -> None:
    """The daemon's status, version and uptime first, then every other field as dotted pairs (each
    child's supervisor state and its adapter's: mode, last update seen, last error)."""
    rest = dict(health)
    version = rest.pop("version", None)
    started = rest.pop("startedAt", None)
    uptime = rest.pop("uptimeMs", None)
    head: dict[str, Any] = {"status": rest.pop("status")} if "status" in rest else {}
    if version is not None:
        head["version"] = version
    if isinstance(uptime, int) and not isinstance(uptime, bool):
        since = ""
        if isinstance(started, str) and len(started) >= 19:
            since = f" (since {started[:10]} {started[11:19]} UTC)"
        head["uptime"] = duration(uptime) + since
    print_pairs({**head, **rest}, out)
