"""The ``a2a`` agent: one chat message → one remote A2A task, sent once, followed durably.

A run (one operation, ``idempotency_key`` = its id) goes through these steps, each
journaled in the task record (:mod:`._book`) before the next one acts:

1. **intent** — ``phase = "sending"`` with the deterministic ``messageId``
   (``prismd-<operation id>``) and the hashes of this task's random push secrets, written
   create-only *before* the request, then the operation moved to ``following``
   (:meth:`~prismd.agents.RunHooks.following`), still before it: a restart takes it up;
2. **send** — with immediate acceptance. A definite refusal (connection refused, 429/503,
   -32601/-32009 before any task exists) is retried with backoff (``Retry-After``
   honoured) until ``task_timeout_ms`` has passed (then "could not be reached"); an
   unknown outcome is never sent again: the record says ``"unknown"`` and the task is
   looked for with ``ListTasks`` (v1.0) by its ``messageId``;
3. **following** — the task id and ``contextId`` journaled at once: a restart (or
   another run of the same operation) finds the record and follows the task again
   instead of sending (a record still ``"sending"``: the task looked for, as in 2);
4. **answer** — when the task is terminal or needs input, a final ``GetTask`` and the reply
   from its artifacts (a single text part exactly, several joined by a blank line — those
   of an artifact seen built by ``append`` chunks, on the stream or in a push, joined as
   sent (:mod:`._book`); the status message, else a fixed notice). Failures are fixed
   words; the peer's own text never reaches the chat or the logs.

Following is by streaming when the card and ``stream`` allow (a broken stream falls back
to polling), by polling with exponential backoff and jitter (slowed while push is
registered), and woken at once by a push (:meth:`A2AAgent.observe`). ``/cancel`` sends
``CancelTask``; a runtime stopping does not (the task is followed after the restart).
"""

from __future__ import annotations

import logging
import math
import random
import secrets
from collections.abc import Mapping
from typing import Any

import attrs
import httpx
import trio

from adapters.toolkit import Http11
from stores import Clock, OwnershipScope, PollStore, StoreUnavailableError

from ...channel import OutboundFile, ReplyFile
from ...grants import ownership_from_identity
from .. import (
    AgentContext,
    EventSink,
    FileProblem,
    RunHooks,
    RunRequest,
    RunResult,
    TextBlock,
)
from .._base import AgentBase, ResumeRequest
from ._book import Book, Stored, TaskRecord, secret_hash
from ._client import A2AClient, A2AError, CardError, OutcomeUnknown, Refused, RemoteError
from ._files import open_file
from ._follower import Follower, park_or_answer
from ._gate import POLL_LEASE_MS
from ._options import A2AOptions, validate_a2a_options
from ._steps import CANCEL_BUDGET_S, failed, follow, recover, send
from ._unary import RPC_CONNECTIONS
from ._wire import TASK_NOT_CANCELABLE, TERMINAL_STATES, PushConfig, Task

log = logging.getLogger("prismd.agents.a2a")
HTTP_LIMITS = httpx.Limits(max_connections=256, max_keepalive_connections=128)
"""Connections kept open to the peer for its streams and file downloads (the unary calls
have their own: :attr:`A2AAgent.rpc`)."""


def _text_of(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, tuple):
        return "\n\n".join(b.text for b in value if isinstance(b, TextBlock))
    return ""


@attrs.define(eq=False)
class A2AAgent(AgentBase):
    alias: str
    options: A2AOptions
    book: Book
    clock: Clock
    bearer: str | None = attrs.field(default=None, repr=False)
    push_base_url: str | None = None
    max_remote_tasks: int = 100
    http: httpx.AsyncClient = attrs.field(factory=lambda: httpx.AsyncClient(limits=HTTP_LIMITS))
    rpc: Http11 = attrs.field(factory=lambda: Http11(max_connections=RPC_CONNECTIONS))
    """The unary JSON-RPC calls' connections (the follower's polls, the runs' calls)."""
    client: A2AClient | None = None
    blocking: int = 0
    """Runs following their task in the run itself (no runtime hooks to park with)."""
    counters: dict[str, int] = attrs.field(factory=dict)
    wakers: dict[str, trio.Event] = attrs.field(factory=dict)
    followers: dict[object, Follower] = attrs.field(factory=dict)
    """The followers of parked tasks, one per runtime (:attr:`RunHooks.runtime`)."""
    polls: PollStore | None = None
    """The store's due polls when several instances share it (PostgreSQL): each due poll
    of a task is made by one of them (:mod:`._follower`)."""
    poll_lease_ms: int = POLL_LEASE_MS

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
            polls=ctx.polls,
        )

    # ------------------------------------------------------------------ the seam

    @property
    def agent_id(self) -> str:
        return f"a2a:{self.alias}"

    @property
    def definition_revision(self) -> str:
        return "a2a-1"

    async def _resume(self, request: ResumeRequest) -> RunResult:
        return failed("refused", request.session_id, request.run_id)  # it never suspends

    async def aclose(self) -> None:
        await self.http.aclose()
        await self.rpc.aclose()

    def count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    async def open_file(self, file: ReplyFile, max_bytes: int) -> OutboundFile | FileProblem:
        """A file of an answer, fetched now (:mod:`._files`; the host's ``FileSource``)."""
        return await open_file(self, file, max_bytes)

    # ------------------------------------------------------------------ pushes

    def observe(self, task_id: str) -> bool:
        """A push said something about ``task_id``: wake its follower in this process to
        read the task now. ``False`` when no follower of it waits here."""
        for follower in self.followers.values():
            if follower.wake_task(task_id):
                return True
        event = self.wakers.get(task_id)
        if event is None:
            return False
        event.set()
        return True

    @property
    def following_now(self) -> int:
        """Remote tasks followed now by this agent in this process."""
        return self.blocking + sum(len(f) for f in self.followers.values())

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
            if await at_limit(self.book, scope, self.max_remote_tasks):
                self.count("refused_limit")
                return failed("limit", session)
            patience = self.options.task_timeout_ms / 1000  # nothing sent yet: then told
            client = await self.connect(request.hooks, patience_s=patience)
            if client is None:
                return failed("unreachable", session)
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
                prompt=context.prompt,
                token_hash=None if push is None else secret_hash(push.token),
                credentials_hash=None if push is None else secret_hash(push.credentials),
            )
            stored = await self.book.save(scope, key, record, 0)
            fresh = stored is not None
            if stored is not None:
                await self.book.index_secrets(stored)
            if stored is None:
                stored = await self.book.load(scope, key)
                if stored is None:
                    raise StoreUnavailableError("a2a task record vanished")
        else:
            fresh = False
        client = await self.connect(request.hooks)
        if client is None:
            return failed("unreachable", session)
        try:
            return await self._drive(client, stored, fresh, push, request, on_event)
        except trio.Cancelled:
            hooks = request.hooks
            if hooks is None or not hooks.stopping():
                await self.cancel_followed(client, scope, key)
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
        answered: Task | None = None
        """The task as the send's answer showed it."""
        if stored.record.phase == "sending":
            if not fresh:
                # Written by an earlier process that may or may not have sent it.
                stored = await self.book.update(stored, phase="unknown")
            else:
                # ``following`` before the request, not after its answer: a process that
                # dies while the send is out (a slow peer's answer may take the task's
                # whole time) leaves the operation to be taken up again after the restart
                # — the task looked for by its messageId, never sent again — instead of
                # ``executing``, which nothing resumes (the answer lost to an operator).
                if request.hooks is not None and not await request.hooks.following():
                    await self.book.update(stored, phase="done", state="refused")
                    return failed("refused", session)
                text = _text_of(request.input)
                sent = await send(self, client, stored, text, push, request.hooks)
                if isinstance(sent, RunResult):
                    return sent
                stored, answered = sent
        if stored.record.phase == "unknown":
            found = await recover(self, client, stored)
            if found is None and stored.record.token_hash is not None:
                found = await self._await_push(client, stored)
            if found is None:
                self.count("send_unknown")
                # Settled (the user is told); no longer counted as followed.
                await self.book.update(stored, phase="done", state="unknown")
                return failed("unknown", session)
            stored = found
        if stored.record.task_id is None:
            return failed("unknown", session)
        hooks: RunHooks | None = request.hooks
        if hooks is not None and not await hooks.following():
            return failed("refused", session)
        if hooks is not None and stored.record.owner != hooks.owner:
            # Who follows it now (listRemoteTasks): written when the follower changes.
            stored = await self.book.update(stored, owner=hooks.owner)
        if hooks is None:
            self.blocking += 1
            try:
                return await follow(self, client, stored, on_event, session)
            finally:
                self.blocking -= 1
        return await park_or_answer(
            self, client, stored, fresh, hooks, on_event, session, answered=answered
        )

    async def _await_push(self, client: A2AClient, stored: Stored) -> Stored | None:
        """After an unknown send outcome that nothing found (a v0.3 peer has no
        ``ListTasks``): wait a while for a push carrying this task's credential — the
        receiver journals the task id it names — then look again. Bounded by
        ``max_poll_interval_ms`` (at most 30 s)."""
        step = self.options.poll_interval_ms / 1000
        end = trio.current_time() + min(self.options.max_poll_interval_ms / 1000, 30.0)
        while trio.current_time() < end:
            await trio.sleep(min(step, max(0.0, end - trio.current_time())))
            again = await self.book.load(stored.scope, stored.key)
            if again is not None and again.record.task_id is not None:
                return await recover(self, client, again)
        return None

    async def release_operation(self, scope: OwnershipScope, operation_id: str) -> None:
        await release(self, scope, operation_id)  # the operation settled without a run

    async def cancel_followed(
        self, client: A2AClient, scope: OwnershipScope, key: str
    ) -> Task | None:
        """``/cancel``: see :func:`_cancel_followed`."""
        return await _cancel_followed(self.book, client, scope, key)

    def _new_push(self, client: A2AClient) -> PushConfig | None:
        url = self.push_url
        if url is None or not client.card.push:
            return None
        return PushConfig(url, secrets.token_urlsafe(24), secrets.token_urlsafe(24))

    async def connect(
        self, hooks: RunHooks | None = None, *, patience_s: float = math.inf
    ) -> A2AClient | None:
        """The client, discovering the card first; retried while the peer refuses or does
        not answer (the run's cancellation ends it), for ``patience_s`` at most. ``None``
        when the card is unusable or the peer did not answer in time."""
        if self.client is not None:
            return self.client
        delay = self.options.poll_interval_ms / 1000
        give_up = trio.current_time() + patience_s
        while trio.current_time() < give_up:
            try:
                self.client = await A2AClient.discover(
                    self.http,
                    url=self.options.url,
                    card_url=self.options.card_url,
                    bearer=self.bearer,
                    protocol=self.options.protocol,
                    rpc=self.rpc,
                )
                return self.client
            except CardError as exc:
                log.warning("agent %s: %s", self.alias, exc)
                return None
            except Refused as exc:
                if hooks is not None:
                    hooks.waiting()
                await trio.sleep(self.backoff(exc.retry_after, delay))
            except OutcomeUnknown:
                if hooks is not None:
                    hooks.waiting()
                await trio.sleep(self.backoff(None, delay))
            delay = min(delay * 2, self.options.max_poll_interval_ms / 1000)
        return None

    def backoff(self, retry_after: float | None, delay: float) -> float:
        """``delay`` with ±20 % jitter, or the peer's longer ``Retry-After`` (a floor: a
        ``0`` or a date past is no reason to ask again at once), at most an hour."""
        pause = delay * random.uniform(0.8, 1.2)
        if retry_after is not None:
            return min(max(retry_after, pause), 3600.0)
        return pause

    def statistics(self) -> dict[str, Any]:
        return {"following": self.following_now, **self.counters}


async def release(agent: A2AAgent, scope: OwnershipScope, operation_id: str) -> None:
    """``operation_id`` was settled without ``agent`` (the sender's grant refused when its
    task ended, or at a restart): the task is followed no more and its record is closed
    (``released``) — no longer listed by ``listRemoteTasks`` nor counted against the
    tenant's limit. The remote task is left as it is (nothing sent)."""
    stored = await agent.book.load(scope, operation_id)
    if stored is None or stored.record.phase == "done":
        return
    task_id = stored.record.task_id
    await agent.book.update(stored, phase="done", state="released")
    if task_id is None:
        return
    for follower in agent.followers.values():
        follower.drop(task_id)
    if agent.polls is not None:
        await agent.polls.forget(f"{agent.alias}/{task_id}")


async def at_limit(book: Book, scope: OwnershipScope, limit: int) -> bool:
    """``scope``'s tenant follows ``limit`` remote tasks already (``max_remote_tasks``)."""
    tenant = OwnershipScope(tenant_id=scope.tenant_id)
    return await book.count_following(tenant, limit) >= limit


async def _cancel_followed(
    book: Book, client: A2AClient, scope: OwnershipScope, key: str
) -> Task | None:
    """``/cancel``: CancelTask for the task being followed, bounded and shielded.

    The task when it was over before the cancel could land: the peer answered
    TaskNotCancelable (-32002: "already terminal", read with GetTask), or answered the
    cancel with the task ended otherwise than cancelled. Its answer is the turn's, as
    if the cancel had come a moment later; the record is left for that answer to
    close. ``None`` once the task is cancelled (or could not be): closed here."""
    with trio.move_on_after(CANCEL_BUDGET_S, shield=True):
        try:
            stored = await book.load(scope, key)
            if stored is None or stored.record.phase == "done":
                return None
            task_id = stored.record.task_id
            if task_id is None or stored.record.phase != "following":
                # Cancelled before the task was known: settled, no longer counted as
                # followed (a send that was on its way may still create a task).
                await book.update(stored, phase="done", state="canceled")
                return None
            over = await _cancel_task(client, task_id)
            if over is not None:
                return over
            await book.update(stored, phase="done", state="canceled")
        except Exception as exc:
            log.warning("cancelling a remote task failed: %s", type(exc).__name__)
    return None


OVER_BEFORE_CANCEL = TERMINAL_STATES - {"canceled"}
"""A task in one of these states ended before a cancel could (see :func:`_cancel_followed`)."""


async def _cancel_task(client: A2AClient, task_id: str) -> Task | None:
    """CancelTask; the task when it was over otherwise than cancelled before the cancel
    could land (answered so, or TaskNotCancelable and then read once), else ``None`` (also
    when the peer refused, or could not be asked or read)."""
    try:
        task = await client.cancel_task(task_id)
    except RemoteError as exc:
        if exc.code != TASK_NOT_CANCELABLE:
            return None
        try:
            task = await client.get_task(task_id)
        except A2AError:
            return None
    except A2AError:
        return None
    return task if task is not None and task.state in OVER_BEFORE_CANCEL else None


async def cancel_remote(
    agents: Mapping[str, A2AAgent], scope: OwnershipScope, operation_id: str
) -> dict[str, Any]:
    """``reconcile … --cancel-remote``: ``CancelTask`` for the remote task an operation
    follows (inside ``scope``, which may be partial), then wake its follower, which reads
    the task (``canceled``) and settles the operation with its notice. A task that was over
    already (TaskNotCancelable, -32002) is not cancelled: the follower, woken the same way,
    reads it and answers with it (``remote_task_over``). The answer is the control
    method's result."""
    for agent in agents.values():
        found = await agent.book.find_operation(scope, operation_id)
        if found is None:
            continue
        record = found.record
        if found.record.alias != agent.alias:
            agent = agents.get(record.alias, agent)
        if record.task_id is None or record.phase == "done":
            return {"status": "conflict", "detail": "not_following", "phase": record.phase}
        client = await agent.connect(patience_s=CANCEL_BUDGET_S)
        if client is None:
            return {"status": "conflict", "detail": "remote_unreachable"}
        try:
            await client.cancel_task(record.task_id)
        except A2AError as exc:
            if isinstance(exc, RemoteError) and exc.code == TASK_NOT_CANCELABLE:
                agent.observe(record.task_id)  # over already: its follower answers it now
                return {"status": "conflict", "detail": "remote_task_over"}
            return {"status": "conflict", "detail": f"remote_refused ({type(exc).__name__})"}
        agent.observe(record.task_id)
        return {"status": "resolved", "outcome": "remote_cancel_requested"}
    return {"status": "conflict", "detail": "no_remote_task"}
