"""The serving daemon: its children (the control server, every adapter, the watchdog,
the metrics endpoint and the A2A push receiver) under the supervisor, ``READY=1`` and the
line saying where to connect, ``STATUS=`` kept current. Mixed into :class:`._daemon.Daemon`."""

from __future__ import annotations

import collections
import functools
import logging
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import trio

from stores import Store

if TYPE_CHECKING:
    from ..control import RemoteTasks
    from ._metrics import DaemonMetrics

from adapters import kinds

from ..channel import AdapterRegistry, ChannelAdapter
from ..grants import GrantAuthorizer
from ..runtime import MessagingRuntime, Runtime
from . import _sdnotify as sdnotify
from ._config import Config, ConnectionConfig
from ._resending import resending_run
from ._startup import EXIT_FAILURE, EXIT_OK
from ._supervisor import (
    DaemonError,
    Supervisor,
    watchdog,
)
from ._wiring import adapter_child_name

log = logging.getLogger("prismd.daemon")

STOP_MARGIN_S = 5.0
"""Extra time on top of ``stop_deadline_ms`` for ``runtime.stop()`` to release leases."""
STATUS_REFRESH_S = 10.0
"""How often the serving daemon looks whether its ``STATUS=`` line changed."""


class DaemonServing:
    """The serving part of :class:`._daemon.Daemon`."""

    config: Config
    env: Mapping[str, str]
    supervisor: Supervisor
    endpoints: dict[str, str]
    metrics: DaemonMetrics | None
    notify: Callable[[str], object] | None
    ready: trio.Event
    instance_id: str | None
    adapter_ready_within_s: float | None
    _unresolved: str
    _stop_requested: bool
    _serve_scope: trio.CancelScope
    _a2a_pushes: dict[str, int]
    _agents: Mapping[str, Any]
    adapters: AdapterRegistry | None

    if TYPE_CHECKING:

        def _fail(self, message: str) -> None: ...

        def _status(self, text: str) -> None: ...

        def _print(self, line: str) -> None: ...

        def health(self) -> dict[str, Any]: ...

        def _a2a_statistics(self) -> dict[str, int] | None: ...

        async def _count_unresolved(
            self, runtime: MessagingRuntime, authorizer: GrantAuthorizer, *, failure_level: int
        ) -> tuple[int, bool] | None: ...

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
    ) -> int:
        failures: list[BaseException] = []
        code = EXIT_FAILURE
        try:
            code = await self._supervise_children(runtime, store, authorizer)
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
    ) -> int:
        from ..control import ControlHandler, pairing_aliases_from_grants, serve_control

        assert self.notify is not None
        notify = self.notify
        config = self.config
        adapters = self.adapters
        assert adapters is not None
        async with trio.open_nursery() as children:
            with self._serve_scope:
                handler = ControlHandler(
                    runtime=runtime,
                    store=store,
                    health=self.health,
                    identity_for=authorizer.identity_for,
                    pair_aliases=pairing_aliases_from_grants(config.grants),
                    inbox_sources=tuple(c for c, a in adapters.items() if a.features.inbox),
                    retention_ms=config.limits.retention_days * 86_400_000,
                    remote=_a2a_remote(self._agents),
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
                await self._start_a2a_push(children, store)
                for connection in config.connections:
                    adapter = adapters[connection.id]
                    await self.supervisor.start(
                        children,
                        adapter_child_name(connection),
                        resending_run(adapter, runtime),
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

    def _watch_metrics(self, runtime: Runtime, adapters: AdapterRegistry) -> None:
        """Point the metrics' live collector at this runtime, the children and adapters."""
        assert self.metrics is not None
        supervisor = self.supervisor
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

    async def _start_a2a_push(self, children: trio.Nursery, store: Store) -> None:
        """``[a2a] push_listen``: the receiver of remote agents' pushes and its inbox worker,
        when the config has ``[a2a]`` and at least one a2a agent."""
        if self.config.a2a is None:
            return
        from ..agents.a2a import A2AAgent, PushReceiver

        agents = {a: x for a, x in self._agents.items() if isinstance(x, A2AAgent)}
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


def _a2a_remote(agents: Mapping[str, Any]) -> RemoteTasks | None:
    """The control methods' view of this daemon's a2a agents (``None``: none)."""
    if not any(
        type(agent).__module__.startswith("prismd.agents.a2a.") for agent in agents.values()
    ):
        return None  # the a2a package is imported only when an a2a agent exists
    from ..agents.a2a import A2AAgent, cancel_remote, next_poll
    from ..control import RemoteTasks

    followed = {a: x for a, x in agents.items() if isinstance(x, A2AAgent)}
    cancel = functools.partial(cancel_remote, followed)
    return RemoteTasks(cancel=cancel, next_poll=functools.partial(next_poll, followed))
