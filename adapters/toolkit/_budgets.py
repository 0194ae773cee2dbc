"""Bounded listeners: the one connection limiter and accept loop of every server prismd runs
(the Telegram webhook, the web chat, the control socket, ``/metrics``).

A listener's connections are split into named :class:`Budget` s, each with its own capacity,
so that one kind of connection cannot take the places of another: the web chat keeps
connections still in their HTTP head or before their hello apart from established
WebSockets, the webhook keeps unauthenticated heads apart from Telegram's authenticated
requests, the control socket keeps refused uids apart from operators. A connection enters
one budget at accept and may :meth:`Slot.move` to another (a web chat socket after its
hello). What a full budget does with a newcomer is the budget's choice:

* ``evict`` — the newcomer takes the place of the member idle longest (the least recent
  :meth:`Slot.touch`; for connections still in their head, the oldest). A flood of
  connections that never finish their head cannot keep a legitimate client out: each
  newcomer pushes out the oldest of the flood, and a client that sends its head at once is
  served long before ``capacity`` newer connections arrived after it.
* ``refuse`` — the newcomer is refused: closed at accept, or :meth:`Slot.move` says False
  and the connection stays where it was (the webhook then answers 503).

Guarantees of :func:`serve_limited`:

* at most the sum of the capacities of connections are held: an evicted connection's task
  is cancelled at once (its handler's cleanup runs under that cancellation, so a bounded
  close such as :func:`~adapters.toolkit.close_gracefully` ends at once);
* a refused connection costs nothing: it is closed at accept, without a task, an answer or
  a log line of its own; a full budget is logged once per :data:`LOG_INTERVAL_S`, with a
  count;
* accept errors that mean "out of resources" (``EMFILE``, ``ENFILE``, ``ENOBUFS``,
  ``ENOMEM``) never end the loop and never log a traceback: when a connection is waiting
  to be accepted the listener sheds its idlest evictable connection (freeing the
  descriptor the waiting one needs) and retries at once, otherwise after a backoff (0.1 s
  doubling to 1 s, reset by the next accept); it logs one warning per interval, with the
  failure count and the process's ``RLIMIT_NOFILE``. Linux fails ``accept`` for want of a
  descriptor even with nobody waiting, hence the check: without it, a process at its limit
  would shed every connection it has, one per retry. Other accept errors propagate;
* listeners are closed when it returns; handler exceptions propagate, as with
  :func:`trio.serve_listeners` (handlers catch what a single connection may raise).

Times are Trio's clock, so tests run on virtual time.
"""

from __future__ import annotations

import errno
import logging
import resource
import select
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Literal

import attrs
import trio
import trio.lowlevel

from ._throttle import LogThrottle, quiet_note

__all__ = [
    "ACCEPT_BACKOFF_MAX_S",
    "ACCEPT_BACKOFF_MIN_S",
    "ACCEPT_CAPACITY_ERRNOS",
    "Budget",
    "BudgetStatistics",
    "ConnectionLimiter",
    "Slot",
    "open_listeners",
    "serve_limited",
]

ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
ACCEPT_BACKOFF_MIN_S = 0.1
ACCEPT_BACKOFF_MAX_S = 1.0
LISTENER_CLOSE_BUDGET_S = 1.0
"""How long closing a server's listeners may take once it stops."""

Handler = Callable[[trio.SocketStream, "Slot"], Awaitable[object]]
BudgetChoice = str | Callable[[trio.SocketStream], str]


@attrs.frozen
class Budget:
    """One share of a listener's connections (see the module docstring)."""

    capacity: int = attrs.field(validator=attrs.validators.ge(1))
    when_full: Literal["evict", "refuse"] = "refuse"
    label: str = "connections"
    """What its members are, for the log line when it is full ("unauthenticated heads")."""


@attrs.frozen
class BudgetStatistics:
    open: int
    capacity: int
    evicted: int
    """Members pushed out by newcomers or shed when accept ran out of descriptors."""
    refused: int
    """Newcomers refused at accept, or moves refused."""


@attrs.define(eq=False)
class Slot:
    """One connection's place in a :class:`ConnectionLimiter`.

    ``cancel_scope`` wraps the connection's handler; eviction cancels it. ``evicted`` says
    why a handler was cancelled (a web chat socket closes with 1013 then, not 1001).
    """

    _limiter: ConnectionLimiter
    budget: str
    cancel_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    last_active: float = attrs.field(factory=trio.current_time)
    evicted: bool = False
    released: bool = False

    def touch(self) -> None:
        """The connection did something useful: it is the last to be evicted now."""
        if self.released:
            return
        self.last_active = trio.current_time()
        self._limiter._members[self.budget].move_to_end(self)

    def move(self, budget: str) -> bool:
        """Change budget (touched); False when ``budget`` is full and refuses newcomers."""
        if self.released or budget == self.budget:
            return not self.released
        if not self._limiter._make_room(budget):
            return False
        del self._limiter._members[self.budget][self]
        self.budget = budget
        self.last_active = trio.current_time()
        self._limiter._members[budget][self] = None
        return True

    def release(self) -> None:
        """Give the place back (idempotent)."""
        if not self.released:
            self.released = True
            self._limiter._members[self.budget].pop(self, None)

    def _evict(self) -> None:
        self.evicted = True
        self.release()
        self.cancel_scope.cancel()


@attrs.define(eq=False)
class ConnectionLimiter:
    """The budgets of one listener; ``name`` starts its log lines ("web chat web")."""

    name: str
    budgets: Mapping[str, Budget]
    logger: logging.Logger = attrs.field(factory=lambda: logging.getLogger("prismd.listeners"))
    throttle: LogThrottle = attrs.field(factory=LogThrottle)
    _members: dict[str, OrderedDict[Slot, None]] = attrs.field(init=False)
    """Per budget, in order of last activity (the idlest first)."""
    _evicted: dict[str, int] = attrs.field(init=False)
    _refused: dict[str, int] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if not self.budgets:
            raise ValueError("a limiter needs at least one budget")
        self._members = {name: OrderedDict() for name in self.budgets}
        self._evicted = dict.fromkeys(self.budgets, 0)
        self._refused = dict.fromkeys(self.budgets, 0)

    @property
    def capacity(self) -> int:
        """Connections this listener holds at most (what ``LimitNOFILE=`` must cover)."""
        return sum(budget.capacity for budget in self.budgets.values())

    def open(self, budget: str | None = None) -> int:
        """Connections held now, in ``budget`` or in all."""
        if budget is not None:
            return len(self._members[budget])
        return sum(len(members) for members in self._members.values())

    def statistics(self) -> Mapping[str, BudgetStatistics]:
        return {
            name: BudgetStatistics(
                open=len(self._members[name]),
                capacity=budget.capacity,
                evicted=self._evicted[name],
                refused=self._refused[name],
            )
            for name, budget in self.budgets.items()
        }

    def admit(self, budget: str) -> Slot | None:
        """A place in ``budget`` for a new connection, or ``None`` (refused)."""
        if not self._make_room(budget):
            return None
        slot = Slot(self, budget)
        self._members[budget][slot] = None
        return slot

    def shed(self) -> bool:
        """Evict the idlest member of the first non-empty evictable budget (in the order
        the budgets were given); False when there is none."""
        for name, budget in self.budgets.items():
            members = self._members[name]
            if budget.when_full == "evict" and members:
                next(iter(members))._evict()
                self._evicted[name] += 1
                return True
        return False

    def _make_room(self, name: str) -> bool:
        budget = self.budgets[name]
        members = self._members[name]
        if len(members) < budget.capacity:
            return True
        if budget.when_full == "refuse":
            self._refused[name] += 1
            self._log_full(name, budget, "further ones are refused")
            return False
        next(iter(members))._evict()
        self._evicted[name] += 1
        self._log_full(name, budget, "the idlest gives way to each newcomer")
        return True

    def _log_full(self, name: str, budget: Budget, what: str) -> None:
        quiet = self.throttle.passes(("full", name))
        if quiet is not None:
            self.logger.warning(
                "%s: %d %s, the cap: %s%s",
                self.name,
                budget.capacity,
                budget.label,
                what,
                quiet_note(quiet),
            )

    def _accept_failed(self, code: int, waiting: bool) -> bool:
        """Shed and log for a failed accept; True when a connection was shed."""
        shed = waiting and self.shed()
        quiet = self.throttle.passes("accept")
        if quiet is not None:
            soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            self.logger.warning(
                "%s: accept failed: %s (open file limit %d); %s, retrying within %.0f s%s",
                self.name,
                errno.errorcode.get(code, str(code)),
                soft,
                "shed the idlest connection"
                if shed
                else ("nothing of ours to shed" if waiting else "nobody waiting"),
                ACCEPT_BACKOFF_MAX_S,
                quiet_note(quiet),
            )
        return shed


Listeners = list[trio.SocketListener]


@asynccontextmanager
async def open_listeners(host: str, port: int) -> AsyncIterator[tuple[Listeners, tuple[str, int]]]:
    """TCP listeners on ``host:port`` and the address the first one is bound to (port 0
    resolved), for :func:`serve_limited`; closed on exit, within
    :data:`LISTENER_CLOSE_BUDGET_S`. Raises ``OSError`` when the port cannot be bound."""
    listeners = await trio.open_tcp_listeners(port, host=host)
    try:
        sockname = listeners[0].socket.getsockname()
        yield listeners, (str(sockname[0]), int(sockname[1]))
    finally:
        with trio.move_on_after(LISTENER_CLOSE_BUDGET_S, shield=True):
            for listener in listeners:
                await listener.aclose()


async def serve_limited(
    handler: Handler,
    listeners: Sequence[trio.abc.Listener[trio.SocketStream]],
    limiter: ConnectionLimiter,
    *,
    budget: BudgetChoice,
    handler_nursery: trio.Nursery | None = None,
    task_status: trio.TaskStatus[
        Sequence[trio.abc.Listener[trio.SocketStream]]
    ] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Accept on every listener until cancelled, each connection in ``budget`` (a name, or a
    function of the accepted stream: the control socket chooses by peer uid), and run
    ``handler(stream, slot)`` in ``handler_nursery`` (default: one of its own). See the
    module docstring. Reports ``listeners`` as started once accepting, like
    :func:`trio.serve_listeners`.
    """
    async with trio.open_nursery() as nursery:
        handlers = handler_nursery if handler_nursery is not None else nursery
        for listener in listeners:
            nursery.start_soon(_accept_loop, listener, handlers, handler, limiter, budget)
        task_status.started(listeners)


async def _accept_loop(
    listener: trio.abc.Listener[trio.SocketStream],
    handlers: trio.Nursery,
    handler: Handler,
    limiter: ConnectionLimiter,
    budget: BudgetChoice,
) -> None:
    async with listener:
        delay = ACCEPT_BACKOFF_MIN_S
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:
                if exc.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                if limiter._accept_failed(exc.errno, _connection_waiting(listener)):
                    # One shed for one waiting connection, as at a full budget; the shed
                    # connection's task closes it (freeing its descriptor) meanwhile.
                    await trio.lowlevel.checkpoint()
                else:
                    await trio.sleep(delay)
                    delay = min(delay * 2, ACCEPT_BACKOFF_MAX_S)
                continue
            delay = ACCEPT_BACKOFF_MIN_S
            slot = limiter.admit(budget(stream) if callable(budget) else budget)
            if slot is None:
                stream.socket.close()
                continue
            handlers.start_soon(_run, handler, stream, slot)


def _connection_waiting(listener: trio.abc.Listener[trio.SocketStream]) -> bool:
    """A connection waits in the listener's accept queue (its socket polls readable);
    True when that cannot be told. ``poll`` needs no descriptor of its own."""
    sock = getattr(listener, "socket", None)
    if sock is None:
        return True
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return bool(poller.poll(0))


async def _run(handler: Handler, stream: trio.SocketStream, slot: Slot) -> None:
    try:
        with slot.cancel_scope:
            await handler(stream, slot)
    finally:
        slot.release()
        stream.socket.close()  # the handler closed it already, unless it was cut short
