"""The tests' wall clocks (the ``now_ms()`` protocol of ``stores.Clock``)."""

from __future__ import annotations

import attrs
import trio

EPOCH_MS = 1_700_000_000_000
"""Where every test clock starts unless told otherwise (2023-11-14T22:13:20Z)."""


@attrs.frozen
class TrioClock:
    """Milliseconds since the epoch that follow Trio's clock, so ``autojump_clock`` moves the
    wall clock too (leases expire, retention passes in virtual time).

    ``now_ms`` = ``base_ms`` + Trio time in whole milliseconds (``base_ms`` outside a run).
    """

    base_ms: int = EPOCH_MS

    def now_ms(self) -> int:
        try:
            return self.base_ms + int(trio.current_time() * 1000)
        except RuntimeError:
            return self.base_ms


@attrs.define
class ManualClock:
    """A wall clock the test moves by hand: set ``ms`` or call :meth:`advance`."""

    ms: int = EPOCH_MS

    def now_ms(self) -> int:
        return self.ms

    def advance(self, ms: int) -> None:
        self.ms += ms
