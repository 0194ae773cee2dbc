"""The ``mock`` agent: a deterministic model stand-in for tests, soaks and benchmarks.

Options (``[agents.<alias>] kind = "mock"``):

* ``delay_ms`` (int >= 0, default 0): ``trio.sleep`` before answering, so virtual clocks
  work and cancellation aborts the wait;
* ``fail`` (bool): every run fails with error code ``mock_failure``;
* ``suspend_for_tool`` (str): every run suspends asking to approve that tool; the run state
  is durable (``prismd.v1.agent-run``), so ``status``/``resume`` work from another process
  on the same store; an allowed resume "runs" the tool exactly once (recorded durably) and
  answers, a rejected one ends ``denied``;
* ``reply_prefix`` (str, default ``"mock: "``); ``vision`` (bool): accept image input.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

import attrs
import trio

from stores import CheckpointStore, Clock, Keep, OwnershipScope, Replace

from ..grants import ownership_from_identity
from ._base import (
    AgentContext,
    EventSink,
    PendingDecision,
    ResumeRequest,
    RunRequest,
    RunResult,
    RunState,
    run_failed,
)
from ._runbook import RunBook, VersionedRun
from ._session import (
    AgentOptionError,
    SessionAgent,
    SessionLog,
    definition_revision,
    image_count,
    input_text,
    new_run_id,
    stream_text,
)

_CAS_ATTEMPTS = 8
MAX_DELAY_MS = 24 * 3600 * 1000


@attrs.frozen
class MockOptions:
    delay_ms: int = 0
    fail: bool = False
    suspend_for_tool: str | None = None
    reply_prefix: str = "mock: "
    vision: bool = False


def validate_mock_options(options: Mapping[str, Any]) -> MockOptions:
    """Parse ``mock`` options; raises :class:`AgentOptionError` naming the bad key."""
    values: dict[str, Any] = {}
    for key, value in options.items():
        if key == "delay_ms":
            if isinstance(value, bool) or not isinstance(value, int):
                raise AgentOptionError(key, "must be an integer >= 0")
            if not 0 <= value <= MAX_DELAY_MS:
                raise AgentOptionError(key, f"must be between 0 and {MAX_DELAY_MS}")
        elif key in ("fail", "vision"):
            if not isinstance(value, bool):
                raise AgentOptionError(key, "must be true or false")
        elif key == "suspend_for_tool":
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise AgentOptionError(key, "must be a non-empty tool name")
        elif key == "reply_prefix":
            if not isinstance(value, str):
                raise AgentOptionError(key, "must be a string")
        else:
            raise AgentOptionError(key, "unknown option for agent kind 'mock'")
        values[key] = value
    return MockOptions(**values)


class _Finish:
    """A resume's answer when the tool has run and only the answer is left to write."""


FINISH = _Finish()


@attrs.frozen
class _RunRecord:
    status: str
    session_id: str
    text: str
    tool_runs: int
    created_at_ms: int
    pending: tuple[PendingDecision, ...] = ()
    answer: str | None = None
    leaf_id: str | None = None

    def state(self, version: int) -> RunState:
        """What ``status`` reports of the run stored at ``version``: its pending decision
        while it is suspended."""
        pending = self.pending if self.status == "suspended" else ()
        return RunState(status=self.status, version=version, pending=pending)

    def succeeded(self, run_id: str) -> RunResult:
        """The stored result of a run that has ended ``succeeded``."""
        return RunResult("succeeded", self.answer or "", run_id, self.session_id, self.leaf_id)

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "sessionId": self.session_id,
            "text": self.text,
            "toolRuns": self.tool_runs,
            "createdAt": self.created_at_ms,
            "pending": [
                {
                    "approvalId": p.approval_id,
                    "kind": p.kind,
                    "reason": p.reason,
                    "toolName": p.tool_name,
                }
                for p in self.pending
            ],
            "answer": self.answer,
            "leafId": self.leaf_id,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> _RunRecord:
        pending = tuple(
            PendingDecision(
                approval_id=str(p["approvalId"]),
                kind=str(p.get("kind", "tool_approval")),
                reason=str(p.get("reason", "")),
                tool_name=None if p.get("toolName") is None else str(p["toolName"]),
            )
            for p in raw.get("pending", [])
        )
        return cls(
            status=str(raw["status"]),
            session_id=str(raw["sessionId"]),
            text=str(raw["text"]),
            tool_runs=int(raw.get("toolRuns", 0)),
            created_at_ms=int(raw.get("createdAt", 0)),
            pending=pending,
            answer=None if raw.get("answer") is None else str(raw["answer"]),
            leaf_id=None if raw.get("leafId") is None else str(raw["leafId"]),
        )


@attrs.define(eq=False)
class MockAgent(SessionAgent):
    """See the module docstring. ``run_calls``/``resume_calls`` count calls in this process."""

    alias: str
    options: MockOptions
    checkpoints: CheckpointStore
    clock: Clock
    _log: SessionLog
    _revision: str
    run_calls: int = 0
    resume_calls: int = 0
    _book: RunBook[_RunRecord] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._book = RunBook(self.checkpoints, self.alias, _RunRecord.from_json)

    @classmethod
    def from_context(cls, ctx: AgentContext) -> MockAgent:
        return cls(
            alias=ctx.alias,
            options=validate_mock_options(ctx.options),
            checkpoints=ctx.checkpoints,
            clock=ctx.clock,
            log=SessionLog(ctx.checkpoints, ctx.alias),
            revision=definition_revision("mock", ctx.options),
        )

    @property
    def input_capabilities(self) -> frozenset[str]:
        return frozenset({"text", "image"}) if self.options.vision else frozenset({"text"})

    @property
    def supports_approvals(self) -> bool:
        return True

    async def tool_runs(self, run_id: str, scope: OwnershipScope) -> int:
        """How many times the suspended tool of ``run_id`` ran (durable; 0 or 1)."""
        loaded = await self._book.load(run_id, scope)
        return 0 if loaded is None else loaded.run.tool_runs

    def _answer(self, text: str, images: int = 0) -> str:
        suffix = f" [{images} image(s)]" if images else ""
        return f"{self.options.reply_prefix}{text}{suffix}"

    async def _delay(self) -> None:
        if self.options.delay_ms:
            await trio.sleep(self.options.delay_ms / 1000)

    async def run(self, request: RunRequest, *, on_event: EventSink | None = None) -> RunResult:
        self.run_calls += 1
        run_id = new_run_id()
        scope = ownership_from_identity(request.identity)
        text = input_text(request.input)
        await self._delay()
        if self.options.fail:
            raise run_failed(run_id, request.session_id, "mock_failure", "mock agent failure")
        tool = self.options.suspend_for_tool
        if tool is not None:
            pending = PendingDecision(
                approval_id=f"approval-{uuid.uuid4().hex}",
                kind="tool_approval",
                reason=f"the mock agent wants to run {tool}",
                tool_name=tool,
            )
            record = _RunRecord(
                status="suspended",
                session_id=request.session_id,
                text=text,
                tool_runs=0,
                created_at_ms=self.clock.now_ms(),
                pending=(pending,),
            )
            if not await self._book.save(run_id, scope, VersionedRun(record), record):
                raise run_failed(run_id, request.session_id, "run_state_conflict", "run id reused")
            leaf = await self._log.append(request.session_id, scope, (("user", text),))
            return RunResult("suspended", "", run_id, request.session_id, leaf_id=leaf)
        answer = self._answer(text, image_count(request.input))
        await stream_text(run_id, answer, on_event)
        leaf = await self._log.append(
            request.session_id, scope, (("user", text), ("assistant", answer))
        )
        return RunResult("succeeded", answer, run_id, request.session_id, leaf_id=leaf)

    async def status(
        self, *, run_id: str, session_id: str, scope: OwnershipScope
    ) -> RunState | None:
        loaded = await self._book.load(run_id, scope, session_id=session_id)
        return None if loaded is None else loaded.run.state(loaded.version)

    async def _resume(self, request: ResumeRequest) -> RunResult:
        """Continue a suspended run. Idempotent on the run: a retried or concurrent resume
        never runs the tool twice; once the run has ended it returns the stored result.

        Raises :class:`RunFailedError` (``run_not_found``, ``version_conflict``,
        ``missing_decision``) when the run cannot be resumed as asked.
        """
        run_id, session_id, scope = request.run_id, request.session_id, request.scope
        self.resume_calls += 1

        def change(
            loaded: VersionedRun[_RunRecord] | None,
        ) -> Replace[RunResult | _Finish] | Keep[RunResult | _Finish]:
            if loaded is None:
                raise run_failed(run_id, session_id, "run_not_found", "no such suspended run")
            version, record = loaded.version, loaded.run
            if record.status == "succeeded":
                return Keep(record.succeeded(run_id))
            if record.status == "denied":
                return Keep(RunResult("denied", "", run_id, session_id, leaf_id=record.leaf_id))
            if record.status == "running":
                # The tool already ran under an earlier resume; only the answer is missing.
                return Keep(FINISH)
            if version != request.expected_version:
                raise run_failed(run_id, session_id, "version_conflict", "run state changed")
            approval_id = record.pending[0].approval_id if record.pending else None
            outcomes = {d.approval_id: d.outcome for d in request.decisions}
            if request.deny or outcomes.get(approval_id or "") == "reject_once":
                denied = attrs.evolve(record, status="denied", pending=())
                result = RunResult("denied", "", run_id, session_id, leaf_id=record.leaf_id)
                return self._book.replace(run_id, denied, result)
            if approval_id is None or outcomes.get(approval_id) != "allow_once":
                raise run_failed(run_id, session_id, "missing_decision", "no decision for the tool")
            # The tool "runs" in the same CAS that leaves `suspended`: exactly one winner.
            running = attrs.evolve(
                record, status="running", pending=(), tool_runs=record.tool_runs + 1
            )
            return self._book.replace(run_id, running, FINISH)

        outcome = await self._book.update(run_id, session_id, scope, change, attempts=_CAS_ATTEMPTS)
        if isinstance(outcome, _Finish):
            return await self._finish(run_id, scope, request.on_event)
        return outcome

    async def _finish(
        self, run_id: str, scope: OwnershipScope, on_event: EventSink | None
    ) -> RunResult:
        await self._delay()
        loaded = await self._book.load(run_id, scope)
        if loaded is None:
            raise run_failed(run_id, "", "run_not_found", "run state vanished")
        record = loaded.run
        if record.status == "succeeded":
            return record.succeeded(run_id)
        answer = self._answer(record.text)
        await stream_text(run_id, answer, on_event)
        leaf = await self._log.append(record.session_id, scope, (("assistant", answer),))

        def change(
            loaded: VersionedRun[_RunRecord] | None,
        ) -> Replace[RunResult] | Keep[RunResult]:
            if loaded is None:
                raise run_failed(
                    run_id, record.session_id, "run_state_conflict", "run state kept changing"
                )
            current = loaded.run
            if current.status == "succeeded":
                # A concurrent resume finished first; its answer is the run's answer.
                return Keep(current.succeeded(run_id))
            done = attrs.evolve(current, status="succeeded", answer=answer, leaf_id=leaf)
            result = RunResult("succeeded", answer, run_id, current.session_id, leaf_id=leaf)
            return self._book.replace(run_id, done, result)

        return await self._book.update(
            run_id, record.session_id, scope, change, attempts=_CAS_ATTEMPTS
        )
