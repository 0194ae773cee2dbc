"""The supervisor: one nursery of children, each started with ``nursery.start`` semantics
and restarted when it crashes, with bounded exponential backoff plus jitter and a
restart-intensity limit; and the watchdog child.

* a child that fails before it first reported ``started`` is a startup error
  (:class:`ChildStartupError`): the daemon exits 1 naming the child;
* :class:`~prismd.channel.AdapterFatalError` stops that child for good (state
  ``failed``) without taking the daemon down;
* any other exception is a crash: state ``restarting``, sleep, run again; more than
  ``max_restarts`` crashes within ``window_s`` raise :class:`TooManyRestartsError`,
  which ends the daemon with exit code 1 and a message naming the child.

Messages name children and exception *types* only: exception text may carry tokens or
URLs (httpx puts the request URL, and Telegram's carries the bot token, into its errors).
"""

from __future__ import annotations

import collections
import errno
import functools
import logging
import math
import random
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal, Protocol, TypeAlias

import attrs
import trio

from ..channel import AdapterFatalError
from ..control import ControlSocketError
from . import _logs as logs

log = logging.getLogger("prismd.daemon")

ChildState: TypeAlias = Literal["starting", "running", "restarting", "failed", "stopped"]


class ChildRun(Protocol):
    def __call__(self, *, task_status: trio.TaskStatus[None] = ...) -> Awaitable[None]: ...


class DaemonError(Exception):
    """The daemon cannot continue; ``str(exc)`` is the operator-facing message."""


class ChildStartupError(DaemonError):
    def __init__(self, name: str, reason: str, where: str | None = None) -> None:
        shown = f"{name} on {where}" if where else name
        super().__init__(f"{shown} failed to start: {reason}")
        self.child = name


ADDRESS_IN_USE_HINT = (
    "another program holds that port (perhaps another prismd; `ss -ltnp` shows which):"
    " stop it, or give this listener another address in the config (prismd init writes"
    " one; prismd doctor checks every port)"
)
"""What a listener that cannot bind its port is told to do (EADDRINUSE at start)."""


def _has_errno(exc: BaseException, number: int) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return any(_has_errno(inner, number) for inner in exc.exceptions)
    return isinstance(exc, OSError) and exc.errno == number


def _bind_hint(exc: BaseException, where: str | None) -> str | None:
    """What to do when a listener on ``where`` (``host:port``) could not bind, or ``None``."""
    if _has_errno(exc, errno.EADDRINUSE):
        return ADDRESS_IN_USE_HINT
    port = (where or "").rpartition(":")[2]
    if _has_errno(exc, errno.EACCES) and port.isdigit() and int(port) < 1024:
        return (
            f"port {port} needs privileges prismd does not have: listen on a port above 1023"
            " (a reverse proxy can face the outside on a low port)"
        )
    return None


class TooManyRestartsError(DaemonError):
    def __init__(self, name: str, crashes: int, window_s: float) -> None:
        super().__init__(
            f"{name} crashed {crashes} times within {window_s:g} s; giving up "
            f"(see the log lines above for each crash)"
        )
        self.child = name


OPERATOR_FACING: tuple[type[BaseException], ...] = (AdapterFatalError, ControlSocketError)
"""Exceptions whose message is written for the operator (fixed text, paths, no payloads)."""


def describe_exception(exc: BaseException) -> str:
    """A short, secret-free description: exception type names, OS error strings only.

    ``OSError.strerror`` is a fixed C-library string ("Address already in use"), and the
    :data:`OPERATOR_FACING` exceptions carry messages meant for the operator (still passed
    through the log redaction); any other message text is left out on purpose.
    """
    if isinstance(exc, BaseExceptionGroup):
        inner = sorted({describe_exception(e) for e in exc.exceptions})
        return " + ".join(inner)
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__} ({exc.strerror})"
    if isinstance(exc, OPERATOR_FACING) and str(exc):
        return f"{type(exc).__name__}: {logs.redact(str(exc))}"
    return type(exc).__name__


def _is_fatal(exc: BaseException) -> bool:
    if isinstance(exc, AdapterFatalError):
        return True
    if isinstance(exc, BaseExceptionGroup):
        matched, rest = exc.split(AdapterFatalError)
        return matched is not None and rest is None
    return False


@attrs.frozen
class RestartPolicy:
    """Backoff doubles from ``initial_backoff_s`` up to ``max_backoff_s``, ± ``jitter``."""

    initial_backoff_s: float = 0.5
    max_backoff_s: float = 30.0
    jitter: float = 0.2
    max_restarts: int = 5
    window_s: float = 60.0
    stable_after_s: float = 60.0
    """A child that ran this long without crashing starts again from the initial backoff."""


@attrs.define(eq=False)
class Child:
    name: str
    run: ChildRun
    health: Callable[[], Mapping[str, str]] | None = None
    state: ChildState = "starting"
    restarts: int = 0
    cancel_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    where: str | None = None
    """Shown in a startup error (a listen address): what the operator has to change."""
    detached: bool = False
    """The daemon stopped waiting for the first start (see ``ready_within_s``): a failure
    before it reports started is then a crash (restarted), not a startup error."""


@attrs.define(eq=False)
class _ChildStatus:
    """The ``task_status`` a supervised run gets: records that the child is serving."""

    on_started: Callable[[], None]
    fired: bool = False

    def started(self, value: Any = None) -> None:
        if self.fired:
            raise RuntimeError("task_status.started() called twice")
        self.fired = True
        self.on_started()


@attrs.define(eq=False)
class _EventStatus:
    """A ``task_status`` that sets an event (for a start that is not waited out)."""

    event: trio.Event

    def started(self, value: Any = None) -> None:
        self.event.set()


@attrs.define(eq=False)
class Supervisor:
    """Runs children; knows their states for ``health``. One per daemon."""

    policy: RestartPolicy = attrs.field(factory=RestartPolicy)
    rng: random.Random = attrs.field(factory=random.Random)
    children: dict[str, Child] = attrs.field(factory=dict)

    async def start(
        self,
        nursery: trio.Nursery,
        name: str,
        run: ChildRun,
        *,
        health: Callable[[], Mapping[str, str]] | None = None,
        ready_within_s: float | None = None,
        where: str | None = None,
    ) -> Child:
        """Start ``run`` under supervision; returns once it first reported ``started``.

        Raises :class:`ChildStartupError` when the first start fails (the daemon exits
        rather than retrying a configuration problem such as a port in use), and
        returns normally for an :class:`AdapterFatalError` at start (state ``failed``).

        With ``ready_within_s``, returns after that long at the latest: a child still
        starting then (an adapter retrying an unreachable platform) keeps starting in the
        background in state ``starting``, and from then on a failure is a crash
        (restarted with backoff), so one platform outage cannot hold the daemon back.
        """
        if name in self.children:
            raise ValueError(f"duplicate child name {name!r}")
        child = Child(name=name, run=run, health=health, where=where)
        self.children[name] = child
        if ready_within_s is None:
            await nursery.start(self._supervise, child)
            return child
        started = trio.Event()
        nursery.start_soon(
            functools.partial(self._supervise, child, task_status=_EventStatus(started))
        )
        with trio.move_on_after(ready_within_s):
            await started.wait()
        if not started.is_set():
            child.detached = True
            log.warning(
                "%s has not started within %g s; continuing, it keeps trying", name, ready_within_s
            )
        return child

    def stop(self, name: str) -> None:
        """Cancel one child for good (state ``stopped``)."""
        self.children[name].cancel_scope.cancel()

    def _backoff(self, attempt: int) -> float:
        base = min(self.policy.max_backoff_s, self.policy.initial_backoff_s * 2.0**attempt)
        spread = self.policy.jitter * base
        return max(0.0, base + self.rng.uniform(-spread, spread))

    async def _supervise(
        self, child: Child, *, task_status: trio.TaskStatus[None] | _EventStatus
    ) -> None:
        crashes: collections.deque[float] = collections.deque()
        attempt = 0
        first = True

        def release_start() -> None:
            """Report the first start (once) so ``Supervisor.start`` stops waiting."""
            nonlocal first
            if first:
                first = False
                task_status.started()

        def report_started() -> None:
            child.state = "running"
            release_start()

        with child.cancel_scope:
            while True:
                if first:
                    child.state = "starting"
                started_at = trio.current_time()
                try:
                    await child.run(task_status=_ChildStatus(report_started))
                except Exception as exc:
                    reason = describe_exception(exc)
                    if _is_fatal(exc):
                        child.state = "failed"
                        log.error("%s stopped: fatal adapter error (%s)", child.name, reason)
                        release_start()
                        return
                    if first and not child.detached:
                        child.state = "failed"
                        hint = _bind_hint(exc, child.where)
                        if hint is not None:
                            reason = f"{reason}; {hint}"
                        raise ChildStartupError(child.name, reason, child.where) from exc
                    now = trio.current_time()
                    if now - started_at >= self.policy.stable_after_s:
                        attempt = 0
                    crashes.append(now)
                    while crashes and crashes[0] <= now - self.policy.window_s:
                        crashes.popleft()
                    if len(crashes) > self.policy.max_restarts:
                        child.state = "failed"
                        raise TooManyRestartsError(
                            child.name, len(crashes), self.policy.window_s
                        ) from exc
                    child.state = "restarting"
                    child.restarts += 1
                    delay = self._backoff(attempt)
                    attempt += 1
                    log.warning(
                        "%s crashed (%s); restart %d in %.1f s",
                        child.name,
                        reason,
                        child.restarts,
                        delay,
                    )
                    await trio.sleep(delay)
                    continue
                # A run that returns on its own is finished, not crashed.
                child.state = "stopped"
                release_start()
                return
        child.state = "stopped"

    def health(self) -> dict[str, dict[str, str]]:
        """Per child: ``state`` (the supervisor's) plus the adapter's own bounded
        ``health()`` enums; an adapter's own ``state`` (``unauthorized``, ``backoff``…,
        which says *why*) is kept as ``adapterState``."""
        out: dict[str, dict[str, str]] = {}
        for name, child in self.children.items():
            entry: dict[str, str] = {}
            if child.health is not None:
                try:
                    entry.update(child.health())
                except Exception as exc:
                    log.warning("%s health() raised %s", name, describe_exception(exc))
            if "state" in entry:
                entry["adapterState"] = entry.pop("state")
            entry["state"] = child.state
            out[name] = entry
        return out


async def watchdog(
    interval_s: float | None,
    ping: Callable[[], object],
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Ping every ``interval_s`` (systemd ``WATCHDOG=1``); without an interval, just idle.

    It runs inside the supervised nursery, so a wedged Trio loop stops the pings and
    systemd restarts the daemon.
    """
    task_status.started()
    if interval_s is None or not math.isfinite(interval_s) or interval_s <= 0:
        await trio.sleep_forever()
    while True:
        ping()
        await trio.sleep(interval_s)
