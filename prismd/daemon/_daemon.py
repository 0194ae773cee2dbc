"""The daemon process: start-up, one root nursery of supervised children (the control
server, every adapter, the watchdog: :mod:`._supervisor`), signals, sd_notify.

:func:`run_daemon` is ``prismd run``: see its docstring for the start and stop order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TextIO, TypeAlias

import attrs
import trio

if TYPE_CHECKING:
    from ._metrics import DaemonMetrics


from ..channel import AdapterRegistry
from ..runtime import MessagingRuntime
from . import _logs as logs
from . import _sdnotify as sdnotify
from ._config import Config
from ._serving import DaemonServing
from ._startup import EXIT_FAILURE, EXIT_OK, DaemonStartup, EarlyExit
from ._supervisor import (
    RestartPolicy,
    Supervisor,
    describe_exception,
)

log = logging.getLogger("prismd.daemon")

ChildState: TypeAlias = Literal["starting", "running", "restarting", "failed", "stopped"]


# --------------------------------------------------------------------------- the daemon


"""Extra time on top of ``stop_deadline_ms`` for ``runtime.stop()`` to release leases."""
EXIT_MARGIN_S = 1.5
"""``prismd run`` exits at most this long after ``stop_deadline_ms`` from the first
SIGTERM/SIGINT, even when an agent ignores cancellation (see :meth:`Daemon.request_stop`)."""


_early_signal: int | None = None


def _early_handler(signum: int, frame: object) -> None:
    """SIGTERM/SIGINT before the daemon's own receiver runs: remember it (a stop request)."""
    global _early_signal
    if _early_signal is not None:
        _forced_exit(signum)
    _early_signal = signum


def install_early_signal_handlers() -> Callable[[], None]:
    """Called first by ``prismd run``: until :meth:`Daemon.run` installs its Trio receiver
    (and again after it closed), SIGTERM/SIGINT only record a stop request instead of
    killing the process or raising ``KeyboardInterrupt`` at an arbitrary point, and
    SIGHUP is ignored. Returns a function that puts the previous handlers back (for
    in-process callers such as tests)."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _early_handler)
    # SIGHUP (log rotation) terminates by default; logs opened during startup are fresh.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)

    def restore() -> None:
        take_early_signal()
        for signum, handler in previous.items():
            signal.signal(signum, handler)

    return restore


def take_early_signal() -> int | None:
    """The signal recorded by the early handler, if any (cleared)."""
    global _early_signal
    signum, _early_signal = _early_signal, None
    return signum


def _exit_after_deadline(budget_s: float) -> None:
    """The stop deadline passed and something (an agent ignoring cancellation) still holds
    the process: leave now, on a timer thread, whatever the event loop is doing."""
    log.warning(
        "stop deadline passed (%.1f s after the signal) with work that ignores cancellation;"
        " exiting: the journal holds what was settled",
        budget_s,
    )
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    os._exit(EXIT_OK)


def _forced_exit(signum: int) -> NoReturn:
    """Second SIGTERM/SIGINT: leave now. Durable state is crash-safe by design (SIGKILL is)."""
    sys.stderr.write(f"prismd: second {signal.Signals(signum).name}, exiting immediately\n")
    sys.stderr.flush()
    os._exit(128 + signum)


@attrs.define(eq=False)
class Daemon(DaemonStartup, DaemonServing):
    """``prismd run``: owns the state directory lock, the store, the runtime and the children.

    Start order: state directory lock → store (a server that cannot be reached is tried
    again, 1 s, 2 s, 4 s … at most 30 s apart, each failure logged and in ``STATUS=``; any
    other store error is fatal) → agents, grants, adapters → runtime (with
    ``adopt_own_leases=True`` and owner ids from the instance id; messages acknowledged
    but never started before a crash are queued for their first run, ``resume_accepted``) →
    a log line counting unresolved operations (nothing that started is re-run) → children
    (control server, every adapter, watchdog) each started with ``nursery.start`` →
    ``READY=1`` (once) and a stderr line saying where to connect. An adapter that has not
    started within ``adapter_ready_within_s`` (its platform unreachable) is not waited for:
    it keeps retrying in state ``starting`` while the rest serves. A SIGTERM/SIGINT during the
    start stops it at the next safe point (exit 0, no ``READY=1``). The checks of
    :func:`~prismd.daemon.check_runnable` (those of ``prismd check-config``) come before the
    lock; a fatal error is one ``prismd:`` line on ``out``, printed once.

    systemd's ``STATUS=`` says ``starting``, then ``ready: 2 connections, 0 unresolved``
    (kept current while serving, see :data:`STATUS_REFRESH_S`), ``stopping``, or
    ``failed: <the fatal error>``.

    Stop order (first SIGTERM/SIGINT or :meth:`request_stop`): ``STOPPING=1`` →
    ``runtime.stop()`` bounded by ``stop_deadline_ms`` (queued and claimed work settled
    ``cancelled``, binding leases released) while the adapters are still up, so replies
    finishing in the drain still go out and new events are answered ``stopped``
    (retryable: not acknowledged) → children cancelled (adapters release their receiver
    leases) → store closed → exit 0. A second SIGTERM/SIGINT exits at once with
    128 + signal number. SIGHUP reopens the logs.
    """

    config: Config
    env: Mapping[str, str] = attrs.field(factory=lambda: dict(os.environ))
    install_signals: bool = True
    hard_exit: bool = False
    accept_new_journal: bool = False
    """Start on a journal that is not the one the state directory remembers (and adopt it)."""
    """Exit the process at the stop deadline whatever holds it (``prismd run`` only: an
    in-process caller must not lose its interpreter)."""
    notify: Callable[[str], object] | None = None
    """``sd_notify`` (default: :func:`prismd.daemon._sdnotify.notify` with ``env``)."""
    out: TextIO | None = None
    """Where the startup line and fatal messages go (default: stderr)."""
    policy: RestartPolicy = attrs.field(factory=RestartPolicy)
    adapter_ready_within_s: float | None = 10.0
    """How long the start waits for one adapter to report started before going on
    without it (it keeps retrying; ``health`` shows ``starting``). ``None``: wait."""
    supervisor: Supervisor = attrs.field(init=False)
    ready: trio.Event = attrs.field(factory=trio.Event, init=False)
    stopped: trio.Event = attrs.field(factory=trio.Event, init=False)
    adapters: AdapterRegistry | None = attrs.field(default=None, init=False)
    runtime: MessagingRuntime | None = attrs.field(default=None, init=False)
    endpoints: dict[str, str] = attrs.field(factory=dict, init=False)
    metrics: DaemonMetrics | None = attrs.field(default=None, init=False)
    """Built when the config has ``[metrics]``: times the store, served by a child."""
    _serve_scope: trio.CancelScope = attrs.field(factory=trio.CancelScope, init=False)
    _stop_requested: bool = attrs.field(default=False, init=False)
    _stop_event: trio.Event = attrs.field(factory=trio.Event, init=False)
    """Set with ``_stop_requested``: wakes a startup step that waits (the store's retry)."""
    _unresolved: str = attrs.field(default="unresolved unknown", init=False)
    """How many operations wait for reconcile, as the ``STATUS=ready`` line says it."""
    instance_id: str | None = attrs.field(default=None, init=False)
    _agents: Mapping[str, Any] = attrs.field(factory=dict, init=False)
    _a2a_pushes: dict[str, int] = attrs.field(factory=dict, init=False)
    """The push receiver's counters (``[a2a]``), read by ``health`` and ``/metrics``."""
    """The state directory's stable instance id (every lease this daemon holds names it)."""
    _leases_held: Callable[[], Mapping[str, Any]] | None = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        self.supervisor = Supervisor(policy=self.policy)
        if self.notify is None:
            env = self.env
            self.notify = lambda state: sdnotify.notify(state, env=env)
        if self.out is None:
            self.out = sys.stderr
        if self.config.metrics is not None:
            from ._metrics import DaemonMetrics

            self.metrics = DaemonMetrics()

    def request_stop(self) -> None:
        """Begin the graceful stop (what the first SIGTERM/SIGINT does).

        With ``hard_exit`` (``prismd run``) the process also exits, exit code 0, at
        ``stop_deadline_ms`` + :data:`EXIT_MARGIN_S` if it is still alive then: by that time
        ``runtime.stop()`` has settled everything it could (a run that did not end is filed
        ``cancelled_at_shutdown`` and logged), and only a task that ignores cancellation can
        still hold the process. What the journal says is durable; nothing else is lost.
        """
        first = not self._stop_requested
        self._stop_requested = True
        self._stop_event.set()
        self._serve_scope.cancel()
        if first and self.hard_exit:
            budget = self.config.limits.stop_deadline_ms / 1000 + EXIT_MARGIN_S
            timer = threading.Timer(budget, _exit_after_deadline, args=(budget,))
            timer.daemon = True
            timer.start()

    def health(self) -> dict[str, Any]:
        """Which instance this is, per child ``state`` (+ adapter ``health()``), the store
        (``ok`` / ``failing``) and the leases held now: how many binding leases, and the
        connections whose receiver lease it holds. Enums, counts and ids of this daemon
        and its connections only."""
        runtime = self.runtime
        store = "unknown" if runtime is None else runtime.health()["store"]
        health: dict[str, Any] = {
            "instance": self.instance_id,
            "ready": self.ready.is_set(),
            "store": store,
            "children": self.supervisor.health(),
        }
        if self._leases_held is not None:
            health["leases"] = self._leases_held()
        a2a = self._a2a_statistics()
        if a2a is not None:
            health["a2a"] = a2a
        return health

    def _a2a_statistics(self) -> dict[str, int] | None:
        """The a2a counters (``None`` without a2a agents): followed now, polls, sends…, and
        the push receiver's when ``[a2a]`` is set."""
        agents = [
            agent
            for agent in self._agents.values()
            if type(agent).__module__.startswith("prismd.agents.a2a.")
        ]
        if not agents:
            return None
        from ..agents.a2a import a2a_statistics

        return a2a_statistics(agents, self._a2a_pushes)

    async def run(self) -> int:
        """Run until stopped; returns the process exit code (0 clean stop, 1 failure).

        The signal receiver is installed before anything is opened, so a SIGTERM/SIGINT
        during startup is a stop request too: startup stops at the next safe point (after
        the step in progress, which is never left half-done) and unwinds what it opened,
        exit 0. A signal that arrived before the event loop ran (see
        :func:`take_early_signal`) counts as such a request.
        """
        self._status("starting")
        try:
            async with trio.open_nursery() as nursery:
                if self.install_signals:
                    await nursery.start(self._signals)
                    early = take_early_signal()
                    if early is not None:
                        log.info("received %s before startup", signal.Signals(early).name)
                        self.request_stop()
                code = await self._start_and_serve()
                nursery.cancel_scope.cancel()
            return code
        finally:
            self.stopped.set()

    def _stopped_during_startup(self, step: str) -> bool:
        """A safe point of the startup: true (and logged) when a stop was requested."""
        if not self._stop_requested:
            return False
        log.info("stop requested during startup (%s); not starting", step)
        self._status("stopping")
        self._print("prismd: stopped during startup")
        return True

    async def _start_and_serve(self) -> int:
        """The startup, one step after the other, each thing it opens closed in reverse
        order on the way out: state directory lock → store → agents, grants and adapters →
        journal identity → runtime → serve. A step that cannot go on (a failure, or a stop
        requested meanwhile) ends the startup with its exit code (:class:`EarlyExit`)."""
        try:
            async with contextlib.AsyncExitStack() as stack:
                self._startup_point("before opening the state directory")
                state = self._open_state_dir(stack)
                store = await self._open_store(stack)
                authorizer, unopened, secrets = await self._wire(stack, state, store)
                await self._check_journal(state, store)
                runtime = await self._open_runtime(
                    stack, state, store, authorizer, unopened, secrets
                )
                await self._report_unresolved(runtime, authorizer)
                # Not _startup_point: an exception would leave the runtime's nursery
                # wrapped in a group. Leaving the block stops the runtime (bounded).
                if self._stopped_during_startup("before starting the children"):
                    return EXIT_OK
                return await self._serve(runtime, store, authorizer)
        except EarlyExit as early:
            return early.code

    def _startup_point(self, step: str) -> None:
        """A safe point of the startup: raises :class:`EarlyExit` (exit 0) when a stop was
        requested (logged)."""
        if self._stopped_during_startup(step):
            raise EarlyExit(EXIT_OK)

    def _give_up(self, message: str) -> NoReturn:
        """A fatal startup error: printed once, exit 1."""
        self._fail(message)
        raise EarlyExit(EXIT_FAILURE)

    def _fail(self, message: str) -> None:
        """A fatal error: one ``prismd:`` line (not also a log record: it would say it twice)."""
        shown = logs.redact(message)
        self._status(f"failed: {shown}")
        self._print(f"prismd: {shown}")

    def _status(self, text: str) -> None:
        assert self.notify is not None
        self.notify(sdnotify.status(text))

    def _print(self, line: str) -> None:
        assert self.out is not None
        try:
            self.out.write(line + "\n")
            self.out.flush()
        except (OSError, ValueError):
            pass

    async def _signals(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            task_status.started()
            async for signum in signals:
                if signum == signal.SIGHUP:
                    _reopen_logs()
                    continue
                if self._stop_requested:
                    _forced_exit(signum)
                log.info("received %s", signal.Signals(signum).name)
                self.request_stop()


def _reopen_logs() -> None:
    try:
        logs.reopen()
    except Exception as exc:
        log.warning("reopening logs failed: %s", describe_exception(exc))


async def run_daemon(config: Config, **kwargs: Any) -> int:
    """``prismd run`` on a loaded config; returns the exit code."""
    kwargs.setdefault("hard_exit", True)
    return await Daemon(config, **kwargs).run()
