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
    session_started_ms: int | None = None
    """When the session in use began (its READY; Unix ms, kept across restarts and
    takeovers with the session)."""
    last_event_ms: int | None = None
    """When the gateway last sent anything (Unix ms): a frame, a heartbeat ACK."""
    resumes: int = 0
    identifies: int = 0
    backfilled: int = 0
    not_backfilled: int = 0
    """Channels whose gap was longer than a backfill reads (logged, never assumed)."""
    swept: int = 0
    """Messages a sweep admitted: the gateway had not sent them (:mod:`._sweep`)."""

    def stopped(self) -> None:
        if self.state != "failed":
            self.state = "stopped"
