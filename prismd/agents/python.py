"""The ``python`` agent kind: ``factory = "module:callable"`` builds any agent in-process.

The callable is imported when the agent is built and called with the :class:`AgentContext`
(``options`` still holds ``factory`` and every other key of the table, so a factory can take
its own options). Its result must satisfy the :class:`~prismd.agents.Agent` protocol.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping
from typing import Any

from ._base import Agent, AgentContext
from ._session import AgentOptionError

FACTORY_RE = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$")
_PROPERTIES = ("agent_id", "definition_revision", "input_capabilities", "supports_approvals")
_METHODS = ("run", "status", "resume")


def validate_python_options(options: Mapping[str, Any]) -> str:
    """Check ``factory`` (required, ``module:callable``); other keys belong to the factory."""
    factory = options.get("factory")
    if factory is None:
        raise AgentOptionError("factory", "is required for agent kind 'python'")
    if not isinstance(factory, str) or not FACTORY_RE.match(factory):
        raise AgentOptionError("factory", "must be 'module:callable'")
    return factory


def resolve_factory(spec: str, key: str = "factory") -> Any:
    """The object ``module:attr.path`` names (imported, not called); raises
    :class:`AgentOptionError` naming ``key`` (the option that gave ``spec``) when it cannot
    be found — never with the module's own error text."""
    module_name, _, attr_path = spec.partition(":")
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise AgentOptionError(key, f"cannot import module {module_name!r}") from exc
    except Exception as exc:
        # A syntax error or an exception raised at import time: name its type only (its
        # text is the module's own and may carry anything).
        raise AgentOptionError(
            key, f"cannot import module {module_name!r} ({type(exc).__name__})"
        ) from None
    for part in attr_path.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise AgentOptionError(
                key, f"module {module_name!r} has no attribute {attr_path!r}"
            ) from None
    if not callable(target):
        raise AgentOptionError(key, f"{spec!r} is not callable")
    return target


def check_agent(agent: object, where: str) -> Agent:
    """``agent`` if it has every member of the Agent protocol, else a ``TypeError`` naming one."""
    for name in _PROPERTIES:
        if not hasattr(agent, name):
            raise TypeError(f"{where} returned an object without {name!r}; expected an Agent")
    for name in _METHODS:
        if not callable(getattr(agent, name, None)):
            raise TypeError(f"{where} returned an object without a {name!r} method")
    caps = agent.input_capabilities  # type: ignore[attr-defined]
    if not isinstance(caps, frozenset | set) or "text" not in caps:
        raise TypeError(f"{where}: input_capabilities must be a set containing 'text'")
    if not isinstance(agent.agent_id, str) or not agent.agent_id:  # type: ignore[attr-defined]
        raise TypeError(f"{where}: agent_id must be a non-empty string")
    return agent  # type: ignore[return-value]


def build_python_agent(ctx: AgentContext) -> Agent:
    """Import and call the factory; errors say which factory failed and why."""
    spec = validate_python_options(ctx.options)
    factory = resolve_factory(spec)
    return check_agent(factory(ctx), f"agent factory {spec!r}")
