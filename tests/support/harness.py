"""One recording host over a real runtime.

:class:`Host` is the host side of ``open_messaging_runtime`` — ``authorize``,
``resolve_agent``, ``deliver``, ``on_preview`` — recording every call. Two ways to run one:

* ``async with runtime(host, store, **options) as rt:`` — the runtime tests' form;
* ``async with open_harness(store, clock, {"primary": agent}, grant=…) as host:`` — the
  runtime is ``host.runtime``; a "restart" is a second harness on the same store.

:func:`store_factory` opens the *same* journal on every call (a "restart" reopens the file;
memory is shared), for tests that run on each backend.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from prismd.agents import Agent
from prismd.channel import AttachmentRef, Preview, Reply, SendResult
from prismd.grants import AuthorizeInput, Grant
from prismd.limits import Limits
from prismd.runtime import ResolveAgentInput, Runtime, open_messaging_runtime
from stores import Store, open_store

from .backends import BACKENDS
from .builders import grant
from .scripted import ScriptedAgent

SECRET = "sk-SECRET-VALUE-123"
"""A secret the redaction tests plant in agent output and look for everywhere."""


class ExactRedactor:
    """Replaces each secret with ``[REDACTED]`` (the behaviours list's redactor)."""

    def __init__(self, *secrets: str) -> None:
        self.secrets = secrets

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            text = text.replace(secret, "[REDACTED]")
        return text


@attrs.define(eq=False)
class Host:
    """The host side of a runtime, recording everything it is asked.

    Agents: ``agents[alias]``, else ``agent`` (``None``: an unknown alias fails to resolve).
    Grants: ``grant_for(request)`` when set, else ``grants[actor]``, else ``default_grant``.
    Delivery answers ``deliver_hook(reply)`` when that returns a result, else ``delivered``
    with the reply's ordinal as message id.
    """

    agent: Agent | None = attrs.field(factory=ScriptedAgent)
    agents: dict[str, Agent] = attrs.field(factory=dict)
    default_grant: Grant | None = attrs.field(factory=grant)
    grants: dict[str, Grant | None] = attrs.field(factory=dict)
    """Grant by actor id."""
    grant_for: Callable[[AuthorizeInput], Grant | None] | None = None
    deliver_hook: Callable[[Reply], SendResult | None] | None = None
    _runtime: Runtime | None = attrs.field(default=None, init=False)
    """Set while :func:`runtime` / :func:`open_harness` runs (read it as :attr:`runtime`)."""
    replies: list[Reply] = attrs.field(factory=list)
    previews: list[Preview] = attrs.field(factory=list)
    authorize_calls: list[AuthorizeInput] = attrs.field(factory=list)
    resolved: list[ResolveAgentInput] = attrs.field(factory=list)
    delivered: trio.Event = attrs.field(factory=trio.Event)
    """Set at the first delivery."""

    async def authorize(self, request: AuthorizeInput) -> Grant | None:
        self.authorize_calls.append(request)
        if self.grant_for is not None:
            return self.grant_for(request)
        return self.grants.get(request.external_actor_id, self.default_grant)

    async def resolve_agent(self, request: ResolveAgentInput) -> Agent:
        self.resolved.append(request)
        chosen = self.agents.get(request.agent_alias, self.agent)
        if chosen is None:
            raise KeyError(request.agent_alias)
        return chosen

    async def deliver(self, reply: Reply) -> SendResult:
        self.replies.append(reply)
        self.delivered.set()
        if self.deliver_hook is not None:
            result = self.deliver_hook(reply)
            if result is not None:
                return result
        return SendResult(delivered=True, message_id=str(len(self.replies)))

    def on_preview(self, preview: Preview) -> None:
        self.previews.append(preview)

    @property
    def runtime(self) -> Runtime:
        """The runtime :func:`runtime` / :func:`open_harness` is running for this host."""
        assert self._runtime is not None, "no runtime is running"
        return self._runtime

    @property
    def scripted(self) -> ScriptedAgent:
        """``agent`` as the :class:`ScriptedAgent` it is by default (its records: calls,
        provider calls, sessions, started runs)."""
        assert isinstance(self.agent, ScriptedAgent), f"the agent is {self.agent!r}"
        return self.agent

    @property
    def actions(self) -> list[str]:
        return [c.action for c in self.authorize_calls]

    @property
    def texts(self) -> list[str]:
        return [r.text for r in self.replies]

    def last(self) -> Reply:
        assert self.replies, "nothing was delivered"
        return self.replies[-1]

    async def settle(self) -> None:
        """Wait until every queued turn, resume and notice has finished."""
        with trio.fail_after(120):
            result = await self.runtime.drain(deadline_ms=60_000)
        assert result.settled, result


@attrs.define(eq=False)
class FirstSendHeld:
    """A ``deliver`` whose first send waits until :attr:`release` is set (the runtime's
    other work goes on meanwhile); each send's text is recorded in :attr:`sent`."""

    first_send: trio.Event = attrs.field(factory=trio.Event)
    """Set when the first send begins waiting."""
    release: trio.Event = attrs.field(factory=trio.Event)
    sent: list[str] = attrs.field(factory=list)

    async def deliver(self, reply: Reply) -> SendResult:
        if not self.sent and not self.release.is_set():
            self.first_send.set()
            await self.release.wait()
        self.sent.append(reply.text)
        return SendResult(delivered=True, message_id=str(len(self.sent)))


@asynccontextmanager
async def runtime(host: Host, store: Store | None = None, **kwargs: Any) -> AsyncIterator[Runtime]:
    """``open_messaging_runtime`` wired to ``host`` (default :class:`Limits`; ``deliver``:
    the host's unless given)."""
    kwargs.setdefault("limits", Limits())
    kwargs.setdefault("deliver", host.deliver)
    async with open_messaging_runtime(
        authorize=host.authorize,
        resolve_agent=host.resolve_agent,
        store=store,
        on_preview=host.on_preview,
        **kwargs,
    ) as rt:
        host._runtime = rt
        try:
            yield rt
        finally:
            host._runtime = None


@asynccontextmanager
async def open_harness(
    store: Store,
    clock: Any,
    agents: Mapping[str, Agent],
    *,
    grant: Grant | None = None,
    grants: Mapping[str, Grant | None] | None = None,
    use_journal: bool = True,
    fetch_attachment: Callable[[AttachmentRef], Awaitable[Any]] | None = None,
    **kwargs: Any,
) -> AsyncIterator[Host]:
    """A :class:`Host` with exactly ``agents`` and a runtime on ``clock``; with
    ``use_journal=False`` the agents still use ``store`` but the runtime keeps no journal."""
    host = Host(agent=None, agents=dict(agents), grants=dict(grants or {}))
    if grant is not None:
        host.default_grant = grant
    if fetch_attachment is not None:
        kwargs["fetch_attachment"] = fetch_attachment
    async with runtime(host, store if use_journal else None, clock=clock, **kwargs):
        yield host


StoreFactory = Callable[[], Awaitable[Store]]


@asynccontextmanager
async def store_factory(
    kind: str, tmp_path: Path, clock: Any = None
) -> AsyncIterator[StoreFactory]:
    """A factory opening a store of backend ``kind`` (see :data:`BACKENDS`); every call opens
    the *same* data (a durable backend reopens it; memory is shared). Every store it opened
    is closed when the block ends."""
    options: dict[str, Any] = {} if clock is None else {"clock": clock}
    backend = BACKENDS[kind](tmp_path)
    shared: list[Store] = []
    async with AsyncExitStack() as stack:
        stack.callback(backend.discard)

        async def open_one() -> Store:
            if backend.durable or not shared:
                shared.append(await stack.enter_async_context(open_store(backend.url, **options)))
            return shared[-1]

        yield open_one
