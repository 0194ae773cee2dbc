"""Building the daemon's parts from a :class:`~prismd.config.Config`.

Everything here is construction, no serving: agents per alias, one adapter per
``[[connections]]`` entry, the grant authorizer, and the host callbacks the runtime needs
(``resolve_agent``, ``deliver``). Adapter modules are imported lazily so a connection kind
whose module is unavailable is a clear startup error (:class:`WiringError`) instead of an
import failure at ``prismd`` start.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs

from stores import Store

from ..agents._base import Agent, AgentContext
from ..agents._session import AgentOptionError
from ..channel import (
    Admission,
    AttachmentRef,
    ChannelAdapter,
    InboundEvent,
    PastReply,
    Preview,
    Reply,
    SendResult,
)
from ..runtime import ResolveAgentInput, Runtime
from ._config import (
    Config,
    ConfigError,
    ConnectionConfig,
    SignalConnectionConfig,
    TelegramConnectionConfig,
    WebchatConnectionConfig,
    read_secret,
)
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
    import os

    from ..agents.registry import build_agent

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


def _import_adapter_module(kind: str, module: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise WiringError(f"connection kind {kind!r} is not available in this build") from None


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
    :class:`~prismd.config.ConfigError` (missing secret).
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
    if isinstance(connection, WebchatConnectionConfig):
        module = _import_adapter_module("webchat", "adapters.webchat")
        token = None
        if connection.access_token_env:
            token = read_secret(
                env_name=connection.access_token_env,
                file_name=None,
                env=env,
                key=f"connections.{connection.id}.access_token_env",
            )
            found.append(token)
        mine = [g for g in config.grants if g.connection == connection.id]
        # Off loopback without a token, config allows only pairing (no "*" grant): then
        # strangers reach the socket but no agent until an operator pairs them.
        pairing_only = bool(mine) and not any("*" in g.actors for g in mine)
        adapter: ChannelAdapter = module.WebchatAdapter(
            connection_id=connection.id,
            listen=connection.listen,
            admit=admit,
            access_token=token,
            pairing_only=pairing_only and any(g.pairing for g in mine),
            checkpoints=store.checkpoints,
            conversations=conversations,
            resume_ttl_days=config.limits.retention_days,
        )
        return adapter
    if isinstance(connection, TelegramConnectionConfig):
        module = _import_adapter_module("telegram", "adapters.telegram")
        # Read once now so a missing token fails the start, not the first poll.
        token_value = read_secret(
            env_name=connection.token_env,
            file_name=connection.token_file,
            env=env,
            key=f"connections.{connection.id}.token",
        )
        found.append(token_value)
        secret = None
        if connection.webhook_secret_env:
            secret = read_secret(
                env_name=connection.webhook_secret_env,
                file_name=None,
                env=env,
                key=f"connections.{connection.id}.webhook_secret_env",
            )
            found.append(secret)
        adapter = module.TelegramAdapter(
            connection_id=connection.id,
            token=lambda: token_value,
            admit=admit,
            store=store,
            owner_id=state.owner_id("telegram", connection.id),
            reclaim=True,
            api_origin=connection.api_origin,
            mode=connection.mode,
            webhook_listen=connection.webhook_listen,
            webhook_path=connection.webhook_path,
            webhook_secret=secret,
            allow_groups=connection.allow_groups,
            poll_timeout_s=connection.poll_timeout_s,
            max_attachment_bytes=config.limits.max_attachment_bytes,
        )
        return adapter
    if isinstance(connection, SignalConnectionConfig):
        module = _import_adapter_module("signal", "adapters.signal")
        factory = getattr(module, "build_signal_adapter", None)
        if factory is None:
            raise WiringError("connection kind 'signal' is not available in this build")
        adapter = factory(
            connection, admit=admit, store=store, owner_id=state.owner_id("signal", connection.id)
        )
        return adapter
    raise WiringError(f"unknown connection kind {getattr(connection, 'kind', '?')!r}")


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
        return any(callable(getattr(a, "send_draft", None)) for a in self.adapters.values())

    def preview(self, preview: Preview) -> None:
        """The runtime's ``on_preview``: hand a streaming preview to its connection's adapter
        (Telegram drafts; adapters without previews ignore it). Never raises."""
        adapter = self.adapters.get(preview.connection_id)
        send_draft = getattr(adapter, "send_draft", None)
        if callable(send_draft):
            try:
                send_draft(preview)
            except Exception as exc:
                log.warning("preview failed: %s", type(exc).__name__)

    def has_typing(self) -> bool:
        return any(callable(getattr(a, "send_typing", None)) for a in self.adapters.values())

    async def typing(self, connection_id: str, conversation_id: str, thread_id: str | None) -> None:
        """The runtime's ``on_typing``: a typing indicator on the turn's connection."""
        adapter = self.adapters.get(connection_id)
        send_typing = getattr(adapter, "send_typing", None)
        if callable(send_typing):
            await send_typing(conversation_id, thread_id)

    def has_attachments(self) -> bool:
        return any(callable(getattr(a, "fetch_attachment", None)) for a in self.adapters.values())

    async def fetch_attachment(self, ref: AttachmentRef) -> Any:
        """The runtime's ``fetch_attachment``: asks each adapter that can fetch files.

        A ref carries no connection id; a file id is only valid for the bot that saw it,
        so every other adapter answers ``None`` and the first answer wins.
        """
        for adapter in self.adapters.values():
            fetch = getattr(adapter, "fetch_attachment", None)
            if not callable(fetch):
                continue
            fetched = await fetch(ref)
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
            close = getattr(adapter, "aclose", None)
            if not callable(close):
                continue
            try:
                await close()
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
        return await adapter.send(reply)
