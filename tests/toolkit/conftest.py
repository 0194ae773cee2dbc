"""Shared pieces of the toolkit tests."""

from __future__ import annotations

import trio


class TrioClock:
    """Store wall clock that follows Trio's (virtual) clock, so leases expire in test time."""

    def now_ms(self) -> int:
        return 1_700_000_000_000 + int(trio.current_time() * 1000)
