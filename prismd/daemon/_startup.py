"""The daemon's start-up steps, in order: the state directory's lock, the store (retried
while its server cannot be reached), the agents, grants and adapters, the journal's
identity, the runtime, and the count of what waits for an operator. Mixed into
:class:`._daemon.Daemon`, which holds the state they set."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
import urllib.parse
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import trio

from stores import Store, StoreError

if TYPE_CHECKING:
    from ._metrics import DaemonMetrics


from ..channel import AdapterRegistry, Redactor
from ..control import Operator
from ..grants import GrantAuthorizer
from ..journal import ChannelJournal, GrantStore, ensure_format
from ..runtime import MessagingRuntime, Runtime, open_messaging_runtime
from . import _logs as logs
from ._config import Config, ConfigError
from ._files import deliver_with_files
from ._runnable import check_runnable
from ._statedir import StateDir, StateDirError, open_state_dir
from ._supervisor import (
    describe_exception,
)
from ._wiring import WiringError, build_adapter, build_agents, close_parts

log = logging.getLogger("prismd.daemon")

_PASSWORD_IN_URL_RE = re.compile(r"(://[^/@:\s]*):[^/@\s]*@")

EXIT_OK = 0
EXIT_FAILURE = 1
CLOSE_BUDGET_S = 10.0
STORE_RETRY_FIRST_S = 1.0
STORE_RETRY_MAX_S = 30.0
"""An unreachable store server is tried again after 1 s, 2 s, 4 s … at most 30 s apart."""
MAX_COUNTED_UNRESOLVED = 100_000
"""Counting stops here (``at least N unresolved``): a bound on the startup listing."""


class EarlyExit(Exception):
    """A start-up step ends the start-up with ``code`` (a failure, or a stop requested)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


async def close_wired(agents: Mapping[str, Any], adapters: AdapterRegistry) -> None:
    with trio.move_on_after(CLOSE_BUDGET_S, shield=True):
        await close_parts(agents, adapters)


class DaemonStartup:
    """The start-up steps of :class:`._daemon.Daemon` (see its docstring for the order)."""

    config: Config
    env: Mapping[str, str]
    accept_new_journal: bool
    metrics: DaemonMetrics | None
    runtime: MessagingRuntime | None
    adapters: AdapterRegistry | None
    instance_id: str | None
    _unresolved: str
    _stop_event: trio.Event
    _agents: Mapping[str, Any]
    _leases_held: Callable[[], Mapping[str, Any]] | None

    if TYPE_CHECKING:

        def _give_up(self, message: str) -> NoReturn: ...

        def _fail(self, message: str) -> None: ...

        def _status(self, text: str) -> None: ...

        def _startup_point(self, step: str) -> None: ...

        def _watch_metrics(self, runtime: Runtime, adapters: AdapterRegistry) -> None: ...

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
    ) -> tuple[GrantAuthorizer, Runtime, list[str]]:
        """Agents, grants and adapters, built (inertly) from the config, and the runtime
        (not opened yet) the adapters admit their events to."""
        config = self.config
        try:
            secrets: list[str] = []
            agents = build_agents(config, store, env=self.env, secrets=secrets)
            self._agents = agents
            authorizer = GrantAuthorizer(
                config.grants, load_paired=GrantStore(store.checkpoints).load
            )
            runtime = Runtime()
            adapters = AdapterRegistry(
                send_with_files=functools.partial(deliver_with_files, agents=agents)
            )
            for connection in config.connections:
                adapters.add(
                    build_adapter(
                        connection,
                        runtime=runtime,
                        store=store,
                        state=state,
                        config=config,
                        env=self.env,
                        secrets=secrets,
                    )
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
        self.adapters = adapters
        stack.push_async_callback(close_wired, agents, adapters)
        for secret in secrets:
            logs.register_secret(secret)
        # A checkpoint first: a signal that arrived while a blocking factory ran is
        # delivered to the receiver task here.
        await trio.lowlevel.checkpoint()
        self._startup_point("before opening the runtime")
        return authorizer, runtime, secrets

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
            raise EarlyExit(EXIT_FAILURE)

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
        runtime: Runtime,
        secrets: list[str],
    ) -> Runtime:
        config = self.config
        adapters = self.adapters
        assert adapters is not None
        await stack.enter_async_context(
            open_messaging_runtime(
                authorize=authorizer.authorize,
                agents=self._agents,
                adapters=adapters,
                runtime=runtime,
                store=store,
                use_leases=True,
                limits=config.limits,
                owner_id=state.owner_id("runtime"),
                adopt_own_leases=True,
                resume_accepted=True,
                pairing_scope=authorizer.pairing_scope,
                on_paired=authorizer.on_paired,
                redactor=Redactor.of(secrets) if secrets else None,
            )
        )
        self.runtime = runtime

        def leases_held() -> Mapping[str, Any]:
            receivers = [c for c, a in adapters.items() if a.receiver_lease_held]
            return {"binding": runtime.leases_held(), "receiver": sorted(receivers)}

        self._leases_held = leases_held
        if self.metrics is not None:
            self._watch_metrics(runtime, adapters)
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
        identities = [
            authorizer.identity_for(Operator(uid=os.getuid(), tenant=tenant))
            for tenant in sorted(tenants)
        ]
        try:
            # What `prismctl list-unresolved` lists, counted without re-reading each pending
            # reply's operation every time (a backlog of sends would cost a read each).
            total, capped = await runtime.count_unresolved(
                identities=identities, limit=MAX_COUNTED_UNRESOLVED
            )
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


def _without_password(text: str, url: str) -> str:
    """``text`` without the password of ``url``, nor the password of any URL it quotes."""
    try:
        password = urllib.parse.urlsplit(url).password
    except ValueError:
        password = None
    if password:
        text = text.replace(password, logs.REDACTED)
    return _PASSWORD_IN_URL_RE.sub(rf"\1:{logs.REDACTED}@", text)
