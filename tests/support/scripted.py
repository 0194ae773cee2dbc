"""A scriptable test agent that stands in for an LLM provider (implements ``prismd.agents``).

Also :class:`RecordingAgent`, a model stand-in that records every input and streams one
fixed answer.

Usage::

    agent = ScriptedAgent(answer="answer")               # answers "answer"
    agent = ScriptedAgent(answer=lambda text, n: f"answer {n}")   # n = 1-based provider call
    agent = ScriptedAgent(deltas=("a ", "b"))            # streams deltas, answers "a b"
    agent = ScriptedAgent(gate=trio.Event())             # every run waits for the gate
    agent = ScriptedAgent(wait_for_cancel=True)          # runs until cancelled (→ aborted)
    agent = ScriptedAgent(fail="boom")                   # raises Exception("boom")
    agent = ScriptedAgent(owner=OwnershipScope("t", None, "u"))  # refuses other owners
    agent = ScriptedAgent(suspend_tool="write", checkpoints=store.checkpoints)

What it records: ``calls`` (every :class:`RunRequest`), ``provider_calls`` (runs +
resumes that reached the "provider"), ``sessions`` (session id → list of entries, a user
and an assistant entry per completed turn), ``active``/``peak`` concurrency, ``tool_runs``,
``cancelled_runs``, ``started`` (one ``trio.Event`` set when call *n* starts — use
``await agent.wait_started(n)``).

Durable suspension: with ``suspend_tool`` the first provider turn of a run asks for tool
approval; the run state is saved in ``checkpoints`` (namespace ``tests.scripted.run``) so a
second agent object over the same store can ``status``/``resume`` it after a "restart".
A resume with ``allow_once`` runs the tool once and answers ``resume_answer``; a deny (or
``reject_once``) ends ``denied``; ``resume_gate``/``resume_wait_for_cancel`` block the resume.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import attrs
import trio

from prismd.agents._base import (
    Decision,
    EventSink,
    ImageBlock,
    PendingDecision,
    RunError,
    RunFailedError,
    RunRequest,
    RunResult,
    RunState,
    StreamEvent,
    TextBlock,
)
from prismd.grants import AgentIdentity, ownership_from_identity
from stores import CheckpointConflictError, CheckpointStore, OwnershipScope

RUN_NS = "tests.scripted.run"
_run_ids = itertools.count(1)


def input_text(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, tuple):
        return "".join(b.text for b in value if isinstance(b, TextBlock))
    return ""


@attrs.define(eq=False)
class ScriptedAgent:
    answer: str | Callable[[str, int], str] = "answer"
    deltas: tuple[str, ...] | None = None
    gate: trio.Event | None = None
    gate_first_only: bool = False
    wait_for_cancel: bool = False
    fail: str | None = None
    owner: OwnershipScope | None = None
    capabilities: frozenset[str] = frozenset({"text"})
    suspend_tool: str | None = None
    suspend_reason: str = "needs to write a file"
    checkpoints: CheckpointStore | None = None
    resume_answer: str = "resumed answer"
    resume_gate: trio.Event | None = None
    resume_wait_for_cancel: bool = False
    on_run: Callable[[RunRequest], None] | None = None
    agent_id: str = "scripted"
    definition_revision: str = "def-1"

    calls: list[RunRequest] = attrs.field(factory=list)
    inputs: list[Any] = attrs.field(factory=list)
    provider_calls: int = 0
    sessions: dict[str, list[tuple[str, str]]] = attrs.field(factory=dict)
    active: int = 0
    peak: int = 0
    tool_runs: int = 0
    cancelled_runs: int = 0
    started: list[trio.Event] = attrs.field(factory=list)

    @property
    def input_capabilities(self) -> frozenset[str]:
        return self.capabilities

    @property
    def supports_approvals(self) -> bool:
        return self.suspend_tool is not None and self.checkpoints is not None

    def _started(self, n: int) -> trio.Event:
        while len(self.started) < n:
            self.started.append(trio.Event())
        return self.started[n - 1]

    async def wait_started(self, n: int = 1) -> None:
        await self._started(n).wait()

    async def _provider(
        self, request_text: str, run_id: str, on_event: EventSink | None, final: str
    ) -> str:
        """One provider turn: count it, stream deltas, honour gates and cancellation."""
        self.provider_calls += 1
        n = self.provider_calls
        self.active += 1
        self.peak = max(self.peak, self.active)
        self._started(n).set()
        try:
            if on_event is not None:
                on_event(StreamEvent("message_started", run_id))
            if self.deltas is not None:
                for delta in self.deltas:
                    if on_event is not None:
                        on_event(StreamEvent("message_delta", run_id, delta))
                    await trio.lowlevel.checkpoint()
            if self.gate is not None and (not self.gate_first_only or n == 1):
                await self.gate.wait()
            if self.wait_for_cancel:
                try:
                    await trio.sleep_forever()
                except trio.Cancelled:
                    self.cancelled_runs += 1
                    raise
            if self.fail is not None:
                raise Exception(self.fail)
            if self.deltas is not None:
                return "".join(self.deltas)
            return final
        finally:
            self.active -= 1

    async def run(self, request: RunRequest, *, on_event: EventSink | None = None) -> RunResult:
        self.calls.append(request)
        self.inputs.append(request.input)
        if self.on_run is not None:
            self.on_run(request)
        run_id = f"run-{next(_run_ids)}"
        if self.owner is not None and ownership_from_identity(request.identity) != self.owner:
            raise RunFailedError(
                RunResult(
                    "failed",
                    "",
                    run_id,
                    request.session_id,
                    error=RunError("forbidden", "agent is bound to another owner"),
                )
            )
        text = input_text(request.input)
        if self.suspend_tool is not None and self.checkpoints is not None:
            await self._provider(text, run_id, on_event, "")
            await self._save_run(
                run_id,
                request.session_id,
                ownership_from_identity(request.identity),
                {"status": "suspended", "text": text, "approvalId": f"appr-{run_id}"},
                0,
            )
            return RunResult("suspended", "", run_id, request.session_id)
        n_next = self.provider_calls + 1
        final = self.answer(text, n_next) if callable(self.answer) else self.answer
        answer = await self._provider(text, run_id, on_event, final)
        entries = self.sessions.setdefault(request.session_id, [])
        entries.append(("user", text))
        entries.append(("assistant", answer))
        return RunResult("succeeded", answer, run_id, request.session_id, leaf_id=f"leaf-{run_id}")

    # ------------------------------------------------------------------ durable run state

    def _scope_key(self, run_id: str) -> str:
        return f"{self.agent_id}:{run_id}"

    async def _save_run(
        self,
        run_id: str,
        session_id: str,
        scope: OwnershipScope,
        value: dict[str, Any],
        expected: int,
    ) -> int:
        assert self.checkpoints is not None
        value = {**value, "sessionId": session_id}
        saved = await self.checkpoints.save_checkpoint(
            namespace=RUN_NS,
            key=self._scope_key(run_id),
            scope=scope,
            version=expected + 1,
            value=value,
            expected_version=expected,
        )
        return saved.version

    async def status(
        self, *, run_id: str, session_id: str, scope: OwnershipScope
    ) -> RunState | None:
        if self.checkpoints is None:
            return None
        stored = await self.checkpoints.load_checkpoint(
            namespace=RUN_NS, key=self._scope_key(run_id), scope=scope
        )
        if stored is None or stored.value.get("sessionId") != session_id:
            return None
        pending: tuple[PendingDecision, ...] = ()
        if stored.value["status"] == "suspended":
            pending = (
                PendingDecision(
                    approval_id=stored.value["approvalId"],
                    reason=self.suspend_reason,
                    tool_name=self.suspend_tool,
                ),
            )
        return RunState(status=stored.value["status"], version=stored.version, pending=pending)

    async def resume(
        self,
        *,
        run_id: str,
        session_id: str,
        scope: OwnershipScope,
        identity: AgentIdentity,
        expected_version: int,
        decisions: tuple[Decision, ...] = (),
        deny: bool = False,
        on_event: EventSink | None = None,
    ) -> RunResult:
        assert self.checkpoints is not None
        stored = await self.checkpoints.load_checkpoint(
            namespace=RUN_NS, key=self._scope_key(run_id), scope=scope
        )
        if stored is None or stored.version != expected_version:
            raise RunFailedError(RunResult("failed", "", run_id, session_id))
        value = dict(stored.value)
        allowed = not deny and any(d.outcome == "allow_once" for d in decisions)
        if not allowed:
            value["status"] = "denied"
            await self._save_run_version(run_id, session_id, scope, value, stored.version)
            return RunResult("denied", "", run_id, session_id)
        self.tool_runs += 1
        value["status"] = "running"
        version = await self._save_run_version(run_id, session_id, scope, value, stored.version)
        try:
            if self.resume_gate is not None:
                await self.resume_gate.wait()
            saved_wait = self.wait_for_cancel
            self.wait_for_cancel = self.resume_wait_for_cancel
            try:
                answer = await self._provider(
                    value.get("text", ""), run_id, on_event, self.resume_answer
                )
            finally:
                self.wait_for_cancel = saved_wait
        except trio.Cancelled:
            value["status"] = "aborted"
            with trio.CancelScope(shield=True):
                await self._save_run_version(run_id, session_id, scope, value, version)
            raise
        value["status"] = "succeeded"
        await self._save_run_version(run_id, session_id, scope, value, version)
        entries = self.sessions.setdefault(session_id, [])
        entries.append(("assistant", answer))
        return RunResult("succeeded", answer, run_id, session_id)

    async def _save_run_version(
        self,
        run_id: str,
        session_id: str,
        scope: OwnershipScope,
        value: dict[str, Any],
        expected: int,
    ) -> int:
        try:
            return await self._save_run(run_id, session_id, scope, value, expected)
        except CheckpointConflictError:
            raise RunFailedError(RunResult("failed", "", run_id, session_id)) from None


def image_blocks(value: object) -> list[ImageBlock]:
    if isinstance(value, tuple):
        return [b for b in value if isinstance(b, ImageBlock)]
    return []


@attrs.define(eq=False)
class RecordingAgent:
    """A model stand-in that records every input and answers ``answer`` (streamed)."""

    agent_id: str = "recording"
    definition_revision: str = "rec-1"
    input_capabilities: frozenset[str] = frozenset({"text"})
    supports_approvals: bool = False
    answer: str = "model answer"
    inputs: list[Any] = attrs.field(factory=list)

    async def run(self, request: RunRequest, *, on_event: EventSink | None = None) -> RunResult:
        self.inputs.append(request.input)
        run_id = f"rec-{len(self.inputs)}"
        if on_event is not None:
            on_event(StreamEvent("message_started", run_id))
            on_event(StreamEvent("message_delta", run_id, self.answer))
            on_event(StreamEvent("message_finished", run_id, self.answer))
        await trio.lowlevel.checkpoint()
        return RunResult("succeeded", self.answer, run_id, request.session_id)

    async def status(self, **_kw: Any) -> RunState | None:
        return None

    async def resume(self, **kw: Any) -> RunResult:
        raise AssertionError("RecordingAgent never suspends")
