"""Bounded exponential backoff with jitter, the one retry pacing every adapter uses."""

from __future__ import annotations

import random as _random

import attrs

__all__ = ["Backoff"]


@attrs.define(eq=False)
class Backoff:
    """``base_s``, twice that, four times … up to ``cap_s``; each delay scaled by a random
    factor in [0.5, 1] so receivers that failed together do not retry together.

    :meth:`next_delay` counts a failure and returns the wait before the next try;
    :meth:`reset` after a success starts over at ``base_s``. Never a hot loop: every delay
    is at least ``base_s / 2``.

    >>> backoff = Backoff(_random.Random(1), base_s=1.0, cap_s=30.0)
    >>> [round(backoff.next_delay(), 2) for _ in range(3)]
    [0.57, 1.85, 3.53]
    """

    random: _random.Random = attrs.field(factory=_random.Random)
    base_s: float = attrs.field(default=1.0)
    cap_s: float = 30.0
    failures: int = attrs.field(default=0, init=False)

    @base_s.validator
    def _check(self, _a: object, value: float) -> None:
        if not 0 < value <= self.cap_s:
            raise ValueError("base_s must be positive and at most cap_s")

    def next_delay(self, minimum: float = 0.0) -> float:
        """The wait after one more failure (at least ``minimum``: a server's own spacing)."""
        delay = min(self.cap_s, self.base_s * 2.0**self.failures)
        # 2**16 times the base is past any sensible cap; stop counting there.
        self.failures = min(self.failures + 1, 16)
        return max(minimum, delay * (0.5 + self.random.random() / 2))

    def reset(self) -> None:
        self.failures = 0
