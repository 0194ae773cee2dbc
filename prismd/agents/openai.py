"""The ``openai`` agent: streamed chat completions against any OpenAI-compatible server.

Options (``[agents.<alias>] kind = "openai"``), checked by :func:`validate_openai_options`:

* ``base_url`` (required): e.g. ``https://api.openai.com/v1``, ``http://127.0.0.1:8080/v1``
  (llama.cpp), ``http://127.0.0.1:8000/v1`` (vLLM), ``http://127.0.0.1:11434/v1`` (Ollama);
  ``http://`` only for loopback hosts, no credentials, query or fragment;
* ``model`` (required); ``api_key_env`` or ``api_key_file`` (optional, at most one; read
  through :attr:`AgentContext.read_secret`, so the daemon redacts it everywhere);
* ``system_prompt``; ``timeout_ms`` (default 60000: the longest silence tolerated while
  connecting, waiting for the answer and between two chunks of it);
* ``max_history_messages`` (default 40; 0 keeps no history), ``max_output_tokens``
  (sent as ``max_tokens``), ``temperature`` (0–2);
* ``tools = "module:callable"`` (see :mod:`prismd.agents.tools`).

Durable state, all in the journal's checkpoint store, scoped by the run's ownership:

* the conversation history per session (``prismd.v1.agent-session``, the same transcript
  records as ``echo``/``mock``): the last ``max_history_messages`` user/assistant texts,
  bounded in bytes, pruned with the journal. ``/new`` starts a new session id, so the
  model no longer sees the old one;
* a run record (``prismd.v1.agent-run``) only once a run calls a tool: the in-run
  messages, the tool calls still to do, the pending approval. Its ``status`` walks
  ``suspended → dispatching → running → … → succeeded | denied | failed``; ``dispatching``
  is written (CAS) *before* a tool is called, so a crash mid-call leaves a run that
  ``status`` reports as interrupted (suspended on a ``tool_interrupted`` decision no
  control can allow) and that ``/cancel`` ends — the tool is never called a second time.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Mapping
from typing import Any

import attrs
import httpx
import trio

from stores import CheckpointConflictError, CheckpointStore, Clock, OwnershipScope

from ..identity import AgentIdentity, ownership_from_identity
from ._base import (
    AgentContext,
    Decision,
    EventSink,
    PendingDecision,
    RunError,
    RunFailedError,
    RunRequest,
    RunResult,
    RunState,
    StreamEvent,
)
from ._chat import Completion, ProviderError, ToolCall, stream_completion
from ._openai_options import OpenAIOptions as OpenAIOptions
from ._openai_options import check_base_url as check_base_url
from ._openai_options import load_tools
from ._openai_options import validate_openai_options as validate_openai_options
from ._session import (
    CATEGORY_RUN,
    NS_RUN,
    AgentOptionError,
    SessionEntry,
    SessionLog,
    definition_revision,
    input_text,
    new_run_id,
)
from .tools import Tool

log = logging.getLogger("prismd.agents.openai")

MAX_TOOL_ROUNDS = 8
"""Model calls per run (a run, or a resume) before it ends ``tool_rounds_exceeded``."""
MAX_TOOL_RESULT_CHARS = 16 * 1024
MAX_RUN_RECORD_BYTES = 768 * 1024
INTERRUPTED_KIND = "tool_interrupted"
DENIED_TOOL_RESULT = "The user denied this tool call. Do not try it again; answer without it."


# --------------------------------------------------------------------------- run records


def _no_key_configured(alias: str, error: ProviderError) -> ProviderError:
    """A 401/403 from a server this agent sends no key to: say that none is configured."""
    status = str(error).rpartition("(")[2].rstrip(")") or "HTTP 401"
    return ProviderError(
        error.code,
        f"the model server wants an API key ({status}) and none is configured;"
        f" set api_key_env or api_key_file in [agents.{alias}]",
    )


def _run_key(alias: str, run_id: str) -> str:
    return f"r1:{alias}:{run_id}"


@attrs.frozen
class _Run:
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
    def from_json(cls, raw: Any) -> _Run:
        if not isinstance(raw, Mapping):
            raise ValueError("run record")
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


@attrs.define
class _Stored:
    """A run record and the version it was loaded or saved at (0: not stored yet)."""

    run: _Run
    version: int = 0


def _failed(run_id: str, session_id: str, code: str, message: str) -> RunFailedError:
    return RunFailedError(
        RunResult("failed", "", run_id, session_id, error=RunError(code, message))
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


# --------------------------------------------------------------------------- the agent


@attrs.define(eq=False)
class OpenAIAgent:
    """See the module docstring. ``tool_calls`` counts tool calls made in this process."""

    alias: str
    options: OpenAIOptions
    checkpoints: CheckpointStore
    clock: Clock
    tools: Mapping[str, Tool]
    _api_key: str | None
    _log: SessionLog
    _revision: str
    _transport: httpx.AsyncBaseTransport | None = None
    _client: httpx.AsyncClient | None = None
    _live: set[str] = attrs.field(factory=set)
    """Runs this process is resuming now: their in-flight statuses are not interrupted."""
    tool_calls: int = 0

    @classmethod
    def from_context(
        cls, ctx: AgentContext, *, transport: httpx.AsyncBaseTransport | None = None
    ) -> OpenAIAgent:
        options = validate_openai_options(ctx.options)
        key: str | None = None
        if options.api_key_env is not None or options.api_key_file is not None:
            key_name = "api_key_env" if options.api_key_env is not None else "api_key_file"
            if ctx.read_secret is None:
                raise AgentOptionError(key_name, "this host cannot read secrets")
            key = ctx.read_secret(options.api_key_env, options.api_key_file, key_name)
        tools = load_tools(options.tools, ctx) if options.tools else {}
        return cls(
            alias=ctx.alias,
            options=options,
            checkpoints=ctx.checkpoints,
            clock=ctx.clock,
            tools=tools,
            api_key=key,
            log=SessionLog(
                ctx.checkpoints, ctx.alias, max_entries=max(1, options.max_history_messages)
            ),
            revision=definition_revision("openai", ctx.options),
            transport=transport,
        )

    @property
    def agent_id(self) -> str:
        return self.alias

    @property
    def definition_revision(self) -> str:
        return self._revision

    @property
    def input_capabilities(self) -> frozenset[str]:
        return frozenset({"text"})

    @property
    def supports_approvals(self) -> bool:
        return True

    async def aclose(self) -> None:
        """Close the HTTP client (its pooled connections)."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    async def session_entries(
        self, session_id: str, ownership: OwnershipScope
    ) -> tuple[SessionEntry, ...]:
        return await self._log.entries(session_id, ownership)

    # ------------------------------------------------------------------ model calls

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            timeout_s = self.options.timeout_ms / 1000
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
                transport=self._transport,
                follow_redirects=False,
                trust_env=False,
            )
        return self._client

    def _headers(self) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if self._api_key:
            headers["authorization"] = f"Bearer {self._api_key}"
        return headers

    async def _history(self, session_id: str, ownership: OwnershipScope) -> list[dict[str, Any]]:
        limit = self.options.max_history_messages
        if limit == 0:
            return []
        entries = (await self._log.entries(session_id, ownership))[-limit:]
        return [{"role": e.role, "content": e.text} for e in entries]

    async def _complete(
        self,
        run_id: str,
        messages: list[Mapping[str, Any]],
        on_event: EventSink | None,
    ) -> Completion:
        body: dict[str, Any] = {"model": self.options.model, "messages": messages, "stream": True}
        if self.options.max_output_tokens is not None:
            body["max_tokens"] = self.options.max_output_tokens
        if self.options.temperature is not None:
            body["temperature"] = self.options.temperature
        if self.tools:
            body["tools"] = [tool.openai_schema() for tool in self.tools.values()]
        started = [False]
        parts: list[str] = []

        def on_text(delta: str) -> None:
            if on_event is None:
                return
            if not started[0]:
                started[0] = True
                on_event(StreamEvent("message_started", run_id))
            parts.append(delta)
            on_event(StreamEvent("message_delta", run_id, delta))

        try:
            completion = await stream_completion(
                self._http(),
                f"{self.options.base_url}/chat/completions",
                self._headers(),
                body,
                on_text,
            )
        except ProviderError as error:
            if error.code == "provider_unauthorized" and not self._api_key:
                # "Refused the API key" would send the reader looking for a wrong key.
                raise _no_key_configured(self.alias, error) from None
            raise
        if on_event is not None and started[0]:
            on_event(StreamEvent("message_finished", run_id, "".join(parts)))
        return completion

    # ------------------------------------------------------------------ durable run state

    async def _load(self, run_id: str, ownership: OwnershipScope) -> _Stored | None:
        stored = await self.checkpoints.load_checkpoint(
            namespace=NS_RUN, key=_run_key(self.alias, run_id), scope=ownership
        )
        if stored is None:
            return None
        try:
            return _Stored(_Run.from_json(stored.value), stored.version)
        except (ValueError, KeyError, TypeError):
            return None

    async def _save(self, run_id: str, ownership: OwnershipScope, held: _Stored, run: _Run) -> bool:
        """CAS ``run`` over ``held`` (create when ``held.version`` is 0); False on a lost CAS."""
        value = run.to_json()
        if len(json.dumps(value)) > MAX_RUN_RECORD_BYTES:
            raise _failed(
                run_id, run.session_id, "run_state_too_large", "the tool results are too large"
            )
        try:
            saved = await self.checkpoints.save_checkpoint(
                namespace=NS_RUN,
                key=_run_key(self.alias, run_id),
                scope=ownership,
                version=held.version + 1,
                value=value,
                expected_version=held.version,
                category=CATEGORY_RUN,
                metadata={"status": run.status},
            )
        except CheckpointConflictError:
            return False
        held.run, held.version = run, saved.version
        return True

    async def _advance(
        self, run_id: str, ownership: OwnershipScope, held: _Stored, run: _Run
    ) -> None:
        """Save or fail the run: losing a CAS here means another resume took the run over."""
        if not await self._save(run_id, ownership, held, run):
            raise _failed(run_id, run.session_id, "run_state_conflict", "run state changed")

    # ------------------------------------------------------------------ protocol

    async def run(self, request: RunRequest, *, on_event: EventSink | None = None) -> RunResult:
        run_id = new_run_id()
        ownership = ownership_from_identity(request.identity)
        text = input_text(request.input)
        held = _Stored(
            _Run(
                status="running",
                session_id=request.session_id,
                user_text=text,
                messages=(),
                created_at_ms=self.clock.now_ms(),
            )
        )
        return await self._guarded(run_id, ownership, held, on_event)

    async def _guarded(
        self,
        run_id: str,
        ownership: OwnershipScope,
        held: _Stored,
        on_event: EventSink | None,
        *,
        decided: bool | None = None,
    ) -> RunResult:
        """``_drive`` (after answering the suspended call when ``decided`` is given: True
        allows it, False tells the model it was denied); a stored run left by cancellation
        or an error ends ``cancelled`` (a crash, which runs no code, leaves it in flight:
        reported interrupted)."""
        try:
            if decided is not None:
                call = held.run.queue[0]
                tool = self.tools.get(call.name)
                if not decided:
                    await self._answer_call(run_id, ownership, held, DENIED_TOOL_RESULT)
                elif tool is None:
                    await self._answer_call(run_id, ownership, held, "error: the tool is gone")
                else:
                    await self._dispatch(run_id, ownership, held, tool, call)
            return await self._drive(run_id, ownership, held, on_event)
        except BaseException:
            if held.version and held.run.status in ("running", "dispatching"):
                await self._end(run_id, ownership, held, "cancelled", error_code="run_cancelled")
            raise

    async def _drive(
        self, run_id: str, ownership: OwnershipScope, held: _Stored, on_event: EventSink | None
    ) -> RunResult:
        """Answer the queued tool calls, then call the model until it answers in text."""
        session_id = held.run.session_id
        history = await self._history(session_id, ownership)
        for _round in range(MAX_TOOL_ROUNDS):
            while held.run.queue:
                suspended = await self._next_call(run_id, ownership, held)
                if suspended is not None:
                    return suspended
            messages: list[Mapping[str, Any]] = []
            if self.options.system_prompt:
                messages.append({"role": "system", "content": self.options.system_prompt})
            messages.extend(history)
            messages.append({"role": "user", "content": held.run.user_text})
            messages.extend(held.run.messages)
            try:
                completion = await self._complete(run_id, messages, on_event)
            except ProviderError as error:
                log.warning("model call failed: %s", error.code)
                await self._end(run_id, ownership, held, "failed", error_code=error.code)
                raise _failed(run_id, session_id, error.code, str(error)) from None
            if not completion.tool_calls:
                return await self._succeed(run_id, ownership, held, completion.text)
            run = attrs.evolve(
                held.run,
                status="running",
                messages=(*held.run.messages, _assistant_message(completion)),
                queue=completion.tool_calls,
            )
            if held.version:
                await self._advance(run_id, ownership, held, run)
            else:
                held.run = run
        await self._end(run_id, ownership, held, "failed", error_code="tool_rounds_exceeded")
        raise _failed(
            run_id,
            session_id,
            "tool_rounds_exceeded",
            "the model kept calling tools without answering",
        )

    async def _next_call(
        self, run_id: str, ownership: OwnershipScope, held: _Stored
    ) -> RunResult | None:
        """Answer the first queued tool call; a ``suspended`` result when it needs approval."""
        call = held.run.queue[0]
        tool = self.tools.get(call.name)
        if tool is None:
            await self._answer_call(
                run_id, ownership, held, f"error: there is no tool named {call.name!r}"
            )
            return None
        if tool.requires_approval:
            pending = PendingDecision(
                approval_id=f"approval-{uuid.uuid4().hex}",
                kind="tool_approval",
                reason=_approval_reason(call),
                tool_name=call.name,
            )
            await self._advance(
                run_id, ownership, held, attrs.evolve(held.run, status="suspended", pending=pending)
            )
            return RunResult("suspended", "", run_id, held.run.session_id)
        await self._dispatch(run_id, ownership, held, tool, call)
        return None

    async def _dispatch(
        self, run_id: str, ownership: OwnershipScope, held: _Stored, tool: Tool, call: ToolCall
    ) -> None:
        """Journal the dispatch, call the tool once, journal its result."""
        await self._advance(
            run_id,
            ownership,
            held,
            attrs.evolve(held.run, status="dispatching", dispatch=call, pending=None),
        )
        try:
            arguments = json.loads(call.arguments or "{}")
            if not isinstance(arguments, dict):
                raise ValueError("arguments")
        except ValueError:
            result = "error: the arguments were not a JSON object"
        else:
            self.tool_calls += 1
            try:
                result = _clip_result(await tool.call(arguments))
            except Exception as exc:
                # The tool's own text may carry anything: the model is told the type only.
                log.warning("tool %s failed: %s", call.name, type(exc).__name__)
                result = f"error: the tool failed ({type(exc).__name__})"
        await self._answer_call(run_id, ownership, held, result)

    async def _answer_call(
        self, run_id: str, ownership: OwnershipScope, held: _Stored, result: str
    ) -> None:
        call = held.run.queue[0]
        run = attrs.evolve(
            held.run,
            status="running",
            messages=(*held.run.messages, _tool_message(call, result)),
            queue=held.run.queue[1:],
            dispatch=None,
            pending=None,
        )
        if held.version:
            # Shielded: the tool ran; losing its result to a cancel would leave it
            # "dispatching" (interrupted) although it finished.
            with trio.CancelScope(shield=True, relative_deadline=10):
                await self._advance(run_id, ownership, held, run)
        else:
            held.run = run

    async def _succeed(
        self, run_id: str, ownership: OwnershipScope, held: _Stored, answer: str
    ) -> RunResult:
        session_id = held.run.session_id
        leaf: str | None = None
        if self.options.max_history_messages > 0:
            leaf = await self._log.append(
                session_id, ownership, (("user", held.run.user_text), ("assistant", answer))
            )
        if held.version:
            done = attrs.evolve(held.run, status="succeeded", answer=answer, leaf_id=leaf)
            await self._advance(run_id, ownership, held, done)
        return RunResult("succeeded", answer, run_id, session_id, leaf_id=leaf)

    async def _end(
        self,
        run_id: str,
        ownership: OwnershipScope,
        held: _Stored,
        status: str,
        *,
        error_code: str | None = None,
    ) -> None:
        if not held.version:
            return
        ended = attrs.evolve(
            held.run, status=status, queue=(), pending=None, dispatch=None, error_code=error_code
        )
        with trio.CancelScope(shield=True, relative_deadline=10):
            await self._save(run_id, ownership, held, ended)

    async def status(
        self, *, run_id: str, session_id: str, ownership: OwnershipScope
    ) -> RunState | None:
        loaded = await self._load(run_id, ownership)
        if loaded is None or loaded.run.session_id != session_id:
            return None
        run = loaded.run
        if run.status == "suspended" and run.pending is not None:
            return RunState("suspended", loaded.version, (run.pending,))
        if run.status in ("dispatching", "running") and run_id not in self._live:
            return RunState("suspended", loaded.version, (_interrupted(run),))
        return RunState(run.status, loaded.version)

    async def resume(
        self,
        *,
        run_id: str,
        session_id: str,
        ownership: OwnershipScope,
        identity: AgentIdentity,
        expected_version: int,
        decisions: tuple[Decision, ...] = (),
        deny: bool = False,
        on_event: EventSink | None = None,
    ) -> RunResult:
        """Continue a suspended run with its decision, or end it (``deny``).

        Allowed: the tool is called once (its dispatch journaled first) and the model goes
        on; rejected: the model is told and goes on without it; ``deny`` (``/cancel``):
        the run ends ``denied``. An interrupted run (crash mid-call) can only be ended:
        ``deny`` answers ``failed``/``tool_interrupted``. Raises :class:`RunFailedError`
        (``run_not_found``, ``version_conflict``, ``missing_decision``, …).
        """
        loaded = await self._load(run_id, ownership)
        if loaded is None or loaded.run.session_id != session_id:
            raise _failed(run_id, session_id, "run_not_found", "no such suspended run")
        run = loaded.run
        if run.status == "succeeded":
            return RunResult("succeeded", run.answer or "", run_id, session_id, run.leaf_id)
        if run.status == "denied":
            return RunResult("denied", "", run_id, session_id)
        if loaded.version != expected_version:
            raise _failed(run_id, session_id, "version_conflict", "run state changed")
        interrupted = run.status in ("dispatching", "running") and run_id not in self._live
        if interrupted:
            if not deny:
                raise _failed(run_id, session_id, "missing_decision", "the run was interrupted")
            await self._advance(
                run_id,
                ownership,
                loaded,
                attrs.evolve(
                    run, status="failed", queue=(), dispatch=None, error_code=INTERRUPTED_KIND
                ),
            )
            return RunResult(
                "failed",
                "",
                run_id,
                session_id,
                error=RunError(
                    INTERRUPTED_KIND,
                    "the request was interrupted by a restart; an interrupted tool call is "
                    "never repeated",
                ),
            )
        if run.status != "suspended" or run.pending is None:
            raise _failed(run_id, session_id, "run_not_found", "no such suspended run")
        if deny:
            await self._advance(
                run_id,
                ownership,
                loaded,
                attrs.evolve(run, status="denied", queue=(), pending=None),
            )
            return RunResult("denied", "", run_id, session_id)
        outcome = {d.approval_id: d.outcome for d in decisions}.get(run.pending.approval_id)
        if outcome is None:
            raise _failed(run_id, session_id, "missing_decision", "no decision for the tool")
        self._live.add(run_id)
        try:
            return await self._guarded(
                run_id, ownership, loaded, on_event, decided=outcome == "allow_once"
            )
        finally:
            self._live.discard(run_id)


def _approval_reason(call: ToolCall) -> str:
    arguments = " ".join(call.arguments.split())
    if len(arguments) > 300:
        arguments = arguments[:300] + "…"
    return f"the model wants to call {call.name} with {arguments or '{}'}"


def _interrupted(run: _Run) -> PendingDecision:
    name = run.dispatch.name if run.dispatch is not None else None
    what = f"the call of {name}" if name else "the request"
    return PendingDecision(
        approval_id=f"interrupted-{run.created_at_ms}",
        kind=INTERRUPTED_KIND,
        reason=f"{what} was interrupted by a restart and is not repeated; /cancel ends it",
        tool_name=name,
    )


def build_openai_agent(ctx: AgentContext) -> OpenAIAgent:
    return OpenAIAgent.from_context(ctx)
