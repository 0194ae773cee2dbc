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

import logging
from collections.abc import Mapping
from typing import Any

import attrs
import httpx

from stores import CheckpointStore, Clock, OwnershipScope

from ..grants import ownership_from_identity
from ._base import (
    AgentContext,
    EventSink,
    ResumeRequest,
    RunError,
    RunRequest,
    RunResult,
    RunState,
    StreamEvent,
    run_failed,
)
from ._chat import Completion, ProviderError, stream_completion
from ._openai_options import OpenAIOptions as OpenAIOptions
from ._openai_options import check_base_url as check_base_url
from ._openai_options import load_tools
from ._openai_options import validate_openai_options as validate_openai_options
from ._openai_run import INTERRUPTED_KIND, MAX_RUN_RECORD_BYTES, RunLoop, RunRecord, interrupted
from ._runbook import RunBook, VersionedRun
from ._session import (
    AgentOptionError,
    SessionAgent,
    SessionLog,
    definition_revision,
    input_text,
    new_run_id,
)
from .tools import Tool

log = logging.getLogger("prismd.agents.openai")


def _no_key_configured(alias: str, error: ProviderError) -> ProviderError:
    """A 401/403 from a server this agent sends no key to: say that none is configured."""
    status = str(error).rpartition("(")[2].rstrip(")") or "HTTP 401"
    return ProviderError(
        error.code,
        f"the model server wants an API key ({status}) and none is configured;"
        f" set api_key_env or api_key_file in [agents.{alias}]",
    )


@attrs.define(eq=False)
class OpenAIAgent(SessionAgent):
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
    _book: RunBook[RunRecord] = attrs.field(init=False)
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

    def __attrs_post_init__(self) -> None:
        self._book = RunBook(
            self.checkpoints, self.alias, RunRecord.from_json, max_bytes=MAX_RUN_RECORD_BYTES
        )

    def _loop(
        self,
        run_id: str,
        scope: OwnershipScope,
        versioned: VersionedRun[RunRecord],
        on_event: EventSink | None,
    ) -> RunLoop:
        return RunLoop(
            self._book,
            self._complete,
            self.options,
            self.tools,
            self._log,
            self._count_tool_call,
            run_id,
            scope,
            versioned,
            on_event,
        )

    def _count_tool_call(self) -> None:
        self.tool_calls += 1

    @property
    def supports_approvals(self) -> bool:
        return True

    async def aclose(self) -> None:
        """Close the HTTP client (its pooled connections)."""
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

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

    # ------------------------------------------------------------------ protocol

    async def run(self, request: RunRequest, *, on_event: EventSink | None = None) -> RunResult:
        run_id = new_run_id()
        scope = ownership_from_identity(request.identity)
        text = input_text(request.input)
        versioned = VersionedRun(
            RunRecord(
                status="running",
                session_id=request.session_id,
                user_text=text,
                messages=(),
                created_at_ms=self.clock.now_ms(),
            )
        )
        return await self._loop(run_id, scope, versioned, on_event).guarded()

    async def status(
        self, *, run_id: str, session_id: str, scope: OwnershipScope
    ) -> RunState | None:
        loaded = await self._book.load(run_id, scope, session_id=session_id)
        if loaded is None:
            return None
        run = loaded.run
        if run.status == "suspended" and run.pending is not None:
            return RunState("suspended", loaded.version, (run.pending,))
        if run.status in ("dispatching", "running") and run_id not in self._live:
            return RunState("suspended", loaded.version, (interrupted(run),))
        return RunState(run.status, loaded.version)

    async def _resume(self, request: ResumeRequest) -> RunResult:
        """Continue a suspended run with its decision, or end it (``deny``).

        Allowed: the tool is called once (its dispatch journaled first) and the model goes
        on; rejected: the model is told and goes on without it; ``deny`` (``/cancel``):
        the run ends ``denied``. An interrupted run (crash mid-call) can only be ended:
        ``deny`` answers ``failed``/``tool_interrupted``. Raises :class:`RunFailedError`
        (``run_not_found``, ``version_conflict``, ``missing_decision``, …).
        """
        run_id, session_id, scope = request.run_id, request.session_id, request.scope
        loaded = await self._book.load(run_id, scope, session_id=session_id)
        if loaded is None:
            raise run_failed(run_id, session_id, "run_not_found", "no such suspended run")
        run = loaded.run
        if run.status == "succeeded":
            return RunResult("succeeded", run.answer or "", run_id, session_id, run.leaf_id)
        if run.status == "denied":
            return RunResult("denied", "", run_id, session_id)
        if loaded.version != request.expected_version:
            raise run_failed(run_id, session_id, "version_conflict", "run state changed")
        interrupted = run.status in ("dispatching", "running") and run_id not in self._live
        if interrupted:
            if not request.deny:
                raise run_failed(run_id, session_id, "missing_decision", "the run was interrupted")
            await self._book.advance(
                run_id,
                scope,
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
            raise run_failed(run_id, session_id, "run_not_found", "no such suspended run")
        if request.deny:
            await self._book.advance(
                run_id,
                scope,
                loaded,
                attrs.evolve(run, status="denied", queue=(), pending=None),
            )
            return RunResult("denied", "", run_id, session_id)
        outcome = {d.approval_id: d.outcome for d in request.decisions}.get(run.pending.approval_id)
        if outcome is None:
            raise run_failed(run_id, session_id, "missing_decision", "no decision for the tool")
        self._live.add(run_id)
        try:
            loop = self._loop(run_id, scope, loaded, request.on_event)
            return await loop.guarded(decided=outcome == "allow_once")
        finally:
            self._live.discard(run_id)


def build_openai_agent(ctx: AgentContext) -> OpenAIAgent:
    return OpenAIAgent.from_context(ctx)
