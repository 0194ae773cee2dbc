"""The daemon process: start-up, one root nursery of supervised children (the control
server, every adapter, the watchdog: :mod:`._supervisor`), signals, sd_notify.

:func:`run_daemon` is ``prismd run``: see its docstring for the start and stop order.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import os
import re
import signal
import sys
import threading
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, Literal, NoReturn, TextIO, TypeAlias

import attrs
import trio

from stores import OwnershipScope, Store, StoreError

if TYPE_CHECKING:
    from ._metrics import DaemonMetrics

from adapters import kinds

from ..channel import ChannelAdapter
from ..control import Operator
from ..grants import GrantAuthorizer
from ..journal import ChannelJournal, GrantStore, ensure_format
from ..redact import Redactor
from ..runtime import MessagingRuntime, Runtime, open_messaging_runtime
from . import _logs as logs
from . import _sdnotify as sdnotify
from ._config import Config, ConfigError, ConnectionConfig
from ._runnable import check_runnable
from ._statedir import StateDir, StateDirError, open_state_dir
from ._supervisor import (
    DaemonError,
    RestartPolicy,
    Supervisor,
    describe_exception,
    watchdog,
)
from ._wiring import Host, WiringError, adapter_child_name, build_adapter, build_agents

log = logging.getLogger("prismd.daemon")

ChildState: TypeAlias = Literal["starting", "running", "restarting", "failed", "stopped"]


# --------------------------------------------------------------------------- the daemon


class _EarlyExit(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


async def _close_host(host: Host) -> None:
    with trio.move_on_after(CLOSE_BUDGET_S, shield=True):
        await host.aclose()


EXIT_OK = 0
EXIT_FAILURE = 1
STOP_MARGIN_S = 5.0
"""Extra time on top of ``stop_deadline_ms`` for ``runtime.stop()`` to release leases."""
EXIT_MARGIN_S = 1.5
"""``prismd run`` exits at most this long after ``stop_deadline_ms`` from the first
SIGTERM/SIGINT, even when an agent ignores cancellation (see :meth:`Daemon.request_stop`)."""
CLOSE_BUDGET_S = 10.0
STORE_RETRY_FIRST_S = 1.0
STORE_RETRY_MAX_S = 30.0
"""An unreachable store server is tried again after 1 s, 2 s, 4 s … at most 30 s apart."""
MAX_COUNTED_UNRESOLVED = 100_000
"""Counting stops here (``at least N unresolved``): a bound on the startup listing."""
STATUS_REFRESH_S = 10.0
"""How often the serving daemon looks whether its ``STATUS=`` line changed."""


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
class Daemon:
    """``prismd run``: owns the state directory lock, the store, the runtime and the children.

    Start order: state directory lock → store (a server that cannot be reached is tried
    again, 1 s, 2 s, 4 s … at most 30 s apart, each failure logged and in ``STATUS=``; any
    other store error is fatal) → agents, grants, adapters → runtime (with
    ``reclaim_own_leases=True`` and owner ids from the instance id; messages acknowledged
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
    host: Host | None = attrs.field(default=None, init=False)
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
        requested meanwhile) ends the startup with its exit code (:class:`_EarlyExit`)."""
        try:
            async with contextlib.AsyncExitStack() as stack:
                self._startup_point("before opening the state directory")
                state = self._open_state_dir(stack)
                store = await self._open_store(stack)
                authorizer, host, secrets = await self._wire(stack, state, store)
                await self._check_journal(state, store)
                runtime = await self._open_runtime(stack, state, store, authorizer, host, secrets)
                await self._report_unresolved(runtime, authorizer)
                # Not _startup_point: an exception would leave the runtime's nursery
                # wrapped in a group. Leaving the block stops the runtime (bounded).
                if self._stopped_during_startup("before starting the children"):
                    return EXIT_OK
                return await self._serve(runtime, store, authorizer, host)
        except _EarlyExit as early:
            return early.code

    def _startup_point(self, step: str) -> None:
        """A safe point of the startup: raises :class:`_EarlyExit` (exit 0) when a stop was
        requested (logged)."""
        if self._stopped_during_startup(step):
            raise _EarlyExit(EXIT_OK)

    def _give_up(self, message: str) -> NoReturn:
        """A fatal startup error: printed once, exit 1."""
        self._fail(message)
        raise _EarlyExit(EXIT_FAILURE)

    def _open_state_dir(self, stack: contextlib.AsyncExitStack) -> StateDir:
        try:
            # What `prismd check-config` checks, before anything is opened.
            check_runnable(self.config, self.env)
        except ConfigError as exc:
            self._give_up(str(exc))
        try:
            state = open_state_dir(self.config.daemon.state_dir)
        except StateDirError as exc:
            self._give_up(str(exc))
        stack.callback(state.close)
        self.instance_id = state.instance_id
        return state

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

    async def _open_store(self, stack: contextlib.AsyncExitStack) -> Store:
        """The store, entered on ``stack`` (leaving it closes the store, bounded). A server
        that is down or still starting is waited for with backoff; a refused login, a
        missing database, a newer schema or a broken file end the startup."""
        from stores import StoreUnreachableError, open_store

        self._startup_point("before opening the store")
        url = self.config.store.url
        try:
            postgres = self.config.store.postgres_options(self.env)
        except ConfigError as exc:
            self._give_up(str(exc))
        if postgres is not None and postgres.password:
            logs.register_secret(postgres.password)
        delay = STORE_RETRY_FIRST_S
        while True:
            try:
                store: Store = await stack.enter_async_context(open_store(url, postgres=postgres))
            except StoreUnreachableError as exc:
                reason = _without_password(str(exc), url)
                log.warning("cannot open the store: %s; trying again in %g s", reason, delay)
                self._status(f"starting: waiting for the store: {reason}")
                with trio.move_on_after(delay):
                    await self._stop_event.wait()
                self._startup_point("while waiting for the store")
                delay = min(delay * 2, STORE_RETRY_MAX_S)
                continue
            except StoreError as exc:
                # The store's own reason ("integrity check failed", "path is a directory"…);
                # a URL's password, should a backend ever quote one, is removed.
                self._give_up(f"cannot open the store: {_without_password(str(exc), url)}")
            except Exception as exc:
                self._give_up(f"cannot open the store: {describe_exception(exc)}")
            if self.metrics is not None:
                store = self.metrics.timed_store(store)
            return store

    async def _wire(
        self, stack: contextlib.AsyncExitStack, state: StateDir, store: Store
    ) -> tuple[GrantAuthorizer, Host, list[str]]:
        """Agents, grants and adapters, built (inertly) from the config."""
        config = self.config
        try:
            secrets: list[str] = []
            agents = build_agents(config, store, env=self.env, secrets=secrets)
            self._agents = agents
            authorizer = GrantAuthorizer(
                config.grants, load_paired=GrantStore(store.checkpoints).load
            )
            host = Host(agents=agents)
            for connection in config.connections:
                host.adapters[connection.id] = build_adapter(
                    connection,
                    admit=host.admit,
                    store=store,
                    state=state,
                    config=config,
                    env=self.env,
                    secrets=secrets,
                    conversations=host,
                )
        except WiringError as exc:
            # Name the file like check-config does (ConfigError messages already do).
            where = f"{config.source}: " if config.source else ""
            self._give_up(f"{where}{exc}")
        except ConfigError as exc:
            self._give_up(str(exc))
        except Exception as exc:
            # Anything else from wiring: one line, the type only (its text may carry a value).
            self._give_up(f"cannot start: {describe_exception(exc)}")
        self.host = host
        stack.push_async_callback(_close_host, host)
        for secret in secrets:
            logs.register_secret(secret)
        # A checkpoint first: a signal that arrived while a blocking factory ran is
        # delivered to the receiver task here.
        await trio.lowlevel.checkpoint()
        self._startup_point("before opening the runtime")
        return authorizer, host, secrets

    async def _check_journal(self, state: StateDir, store: Store) -> None:
        """The journal's identity (and format): the one this state directory ran on."""
        try:
            # Before the runtime: its resume of acknowledged messages reads the open index.
            journal = await ensure_format(ChannelJournal(store.checkpoints))
        except Exception as exc:
            self._give_up(f"cannot read the journal's identity: {describe_exception(exc)}")
        if journal.refiled:
            log.info("journal upgraded: %d unresolved record(s) indexed", journal.refiled)
        if journal.moved:
            log.info("journal upgraded: %d agent record(s) moved to prismd.v1.*", journal.moved)
        if not self._same_journal(state, journal.journal_id):
            raise _EarlyExit(EXIT_FAILURE)

    def _same_journal(self, state: StateDir, journal_id: str) -> bool:
        """The journal is the one this state directory ran on (or it never ran); otherwise
        refuse, unless ``accept_new_journal``. Remembers the id it starts with."""
        try:
            remembered = state.remembered_journal()
            if remembered is not None and remembered != journal_id:
                if not self.accept_new_journal:
                    url = self.config.store.url
                    self._fail(
                        f"the journal ({_without_password(url, url)}) is not the one this"
                        f" daemon ran on before (state directory {state.path}): a new, emptied"
                        " or replaced journal has lost every dedup record, so messages could be"
                        " answered twice. Restore the journal, or start once with"
                        " `prismd run --accept-new-journal` to adopt it"
                    )
                    return False
                log.warning(
                    "adopting a new journal (--accept-new-journal): messages redelivered"
                    " from before it may run again"
                )
            if remembered != journal_id:
                state.remember_journal(journal_id)
        except StateDirError as exc:
            self._fail(str(exc))
            return False
        return True

    async def _open_runtime(
        self,
        stack: contextlib.AsyncExitStack,
        state: StateDir,
        store: Store,
        authorizer: GrantAuthorizer,
        host: Host,
        secrets: list[str],
    ) -> Runtime:
        config = self.config
        runtime = await stack.enter_async_context(
            open_messaging_runtime(
                authorize=authorizer.authorize,
                resolve_agent=host.resolve_agent,
                deliver=host.deliver,
                store=store,
                use_leases=True,
                limits=config.limits,
                owner_id=state.owner_id("runtime"),
                reclaim_own_leases=True,
                tells_unanswered=host.tells_unanswered,
                resume_accepted=True,
                pairing_scope=authorizer.pairing_scope,
                on_paired=authorizer.on_paired,
                redactor=Redactor.of(secrets) if secrets else None,
                fetch_attachment=host.fetch_attachment if host.has_attachments() else None,
                on_preview=host.preview if host.has_previews() else None,
                on_typing=host.typing if host.has_typing() else None,
                typing_delay_ms=host.typing_delay_ms,
            )
        )
        self.runtime = runtime
        adapters = host.adapters

        def leases_held() -> Mapping[str, Any]:
            receivers = [c for c, a in adapters.items() if a.receiver_lease_held]
            return {"binding": runtime.leases_held(), "receiver": sorted(receivers)}

        self._leases_held = leases_held
        if self.metrics is not None:
            self._watch_metrics(runtime, host)
        host.bind(runtime.admit, runtime)
        stack.callback(host.bind, None)
        return runtime

    async def _report_unresolved(
        self, runtime: MessagingRuntime, authorizer: GrantAuthorizer
    ) -> None:
        """Log how many operations wait for ``reconcile``; never re-run anything."""
        counted = await self._count_unresolved(runtime, authorizer, failure_level=logging.WARNING)
        if counted is None:
            return
        total, capped = counted
        if total:
            log.warning(
                "%s%d unresolved operation(s) in the journal; nothing is re-run: "
                "review them with `prismctl list-unresolved` and settle with `prismctl reconcile`",
                "at least " if capped else "",
                total,
            )
        else:
            log.info("no unresolved operations in the journal")

    async def _count_unresolved(
        self, runtime: MessagingRuntime, authorizer: GrantAuthorizer, *, failure_level: int
    ) -> tuple[int, bool] | None:
        """``(count, capped)`` over every configured tenant, also kept for ``STATUS=``;
        ``None`` (logged at ``failure_level``) when the journal cannot be listed."""
        tenants = {"default"} | {g.tenant for g in self.config.grants}
        tenants |= {op.tenant for op in self.config.control.operators}
        limit = self.config.limits.max_journal_page
        total = 0
        capped = False
        for tenant in sorted(tenants):
            identity = authorizer.identity_for(Operator(uid=os.getuid(), tenant=tenant))
            after: str | None = None
            try:
                # Every page: the listing reads the unresolved set only (an index), so
                # counting it costs what is unresolved, not the journal's length.
                while True:
                    page = await runtime.list_unresolved_page(
                        identity=identity, limit=limit, after=after
                    )
                    total += len(page.entries)
                    after = page.next_cursor
                    if after is None:
                        break
                    if total >= MAX_COUNTED_UNRESOLVED:
                        capped = True
                        break
            except Exception as exc:
                log.log(
                    failure_level,
                    "listing unresolved operations failed: %s",
                    describe_exception(exc),
                )
                self._unresolved = "unresolved unknown"
                return None
        self._unresolved = f"{'at least ' if capped else ''}{total} unresolved"
        return total, capped

    async def _keep_status_current(
        self, runtime: MessagingRuntime, authorizer: GrantAuthorizer
    ) -> NoReturn:
        """While serving: re-send ``STATUS=`` when it changed (an adapter came up or went
        down, an operation became unresolved or was reconciled). Never raises."""
        shown = self._ready_status()
        while True:
            await trio.sleep(STATUS_REFRESH_S)
            await self._count_unresolved(runtime, authorizer, failure_level=logging.DEBUG)
            current = self._ready_status()
            if current != shown:
                self._status(current)
                shown = current

    async def _serve(
        self,
        runtime: MessagingRuntime,
        store: Store,
        authorizer: GrantAuthorizer,
        host: Host,
    ) -> int:
        failures: list[BaseException] = []
        code = EXIT_FAILURE
        try:
            code = await self._supervise_children(runtime, store, authorizer, host)
        except* DaemonError as group:
            failures.extend(_leaves(group))
        if not failures:
            return code
        for exc in failures:
            self._fail(str(exc))
        assert self.notify is not None
        self.notify("STOPPING=1")
        with trio.move_on_after(self._stop_budget_s(), shield=True):
            await runtime.stop()
        return EXIT_FAILURE

    def _stop_budget_s(self) -> float:
        return self.config.limits.stop_deadline_ms / 1000 + STOP_MARGIN_S

    async def _supervise_children(
        self,
        runtime: MessagingRuntime,
        store: Store,
        authorizer: GrantAuthorizer,
        host: Host,
    ) -> int:
        from ..control import ControlHandler, pairing_aliases_from_grants, serve_control

        assert self.notify is not None
        notify = self.notify
        config = self.config
        async with trio.open_nursery() as children:
            with self._serve_scope:
                handler = ControlHandler(
                    runtime=runtime,
                    store=store,
                    health=self.health,
                    identity_for=authorizer.identity_for,
                    pair_aliases=pairing_aliases_from_grants(config.grants),
                    inbox_sources=tuple(c for c, a in host.adapters.items() if a.features.inbox),
                    retention_ms=config.limits.retention_days * 86_400_000,
                    cancel_remote=_a2a_cancel(host),
                )
                await self.supervisor.start(
                    children,
                    "control",
                    functools.partial(
                        serve_control, config.control, handler=handler, daemon_uid=os.getuid()
                    ),
                )
                self.endpoints["control"] = config.control.socket
                if self.metrics is not None:
                    await self._start_metrics(children)
                await self._start_a2a_push(children, store, host)
                for connection in config.connections:
                    adapter = host.adapters[connection.id]
                    await self.supervisor.start(
                        children,
                        adapter_child_name(connection),
                        adapter.run,
                        health=adapter.health,
                        ready_within_s=self.adapter_ready_within_s,
                        where=_listen_address(connection),
                    )
                    self.endpoints[adapter_child_name(connection)] = _where(connection, adapter)
                await self.supervisor.start(
                    children,
                    "watchdog",
                    functools.partial(
                        watchdog, sdnotify.watchdog_interval(self.env), lambda: notify("WATCHDOG=1")
                    ),
                )
                # The "where to connect" line first, so it is there once READY=1 is seen.
                self._announce()
                self.ready.set()
                self._status(self._ready_status())
                notify("READY=1")
                await self._keep_status_current(runtime, authorizer)
            if not self._stop_requested:
                return EXIT_OK  # pragma: no cover - the scope is only cancelled by a stop
            self._status("stopping")
            notify("STOPPING=1")
            log.info("stopping: settling queued and claimed work (runtime.stop)")
            with trio.move_on_after(self._stop_budget_s()) as budget:
                await runtime.stop()
            if budget.cancelled_caught:
                log.warning("runtime.stop() did not finish within the stop deadline")
            children.cancel_scope.cancel()
        log.info("stopped")
        return EXIT_OK

    def _watch_metrics(self, runtime: Runtime, host: Host) -> None:
        """Point the metrics' live collector at this runtime, the children and adapters."""
        assert self.metrics is not None
        supervisor, adapters = self.supervisor, host.adapters
        self.metrics.watch(
            diagnostics=runtime.diagnostics,
            health=supervisor.health,
            restarts=lambda: {name: c.restarts for name, c in supervisor.children.items()},
            leases=lambda: {
                "binding": runtime.leases_held(),
                "receiver": sum(1 for a in adapters.values() if a.receiver_lease_held),
            },
            a2a=(lambda: self._a2a_statistics() or {})
            if self._a2a_statistics() is not None
            else None,
        )

    async def _start_metrics(self, children: trio.Nursery) -> None:
        from ._metrics import MetricsServer

        assert self.metrics is not None and self.config.metrics is not None
        server = MetricsServer(
            listen=self.config.metrics.listen,
            metrics=self.metrics,
            allow_non_loopback=self.config.metrics.allow_non_loopback,
        )
        await self.supervisor.start(
            children, "metrics", server.run, health=server.health, where=server.listen
        )
        self.endpoints["metrics"] = server.url

    async def _start_a2a_push(self, children: trio.Nursery, store: Store, host: Host) -> None:
        """``[a2a] push_listen``: the receiver of remote agents' pushes and its inbox worker,
        when the config has ``[a2a]`` and at least one a2a agent."""
        if self.config.a2a is None:
            return
        from ..agents.a2a import A2AAgent, PushReceiver

        agents = {a: x for a, x in host.agents.items() if isinstance(x, A2AAgent)}
        if not agents:
            return
        receiver = PushReceiver(self.config.a2a.push_listen, agents, store.inbox)
        self._a2a_pushes = receiver.counters
        await self.supervisor.start(
            children,
            "a2a-push",
            functools.partial(receiver.run, f"prismd-{self.instance_id}:a2a-push"),
            health=receiver.health,
            where=self.config.a2a.push_listen,
        )
        self.endpoints["a2a-push"] = self.config.a2a.push_listen

    def _ready_status(self) -> str:
        """``ready: 2 connections, 0 unresolved`` (``(1 starting)`` for adapters not up yet)."""
        count = len(self.config.connections)
        text = f"ready: {count} connection{'' if count == 1 else 's'}"
        states = collections.Counter(
            self.supervisor.children[adapter_child_name(c)].state for c in self.config.connections
        )
        others = [f"{n} {state}" for state, n in sorted(states.items()) if state != "running"]
        if others:
            text += f" ({', '.join(others)})"
        return f"{text}, {self._unresolved}"

    def _announce(self) -> None:
        """One stderr line saying where to connect (what `make run` users look for)."""
        parts: list[str] = []
        for connection in self.config.connections:
            where = self.endpoints.get(adapter_child_name(connection), "")
            state = self.supervisor.children[adapter_child_name(connection)].state
            kind = kinds.connection_kind(connection.kind)
            label = kind.label if kind is not None else connection.kind
            suffix = "" if state == "running" else f" [{state}]"
            parts.append(f"{label} {connection.id}: {where}{suffix}")
        parts.append(f"control socket: {self.endpoints['control']}")
        self._print("prismd: ready — " + "; ".join(parts))
        log.info("ready")

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


def _leaves(exc: BaseException) -> list[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _listen_address(connection: ConnectionConfig) -> str | None:
    """The configured address a connection listens on, if any (for startup errors)."""
    kind = kinds.connection_kind(connection.kind)
    return kind.listen_address(connection) if kind is not None else None


def _where(connection: ConnectionConfig, adapter: ChannelAdapter) -> str:
    """A human hint for the startup line: a URL for the web chat, the mode otherwise."""
    kind = kinds.connection_kind(connection.kind)
    return kind.where(connection, adapter) if kind is not None else "(connected)"


_PASSWORD_IN_URL_RE = re.compile(r"(://[^/@:\s]*):[^/@\s]*@")


def _without_password(text: str, url: str) -> str:
    """``text`` without the password of ``url``, nor the password of any URL it quotes."""
    try:
        password = urllib.parse.urlsplit(url).password
    except ValueError:
        password = None
    if password:
        text = text.replace(password, logs.REDACTED)
    return _PASSWORD_IN_URL_RE.sub(rf"\1:{logs.REDACTED}@", text)


def _reopen_logs() -> None:
    try:
        logs.reopen()
    except Exception as exc:
        log.warning("reopening logs failed: %s", describe_exception(exc))


async def run_daemon(config: Config, **kwargs: Any) -> int:
    """``prismd run`` on a loaded config; returns the exit code."""
    kwargs.setdefault("hard_exit", True)
    return await Daemon(config, **kwargs).run()


def _a2a_cancel(
    host: Host,
) -> Callable[[OwnershipScope, str], Awaitable[Mapping[str, Any]]] | None:
    """``reconcile … --cancel-remote`` over this daemon's a2a agents (``None``: none)."""
    if not any(
        type(agent).__module__.startswith("prismd.agents.a2a.") for agent in host.agents.values()
    ):
        return None  # the a2a package is imported only when an a2a agent exists
    from ..agents.a2a import A2AAgent, cancel_remote

    agents = {a: x for a, x in host.agents.items() if isinstance(x, A2AAgent)}
    return functools.partial(cancel_remote, agents)
