"""The ``a2a`` agent's steps once its client is known: the send (:func:`send`, then
:func:`recover` after an unknown outcome), the following (:func:`follow`: stream, poll,
push wake-ups) and the answer (:func:`answer`). See :mod:`._agent` for the whole story."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

import trio

from stores import ANY_SCOPE, Clock

from .. import EventSink, RunError, RunHooks, RunResult, StreamEvent
from ._book import MAX_APPENDED, Book, ContextRecord, Stored, appended_key
from ._client import A2AClient, A2AError, OutcomeUnknown, Refused, RemoteError
from ._files import completed
from ._options import A2AOptions
from ._relay import ends_turn, prompt_key, relay_interrupt
from ._wire import (
    INTERRUPTED_STATES,
    INVALID_PARAMS,
    METHOD_NOT_FOUND,
    PUSH_NOT_SUPPORTED,
    TASK_NOT_FOUND,
    TERMINAL_STATES,
    UNSUPPORTED_OPERATION,
    VERSION_NOT_SUPPORTED,
    ArtifactUpdate,
    Message,
    Observation,
    PushConfig,
    Task,
    observed_state,
)

log = logging.getLogger("prismd.agents.a2a")


class A2AAgent(Protocol):
    """What the steps use of the agent (:class:`._agent.A2AAgent`)."""

    alias: str
    book: Book
    clock: Clock
    wakers: dict[str, trio.Event]

    @property
    def options(self) -> A2AOptions: ...

    def count(self, name: str) -> None: ...

    def backoff(self, retry_after: float | None, delay: float) -> float: ...


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
PUSH_REFUSED = frozenset({PUSH_NOT_SUPPORTED, INVALID_PARAMS})
"""A send's refusals that may be its push config's: made again once without it."""
CONTINUATION_REFUSED = frozenset({TASK_NOT_FOUND, UNSUPPORTED_OPERATION, INVALID_PARAMS})
"""A continued task's refusals that mean it is gone or over: -32001, -32004 (v1.0), and
-32602, which a2a-sdk 0.3 answers for a message to a terminal task."""
CANCEL_BUDGET_S = 5.0
MAX_LIST_PAGES = 20
"""``ListTasks`` pages read looking for a send whose outcome is unknown (newest first)."""
PUSH_SLOWDOWN = 4


def failed(code: str, session_id: str, run_id: str = "") -> RunResult:
    return RunResult(
        status="failed",
        text="",
        run_id=run_id,
        session_id=session_id,
        error=RunError(code=f"a2a_{code}", message=NOTICES[code]),
    )


def reply_text(task: Task, appended: tuple[str, ...] = ()) -> str:
    """The chat reply of a completed task: its artifacts' text parts (one exactly, several
    joined by a blank line), else the final status message, else a fixed notice. The parts
    of an artifact seen built by ``append`` chunks (``appended``, :mod:`._book`) are its
    chunks: joined as they were sent, with nothing between them."""
    texts: list[str] = []
    for artifact in task.artifacts:
        if artifact.artifact_id and appended_key(artifact.artifact_id) in appended:
            texts.append("".join(artifact.texts))
        else:
            texts.extend(artifact.texts)
    texts = [t for t in texts if t.strip()]
    if len(texts) == 1:
        return texts[0]
    if texts:
        return "\n\n".join(texts)
    return task.status_text or NO_TEXT


# ------------------------------------------------------------------ send


async def send(
    agent: A2AAgent,
    client: A2AClient,
    stored: Stored,
    text: str,
    push: PushConfig | None,
    hooks: RunHooks | None = None,
) -> tuple[Stored, Task | None] | RunResult:
    """The message sent once: the task record as journaled and the task the peer answered
    (``None``: the outcome is unknown, the record says so), or the run's result (a bare
    message, a refusal)."""
    record = stored.record
    delay = agent.options.poll_interval_ms / 1000
    cap = agent.options.max_poll_interval_ms / 1000
    refused_rpc = 0
    deadline_ms = record.created_ms + agent.options.task_timeout_ms
    while True:
        # A peer that ignores immediate acceptance answers once the task is over: waited
        # for as long as the task may take, not lost to a call's timeout.
        wait_s = max(client.timeout_s, (deadline_ms - agent.clock.now_ms()) / 1000)
        try:
            answer = await client.send(
                message_id=record.message_id,
                text=text,
                context_id=record.context_id,
                task_id=record.task_id if record.continues_task else None,
                push=push,
                wait_s=wait_s,
            )
        except Refused as exc:
            agent.count("send_refused")
            if agent.clock.now_ms() >= deadline_ms:
                # Refused for as long as the task was given: told, and the conversation
                # goes on (nothing was sent).
                await agent.book.update(stored, phase="done", state="unreachable")
                return failed("unreachable", record.session_id)
            if hooks is not None:
                hooks.waiting()  # a refusing peer holds no concurrency slot
            await trio.sleep(agent.backoff(exc.retry_after, delay))
            delay = min(delay * 2, cap)
            continue
        except OutcomeUnknown:
            return await agent.book.update(stored, phase="unknown"), None
        except RemoteError as exc:
            agent.count("send_refused")
            if exc.code in (METHOD_NOT_FOUND, VERSION_NOT_SUPPORTED):
                refused_rpc += 1
                if hooks is not None:
                    hooks.waiting()
                if refused_rpc < MAX_REFUSED_RPC:
                    await trio.sleep(agent.backoff(None, delay))
                    delay = min(delay * 2, cap)
                    continue
            elif push is not None and exc.code in PUSH_REFUSED:
                # -32003: "fall back to polling" (reference §4, §5); -32602: a strict
                # server refusing the webhook URL (a2a-sdk's push_url_validator) before
                # any task exists. The same message again without push, polled alone.
                push = None
                stored = await agent.book.update(stored, token_hash=None, credentials_hash=None)
                record = stored.record
                continue
            elif record.continues_task and exc.code in CONTINUATION_REFUSED:
                # The task that asked for input is gone or over: a new task, same context.
                stored = await agent.book.update(
                    stored, task_id=None, continues_task=False, prompt=None
                )
                record = stored.record
                continue
            await agent.book.update(stored, phase="done", state="rejected")
            return failed("refused", record.session_id)
        break
    if isinstance(answer, Message):
        context_id = answer.context_id or record.context_id
        await agent.book.update(stored, phase="done", context_id=context_id, state="message")
        await agent.book.set_context(
            stored.scope, agent.alias, record.session_id, ContextRecord(context_id, None)
        )
        texts = [t for t in answer.texts if t.strip()]
        return RunResult(
            status="succeeded",
            text="\n\n".join(texts) or NO_TEXT,
            run_id=f"a2a:{answer.message_id}",
            session_id=record.session_id,
        )
    return await accepted(agent, stored, answer), answer


async def accepted(agent: A2AAgent, stored: Stored, task: Task) -> Stored:
    """Journal the task id and contextId at once, and the way back from a push (first, so
    a push racing this write already finds its task)."""
    await agent.book.index(stored, task.id)
    stored = await agent.book.update(
        stored,
        phase="following",
        task_id=task.id,
        context_id=task.context_id or stored.record.context_id,
        state=task.state,
        observed_ms=agent.clock.now_ms(),
    )
    agent.count("sent")
    return stored


async def recover(agent: A2AAgent, client: A2AClient, stored: Stored) -> Stored | None:
    """After an unknown outcome: find the task by its ``messageId`` (v1.0 ``ListTasks``
    in the context); ``None`` when it cannot be found (the operator decides)."""
    record = stored.record
    if record.task_id is not None:
        # A continuation: the task was known before; its history says if the message
        # arrived. Else a task id a push told us, proved by this send's own random
        # credential (journaled with the intent): the send created it, whatever the
        # history shows (the server's default may be none).
        try:
            task = await client.get_task(record.task_id)
        except A2AError:
            return None
        if not record.continues_task or record.message_id in task.message_ids:
            return await accepted(agent, stored, task)
        return None
    delay = agent.options.poll_interval_ms / 1000
    token: str | None = None
    pages = failures = 0
    while pages < MAX_LIST_PAGES and failures < 4:
        try:
            tasks, token = await client.list_tasks(context_id=record.context_id, page_token=token)
        except RemoteError:
            return None
        except (Refused, OutcomeUnknown) as exc:
            failures += 1
            await trio.sleep(agent.backoff(getattr(exc, "retry_after", None), delay))
            delay *= 2
            continue
        pages += 1
        for task in tasks:
            if record.message_id in task.message_ids:
                return await accepted(agent, stored, task)
        if token is None:
            return None
    return None


# ------------------------------------------------------------------ follow


async def follow(
    agent: A2AAgent,
    client: A2AClient,
    stored: Stored,
    on_event: EventSink | None,
    session: str,
    hooks: RunHooks | None = None,
) -> RunResult:
    record = stored.record
    task_id = record.task_id
    assert task_id is not None
    deadline_ms = record.created_ms + agent.options.task_timeout_ms
    first = agent.options.poll_interval_ms / 1000
    cap = agent.options.max_poll_interval_ms / 1000
    slowed = PUSH_SLOWDOWN if record.token_hash is not None else 1
    delay = first
    streaming = agent.options.stream and client.card.streaming
    shown: list[str | None] = [None]
    while True:
        if streaming:
            streaming = await stream(
                agent, client, task_id, on_event, shown, deadline_ms, stored.key
            )
        try:
            task: Task | None = await client.get_task(task_id)
            agent.count("polls")
        except RemoteError as exc:
            if exc.code == TASK_NOT_FOUND:
                await agent.book.update(stored, phase="done", state="lost")
                return failed("lost", session, f"a2a:{task_id}")
            task = None
        except Refused as exc:
            task = None
            if exc.retry_after is not None:
                delay = max(delay, min(exc.retry_after, 3600.0))
        except OutcomeUnknown:
            task = None
        if task is not None:
            if task.state != stored.record.state:
                stored = await agent.book.update(
                    stored, state=task.state, observed_ms=agent.clock.now_ms()
                )
                delay = first
            if ends_turn(task, stored.record.prompt):
                return await answer(agent, stored, task, session)
            if await relay_interrupt(hooks, task, shown):
                agent.count("relays")
            preview(on_event, task_id, task.status_text, shown)
        if agent.clock.now_ms() >= deadline_ms:
            with trio.move_on_after(CANCEL_BUDGET_S, shield=True):
                try:
                    await client.cancel_task(task_id)
                except A2AError:
                    pass
            await agent.book.update(stored, phase="done", state="timeout")
            return failed("timeout", session, f"a2a:{task_id}")
        pause = min(agent.backoff(None, delay) * slowed, cap)
        pause = min(pause, max(0.0, (deadline_ms - agent.clock.now_ms()) / 1000))
        await sleep_or_push(agent, task_id, pause)
        delay = min(delay * 2, cap)


async def sleep_or_push(agent: A2AAgent, task_id: str, seconds: float) -> None:
    event = trio.Event()
    agent.wakers[task_id] = event
    try:
        with trio.move_on_after(seconds):
            await event.wait()
    finally:
        if agent.wakers.get(task_id) is event:
            del agent.wakers[task_id]


async def stream(
    agent: A2AAgent,
    client: A2AClient,
    task_id: str,
    on_event: EventSink | None,
    shown: list[str | None],
    deadline_ms: int,
    key: str,
) -> bool:
    """Follow the task's stream until it ends; whether streaming is worth trying again
    (not after the peer refused it). An artifact seen built by ``append`` chunks is noted
    in the task record of operation ``key`` as it is seen (before this returns)."""
    left_s = max(0.0, (deadline_ms - agent.clock.now_ms()) / 1000)
    noted: set[str] = set()
    to_note: list[str] = []

    def on_item(item: Observation) -> bool:
        if isinstance(item, ArtifactUpdate) and item.append:
            artifact_id = item.artifact.artifact_id
            if artifact_id and artifact_id not in noted and len(noted) < MAX_APPENDED:
                noted.add(artifact_id)
                to_note.append(artifact_id)
        state = observed_state(item)
        if state in ("working", "submitted", "auth-required"):
            preview(on_event, task_id, getattr(item, "status_text", None), shown)
        # auth-required ends the stream too: the next GetTask reads it and relays it.
        return state in INTERRUPTED_STATES or state in TERMINAL_STATES

    async def note() -> None:
        """Journal the artifact ids seen appended to (between two events: an id is in
        the record before the stream reads on). A store that fails loses only that
        evidence (the parts are then joined as paragraphs)."""
        while to_note:
            artifact_id = to_note.pop(0)
            try:
                stored = await agent.book.find_operation(ANY_SCOPE, key)
                await agent.book.note_appended(stored, artifact_id)
            except Exception as exc:
                log.warning("a2a: noting an appended artifact failed (%s)", type(exc).__name__)

    with trio.move_on_after(left_s):
        try:
            await client.subscribe(
                task_id,
                on_item,
                idle_s=agent.options.max_poll_interval_ms / 1000,
                after_item=note,
            )
        except RemoteError:
            return False
        except A2AError:
            return True
    return True


def preview(
    on_event: EventSink | None,
    task_id: str,
    text: str | None,
    shown: list[str | None],
) -> None:
    """A working task's status message as a preview (never journaled)."""
    if on_event is None or not text or text == shown[0]:
        return
    shown[0] = text
    run_id = f"a2a:{task_id}"
    on_event(StreamEvent("message_started", run_id))
    on_event(StreamEvent("message_delta", run_id, text))


async def answer(agent: A2AAgent, stored: Stored, task: Task, session: str) -> RunResult:
    record = stored.record
    run_id = f"a2a:{task.id}"
    context_id = task.context_id or record.context_id
    waiting = task.state == "input-required"
    await agent.book.set_context(
        stored.scope,
        agent.alias,
        record.session_id,
        ContextRecord(context_id, task.id, prompt_key(task))
        if waiting
        else ContextRecord(context_id),
    )
    done = await agent.book.update(stored, phase="done", state=task.state, context_id=context_id)
    agent.count(f"tasks_{task.state.replace('-', '_')}")
    if waiting:
        return RunResult("succeeded", task.status_text or NEEDS_INPUT, run_id, session)
    if task.state == "completed":
        # The record as written: what a stream or a push noted meanwhile is in it.
        text = reply_text(task, done.record.appended)
        return completed(agent.alias, task, text, run_id, session)
    return failed(task.state, session, run_id)
