"""Channel limits (contract §6.1): defaults, hard caps, validation.

Config keys under ``[limits]`` are exactly these attribute names.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

KIB = 1024
MIB = 1024 * 1024

# name -> (default, hard cap)
LIMIT_TABLE: dict[str, tuple[int, int]] = {
    "max_input_bytes": (32 * KIB, 64 * KIB),
    "max_response_bytes": (64 * KIB, 128 * KIB),
    "max_pending_per_binding": (8, 32),
    "max_pending_per_process": (100, 500),
    "max_active_sessions": (4, 16),
    "max_routes": (1_000, 10_000),
    "max_seen_events_per_connection": (1_000, 10_000),
    "stop_deadline_ms": (30_000, 300_000),
    "retention_days": (7, 90),
    "max_journal_page": (100, 500),
    "max_journal_record_bytes": (128 * KIB, 512 * KIB),
    "lease_ttl_ms": (30_000, 300_000),
    "approval_ttl_ms": (300_000, 300_000),
    "max_attachment_bytes": (1 * MIB, 4 * MIB),
    "max_remote_tasks_per_tenant": (100, 100_000),
}


def _check(name: str) -> Any:
    cap = LIMIT_TABLE[name][1]

    def validator(_inst: object, _attr: object, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"limit {name} must be a number, got {type(value).__name__}")
        if not math.isfinite(value) or not 1 <= value <= cap:
            raise ValueError(f"limit {name} must be between 1 and {cap}, got {value}")

    return validator


def _field(name: str) -> Any:
    return attrs.field(default=LIMIT_TABLE[name][0], validator=_check(name))


@attrs.frozen
class Limits:
    """Every value is finite and within [1, hard cap]; anything else raises on construction."""

    max_input_bytes: int = _field("max_input_bytes")
    max_response_bytes: int = _field("max_response_bytes")
    max_pending_per_binding: int = _field("max_pending_per_binding")
    max_pending_per_process: int = _field("max_pending_per_process")
    max_active_sessions: int = _field("max_active_sessions")
    max_routes: int = _field("max_routes")
    max_seen_events_per_connection: int = _field("max_seen_events_per_connection")
    stop_deadline_ms: int = _field("stop_deadline_ms")
    retention_days: int = _field("retention_days")
    max_journal_page: int = _field("max_journal_page")
    max_journal_record_bytes: int = _field("max_journal_record_bytes")
    lease_ttl_ms: int = _field("lease_ttl_ms")
    approval_ttl_ms: int = _field("approval_ttl_ms")
    max_attachment_bytes: int = _field("max_attachment_bytes")
    max_remote_tasks_per_tenant: int = _field("max_remote_tasks_per_tenant")
    """Remote A2A tasks followed at once per tenant; a message beyond it is refused before
    any send."""
