"""The ``echo`` agent: answers with the input text. The default agent of ``make run``.

It keeps no transcript unless ``history = true``: its answers never read one, and a
transcript rewritten after every turn was a fifth of the journal's writes per message (the
transcript itself, and the binding whose leaf it moved). With ``history`` it keeps one per
session, as the model agents do (see :meth:`EchoAgent.session_entries`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from ..grants import ownership_from_identity
from ._base import (
    AgentContext,
    EventSink,
    ResumeRequest,
    RunRequest,
    RunResult,
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
    """``echo`` takes ``history`` (a boolean) only; any other key, or a ``history`` that is
    not a boolean, is an error naming it."""
    for key, value in options.items():
        if key != "history":
            raise AgentOptionError(key, "unknown option for agent kind 'echo'")
        if not isinstance(value, bool):
            raise AgentOptionError(key, "must be true or false")


@attrs.define(eq=False)
class EchoAgent(SessionAgent):
    """Answers with the input text (text blocks joined by newlines), streamed as one delta.

    With ``history`` it keeps a durable transcript per session (see :meth:`session_entries`)
    and answers the last entry's id as the run's leaf; without, it writes nothing and
    answers no leaf, so the route's binding is not rewritten after each turn. It never
    suspends, so ``status`` is always ``None`` and ``resume`` fails.
    """

    alias: str
    _log: SessionLog
    _revision: str
    history: bool = False

    @classmethod
    def from_context(cls, ctx: AgentContext) -> EchoAgent:
        validate_echo_options(ctx.options)
        return cls(
            alias=ctx.alias,
            log=SessionLog(ctx.checkpoints, ctx.alias),
            revision=definition_revision("echo", ctx.options),
            history=bool(ctx.options.get("history", False)),
        )

    async def run(self, request: RunRequest, *, on_event: EventSink | None = None) -> RunResult:
        run_id = new_run_id()
        text = input_text(request.input)
        await stream_text(run_id, text, on_event, by_word=False)
        if not self.history:
            return RunResult("succeeded", text, run_id, request.session_id)
        leaf = await self._log.append(
            request.session_id,
            ownership_from_identity(request.identity),
            (("user", text), ("assistant", text)),
        )
        return RunResult("succeeded", text, run_id, request.session_id, leaf_id=leaf)

    async def _resume(self, request: ResumeRequest) -> RunResult:
        raise run_failed(
            request.run_id, request.session_id, "not_resumable", "echo runs never suspend"
        )
