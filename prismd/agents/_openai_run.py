"""The ``openai`` agent's runs that call tools: the durable run record, and the loop that
answers tool calls and calls the model until it answers in text.

A run record (``prismd.v1.agent-run``) exists only once a run calls a tool; its ``status``
walks ``suspended → dispatching → running → … → succeeded | denied | failed``, and
``dispatching`` is written (CAS) *before* a tool is called, so a crash mid-call leaves a run
that is reported interrupted and never calls the tool a second time (see
:mod:`prismd.agents.openai`).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from stores import OwnershipScope

from ._base import EventSink, PendingDecision, RunResult, run_failed
from ._chat import Completion, ProviderError, ToolCall
from ._openai_options import OpenAIOptions
from ._runbook import RunBook, VersionedRun
from ._session import SessionLog
from .tools import Tool

__all__ = ["MAX_RUN_RECORD_BYTES", "RunLoop", "RunRecord", "interrupted"]

log = logging.getLogger("prismd.agents.openai")

MAX_TOOL_ROUNDS = 8
"""Model calls per run (a run, or a resume) before it ends ``tool_rounds_exceeded``."""
MAX_TOOL_RESULT_CHARS = 16 * 1024
MAX_RUN_RECORD_BYTES = 768 * 1024
INTERRUPTED_KIND = "tool_interrupted"
DENIED_TOOL_RESULT = "The user denied this tool call. Do not try it again; answer without it."

Complete = Callable[[str, list[Mapping[str, Any]], EventSink | None], Awaitable[Completion]]
"""``complete(run_id, messages, on_event)``: one streamed model call."""


@attrs.frozen
class RunRecord:
    """The durable state of a run that called a tool (JSON in ``prismd.v1.agent-run``)."""

    status: str
    session_id: str
    user_text: str
    messages: tuple[Mapping[str, Any], ...]
    """Everything after the user message: assistant tool-call messages and tool results."""
    queue: tuple[ToolCall, ...] = ()
    """Tool calls of the last assistant message still to answer, in order."""
    pending: PendingDecision | None = None
    dispatch: ToolCall | None = None
    created_at_ms: int = 0
    answer: str | None = None
    leaf_id: str | None = None
    error_code: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "sessionId": self.session_id,
            "userText": self.user_text,
            "messages": [dict(m) for m in self.messages],
            "queue": [attrs.asdict(c) for c in self.queue],
            "pending": None if self.pending is None else attrs.asdict(self.pending),
            "dispatch": None if self.dispatch is None else attrs.asdict(self.dispatch),
            "createdAt": self.created_at_ms,
            "answer": self.answer,
            "leafId": self.leaf_id,
            "errorCode": self.error_code,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> RunRecord:
        pending = raw.get("pending")
        dispatch = raw.get("dispatch")
        return cls(
            status=str(raw["status"]),
            session_id=str(raw["sessionId"]),
            user_text=str(raw["userText"]),
            messages=tuple(dict(m) for m in raw["messages"]),
            queue=tuple(ToolCall(**c) for c in raw.get("queue", [])),
            pending=None if pending is None else PendingDecision(**pending),
            dispatch=None if dispatch is None else ToolCall(**dispatch),
            created_at_ms=int(raw.get("createdAt", 0)),
            answer=raw.get("answer"),
            leaf_id=raw.get("leafId"),
            error_code=raw.get("errorCode"),
        )


def _tool_message(call: ToolCall, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call.id, "content": content}


def _assistant_message(completion: Completion) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": completion.text or None,
        "tool_calls": [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in completion.tool_calls
        ],
    }


def _clip_result(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)
    if len(text) > MAX_TOOL_RESULT_CHARS:
        text = text[:MAX_TOOL_RESULT_CHARS] + " …[truncated]"
    return text


@attrs.define(eq=False)
class RunLoop:
    """One run (or resume) of the agent: answers its queued tool calls, then calls the
    model until it answers in text, journaling each step in ``versioned``'s record."""

    book: RunBook[RunRecord]
    complete: Complete
    options: OpenAIOptions
    tools: Mapping[str, Tool]
    session_log: SessionLog
    count_tool_call: Callable[[], None]
    run_id: str
    scope: OwnershipScope
    versioned: VersionedRun[RunRecord]
    on_event: EventSink | None

    async def guarded(self, *, decided: bool | None = None) -> RunResult:
        """:meth:`drive` (after answering the suspended call when ``decided`` is given: True
        allows it, False tells the model it was denied); a stored run left by cancellation
        or an error ends ``cancelled`` (a crash, which runs no code, leaves it in flight:
        reported interrupted)."""
        versioned = self.versioned
        try:
            if decided is not None:
                call = versioned.run.queue[0]
                tool = self.tools.get(call.name)
                if not decided:
                    await self._answer_call(DENIED_TOOL_RESULT)
                elif tool is None:
                    await self._answer_call("error: the tool is gone")
                else:
                    await self._dispatch(tool, call)
            return await self.drive()
        except BaseException:
            if versioned.version and versioned.run.status in ("running", "dispatching"):
                await self._end("cancelled", error_code="run_cancelled")
            raise

    async def drive(self) -> RunResult:
        """Answer the queued tool calls, then call the model until it answers in text."""
        versioned, run_id = self.versioned, self.run_id
        session_id = versioned.run.session_id
        history = await self._history(session_id)
        for _round in range(MAX_TOOL_ROUNDS):
            while versioned.run.queue:
                suspended = await self._next_call()
                if suspended is not None:
                    return suspended
            messages: list[Mapping[str, Any]] = []
            if self.options.system_prompt:
                messages.append({"role": "system", "content": self.options.system_prompt})
            messages.extend(history)
            messages.append({"role": "user", "content": versioned.run.user_text})
            messages.extend(versioned.run.messages)
            try:
                completion = await self.complete(run_id, messages, self.on_event)
            except ProviderError as error:
                log.warning("model call failed: %s", error.code)
                await self._end("failed", error_code=error.code)
                raise run_failed(run_id, session_id, error.code, str(error)) from None
            if not completion.tool_calls:
                return await self._succeed(completion.text)
            run = attrs.evolve(
                versioned.run,
                status="running",
                messages=(*versioned.run.messages, _assistant_message(completion)),
                queue=completion.tool_calls,
            )
            if versioned.version:
                await self._advance(run)
            else:
                versioned.run = run
        await self._end("failed", error_code="tool_rounds_exceeded")
        raise run_failed(
            run_id,
            session_id,
            "tool_rounds_exceeded",
            "the model kept calling tools without answering",
        )

    async def _history(self, session_id: str) -> list[dict[str, Any]]:
        limit = self.options.max_history_messages
        if limit == 0:
            return []
        entries = (await self.session_log.entries(session_id, self.scope))[-limit:]
        return [{"role": e.role, "content": e.text} for e in entries]

    async def _advance(self, run: RunRecord) -> None:
        await self.book.advance(self.run_id, self.scope, self.versioned, run)

    async def _next_call(self) -> RunResult | None:
        """Answer the first queued tool call; a ``suspended`` result when it needs approval."""
        versioned = self.versioned
        call = versioned.run.queue[0]
        tool = self.tools.get(call.name)
        if tool is None:
            await self._answer_call(f"error: there is no tool named {call.name!r}")
            return None
        if tool.requires_approval:
            pending = PendingDecision(
                approval_id=f"approval-{uuid.uuid4().hex}",
                kind="tool_approval",
                reason=_approval_reason(call),
                tool_name=call.name,
            )
            await self._advance(attrs.evolve(versioned.run, status="suspended", pending=pending))
            return RunResult("suspended", "", self.run_id, versioned.run.session_id)
        await self._dispatch(tool, call)
        return None

    async def _dispatch(self, tool: Tool, call: ToolCall) -> None:
        """Journal the dispatch, call the tool once, journal its result."""
        await self._advance(
            attrs.evolve(self.versioned.run, status="dispatching", dispatch=call, pending=None)
        )
        try:
            arguments = json.loads(call.arguments or "{}")
            if not isinstance(arguments, dict):
                raise ValueError("arguments")
        except ValueError:
            result = "error: the arguments were not a JSON object"
        else:
            self.count_tool_call()
            try:
                result = _clip_result(await tool.call(arguments))
            except Exception as exc:
                # The tool's own text may carry anything: the model is told the type only.
                log.warning("tool %s failed: %s", call.name, type(exc).__name__)
                result = f"error: the tool failed ({type(exc).__name__})"
        await self._answer_call(result)

    async def _answer_call(self, result: str) -> None:
        versioned = self.versioned
        call = versioned.run.queue[0]
        run = attrs.evolve(
            versioned.run,
            status="running",
            messages=(*versioned.run.messages, _tool_message(call, result)),
            queue=versioned.run.queue[1:],
            dispatch=None,
            pending=None,
        )
        if versioned.version:
            # Shielded: the tool ran; losing its result to a cancel would leave it
            # "dispatching" (interrupted) although it finished.
            with trio.CancelScope(shield=True, relative_deadline=10):
                await self._advance(run)
        else:
            versioned.run = run

    async def _succeed(self, answer: str) -> RunResult:
        versioned = self.versioned
        session_id = versioned.run.session_id
        leaf: str | None = None
        if self.options.max_history_messages > 0:
            leaf = await self.session_log.append(
                session_id, self.scope, (("user", versioned.run.user_text), ("assistant", answer))
            )
        if versioned.version:
            done = attrs.evolve(versioned.run, status="succeeded", answer=answer, leaf_id=leaf)
            await self._advance(done)
        return RunResult("succeeded", answer, self.run_id, session_id, leaf_id=leaf)

    async def _end(self, status: str, *, error_code: str | None = None) -> None:
        versioned = self.versioned
        if not versioned.version:
            return
        ended = attrs.evolve(
            versioned.run,
            status=status,
            queue=(),
            pending=None,
            dispatch=None,
            error_code=error_code,
        )
        with trio.CancelScope(shield=True, relative_deadline=10):
            await self.book.save(self.run_id, self.scope, versioned, ended)


def _approval_reason(call: ToolCall) -> str:
    arguments = " ".join(call.arguments.split())
    if len(arguments) > 300:
        arguments = arguments[:300] + "…"
    return f"the model wants to call {call.name} with {arguments or '{}'}"


def interrupted(run: RunRecord) -> PendingDecision:
    name = run.dispatch.name if run.dispatch is not None else None
    what = f"the call of {name}" if name else "the request"
    return PendingDecision(
        approval_id=f"interrupted-{run.created_at_ms}",
        kind=INTERRUPTED_KIND,
        reason=f"{what} was interrupted by a restart and is not repeated; /cancel ends it",
        tool_name=name,
    )
