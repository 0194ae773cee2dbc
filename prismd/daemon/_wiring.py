"""Building the daemon's parts from a :class:`~prismd.daemon.Config`.

Everything here is construction, no serving: agents per alias, and one adapter per
``[[connections]]`` entry (built by its kind's builder from :mod:`adapters.kinds`, with the
runtime not opened yet; a kind not built in this build is a clear startup error,
:class:`WiringError`). The runtime is then opened with both (its replies leave through the
adapters' :class:`~prismd.channel.AdapterRegistry`): no callback of the daemon is on a
message's way.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

from adapters import kinds
from stores import Store

from ..agents import Agent, AgentContext, AgentOptionError, build_agent
from ..channel import AdapterRegistry, BuildContext, ChannelAdapter
from ..runtime import Runtime
from ._config import Config, ConfigError, ConnectionConfig, read_secret
from ._statedir import StateDir

log = logging.getLogger("prismd.wiring")


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
            polls=store.polls,
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
    runtime: Runtime,
    store: Store,
    state: StateDir,
    config: Config,
    env: Mapping[str, str],
    secrets: list[str] | None = None,
) -> ChannelAdapter:
    """Construct (inertly) the adapter for one connection; secrets are read here.

    ``runtime`` (not opened yet: it admits nothing until it is) is what the adapter admits
    its events to, and gives the web chat its history and re-drive of held replies.

    Every secret read is appended to ``secrets`` (the daemon's outbound redactor removes
    them from any text an agent produces). Raises :class:`WiringError` or
    :class:`~prismd.daemon.ConfigError` (missing secret).
    """
    found: list[str] = [] if secrets is None else secrets

    def secret(name: str, env_name: str | None, file_name: str | None) -> str:
        value = read_secret(
            env_name=env_name,
            file_name=file_name,
            env=env,
            key=f"connections.{connection.id}.{name}",
        )
        found.append(value)
        return value

    try:
        kind = kinds.connection_kind(connection.kind)
        if kind is None:
            raise WiringError(f"unknown connection kind {connection.kind!r}")
        if kind.build is None:
            raise WiringError(f"connection kind {kind.name!r} is not available in this build")
        context = BuildContext(
            admit=runtime.admit,
            store=store,
            owner_id=state.owner_id(kind.name, connection.id),
            secret=secret,
            grants=tuple(g for g in config.grants if g.connection == connection.id),
            retention_days=config.limits.retention_days,
            max_attachment_bytes=config.limits.max_attachment_bytes,
            lease_ttl_ms=config.limits.lease_ttl_ms,
            conversations=runtime,
        )
        return kind.build(connection, context)
    except (WiringError, ConfigError):
        raise
    except (ValueError, TypeError) as exc:
        # The adapters' constructors validate their arguments with fixed messages (no
        # values); the secrets read are still removed in case one ever quotes a value.
        message = str(exc)
        for found_secret in found:
            if found_secret:
                message = message.replace(found_secret, "[redacted]")
        raise WiringError(f"[connections] {connection.id}: {message}") from None
    except Exception as exc:
        raise WiringError(
            f"[connections] {connection.id}: building the adapter failed ({type(exc).__name__})"
        ) from None


async def close_parts(agents: Mapping[str, Agent], adapters: AdapterRegistry) -> None:
    """Close the agents and adapters that hold resources outside ``run`` (HTTP clients);
    never raises."""
    for alias, agent in agents.items():
        close_agent = getattr(agent, "aclose", None)
        if callable(close_agent):
            try:
                await close_agent()
            except Exception as exc:
                log.warning("closing agent %s failed: %s", alias, type(exc).__name__)
    await adapters.aclose()
