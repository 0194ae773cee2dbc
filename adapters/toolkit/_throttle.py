"""One log line per interval for events that can come in floods."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import attrs
import trio

__all__ = ["LOG_INTERVAL_S", "LogThrottle", "quiet_note"]

LOG_INTERVAL_S = 60.0
"""How often a repeated event (a refused uid, a full budget, a failing accept) is logged."""


@attrs.define(eq=False)
class LogThrottle:
    """Lets one log line per key through per ``interval_s`` and counts the events in between,
    so that 2,000 refused connections write one line (and a count), not 2,000.

    :meth:`passes` answers ``None`` while the key's interval runs (the event is counted), else
    the number of events kept quiet since the key's last line, to say in the new line. At
    most ``max_keys`` keys are remembered (the oldest is forgotten first), so a flood of
    distinct keys cannot grow it.

    >>> now = [0.0]
    >>> throttle = LogThrottle(interval_s=60.0, clock=lambda: now[0])
    >>> throttle.passes("uid 1000"), throttle.passes("uid 1000"), throttle.passes("uid 1000")
    (0, None, None)
    >>> now[0] = 61.0
    >>> throttle.passes("uid 1000")
    2
    """

    interval_s: float = LOG_INTERVAL_S
    clock: Callable[[], float] = trio.current_time
    max_keys: int = 256
    _windows: dict[Hashable, tuple[float, int]] = attrs.field(factory=dict, init=False)
    """key → (when its next line may be written, events kept quiet since its last line)"""

    def passes(self, key: Hashable = None) -> int | None:
        now = self.clock()
        window = self._windows.get(key)
        if window is not None and now < window[0]:
            self._windows[key] = (window[0], window[1] + 1)
            return None
        self._windows.pop(key, None)
        while len(self._windows) >= self.max_keys:
            del self._windows[next(iter(self._windows))]
        self._windows[key] = (now + self.interval_s, 0)
        return 0 if window is None else window[1]


def quiet_note(count: int) -> str:
    """`` (37 more since the last line)`` for a count of quiet events, ``""`` for none."""
    return f" ({count} more since the last line)" if count else ""
