"""Building the daemon's parts from a :class:`~prismd.daemon.Config`.

Everything here is construction, no serving: agents per alias, one adapter per
``[[connections]]`` entry (built by its kind's builder from :mod:`adapters.kinds`; a kind
not built in this build is a clear startup error, :class:`WiringError`), and the host
callbacks the runtime needs (``resolve_agent``, ``deliver``, and the optional seams that
adapters declare in their :class:`~prismd.channel.AdapterFeatures`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs

from adapters import kinds
from stores import Store

from ..agents import Agent, AgentContext, AgentOptionError, build_agent
from ..channel import (
    DEFAULT_TYPING_DELAY_MS,
    Admission,
    AttachmentRef,
    BuildContext,
    ChannelAdapter,
    InboundEvent,
    PastReply,
    Preview,
    Reply,
    SendResult,
)
from ..runtime import ResolveAgentInput, Runtime
from ._config import Config, ConfigError, ConnectionConfig, read_secret
from ._files import deliver_with_files
from ._statedir import StateDir

log = logging.getLogger("prismd.wiring")

UNKNOWN_CONNECTION = "unknown_connection"


class WiringError(Exception):
    """The configuration cannot be turned into a running daemon; the message names the part."""


def secret_reader(
    env: Mapping[str, str], found: list[str], where: str
) -> Callable[[str | None, str | None, str], str]:
    """An :attr:`AgentContext.read_secret` over :func:`read_secret` that appends every value
    it reads to ``found`` (the daemon's redactor and log filter); errors name
    ``<where>.<key>``."""

    def read(env_name: str | None, file_name: str | None, key: str) -> str:
        value = read_secret(env_name=env_name, file_name=file_name, env=env, key=f"{where}.{key}")
        found.append(value)
        return value

    return read


def build_agents(
    config: Config,
    store: Store,
    *,
    env: Mapping[str, str] | None = None,
    secrets: list[str] | None = None,
) -> dict[str, Agent]:
    """One agent per ``[agents.<alias>]``, each with the store's checkpoints.

    Secrets an agent reads (an ``openai`` API key) come from ``env`` (default: this
    process's environment) and are appended to ``secrets``.
    """

    found: list[str] = [] if secrets is None else secrets
    agents: dict[str, Agent] = {}
    for alias, agent in config.agents.items():
        context = AgentContext(
            alias=alias,
            options=agent.options,
            checkpoints=store.checkpoints,
            read_secret=secret_reader(
                os.environ if env is None else env, found, f"[agents.{alias}]"
            ),
            push_base_url=None if config.a2a is None else config.a2a.push_base_url,
            max_remote_tasks_per_tenant=config.limits.max_remote_tasks_per_tenant,
        )
        try:
            agents[alias] = build_agent(agent.kind, context)
        except AgentOptionError as exc:
            # AgentOptionError messages name the option, never a value.
            raise WiringError(f"[agents.{alias}]: {exc}") from None
        except ConfigError:
            raise  # a missing secret: the message names the key, never a value
        except TypeError as exc:
            if str(exc).startswith("agent factory "):
                # check_agent's own fixed text: which protocol member is missing.
                raise WiringError(f"[agents.{alias}]: {exc}") from None
            raise WiringError(f"[agents.{alias}]: {_factory_failed(exc)}") from None
        except Exception as exc:
            # A python factory's own error: its text is the factory's and may carry
            # anything (a key it read), so only the type is named.
            raise WiringError(f"[agents.{alias}]: {_factory_failed(exc)}") from None
    return agents


def _factory_failed(exc: BaseException) -> str:
    return f"building the agent failed ({type(exc).__name__})"


def adapter_child_name(connection: ConnectionConfig) -> str:
    """The supervisor child name of a connection's adapter, e.g. ``webchat:web``."""
    return f"{connection.kind}:{connection.id}"


def build_adapter(
    connection: ConnectionConfig,
    *,
    admit: Callable[[InboundEvent], Awaitable[Admission]],
    store: Store,
    state: StateDir,
    config: Config,
    env: Mapping[str, str],
    secrets: list[str] | None = None,
    conversations: Host | None = None,
) -> ChannelAdapter:
    """Construct (inertly) the adapter for one connection; secrets are read here.

    ``conversations`` (the :class:`Host`) gives the web chat its late-bound history and
    re-drive of held replies.

    Every secret read is appended to ``secrets`` (the daemon's outbound redactor removes
    them from any text an agent produces). Raises :class:`WiringError` or
    :class:`~prismd.daemon.ConfigError` (missing secret).
    """
    found: list[str] = [] if secrets is None else secrets
    try:
        return _build_adapter(
            connection,
            admit=admit,
            store=store,
            state=state,
            config=config,
            env=env,
            found=found,
            conversations=conversations,
        )
    except (WiringError, ConfigError):
        raise
    except (ValueError, TypeError) as exc:
        # The adapters' constructors validate their arguments with fixed messages (no
        # values); the secrets read are still removed in case one ever quotes a value.
        message = str(exc)
        for secret in found:
            if secret:
                message = message.replace(secret, "[redacted]")
        raise WiringError(f"[connections] {connection.id}: {message}") from None
    except Exception as exc:
        raise WiringError(
            f"[connections] {connection.id}: building the adapter failed ({type(exc).__name__})"
        ) from None


def _build_adapter(
    connection: ConnectionConfig,
    *,
    admit: Callable[[InboundEvent], Awaitable[Admission]],
    store: Store,
    state: StateDir,
    config: Config,
    env: Mapping[str, str],
    found: list[str],
    conversations: Host | None,
) -> ChannelAdapter:
    kind = kinds.connection_kind(connection.kind)
    if kind is None:
        raise WiringError(f"unknown connection kind {connection.kind!r}")
    if kind.build is None:
        raise WiringError(f"connection kind {kind.name!r} is not available in this build")

    def secret(name: str, env_name: str | None, file_name: str | None) -> str:
        value = read_secret(
            env_name=env_name,
            file_name=file_name,
            env=env,
            key=f"connections.{connection.id}.{name}",
        )
        found.append(value)
        return value

    context = BuildContext(
        admit=admit,
        store=store,
        owner_id=state.owner_id(kind.name, connection.id),
        secret=secret,
        grants=tuple(g for g in config.grants if g.connection == connection.id),
        retention_days=config.limits.retention_days,
        max_attachment_bytes=config.limits.max_attachment_bytes,
        lease_ttl_ms=config.limits.lease_ttl_ms,
        conversations=conversations,
    )
    return kind.build(connection, context)


@attrs.define(eq=False)
class Host:
    """The runtime's host callbacks over the built agents and adapters.

    ``admit`` is late-bound: adapters are built before the runtime (the runtime's
    ``deliver`` needs them), so they get :meth:`admit`, which forwards to the runtime once
    :meth:`bind` was called and answers ``denied/unavailable`` (retryable: the adapter
    does not acknowledge the transport) before that. :meth:`redeliver_pending` and
    :meth:`recent_replies` (the web chat's reconnect) are late-bound the same way and do
    nothing before that.
    """

    agents: Mapping[str, Agent]
    adapters: dict[str, ChannelAdapter] = attrs.field(factory=dict)
    _admit: Callable[[InboundEvent], Awaitable[Admission]] | None = None
    _runtime: Runtime | None = None

    def bind(
        self,
        admit: Callable[[InboundEvent], Awaitable[Admission]] | None,
        runtime: Runtime | None = None,
    ) -> None:
        self._admit = admit
        self._runtime = runtime

    async def redeliver_pending(
        self, *, connection_id: str, external_conversation_id: str, external_actor_id: str
    ) -> int:
        runtime = self._runtime
        if runtime is None:
            return 0
        return await runtime.redeliver_pending(
            connection_id=connection_id,
            external_conversation_id=external_conversation_id,
            external_actor_id=external_actor_id,
        )

    async def recent_replies(
        self,
        *,
        connection_id: str,
        external_conversation_id: str,
        external_actor_id: str,
        limit: int,
    ) -> list[PastReply]:
        runtime = self._runtime
        if runtime is None:
            return []
        return await runtime.recent_replies(
            connection_id=connection_id,
            external_conversation_id=external_conversation_id,
            external_actor_id=external_actor_id,
            limit=limit,
        )

    def busy_conversations(self, connection_id: str) -> frozenset[str]:
        """The conversations of ``connection_id`` the runtime still works on (a durable
        inbox keeps their next updates here, in order); none before :meth:`bind`."""
        runtime = self._runtime
        if runtime is None:
            return frozenset()
        return runtime.busy_conversations(connection_id)

    async def admit(self, event: InboundEvent) -> Admission:
        target = self._admit
        if target is None:
            return Admission(status="denied", reason="unavailable")
        return await target(event)

    async def resolve_agent(self, request: ResolveAgentInput) -> Agent:
        """``resolve_agent(ResolveAgentInput)``: the agent built for the alias."""
        alias = request.agent_alias
        agent = self.agents.get(alias)
        if agent is None:
            raise LookupError(f"no agent is configured for alias {alias!r}")
        return agent

    def has_previews(self) -> bool:
        return any(a.features.previews for a in self.adapters.values())

    def preview(self, preview: Preview) -> None:
        """The runtime's ``on_preview``: hand a streaming preview to its connection's adapter
        (Telegram drafts; adapters without previews are not asked). Never raises."""
        adapter = self.adapters.get(preview.connection_id)
        if adapter is None or not adapter.features.previews:
            return
        try:
            adapter.send_draft(preview)
        except Exception as exc:
            log.warning("preview failed: %s", type(exc).__name__)

    def has_typing(self) -> bool:
        return any(a.features.typing for a in self.adapters.values())

    def typing_delay_ms(self, connection_id: str) -> int:
        """The runtime's ``typing_delay_ms``: as the connection's adapter declares it."""
        adapter = self.adapters.get(connection_id)
        if adapter is None:
            return DEFAULT_TYPING_DELAY_MS
        return adapter.features.typing_delay_ms

    async def typing(self, connection_id: str, conversation_id: str, thread_id: str | None) -> None:
        """The runtime's ``on_typing``: a typing indicator on the turn's connection."""
        adapter = self.adapters.get(connection_id)
        if adapter is not None and adapter.features.typing:
            await adapter.send_typing(conversation_id, thread_id)

    def has_attachments(self) -> bool:
        return any(a.features.attachments for a in self.adapters.values())

    async def fetch_attachment(self, ref: AttachmentRef) -> Any:
        """The runtime's ``fetch_attachment``: asked of the adapter of the ref's connection
        (a file id is only valid for the bot that saw it). A ref without a connection id
        (rebuilt from an older record) is asked of each adapter that fetches files; the
        others answer ``None`` for ids they did not issue, and the first answer wins."""
        if ref.connection_id is not None:
            adapter = self.adapters.get(ref.connection_id)
            if adapter is None or not adapter.features.attachments:
                return None
            return await adapter.fetch_attachment(ref)
        for adapter in self.adapters.values():
            if not adapter.features.attachments:
                continue
            fetched = await adapter.fetch_attachment(ref)
            if fetched is not None:
                return fetched
        return None

    async def aclose(self) -> None:
        """Close adapters and agents that hold resources outside ``run`` (HTTP clients);
        never raises."""
        for alias, agent in self.agents.items():
            close_agent = getattr(agent, "aclose", None)
            if callable(close_agent):
                try:
                    await close_agent()
                except Exception as exc:
                    log.warning("closing agent %s failed: %s", alias, type(exc).__name__)
        for adapter in self.adapters.values():
            try:
                await adapter.aclose()
            except Exception as exc:
                log.warning("closing %s failed: %s", adapter.connection_id, type(exc).__name__)

    async def deliver(self, reply: Reply) -> SendResult:
        """Route a reply to its connection's adapter; unknown connection → not delivered.

        An adapter's exception propagates on purpose: the message may have gone out, and
        the runtime records a raising ``deliver`` as ambiguous (``delivery_unknown``), not
        as failed."""
        adapter = self.adapters.get(reply.connection_id)
        if adapter is None:
            return SendResult(delivered=False, reason=UNKNOWN_CONNECTION)
        if reply.files:
            return await deliver_with_files(adapter, reply, self.agents)
        return await adapter.send(reply)

    def tells_unanswered(self, connection_id: str) -> bool:
        """The runtime's ``tells_unanswered``: as the connection's adapter declares."""
        adapter = self.adapters.get(connection_id)
        return adapter is not None and adapter.features.unanswered_notices

    async def unanswered_notices(
        self,
        *,
        connection_id: str,
        external_conversation_id: str,
        external_actor_id: str,
        limit: int,
    ) -> list[PastReply]:
        """The web chat's notices for messages settled unanswered (late-bound like
        :meth:`recent_replies`)."""
        runtime = self._runtime
        if runtime is None:
            return []
        return await runtime.unanswered_notices(
            connection_id=connection_id,
            external_conversation_id=external_conversation_id,
            external_actor_id=external_actor_id,
            limit=limit,
        )
