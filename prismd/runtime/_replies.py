"""The reply path (contract §9.2): bound the text, journal it ``pending`` — in the same
transaction as the operation's settlement and the binding — deliver, mark the outcome; and
what an agent run's result means for the journal and the user (:func:`outcome_of`, the one
table, shared by turns and resumes) with what the user sees while it runs: previews, and
the typing indicator (:class:`TypingTimer`).

:func:`answer` is the one way a reply leaves the runtime. Persist before send: nothing is
delivered unless its record is staged (or, without a journal, nothing is staged at all).
The send itself (deliver, mark; a turn's reply through its route's outbox, so the route's
next turn is claimed while it is on its way) is :mod:`._core`'s: the held mark and one
send at a time per conversation serve channels that may hold a reply while the
conversation has no live connection (:mod:`prismd.runtime._delivery`).
"""

from __future__ import annotations

import heapq
import itertools
import logging
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import trio

from ..agents import EventSink, RunResult, StreamEvent
from ..channel import (
    DEFAULT_TYPING_DELAY_MS,
    MAX_TYPING_DELAY_MS,
    Button,
    InboundEvent,
    Preview,
    Reply,
    ReplyFile,
    truncate_utf8,
    utf8_len,
)
from ..grants import AgentIdentity
from ..journal import Change as Change
from ..journal import (
    Loaded,
    OperationRecord,
    OperationRef,
    OwnershipScope,
    ReplyRecord,
    StoredButton,
    StoredFile,
    Write,
    compact_json,
    finish,
)
from ._core import (
    JOURNAL_BUDGET_S,
    Core,
    Outgoing,
    deliver_and_mark,
    fence_lost,
    send_from_route,
    send_staged,
    stamp_us,
)
from ._routes import ActiveTurn, Route

log = logging.getLogger("prismd.runtime")


def scrub_surrogates(text: str) -> str:
    """``text`` with lone surrogates replaced by U+FFFD (a surrogate pair held as two
    code points becomes its character): the journal stores UTF-8, which has no encoding
    for a lone surrogate, and a reply that cannot be staged would be lost."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def _record_size(record: ReplyRecord, text: str) -> int:
    value = (record if text == record.text else attrs.evolve(record, text=text)).to_json()
    return utf8_len(compact_json(value))


_BOUND_PER_CHAR = 6
"""JSON bytes one code point of a string can take in a record: a control character
escaped as ``\\u001f`` six, anything else at most four (UTF-8)."""
_BOUND_FIXED = 512
"""Bytes for everything of a record that is not one of its strings: keys, punctuation,
numbers, the two ISO-8601 stamps (about 300 at most)."""


def fits_unmeasured(record: ReplyRecord, budget: int) -> bool:
    """``record``'s JSON certainly fits ``budget`` by a bound on its strings alone, so it
    need not be encoded to be measured (and is encoded once, when journaled). Only for a
    record without controls or an approval target: those are measured."""
    if record.buttons or record.approval is not None or record.files:
        return False
    chars = len(record.text) + len(record.operation_id) + len(record.connection_id)
    chars += len(record.external_conversation_id) + len(record.kind) + len(record.state)
    for optional in (record.thread_id, record.message_id, record.reason):
        if optional is not None:
            chars += len(optional)
    return _BOUND_PER_CHAR * chars + _BOUND_FIXED <= budget


def fit_record(record: ReplyRecord, max_journal_record_bytes: int) -> ReplyRecord:
    """``record``, its text cut further (with the truncation marker) when its JSON would
    not fit ``max_journal_record_bytes`` with room left for marking it (message id and a
    reason of up to 512 bytes, escaped). JSON escaping can grow a text six-fold, and a
    record that cannot be staged would lose the answer. Returns ``record`` itself when
    it already fits.
    """
    limit = max(1024, max_journal_record_bytes)
    budget = limit - min(4096, limit // 4)
    if fits_unmeasured(record, budget) or _record_size(record, record.text) <= budget:
        return record
    lo, hi = 0, utf8_len(record.text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _record_size(record, truncate_utf8(record.text, mid)[0]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return attrs.evolve(record, text=truncate_utf8(record.text, lo)[0])


# --------------------------------------------------------------------------- the reply path


@attrs.frozen
class Draft:
    """A reply to journal and send. ``text`` is already redacted."""

    identity: AgentIdentity | None
    """Checked active before anything is staged (``None``: a pairing answer, no owner)."""
    operation_id: str
    connection_id: str
    external_conversation_id: str
    thread_id: str | None
    text: str
    kind: str
    in_reply_to: str | None
    buttons: tuple[Button, ...] = ()
    approval: Mapping[str, Any] | None = None
    """The non-secret target of an approval notice, so a resend can issue fresh controls."""
    files: tuple[ReplyFile, ...] = ()
    """Files that go with the reply, by reference (journaled so; fetched at delivery)."""

    @classmethod
    def for_event(
        cls,
        identity: AgentIdentity | None,
        operation_id: str,
        event: InboundEvent | OperationRecord,
        text: str,
        *,
        kind: str = "notice",
        buttons: tuple[Button, ...] = (),
        approval: Mapping[str, Any] | None = None,
        files: tuple[ReplyFile, ...] = (),
    ) -> Draft:
        """The answer to ``event`` (or to the event an operation record was admitted for),
        in its conversation and thread."""
        return cls(
            identity,
            operation_id,
            event.connection_id,
            event.external_conversation_id,
            event.thread_id,
            text,
            kind,
            event.event_id,
            buttons,
            approval,
            files,
        )

    @classmethod
    def for_route(
        cls,
        route: Route,
        identity: AgentIdentity | None,
        operation_id: str,
        text: str,
        in_reply_to: str | None,
        *,
        kind: str = "notice",
        buttons: tuple[Button, ...] = (),
        approval: Mapping[str, Any] | None = None,
    ) -> Draft:
        """An answer in a route's conversation and thread (a decision about its suspended
        run, whichever event carried it)."""
        return cls(
            identity,
            operation_id,
            route.connection_id,
            route.external_conversation_id,
            route.thread_id,
            text,
            kind,
            in_reply_to,
            buttons,
            approval,
        )


def stored_files(files: tuple[ReplyFile, ...]) -> tuple[StoredFile, ...]:
    return tuple(StoredFile(f.source, f.ref, f.name, f.media_type, f.size) for f in files)


def reply_files(files: tuple[StoredFile, ...]) -> tuple[ReplyFile, ...]:
    return tuple(ReplyFile(f.source, f.ref, f.name, f.media_type, f.size) for f in files)


@attrs.frozen
class Settle:
    """The operation write that commits with the reply: ``ref`` moves to ``to`` (``None``:
    state kept), from the record this runtime last wrote (``known``) when it has one."""

    ref: OperationRef
    to: str | None
    known: Loaded[OperationRecord] | None = None
    change: Change | None = None
    only_from: frozenset[str] | None = None
    """Settle only from these states (default: whatever the state machine allows)."""


@attrs.frozen
class Answered:
    operation: Loaded[OperationRecord] | None = None
    """The settled operation as stored (``None``: not written — see :func:`finish`)."""
    binding: Loaded[Any] | None = None
    state: str | None = None
    """The reply's state after the send; ``None`` when nothing was sent."""


NOTHING_ANSWERED = Answered()
"""Nothing written, nothing sent."""


def _only_from(settle: Settle | None) -> Callable[[OperationRecord], bool] | None:
    states = None if settle is None else settle.only_from
    return None if states is None else (lambda record: record.state in states)


def _record(core: Core, draft: Draft) -> tuple[ReplyRecord, str]:
    """The reply record (text bounded to ``max_response_bytes`` and to what fits one journal
    record) and the text to send."""
    bounded, cut = truncate_utf8(scrub_surrogates(draft.text), core.limits.max_response_bytes)
    now = core.now_ms()
    record = ReplyRecord(
        operation_id=draft.operation_id,
        connection_id=draft.connection_id,
        external_conversation_id=draft.external_conversation_id,
        kind=draft.kind,
        text=bounded,
        state="pending",
        created_at_ms=now,
        updated_at_ms=now,
        thread_id=draft.thread_id,
        buttons=tuple(StoredButton(c.label, button_kind(c.value)) for c in draft.buttons),
        approval=None if draft.approval is None else dict(draft.approval),
        created_us=stamp_us(),
        files=stored_files(draft.files),
    )
    fitted = fit_record(record, core.limits.max_journal_record_bytes)
    if cut or fitted is not record:
        core.count("truncated")
    return fitted, fitted.text


async def answer(
    core: Core,
    draft: Draft | None,
    *,
    scope: OwnershipScope | None,
    fence: int | None = None,
    settle: Settle | None = None,
    binding: Write | None = None,
    send_later: bool = False,
    fenced: Callable[[], bool] | None = None,
    send_behind: Route | None = None,
) -> Answered:
    """Commit ``settle``, ``binding`` and the staged reply in one transaction, then deliver
    the reply and mark its outcome.

    ``fenced`` (a turn's writes under its route lease): asked right before the journal
    write and again right before the send; once it says the lease ``fence`` came from is no
    longer held (expired while the process was stopped, or taken over), nothing more is
    written or sent — the operation stays as it was (listed), a staged reply stays
    ``pending`` (listed), counted ``lease_losses``. The store's own fence check refuses a
    write only to rows a newer holder wrote; this refuses the rest.

    A reply whose record already settled is never sent again; a journal failure means
    nothing is sent (counted ``storage_failures``; whatever is unresolved stays listed). A
    draft for an identity no longer active is dropped (``failed``), the rest still commits.
    ``scope=None`` sends without journaling (pairing answers, which have no owner yet).
    With ``send_later`` the journal transaction is awaited and the send runs in the
    background (tracked for ``drain``): admission answers commands without waiting for
    the platform. With ``send_behind`` (a turn's answer) the reply is sent by that route's
    sender (:func:`send_from_route`), after the route's earlier replies, and this returns
    once it is staged: the route's next turn is claimed while it is sent.
    """
    if draft is not None and draft.identity is not None and not core.active(draft.identity):
        core.count("failed")
        draft = None
    record, text = (None, "") if draft is None else _record(core, draft)
    staged: Loaded[ReplyRecord] | None = None
    answered = NOTHING_ANSWERED
    journal = core.journal
    if journal is not None and scope is not None:
        if settle is None and record is None and binding is None:
            return answered
        if fenced is not None and not fenced():
            core.count("lease_losses")
            return answered
        ref = settle.ref if settle is not None else None
        if ref is None:
            assert draft is not None or binding is not None
            ref = OperationRef(
                scope,
                "" if draft is None else draft.connection_id,
                "" if draft is None else draft.operation_id,
            )
        finished = None
        with trio.CancelScope(shield=True, relative_deadline=JOURNAL_BUDGET_S) as bound:
            try:
                finished = await finish(
                    journal,
                    ref,
                    None if settle is None else settle.to,
                    now_ms=core.now_ms(),
                    known=None if settle is None else settle.known,
                    fence=fence,
                    change=None if settle is None else settle.change,
                    binding=binding,
                    reply=record,
                    settle=settle is not None,
                    allowed=_only_from(settle),
                )
            except Exception:
                finished = None
        if finished is None:
            core.count("storage_failures")
            return answered
        if bound.cancelled_caught:
            core.count("storage_failures")
        answered = Answered(finished.operation, finished.binding)
        staged = finished.reply
        if staged is None:
            return answered
    if draft is None:
        return answered
    reply = Reply(
        connection_id=draft.connection_id,
        external_conversation_id=draft.external_conversation_id,
        text=text,
        kind="final" if draft.kind == "final" else "notice",
        buttons=draft.buttons,
        thread_id=draft.thread_id,
        in_reply_to=draft.in_reply_to,
        operation_id=draft.operation_id,
        files=draft.files,
        staged_at_ms=None if record is None else _ms(record.created_us),
    )
    journaled = journal is not None and scope is not None
    staged = staged if journaled else None
    if send_later:
        core.spawn(send_staged, core, reply, staged, scope, fence)
        return answered
    if send_behind is not None:
        send_from_route(core, send_behind, Outgoing(reply, staged, scope, fence, fenced))
        return answered
    if fenced is not None and not fenced():
        await fence_lost(core, reply, staged)
        return answered
    state = await deliver_and_mark(core, reply, staged, scope, fence)
    return Answered(answered.operation, answered.binding, state)


def _ms(us: int | None) -> int | None:
    return None if us is None else us // 1000


def button_kind(value: str) -> str:
    if value.startswith("p:a:"):
        return "allow_once"
    if value.startswith("p:d:"):
        return "reject_once"
    return "other"


# --------------------------------------------------------------------------- what a run means

CANCELLED_TEXT = "Request cancelled."
EMPTY_ANSWER_TEXT = "The request completed without a text answer."
DENIED_TEXT = "Approval denied. The request will not continue."


@attrs.frozen
class Outcome:
    """A run's result as the journal settles it and the user is answered."""

    state: str
    """The operation's new state."""
    error_code: str | None
    counter: str | None
    """The diagnostics counter it moves (``None``: none)."""
    kind: str
    """The reply's kind: ``final`` (the agent's answer) or ``notice``."""
    text: str | None
    """The reply's text, already redacted; ``None`` for ``suspended``, whose notice (with
    its approval controls) is built by the approvals module."""


def outcome_of(core: Core, result: RunResult) -> Outcome:
    """The table from a run's result to terminal state, counter and reply (§9.1, §10.4)."""
    status = result.status
    if status == "succeeded":
        text = core.redact(result.text)
        if text.strip():
            return Outcome("succeeded", None, "completed", "final", text)
        return Outcome("succeeded", None, "completed", "notice", EMPTY_ANSWER_TEXT)
    if status == "aborted":
        return Outcome("cancelled", None, "cancelled", "notice", CANCELLED_TEXT)
    if status == "suspended":
        return Outcome("suspended", None, "suspended", "notice", None)
    if status == "denied":
        return Outcome("failed", "denied", None, "notice", DENIED_TEXT)
    error = result.error
    code = str(error.code) if error is not None and error.code else "run_failed"
    message = error.message if error is not None else None
    return Outcome("failed", code, "failed", "notice", core.failure_text(message))


def preview_sink(core: Core, route: Route, active: ActiveTurn) -> EventSink | None:
    """Previews (§9.3): cumulative redacted text of the current assistant message."""
    on_preview = core.on_preview
    if on_preview is None:
        return None
    acc: list[str] = []
    current: list[str] = [""]

    def sink(event: StreamEvent) -> None:
        if event.kind == "message_started":
            acc.clear()
            current[0] = event.run_id
            return
        if event.kind != "message_delta":
            return
        if current[0] and event.run_id and event.run_id != current[0]:
            return
        acc.append(event.text)
        text = core.redact("".join(acc))
        if not text.strip() or active.cancelled or core.stopped:
            return
        try:
            on_preview(
                Preview(
                    connection_id=route.connection_id,
                    external_conversation_id=route.external_conversation_id,
                    text=text,
                    thread_id=route.thread_id,
                )
            )
        except Exception:
            # The host's preview callback must never break a turn.
            pass

    return sink


# --------------------------------------------------------------------------- typing
# The typing indicator of running turns: started only once a turn's agent run has lasted
# its connection's ``typing_delay_ms`` (an instant answer shows none), then renewed every
# :data:`TYPING_INTERVAL_S` until the run ends — one timer task for every running turn.

TYPING_INTERVAL_S = 4.5


@attrs.define(eq=False)
class _Watch:
    route: Route
    due: float
    ended: bool = False
    scope: trio.CancelScope | None = None
    """The indicator's task, once started (cancelled when the run ends)."""


@attrs.define(eq=False)
class TypingTimer:
    """When each running turn's typing indicator is due, for all turns at once.

    One task of the runtime nursery sleeps until the earliest due time and starts the
    indicator (:func:`typing_loop`, in a child task under its own cancel scope: not a
    nested nursery, which would wrap the run's exceptions in an ExceptionGroup) of the
    turns still running then. A turn answered sooner — most — costs a heap entry, not a
    task of its own; the timer's task ends whenever no turn is waiting.
    """

    core: Core
    _due: list[tuple[float, int, _Watch]] = attrs.field(factory=list)
    _order: itertools.count[int] = attrs.field(factory=itertools.count)
    _changed: trio.Event = attrs.field(factory=trio.Event)
    _serving: bool = False

    def watch(self, route: Route) -> _Watch:
        """A run on ``route`` starts now; :meth:`end` it however it ends."""
        watch = _Watch(route, trio.current_time() + typing_delay_s(self.core, route.connection_id))
        heapq.heappush(self._due, (watch.due, next(self._order), watch))
        if not self._serving:
            self._serving = True
            self.core.nursery.start_soon(self._serve)
        elif self._due[0][2] is watch:
            self._changed.set()  # due before what the task sleeps for
        return watch

    def end(self, watch: _Watch) -> None:
        watch.ended = True
        if watch.scope is not None:
            watch.scope.cancel()
        elif self._due and self._due[0][2] is watch:
            self._changed.set()  # the task need not sleep for it (nor hold up a shutdown)

    async def _serve(self) -> None:
        due = self._due
        try:
            while True:
                while due and due[0][2].ended:
                    heapq.heappop(due)
                if not due:
                    return
                self._changed = trio.Event()
                with trio.move_on_at(due[0][0]):
                    await self._changed.wait()
                now = trio.current_time()
                while due and due[0][0] <= now:
                    watch = heapq.heappop(due)[2]
                    if not watch.ended:
                        watch.scope = trio.CancelScope()
                        self.core.nursery.start_soon(_typing_task, self.core, watch)
        finally:
            self._serving = False


async def _typing_task(core: Core, watch: _Watch) -> None:
    assert watch.scope is not None
    with watch.scope:
        await typing_loop(core, watch.route, delay_s=0.0)


def typing_delay_s(core: Core, connection_id: str) -> float:
    """How long a turn on ``connection_id`` runs before its typing indicator starts: the
    host's ``typing_delay_ms`` for the connection (bounded), else the default."""
    delay_ms = DEFAULT_TYPING_DELAY_MS
    if core.typing_delay_ms is not None:
        try:
            asked = core.typing_delay_ms(connection_id)
        except Exception as exc:
            log.warning("typing delay lookup failed: %s", type(exc).__name__)
        else:
            if isinstance(asked, int) and not isinstance(asked, bool):
                delay_ms = min(max(asked, 0), MAX_TYPING_DELAY_MS)
    return delay_ms / 1000


async def typing_loop(core: Core, route: Route, *, delay_s: float | None = None) -> None:
    """Call ``on_typing`` once ``delay_s`` passed (default: the connection's typing delay,
    see :func:`typing_delay_s`), then every :data:`TYPING_INTERVAL_S` until cancelled.

    Runs in a child task of the turn, cancelled when the run ends: an answer ready
    before the delay sends no indicator at all. A failing callback is logged by exception
    type only (never its text, which may carry ids or tokens) and swallowed; each call is
    bounded by the interval so a hung callback cannot pile up or outlive the run's
    cancellation check.
    """
    on_typing = core.on_typing
    if on_typing is None:
        return
    if delay_s is None:
        delay_s = typing_delay_s(core, route.connection_id)
    next_at = trio.current_time() + delay_s
    if delay_s > 0:
        await trio.sleep_until(next_at)
    while True:
        next_at += TYPING_INTERVAL_S
        with trio.move_on_at(next_at):
            try:
                await on_typing(
                    route.connection_id, route.external_conversation_id, route.thread_id
                )
            except Exception as exc:
                log.warning("typing callback failed: %s", type(exc).__name__)
        await trio.sleep_until(next_at)
