"""Waits that one call cuts short: :class:`Interrupts`."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import attrs
import trio

__all__ = ["Interrupts"]


@attrs.define(eq=False)
class Interrupts:
    """The regions (waits, mostly) open now that one call cancels all at once.

    :meth:`interrupt` cancels the regions open now; a region opened later runs. :meth:`stop`
    does the same and latches: a region opened after it is cancelled as it opens, until
    :attr:`stopped` is set back to ``False``. A region's scope says whether it was cut
    (``cancelled_caught``).
    """

    stopped: bool = False
    _open: set[trio.CancelScope] = attrs.field(factory=set, repr=False)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[trio.CancelScope]:
        """A region that :meth:`interrupt` and :meth:`stop` cancel."""
        scope = trio.CancelScope()
        if self.stopped:
            scope.cancel()
        self._open.add(scope)
        try:
            with scope:
                yield scope
        finally:
            self._open.discard(scope)

    def interrupt(self) -> None:
        for scope in self._open:
            scope.cancel()

    def stop(self) -> None:
        self.stopped = True
        self.interrupt()
