"""A shard's gateway state for ``health()`` and the log lines every part shares."""

from __future__ import annotations

import logging

import attrs

log = logging.getLogger("prismd.discord")

STATES = (
    "idle",
    "starting",
    "standby",
    "identify_wait",
    "connecting",
    "resuming",
    "connected",
    "backfilling",
    "backoff",
    "failed",
    "stopped",
)
"""``failed`` stays after ``run`` ends: a fatal close (bad token, intents) says why."""


@attrs.define(eq=False)
class ShardStatus:
    state: str = "idle"
    reason: str | None = None
    """Why it failed (fixed text from the close-code table)."""
    session_started_at: float | None = None
    """``trio.current_time()`` of the READY of the session in use."""
    last_event_at: float | None = None
    resumes: int = 0
    identifies: int = 0
    backfilled: int = 0
    not_backfilled: int = 0
    """Channels whose gap was longer than a backfill reads (logged, never assumed)."""

    def stopped(self) -> None:
        if self.state != "failed":
            self.state = "stopped"
