"""Agents: the Trio-native agent seam (``_base``) and the built-in kinds.

Kinds: ``echo`` (answers with the input), ``mock`` (test/soak stand-in with delays,
failures and durable tool approvals), ``openai`` (any OpenAI-compatible chat completions
server, streamed, with durable history and tools) and ``python`` (any ``module:callable``
factory).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._base import Agent as Agent
from ._base import AgentContext as AgentContext
from ._base import AgentFactory as AgentFactory
from ._base import AgentInput as AgentInput
from ._base import Decision as Decision
from ._base import EventSink as EventSink
from ._base import FileProblem as FileProblem
from ._base import FileSource as FileSource
from ._base import ImageBlock as ImageBlock
from ._base import PendingDecision as PendingDecision
from ._base import RunError as RunError
from ._base import RunFailedError as RunFailedError
from ._base import RunHooks as RunHooks
from ._base import RunRequest as RunRequest
from ._base import RunResult as RunResult
from ._base import RunState as RunState
from ._base import RunStatusName as RunStatusName
from ._base import SecretReader as SecretReader
from ._base import StreamEvent as StreamEvent
from ._base import TextBlock as TextBlock
from ._retention import AGENT_NAMESPACES as AGENT_NAMESPACES
from ._retention import NS_A2A_INDEX as NS_A2A_INDEX
from ._retention import NS_A2A_TASK as NS_A2A_TASK
from ._retention import agent_record_kept as agent_record_kept
from ._session import MOVED_NAMESPACES as MOVED_NAMESPACES
from ._session import NS_RUN as NS_RUN
from ._session import NS_SESSION as NS_SESSION
from ._session import AgentOptionError as AgentOptionError
from ._session import SessionEntry as SessionEntry
from .echo import EchoAgent as EchoAgent
from .mock import MockAgent as MockAgent
from .mock import MockOptions as MockOptions
from .python import resolve_factory as resolve_factory
from .registry import AGENT_KINDS as AGENT_KINDS
from .registry import build_agent as build_agent
from .registry import validate_agent_options as validate_agent_options
from .tools import Tool as Tool

if TYPE_CHECKING:
    from .openai import OpenAIAgent as OpenAIAgent
    from .openai import OpenAIOptions as OpenAIOptions


def __getattr__(name: str) -> Any:
    # The openai kind is imported when first named: it brings httpx and its HTTP stack
    # (~3 MB resident), which a process running other kinds never uses.
    if name in ("OpenAIAgent", "OpenAIOptions"):
        from . import openai

        return getattr(openai, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
