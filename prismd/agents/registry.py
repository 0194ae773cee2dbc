"""Agent kinds by name: ``build_agent(kind, ctx)`` and ``validate_agent_options(kind, options)``.

``validate_agent_options`` is what ``prismd check-config`` runs for ``[agents.<alias>]``; it
raises :class:`~prismd.agents.AgentOptionError` (a ``ValueError`` whose ``key`` names the bad
option and whose message starts with ``<key>:``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ._base import Agent, AgentContext
from ._session import AgentOptionError
from .echo import EchoAgent, validate_echo_options
from .mock import MockAgent, validate_mock_options
from .python import build_python_agent, resolve_factory, validate_python_options

AGENT_KINDS = ("a2a", "echo", "mock", "openai", "python")

# The a2a kind is a package built on the agent seam (it imports this package's face), so
# it is found by name on first use, as a ``python`` factory is: no import cycle.
A2A_FACTORY = "prismd.agents.a2a:A2AAgent.from_context"
A2A_VALIDATOR = "prismd.agents.a2a:validate_a2a_options"


def _unavailable(kind: str) -> AgentOptionError:
    return AgentOptionError(
        "kind", f"unknown agent kind {kind!r}; expected one of {', '.join(AGENT_KINDS)}"
    )


def validate_agent_options(kind: str, options: Mapping[str, Any]) -> None:
    """Raise ``AgentOptionError`` naming the first bad option (or ``kind``); else ``None``."""
    if kind == "a2a":
        resolve_factory(A2A_VALIDATOR)(options)
    elif kind == "echo":
        validate_echo_options(options)
    elif kind == "mock":
        validate_mock_options(options)
    elif kind == "openai":
        from .openai import validate_openai_options

        validate_openai_options(options)
    elif kind == "python":
        validate_python_options(options)
    else:
        raise _unavailable(kind)


def build_agent(kind: str, ctx: AgentContext) -> Agent:
    """Build the agent for one alias. Raises ``AgentOptionError`` for bad kinds/options and
    ``TypeError`` when a python factory returns something that is not an agent."""
    if kind == "a2a":
        agent: Agent = resolve_factory(A2A_FACTORY)(ctx)
        return agent
    if kind == "echo":
        return EchoAgent.from_context(ctx)
    if kind == "mock":
        return MockAgent.from_context(ctx)
    if kind == "openai":
        # Imported on first use (httpx and its HTTP stack): see the package.
        from .openai import OpenAIAgent

        return OpenAIAgent.from_context(ctx)
    if kind == "python":
        return build_python_agent(ctx)
    raise _unavailable(kind)
