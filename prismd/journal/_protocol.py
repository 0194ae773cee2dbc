"""The journal's write protocol: every state change of an operation and its reply.

Read it top to bottom. First the two state machines, then the one compare-and-swap helper
every transition uses, then the steps of a message's life, each one store transaction:

1. :func:`admit` — the operation record ``accepted`` (create-only: the dedup key and the
   point where the transport is acknowledged), with the connection's cursor;
2. :func:`transition` ``accepted → executing`` (the claim, ``attempts`` + 1) under the route
   lease fence, *before* the agent is called;
3. :func:`finish` — the terminal state, the binding (when it changed) and the reply staged
   ``pending``, all or nothing: after a crash the record is either still ``executing``
   (listed for the operator) or its answer is staged (listed until delivered);
4. :func:`mark` — the reply's outcome once the channel answered.

Commands, approvals, cancellation, ``stop()``, resumes and ``reconcile`` move operations
through the same :func:`transition`; nothing here knows about agents, routes or channels.

Fencing (SPEC difference 1): a write carries the route lease's fencing token when the
caller holds the lease. ``fence=None`` re-uses the token stored on the record: the writes of
an operator (``reconcile``), of ``stop()`` and of bookkeeping outside a turn, which settle a
record without re-running anything, must not be blocked by the fence of a holder that died.

Every function raises the store's errors (``StoreUnavailableError``) and
:class:`JournalRecordTooLargeError` unchanged; a lost compare-and-swap is never an error.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs

from stores import OwnershipScope

from ._journal import (
    NS_BINDING,
    NS_CURSOR,
    NS_OPERATION,
    NS_REPLY,
    ChannelJournal,
    Loaded,
    Write,
    cursor_key,
)
from ._records import CursorRecord, JournalRecordTooLargeError, OperationRecord, ReplyRecord

# --------------------------------------------------------------------------- the states

OPERATION_FLOW: Mapping[str, frozenset[str]] = {
    # Journaled, never started: claimed, answered at once (commands, approvals), settled
    # without a run (cancelled, revoked, denied at resume), or abandoned by an operator.
    "accepted": frozenset({"executing", "succeeded", "failed", "cancelled", "abandoned"}),
    # The agent may have run: it ends, suspends for a decision, or an operator files it;
    # or its remote task (a2a) is known and journaled: the operation is followed.
    "executing": frozenset(
        {"succeeded", "failed", "cancelled", "suspended", "execution_unknown", "following"}
    ),
    # A remote task is followed (SPEC difference 9): not interrupted work. A restart
    # follows it again (a claim keeps the state, fenced); it ends like a run, or an operator
    # settles it (``reconcile --cancel-remote``).
    "following": frozenset({"succeeded", "failed", "cancelled"}),
    # Waiting for a decision; the resume claims it (executing) while the agent continues
    # (a tool may run: a crash then leaves it listed), or settles it.
    "suspended": frozenset({"executing", "succeeded", "failed", "cancelled"}),
}
"""Which state an operation may move to from each state. Absent states are terminal:
``succeeded``, ``failed``, ``cancelled``, ``abandoned``, ``execution_unknown``."""

UNRESOLVED = frozenset({"accepted", "executing"})
"""Operations an operator must see: the agent has not run, or may have."""

REPLY_FLOW: Mapping[str, frozenset[str]] = {
    # Staged before the send; a held reply (no live connection took it) stays pending.
    "pending": frozenset({"delivered", "delivery_failed", "delivery_unknown", "pending"}),
    # Settled ambiguously or refused: only a resend (reopened: back to pending) moves it.
    "delivery_unknown": frozenset({"pending"}),
    "delivery_failed": frozenset({"pending"}),
}
"""Which state a reply may move to. ``delivered`` is final."""


def may_move(state: str, to: str) -> bool:
    """``to`` is a state the operation may take from ``state``."""
    return to in OPERATION_FLOW.get(state, frozenset())


def _may_write(
    record: OperationRecord, to: str | None, allowed: Callable[[OperationRecord], bool] | None
) -> bool:
    """A step may write ``record`` now: ``to`` (``None``: the state is kept) is a move
    :data:`OPERATION_FLOW` allows from its state, and ``allowed`` (when given) agrees."""
    if to is not None and not may_move(record.state, to):
        return False
    return allowed is None or allowed(record)


# --------------------------------------------------------------------------- references


@attrs.frozen
class OperationRef:
    """Where an operation record lives: its owner's scope, connection and id."""

    scope: OwnershipScope
    connection_id: str
    operation_id: str


Change = Mapping[str, Any] | Callable[[OperationRecord], Mapping[str, Any]]
"""What a step changes in an operation record besides its state and time: the fields to
set, or a function of the record as it stands that answers them (``lambda record:
{"attempts": record.attempts + 1}``)."""


def _write(
    ref: OperationRef,
    current: Loaded[OperationRecord],
    to: str | None,
    change: Change | None,
    fence: int | None,
    now_ms: int,
    **also: Any,
) -> Write:
    record = current.record
    fields = dict(change(record) if callable(change) else change or {})
    fields.update(also)
    fields["state"] = record.state if to is None else to
    fields["updated_at_ms"] = now_ms
    # One copy of the record for the whole step.
    updated = record.replace(**fields)
    return Write(
        NS_OPERATION,
        ref.scope,
        updated,
        current.version,
        current.fencing_token if fence is None else fence,
    )


# --------------------------------------------------------------------------- the one CAS


async def transition(
    journal: ChannelJournal,
    ref: OperationRef,
    to: str | None,
    *,
    now_ms: int,
    known: Loaded[OperationRecord] | None = None,
    fence: int | None = None,
    change: Change | None = None,
    allowed: Callable[[OperationRecord], bool] | None = None,
    retry: bool = True,
) -> Loaded[OperationRecord] | None:
    """Move the operation to ``to`` (``None``: keep the state, apply ``change`` only) by
    compare-and-swap; the stored record, or ``None`` when nothing was written.

    Tries the version this runtime last wrote (``known``) first, then re-reads once: a lost
    CAS means someone else wrote the record, and the move is made only if it is still
    allowed from the state found — by :data:`OPERATION_FLOW`, and by ``allowed`` when
    given. So a late result never undoes an operator's ``execution_unknown``, and two
    runtimes can never both claim one record. With ``retry=False`` a lost CAS is final
    (an operator's decision was made on the version it saw).
    """
    for attempt in range(2 if retry else 1):
        current = known if attempt == 0 and known is not None else None
        if current is None:
            current = await journal.load_operation(ref.scope, ref.connection_id, ref.operation_id)
        if current is None:
            return None
        if not _may_write(current.record, to, allowed):
            return None
        write = _write(ref, current, to, change, fence, now_ms)
        stored = (await journal.commit((write,))).items[0]
        if stored is not None:
            return stored
    return None


# --------------------------------------------------------------------------- the steps


@attrs.frozen
class Admitted:
    """:func:`admit`'s answer: the new record (``None``: the event was admitted before)
    and the cursor as stored (``None`` when it could not be advanced: ordering evidence
    only, never needed for correctness)."""

    operation: Loaded[OperationRecord] | None
    cursor: Loaded[CursorRecord] | None


async def admit(
    journal: ChannelJournal,
    scope: OwnershipScope,
    record: OperationRecord,
    *,
    cursor: Loaded[CursorRecord] | None,
    now_ms: int,
    with_cursor: bool = True,
) -> Admitted:
    """Create the ``accepted`` record and advance the connection's cursor in one transaction.

    Create-only: an existing record (a redelivery) writes nothing and answers
    ``operation=None``. ``cursor`` is the cursor as this runtime last stored it (saves a
    read); a stale one is re-read and the pair retried once, then the record is written
    alone. A record whose ``input`` does not fit ``max_journal_record_bytes`` is written
    without it (it can then only be listed after a crash, not resumed). With
    ``with_cursor=False`` (host notices, which are not inbound events) only the record is
    written.
    """
    key = cursor_key(record.connection_id, scope)
    op_write = Write(NS_OPERATION, scope, record, 0)
    known = cursor
    for attempt in range(3 if with_cursor else 1):
        if not with_cursor:
            try:
                committed = await journal.commit((op_write,))
            except JournalRecordTooLargeError:
                if op_write.record.input is None:
                    raise
                op_write = op_write._replace(record=record.replace(input=None))
                committed = await journal.commit((op_write,))
            return Admitted(committed.items[0], None)
        if attempt == 1 or known is None:
            known = await journal.load_cursor(scope, record.connection_id)
        advanced = CursorRecord(
            (0 if known is None else known.record.admitted) + 1, record.event_id, now_ms
        )
        cursor_write = Write(
            NS_CURSOR,
            scope,
            advanced,
            0 if known is None else known.version,
            None if known is None else known.fencing_token,
            key=key,
        )
        writes = (op_write, cursor_write) if attempt < 2 else (op_write,)
        try:
            committed = await journal.commit(writes, atomic=True)
        except JournalRecordTooLargeError:
            if op_write.record.input is None:
                raise
            op_write = op_write._replace(record=record.replace(input=None))
            continue
        if committed.ok:
            return Admitted(committed.items[0], committed.items[1] if attempt < 2 else None)
        if committed.lost(0):
            return Admitted(None, None)
    return Admitted(None, None)


@attrs.frozen
class Finished:
    """:func:`finish`'s answer. ``operation`` is ``None`` when the record had already left
    the states this step may move it from (an operator filed it, ``stop()`` settled it).
    ``reply`` is the reply to send now: the one just staged, or one staged earlier for the
    same operation and still ``pending``; ``None`` means send nothing (it was settled)."""

    operation: Loaded[OperationRecord] | None
    binding: Loaded[object] | None
    reply: Loaded[ReplyRecord] | None


FINISH_ATTEMPTS = 3


async def finish(
    journal: ChannelJournal,
    ref: OperationRef,
    to: str | None,
    *,
    now_ms: int,
    known: Loaded[OperationRecord] | None = None,
    fence: int | None = None,
    change: Change | None = None,
    binding: Write | None = None,
    reply: ReplyRecord | None = None,
    settle: bool = True,
    allowed: Callable[[OperationRecord], bool] | None = None,
) -> Finished:
    """Settle the operation in ``to``, write ``binding`` and stage ``reply`` — atomically.

    With ``settle=False`` the operation is not written (a notice about a record that is
    settled elsewhere, or removed): only the binding and the reply are. ``allowed``
    narrows the states the operation may be settled from, as for :func:`transition`.

    The reply is staged create-only and unfenced (persist before send: whoever holds the
    route, the answer must not be lost), and the operation's ``reply_staged`` flag is set in
    the same write. Each lost compare-and-swap is resolved and the step retried (bounded):
    a stale binding version is re-read (this runtime's binding is the newer truth), an
    operation that left the allowed states is no longer written (the binding and the reply
    still are), and an existing reply is sent only while it is still ``pending``.
    """
    op_known = known
    write_op = settle
    staged_before: Loaded[ReplyRecord] | None = None
    for _attempt in range(FINISH_ATTEMPTS):
        writes: list[Write] = []
        if write_op:
            current = op_known or await journal.load_operation(
                ref.scope, ref.connection_id, ref.operation_id
            )
            if current is None or not _may_write(current.record, to, allowed):
                write_op = False
            else:
                flag = reply is not None or current.record.reply_staged
                writes.append(_write(ref, current, to, change, fence, now_ms, reply_staged=flag))
        if binding is not None:
            writes.append(binding)
        if reply is not None:
            writes.append(Write(NS_REPLY, ref.scope, reply, 0))
        if not writes:
            return Finished(None, None, staged_before)
        committed = await journal.commit(writes, atomic=True)
        items = list(committed.items)
        statuses = list(committed.statuses)
        if committed.ok:
            op = items.pop(0) if write_op else None
            stored_binding = items.pop(0) if binding is not None else None
            staged = items.pop(0) if reply is not None else staged_before
            return Finished(op, stored_binding, staged)
        index = 0
        if write_op:
            if statuses[index] == "conflict":
                op_known = None  # re-read: someone else wrote it
            index += 1
        if binding is not None:
            if statuses[index] == "conflict":
                assert binding.key is not None
                now = await journal.load(NS_BINDING, binding.scope, binding.key)
                binding = binding._replace(expected_version=0 if now is None else now.version)
            index += 1
        if reply is not None and statuses[index] == "conflict":
            existing = await journal.load_reply(ref.scope, reply.connection_id, reply.operation_id)
            staged_before = (
                existing if existing is not None and existing.record.state == "pending" else None
            )
            reply = None
    return Finished(None, None, None)


async def mark(
    journal: ChannelJournal,
    scope: OwnershipScope,
    staged: Loaded[ReplyRecord],
    state: str,
    *,
    now_ms: int,
    message_id: str | None = None,
    reason: str | None = None,
    fence: int | None = None,
    linger_s: float = 0.0,
) -> Loaded[ReplyRecord] | None:
    """Record a send's outcome on the staged reply (``attempts`` + 1); ``None`` when the
    record moved meanwhile (someone else resent or settled it) or the move is not allowed.
    ``linger_s``: see :meth:`ChannelJournal.commit`."""
    if state not in REPLY_FLOW.get(staged.record.state, frozenset()):
        return None
    updated = staged.record.replace(
        state=state,
        attempts=staged.record.attempts + 1,
        message_id=message_id,
        reason=reason,
        updated_at_ms=now_ms,
    )
    write = Write(
        NS_REPLY, scope, updated, staged.version, staged.fencing_token if fence is None else fence
    )
    return (await journal.commit((write,), linger_s=linger_s)).items[0]


async def reopen_reply(
    journal: ChannelJournal, scope: OwnershipScope, stored: Loaded[ReplyRecord], *, now_ms: int
) -> Loaded[ReplyRecord] | None:
    """Reopen a stored reply for a resend: back to ``pending`` (its held mark or last failure
    cleared) by compare-and-swap at the version read, under the record's own fence. Of two
    concurrent resends exactly one wins; ``None`` for the loser (or a ``delivered`` reply)."""
    if "pending" not in REPLY_FLOW.get(stored.record.state, frozenset()):
        return None
    reopened = stored.record.replace(state="pending", reason=None, updated_at_ms=now_ms)
    write = Write(NS_REPLY, scope, reopened, stored.version, stored.fencing_token)
    return (await journal.commit((write,))).items[0]
