"""Tools for the ``openai`` agent: ``tools = "module:callable"`` returns :class:`Tool` values.

The factory is called once when the agent is built, with the agent's
:class:`~prismd.agents.AgentContext`, and returns an iterable of :class:`Tool`. Each tool is
offered to the model as an OpenAI ``function`` tool (``name``, ``description``, JSON-schema
``parameters``); when the model calls it, ``call`` is awaited with the parsed arguments and its
result (a string, or any JSON value, which is serialised) is fed back to the model.

A tool with ``requires_approval=True`` is never called before a person allowed it: the run
suspends with a pending decision, the runtime shows it with Allow/Deny controls, and the run
resumes after the decision. Every call of an approved tool is journaled before it starts, so a
crash mid-call leaves the run interrupted (shown, settled by ``/cancel``) instead of calling
the tool again.

Example (docs/agents.md's)::

    from prismd.agents.tools import Tool

    async def clock(arguments):
        return {"utc": "2024-01-01T00:00:00Z"}

    def tools(ctx):
        return [Tool(name="clock", description="The current UTC time.",
                     parameters={"type": "object", "properties": {}}, call=clock)]
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import attrs

from ._session import AgentOptionError

TOOL_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""OpenAI's rule for function names."""
MAX_TOOLS = 64
MAX_DESCRIPTION_CHARS = 1024

ToolCallable = Callable[[Mapping[str, Any]], Awaitable[Any]]


def _check_parameters(_instance: object, _attribute: object, value: object) -> None:
    if not isinstance(value, Mapping) or value.get("type") != "object":
        raise ValueError("parameters must be a JSON schema object ({'type': 'object', ...})")


@attrs.frozen
class Tool:
    """One tool: ``call(arguments)`` is awaited with the model's parsed JSON arguments."""

    name: str = attrs.field()
    description: str
    parameters: Mapping[str, Any] = attrs.field(validator=_check_parameters)
    call: ToolCallable
    requires_approval: bool = False

    @name.validator
    def _check_name(self, _attribute: object, value: object) -> None:
        if not isinstance(value, str) or not TOOL_NAME_RE.match(value):
            raise ValueError("a tool name must be 1-64 letters, digits, '_' or '-'")

    def openai_schema(self) -> dict[str, Any]:
        """The entry of the request's ``tools`` list."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description[:MAX_DESCRIPTION_CHARS],
                "parameters": dict(self.parameters),
            },
        }


def check_tools(produced: object, where: str) -> dict[str, Tool]:
    """The tools by name; ``AgentOptionError("tools", …)`` when the factory's result is not
    an iterable of distinct :class:`Tool` values (at most :data:`MAX_TOOLS`)."""
    if not isinstance(produced, Iterable) or isinstance(produced, str | bytes | Mapping):
        raise AgentOptionError("tools", f"{where} must return an iterable of Tool")
    tools: dict[str, Tool] = {}
    for item in produced:
        if not isinstance(item, Tool):
            raise AgentOptionError("tools", f"{where} returned something that is not a Tool")
        if not callable(item.call):
            raise AgentOptionError("tools", f"tool {item.name!r} has no callable 'call'")
        if item.name in tools:
            raise AgentOptionError("tools", f"{where} returned two tools named {item.name!r}")
        tools[item.name] = item
        if len(tools) > MAX_TOOLS:
            raise AgentOptionError("tools", f"{where} returned more than {MAX_TOOLS} tools")
    return tools
