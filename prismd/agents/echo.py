"""The ``echo`` agent: answers with the input text. The default agent of ``make run``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from stores import OwnershipScope

from ..identity import ownership_from_identity
from ._base import (
    AgentContext,
    EventSink,
    ResumeRequest,
    RunRequest,
    RunResult,
    RunState,
    run_failed,
)
from ._session import (
    AgentOptionError,
    SessionAgent,
    SessionLog,
    definition_revision,
    input_text,
    new_run_id,
    stream_text,
)


def validate_echo_options(options: Mapping[str, Any]) -> None:
    """``echo`` takes no options; any key is an error naming it."""
    for key in options:
        raise AgentOptionError(key, "unknown option for agent kind 'echo'")


@attrs.define(eq=False)
class EchoAgent(SessionAgent):
    """Answers with the input text (text blocks joined by newlines), streamed as one delta.

    Keeps a durable transcript per session (see :meth:`session_entries`); it never suspends,
    so ``status`` is always ``None`` and ``resume`` fails.
    """

    alias: str
    _log: SessionLog
    _revision: str

    @classmethod
    def from_context(cls, ctx: AgentContext) -> EchoAgent:
        validate_echo_options(ctx.options)
        return cls(
            alias=ctx.alias,
            log=SessionLog(ctx.checkpoints, ctx.alias),
            revision=definition_revision("echo", ctx.options),
        )

    async def run(self, request: RunRequest, *, on_event: EventSink | None = None) -> RunResult:
        run_id = new_run_id()
        text = input_text(request.input)
        await stream_text(run_id, text, on_event, by_word=False)
        leaf = await self._log.append(
            request.session_id,
            ownership_from_identity(request.identity),
            (("user", text), ("assistant", text)),
        )
        return RunResult("succeeded", text, run_id, request.session_id, leaf_id=leaf)

    async def status(
        self, *, run_id: str, session_id: str, ownership: OwnershipScope
    ) -> RunState | None:
        return None

    async def _resume(self, request: ResumeRequest) -> RunResult:
        raise run_failed(
            request.run_id, request.session_id, "not_resumable", "echo runs never suspend"
        )
