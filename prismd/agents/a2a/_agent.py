"""The ``a2a`` agent: one chat message → one remote A2A task, sent once, followed durably.

A run (one operation, ``idempotency_key`` = its id) goes through these steps, each
journaled in the task record (:mod:`._book`) before the next one acts:

1. **intent** — ``phase = "sending"`` with the deterministic ``messageId``
   (``prismd-<operation id>``) and the hashes of this task's random push secrets, written
   create-only *before* the request;
2. **send** — with immediate acceptance. A definite refusal (connection refused, 429/503,
   -32601/-32009 before any task exists) is retried with backoff (``Retry-After``
   honoured); an unknown outcome is never sent again: the record says ``"unknown"`` and the
   task is looked for with ``ListTasks`` (v1.0) by its ``messageId``;
3. **following** — the task id and ``contextId`` journaled at once, then
   :meth:`~prismd.agents.RunHooks.following` moves the operation to ``following``: a
   restart (or another run of the same operation) finds the record and follows the task
   again instead of sending;
4. **answer** — when the task is terminal or needs input, a final ``GetTask`` and the reply
   from its artifacts (a single text part exactly, several joined by a blank line; the
   status message, else a fixed notice). Failures are fixed words; the peer's own text never
   reaches the chat or the logs.

Following is by streaming when the card and ``stream`` allow (a broken stream falls back
to polling), by polling with exponential backoff and jitter (slowed while push is
registered), and woken at once by a push (:meth:`A2AAgent.observe`). ``/cancel`` sends
``CancelTask``; a runtime stopping does not (the task is followed after the restart).
"""

from __future__ import annotations

import logging
import random
import secrets
from collections.abc import Mapping
from typing import Any

import attrs
import httpx
import trio

from stores import Clock, OwnershipScope, StoreUnavailableError

from ...identity import AgentIdentity, ownership_from_identity
from .. import (
    AgentContext,
    Decision,
    EventSink,
    RunError,
    RunHooks,
    RunRequest,
    RunResult,
    RunState,
    StreamEvent,
    TextBlock,
)
from ._book import Book, ContextRecord, Stored, TaskRecord, secret_hash
from ._client import A2AClient, A2AError, CardError, OutcomeUnknown, Refused, RemoteError
from ._options import A2AOptions, validate_a2a_options
from ._wire import (
    METHOD_NOT_FOUND,
    TASK_NOT_FOUND,
    UNSUPPORTED_OPERATION,
    VERSION_NOT_SUPPORTED,
    Message,
    Observation,
    PushConfig,
    Task,
    observed_state,
)

log = logging.getLogger("prismd.agents.a2a")

NOTICES: Mapping[str, str] = {
    "failed": "the remote agent could not complete it.",
    "canceled": "the remote agent cancelled it.",
    "rejected": "the remote agent declined it.",
    "lost": "the remote agent no longer knows this task.",
    "timeout": "the remote agent did not finish in time; it was cancelled.",
    "unknown": "the remote agent may have received it; it was not sent again.",
    "refused": "the remote agent refused it.",
    "unreachable": "the remote agent could not be reached.",
    "limit": "too many requests are waiting on remote agents; try again later.",
}
NO_TEXT = "The remote agent finished without a text answer."
NEEDS_INPUT = "The remote agent needs more input."
MAX_REFUSED_RPC = 8
CANCEL_BUDGET_S = 5.0
PUSH_SLOWDOWN = 4


def _failed(code: str, session_id: str, run_id: str = "") -> RunResult:
    return RunResult(
        status="failed",
        text="",
        run_id=run_id,
        session_id=session_id,
        error=RunError(code=f"a2a_{code}", message=NOTICES[code]),
    )


def reply_text(task: Task) -> str:
    """The chat reply of a completed task: its artifacts' text parts (one exactly, several
    joined by a blank line), else the final status message, else a fixed notice."""
    texts = [t for artifact in task.artifacts for t in artifact.texts if t.strip()]
    if len(texts) == 1:
        return texts[0]
    if texts:
        return "\n\n".join(texts)
    return task.status_text or NO_TEXT


def _text_of(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, tuple):
        return "\n\n".join(b.text for b in value if isinstance(b, TextBlock))
    return ""


@attrs.define(eq=False)
class A2AAgent:
    alias: str
    options: A2AOptions
    book: Book
    clock: Clock
    bearer: str | None = attrs.field(default=None, repr=False)
    push_base_url: str | None = None
    max_remote_tasks: int = 100
    http: httpx.AsyncClient = attrs.field(factory=httpx.AsyncClient)
    client: A2AClient | None = None
    following_now: int = 0
    counters: dict[str, int] = attrs.field(factory=dict)
    _wakers: dict[str, trio.Event] = attrs.field(factory=dict)

    @classmethod
    def from_context(cls, ctx: AgentContext) -> A2AAgent:
        options = validate_a2a_options(ctx.options)
        bearer = None
        if options.bearer_token_env or options.bearer_token_file:
            if ctx.read_secret is None:
                raise ValueError("bearer_token_env: no secret reader in this host")
            bearer = ctx.read_secret(
                options.bearer_token_env, options.bearer_token_file, "bearer_token_env"
            )
        return cls(
            alias=ctx.alias,
            options=options,
            book=Book(ctx.checkpoints),
            clock=ctx.clock,
            bearer=bearer,
            push_base_url=ctx.push_base_url,
            max_remote_tasks=ctx.max_remote_tasks_per_tenant,
        )

    # ------------------------------------------------------------------ the seam

    @property
    def agent_id(self) -> str:
        return f"a2a:{self.alias}"

    @property
    def definition_revision(self) -> str:
        return "a2a-1"

    @property
    def input_capabilities(self) -> frozenset[str]:
        return frozenset({"text"})

    @property
    def supports_approvals(self) -> bool:
        return False

    async def status(
        self, *, run_id: str, session_id: str, ownership: OwnershipScope
    ) -> RunState | None:
        return None

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
        return _failed("refused", session_id, run_id)

    async def aclose(self) -> None:
        await self.http.aclose()

    def _count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    # ------------------------------------------------------------------ pushes

    def observe(self, task_id: str) -> bool:
        """A push said something about ``task_id``: wake its follower in this process to
        read the task now. ``False`` when no follower of it waits here."""
        event = self._wakers.get(task_id)
        if event is None:
            return False
        event.set()
        return True

    @property
    def push_url(self) -> str | None:
        if not self.options.push or self.push_base_url is None:
            return None
        return f"{self.push_base_url.rstrip('/')}/a2a/push/{self.alias}"

    # ------------------------------------------------------------------ run

    async def run(self, request: RunRequest, *, on_event: EventSink | None = None) -> RunResult:
        scope = ownership_from_identity(request.identity)
        key = request.idempotency_key
        session = request.session_id
        stored = await self.book.load(scope, key)
        push: PushConfig | None = None
        if stored is None:
            if await self._at_limit(scope):
                self._count("refused_limit")
                return _failed("limit", session)
            client = await self._connect()
            if client is None:
                return _failed("unreachable", session)
            context = await self.book.context(scope, self.alias, session)
            push = self._new_push(client)
            record = TaskRecord(
                alias=self.alias,
                message_id=f"prismd-{key}",
                phase="sending",
                session_id=session,
                created_ms=self.clock.now_ms(),
                task_id=context.task_id,
                context_id=context.context_id,
                continues_task=context.task_id is not None,
                token_hash=None if push is None else secret_hash(push.token),
                credentials_hash=None if push is None else secret_hash(push.credentials),
            )
            stored = await self.book.save(scope, key, record, 0)
            fresh = stored is not None
            if stored is None:
                stored = await self.book.load(scope, key)
                if stored is None:
                    raise StoreUnavailableError("a2a task record vanished")
        else:
            fresh = False
        client = await self._connect()
        if client is None:
            return _failed("unreachable", session)
        try:
            return await self._drive(client, stored, fresh, push, request, on_event)
        except trio.Cancelled:
            hooks = request.hooks
            if hooks is None or not hooks.stopping():
                await self._cancel_remote(client, scope, key)
            raise

    async def _drive(
        self,
        client: A2AClient,
        stored: Stored,
        fresh: bool,
        push: PushConfig | None,
        request: RunRequest,
        on_event: EventSink | None,
    ) -> RunResult:
        session = request.session_id
        if stored.record.phase == "sending":
            if not fresh:
                # Written by an earlier process that may or may not have sent it.
                stored = await self.book.update(stored, phase="unknown")
            else:
                sent = await self._send(client, stored, _text_of(request.input), push)
                if isinstance(sent, RunResult):
                    return sent
                stored = sent
        if stored.record.phase == "unknown":
            found = await self._recover(client, stored)
            if found is None:
                self._count("send_unknown")
                return _failed("unknown", session)
            stored = found
        if stored.record.task_id is None:
            return _failed("unknown", session)
        hooks: RunHooks | None = request.hooks
        if hooks is not None and not await hooks.following():
            return _failed("refused", session)
        self.following_now += 1
        try:
            return await self._follow(client, stored, on_event, session)
        finally:
            self.following_now -= 1

    async def _cancel_remote(self, client: A2AClient, scope: OwnershipScope, key: str) -> None:
        """``/cancel``: CancelTask for the task being followed, bounded and shielded."""
        with trio.move_on_after(CANCEL_BUDGET_S, shield=True):
            try:
                stored = await self.book.load(scope, key)
                if stored is None or stored.record.task_id is None:
                    return
                if stored.record.phase == "done":
                    return
                try:
                    await client.cancel_task(stored.record.task_id)
                except A2AError:
                    pass
                await self.book.update(stored, phase="done", state="canceled")
            except Exception as exc:
                log.warning("cancelling a remote task failed: %s", type(exc).__name__)

    async def _at_limit(self, scope: OwnershipScope) -> bool:
        tenant = OwnershipScope(tenant_id=scope.tenant_id)
        open_tasks, _ = await self.book.following(
            scope=tenant, limit=min(500, self.max_remote_tasks + 1)
        )
        return len(open_tasks) >= self.max_remote_tasks

    def _new_push(self, client: A2AClient) -> PushConfig | None:
        url = self.push_url
        if url is None or not client.card.push:
            return None
        return PushConfig(url, secrets.token_urlsafe(24), secrets.token_urlsafe(24))

    async def _connect(self) -> A2AClient | None:
        """The client, discovering the card first; retried while the peer refuses or does
        not answer (the run's cancellation ends it). ``None`` when the card is unusable."""
        if self.client is not None:
            return self.client
        delay = self.options.poll_interval_ms / 1000
        while True:
            try:
                self.client = await A2AClient.discover(
                    self.http,
                    url=self.options.url,
                    card_url=self.options.card_url,
                    bearer=self.bearer,
                    protocol=self.options.protocol,
                )
                return self.client
            except CardError as exc:
                log.warning("agent %s: %s", self.alias, exc)
                return None
            except Refused as exc:
                await trio.sleep(self._wait(exc.retry_after, delay))
            except OutcomeUnknown:
                await trio.sleep(self._wait(None, delay))
            delay = min(delay * 2, self.options.max_poll_interval_ms / 1000)

    def _wait(self, retry_after: float | None, delay: float) -> float:
        """The backoff pause: ``Retry-After`` when the peer said it, else ``delay`` with
        ±20 % jitter."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), 3600.0)
        return delay * random.uniform(0.8, 1.2)

    # ------------------------------------------------------------------ send

    async def _send(
        self, client: A2AClient, stored: Stored, text: str, push: PushConfig | None
    ) -> Stored | RunResult:
        record = stored.record
        delay = self.options.poll_interval_ms / 1000
        cap = self.options.max_poll_interval_ms / 1000
        refused_rpc = 0
        while True:
            try:
                answer = await client.send(
                    message_id=record.message_id,
                    text=text,
                    context_id=record.context_id,
                    task_id=record.task_id if record.continues_task else None,
                    push=push,
                )
            except Refused as exc:
                self._count("send_refused")
                await trio.sleep(self._wait(exc.retry_after, delay))
                delay = min(delay * 2, cap)
                continue
            except OutcomeUnknown:
                return await self.book.update(stored, phase="unknown")
            except RemoteError as exc:
                self._count("send_refused")
                if exc.code in (METHOD_NOT_FOUND, VERSION_NOT_SUPPORTED):
                    refused_rpc += 1
                    if refused_rpc < MAX_REFUSED_RPC:
                        await trio.sleep(self._wait(None, delay))
                        delay = min(delay * 2, cap)
                        continue
                elif record.continues_task and exc.code in (TASK_NOT_FOUND, UNSUPPORTED_OPERATION):
                    # The task that asked for input is gone or over: a new task, same context.
                    stored = await self.book.update(stored, task_id=None, continues_task=False)
                    record = stored.record
                    continue
                await self.book.update(stored, phase="done", state="rejected")
                return _failed("refused", record.session_id)
            break
        if isinstance(answer, Message):
            context_id = answer.context_id or record.context_id
            await self.book.update(stored, phase="done", context_id=context_id, state="message")
            await self.book.set_context(
                stored.scope, self.alias, record.session_id, ContextRecord(context_id, None)
            )
            texts = [t for t in answer.texts if t.strip()]
            return RunResult(
                status="succeeded",
                text="\n\n".join(texts) or NO_TEXT,
                run_id=f"a2a:{answer.message_id}",
                session_id=record.session_id,
            )
        return await self._accepted(stored, answer)

    async def _accepted(self, stored: Stored, task: Task) -> Stored:
        """Journal the task id and contextId at once, and the way back from a push."""
        stored = await self.book.update(
            stored,
            phase="following",
            task_id=task.id,
            context_id=task.context_id or stored.record.context_id,
            state=task.state,
            observed_ms=self.clock.now_ms(),
        )
        await self.book.index(stored)
        self._count("sent")
        return stored

    async def _recover(self, client: A2AClient, stored: Stored) -> Stored | None:
        """After an unknown outcome: find the task by its ``messageId`` (v1.0 ``ListTasks``
        in the context); ``None`` when it cannot be found (the operator decides)."""
        record = stored.record
        if record.continues_task and record.task_id is not None:
            # A continuation: the task is known already; its history says if it arrived.
            try:
                task = await client.get_task(record.task_id)
            except A2AError:
                return None
            if record.message_id in task.message_ids:
                return await self._accepted(stored, task)
            return None
        delay = self.options.poll_interval_ms / 1000
        for _attempt in range(4):
            try:
                tasks = await client.list_tasks(context_id=record.context_id)
            except RemoteError:
                return None
            except (Refused, OutcomeUnknown) as exc:
                await trio.sleep(self._wait(getattr(exc, "retry_after", None), delay))
                delay *= 2
                continue
            for task in tasks:
                if record.message_id in task.message_ids:
                    return await self._accepted(stored, task)
            return None
        return None

    # ------------------------------------------------------------------ follow

    async def _follow(
        self, client: A2AClient, stored: Stored, on_event: EventSink | None, session: str
    ) -> RunResult:
        record = stored.record
        task_id = record.task_id
        assert task_id is not None
        deadline_ms = record.created_ms + self.options.task_timeout_ms
        first = self.options.poll_interval_ms / 1000
        cap = self.options.max_poll_interval_ms / 1000
        slowed = PUSH_SLOWDOWN if record.token_hash is not None else 1
        delay = first
        stream = self.options.stream and client.card.streaming
        shown: list[str | None] = [None]
        while True:
            if stream:
                stream = await self._stream(client, task_id, on_event, shown, deadline_ms)
            try:
                task: Task | None = await client.get_task(task_id)
                self._count("polls")
            except RemoteError as exc:
                if exc.code == TASK_NOT_FOUND:
                    await self.book.update(stored, phase="done", state="lost")
                    return _failed("lost", session, f"a2a:{task_id}")
                task = None
            except Refused as exc:
                task = None
                if exc.retry_after is not None:
                    delay = max(delay, min(exc.retry_after, 3600.0))
            except OutcomeUnknown:
                task = None
            if task is not None:
                if task.state != stored.record.state:
                    stored = await self.book.update(
                        stored, state=task.state, observed_ms=self.clock.now_ms()
                    )
                    delay = first
                if task.terminal or task.state == "input-required":
                    return await self._answer(stored, task, session)
                self._preview(on_event, task_id, task.status_text, shown)
            if self.clock.now_ms() >= deadline_ms:
                with trio.move_on_after(CANCEL_BUDGET_S, shield=True):
                    try:
                        await client.cancel_task(task_id)
                    except A2AError:
                        pass
                await self.book.update(stored, phase="done", state="timeout")
                return _failed("timeout", session, f"a2a:{task_id}")
            pause = min(self._wait(None, delay) * slowed, cap)
            pause = min(pause, max(0.0, (deadline_ms - self.clock.now_ms()) / 1000))
            await self._sleep_or_push(task_id, pause)
            delay = min(delay * 2, cap)

    async def _sleep_or_push(self, task_id: str, seconds: float) -> None:
        event = trio.Event()
        self._wakers[task_id] = event
        try:
            with trio.move_on_after(seconds):
                await event.wait()
        finally:
            if self._wakers.get(task_id) is event:
                del self._wakers[task_id]

    async def _stream(
        self,
        client: A2AClient,
        task_id: str,
        on_event: EventSink | None,
        shown: list[str | None],
        deadline_ms: int,
    ) -> bool:
        """Follow the task's stream until it ends; whether streaming is worth trying again
        (not after the peer refused it)."""
        left_s = max(0.0, (deadline_ms - self.clock.now_ms()) / 1000)

        def on_item(item: Observation) -> bool:
            state = observed_state(item)
            if state in ("working", "submitted", "auth-required"):
                self._preview(on_event, task_id, getattr(item, "status_text", None), shown)
            return state in ("input-required", "completed", "canceled", "failed", "rejected")

        with trio.move_on_after(left_s):
            try:
                await client.subscribe(
                    task_id, on_item, idle_s=self.options.max_poll_interval_ms / 1000
                )
            except RemoteError:
                return False
            except A2AError:
                return True
        return True
        return True
        return True

    def _preview(
        self, on_event: EventSink | None, task_id: str, text: str | None, shown: list[str | None]
    ) -> None:
        """A working task's status message as a preview (never journaled)."""
        if on_event is None or not text or text == shown[0]:
            return
        shown[0] = text
        run_id = f"a2a:{task_id}"
        on_event(StreamEvent("message_started", run_id))
        on_event(StreamEvent("message_delta", run_id, text))

    async def _answer(self, stored: Stored, task: Task, session: str) -> RunResult:
        record = stored.record
        run_id = f"a2a:{task.id}"
        context_id = task.context_id or record.context_id
        waiting = task.state == "input-required"
        await self.book.set_context(
            stored.scope,
            self.alias,
            record.session_id,
            ContextRecord(context_id, task.id if waiting else None),
        )
        await self.book.update(stored, phase="done", state=task.state, context_id=context_id)
        self._count(f"tasks_{task.state.replace('-', '_')}")
        if waiting:
            return RunResult("succeeded", task.status_text or NEEDS_INPUT, run_id, session)
        if task.state == "completed":
            return RunResult("succeeded", reply_text(task), run_id, session)
        return _failed(task.state, session, run_id)

    def statistics(self) -> dict[str, Any]:
        return {"following": self.following_now, **self.counters}
