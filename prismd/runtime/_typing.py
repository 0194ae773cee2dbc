"""The typing indicator of running turns: started only once a turn's agent run has lasted
its connection's ``typing_delay_ms`` (an instant answer shows none), then renewed every
:data:`TYPING_INTERVAL_S` until the run ends — one timer task for every running turn.
"""

from __future__ import annotations

import heapq
import itertools
import logging

import attrs
import trio

from ..channel import DEFAULT_TYPING_DELAY_MS, MAX_TYPING_DELAY_MS
from ._core import Core
from ._routes import Route

__all__ = ["TYPING_INTERVAL_S", "TypingTimer", "typing_delay_s", "typing_loop"]

log = logging.getLogger("prismd.runtime")

TYPING_INTERVAL_S = 4.5


@attrs.define(eq=False)
class _Watch:
    route: Route
    due: float
    ended: bool = False
    scope: trio.CancelScope | None = None
    """The indicator's task, once started (cancelled when the run ends)."""


@attrs.define(eq=False)
class TypingTimer:
    """When each running turn's typing indicator is due, for all turns at once.

    One task of the runtime nursery sleeps until the earliest due time and starts the
    indicator (:func:`typing_loop`, in a child task under its own cancel scope: not a
    nested nursery, which would wrap the run's exceptions in an ExceptionGroup) of the
    turns still running then. A turn answered sooner — most — costs a heap entry, not a
    task of its own; the timer's task ends whenever no turn is waiting.
    """

    core: Core
    _due: list[tuple[float, int, _Watch]] = attrs.field(factory=list)
    _order: itertools.count[int] = attrs.field(factory=itertools.count)
    _changed: trio.Event = attrs.field(factory=trio.Event)
    _serving: bool = False

    def watch(self, route: Route) -> _Watch:
        """A run on ``route`` starts now; :meth:`end` it however it ends."""
        watch = _Watch(route, trio.current_time() + typing_delay_s(self.core, route.connection_id))
        heapq.heappush(self._due, (watch.due, next(self._order), watch))
        if not self._serving:
            self._serving = True
            self.core.nursery.start_soon(self._serve)
        elif self._due[0][2] is watch:
            self._changed.set()  # due before what the task sleeps for
        return watch

    def end(self, watch: _Watch) -> None:
        watch.ended = True
        if watch.scope is not None:
            watch.scope.cancel()
        elif self._due and self._due[0][2] is watch:
            self._changed.set()  # the task need not sleep for it (nor hold up a shutdown)

    async def _serve(self) -> None:
        due = self._due
        try:
            while True:
                while due and due[0][2].ended:
                    heapq.heappop(due)
                if not due:
                    return
                self._changed = trio.Event()
                with trio.move_on_at(due[0][0]):
                    await self._changed.wait()
                now = trio.current_time()
                while due and due[0][0] <= now:
                    watch = heapq.heappop(due)[2]
                    if not watch.ended:
                        watch.scope = trio.CancelScope()
                        self.core.nursery.start_soon(_typing_task, self.core, watch)
        finally:
            self._serving = False


async def _typing_task(core: Core, watch: _Watch) -> None:
    assert watch.scope is not None
    with watch.scope:
        await typing_loop(core, watch.route, delay_s=0.0)


def typing_delay_s(core: Core, connection_id: str) -> float:
    """How long a turn on ``connection_id`` runs before its typing indicator starts: the
    host's ``typing_delay_ms`` for the connection (bounded), else the default."""
    delay_ms = DEFAULT_TYPING_DELAY_MS
    if core.typing_delay_ms is not None:
        try:
            asked = core.typing_delay_ms(connection_id)
        except Exception as exc:
            log.warning("typing delay lookup failed: %s", type(exc).__name__)
        else:
            if isinstance(asked, int) and not isinstance(asked, bool):
                delay_ms = min(max(asked, 0), MAX_TYPING_DELAY_MS)
    return delay_ms / 1000


async def typing_loop(core: Core, route: Route, *, delay_s: float | None = None) -> None:
    """Call ``on_typing`` once ``delay_s`` passed (default: the connection's typing delay,
    see :func:`typing_delay_s`), then every :data:`TYPING_INTERVAL_S` until cancelled.

    Runs in a child task of the turn, cancelled when the run ends: an answer ready
    before the delay sends no indicator at all. A failing callback is logged by exception
    type only (never its text, which may carry ids or tokens) and swallowed; each call is
    bounded by the interval so a hung callback cannot pile up or outlive the run's
    cancellation check.
    """
    on_typing = core.on_typing
    if on_typing is None:
        return
    if delay_s is None:
        delay_s = typing_delay_s(core, route.connection_id)
    next_at = trio.current_time() + delay_s
    if delay_s > 0:
        await trio.sleep_until(next_at)
    while True:
        next_at += TYPING_INTERVAL_S
        with trio.move_on_at(next_at):
            try:
                await on_typing(route.connection_id, route.conversation_id, route.thread_id)
            except Exception as exc:
                log.warning("typing callback failed: %s", type(exc).__name__)
        await trio.sleep_until(next_at)
