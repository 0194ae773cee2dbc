"""Journaled replies after their first send: resends, held replies, recent history.

:func:`resend` sends a stored reply again (``reconcile`` and the re-drive below);
:func:`past_replies` reads a conversation's delivered replies back (with
:func:`delivered_replies`). A reply's first
send is :func:`prismd.runtime._replies.answer`.

A channel without a live connection to a conversation (a web chat tab that was closed)
answers ``SendResult.hold()``; the reply record then stays ``pending`` with reason
:data:`~._core.HELD_REASON` — proven unsent — instead of ending ``delivery_failed``.
When the conversation connects again the channel calls :func:`redeliver_pending`, and the
runtime loads that conversation's held replies from the journal and delivers them.

Guarantees:

* **Never twice.** Every resend (this re-drive and an operator's ``reconcile``) goes through
  :func:`resend`: a compare-and-swap on the reply record *reopens* it (reason cleared, still
  ``pending``) before ``deliver`` is called, then the outcome is marked on the reopened
  version. Of two concurrent re-drives (two tabs reconnecting, two processes, a re-drive
  racing an operator) exactly one wins the reopen and sends. A crash after the reopen leaves
  a plain ``pending`` reply — it may have been sent — for the operator, never for a second
  automatic send (on a channel that repeats safely, see below: the next start's). Within
  one process re-drives also queue behind :class:`~._core.DeliveryLocks`, so a held reply
  being marked is always seen.
* **Only what was held — unless the channel repeats safely.** Here only held replies are
  re-driven. A ``pending`` reply without the held mark (staged, then the daemon died
  mid-send) stays listed for ``reconcile`` — except on a connection whose adapter declares
  ``features.idempotent_send`` (Discord): there the runtime re-drives it through the same
  :func:`resend` each time the adapter is up after a start (:mod:`._unconfirmed`), and the
  adapter's nonce window or lookup decides resend, proof or ``delivery_unknown``. For such
  a channel a crash after the reopen is no longer only the operator's: the next start
  re-drives it again, safe by the same argument (a repeat is deduplicated or proven by the
  channel, never a blind second post).
* **Bounded, in order, within retention.** At most :data:`MAX_SCAN_PAGES` pages of the
  conversation owner's reply rows are read per call; held replies created within
  ``retention_days`` are delivered oldest first, at most :data:`MAX_REDELIVER` per call.
  Older held replies stay listed for the operator. When the connection goes away again
  mid-way, the rest stay held for the next reconnect.
* **Only the owner's.** The conversation's owner is whoever ``authorize`` says the actor is
  now (a revoked actor gets nothing); rows are read under exactly that ownership scope.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import trio

from ..channel import PastReply, Reply
from ..grants import AgentIdentity, Grant, ownership_from_identity
from ..journal import (
    NS_REPLY,
    Loaded,
    OperationRecord,
    OwnershipScope,
    ReplyRecord,
    reopen_reply,
    reply_key,
)
from ._approvals import reissue_buttons
from ._core import JOURNAL_BUDGET_S, Core, check_grant, deliver_once, is_held, mark_outcome
from ._notify import authorize_actor
from ._replies import reply_files

MAX_SCAN_PAGES = 5
"""Pages of ``max_journal_page`` reply rows read per call (newest first)."""
MAX_REDELIVER = 100
"""Held replies re-driven per reconnect; more wait for the next one."""
MAX_HISTORY = 100
DAY_MS = 24 * 60 * 60 * 1000


async def resend(
    core: Core,
    scope: OwnershipScope,
    loaded: Loaded[ReplyRecord],
    *,
    in_reply_to: str | None = None,
) -> str | None:
    """Reopen the stored reply by CAS, deliver its stored text, mark the outcome.

    Returns the state marked (``delivered``, ``delivery_failed``, ``delivery_unknown``, or
    ``pending`` when the channel held it again), or ``None`` when nothing was sent because
    the reopen was lost (someone else resent or settled it) or the store failed. Approval
    notices get fresh controls (SPEC difference 4: the record keeps no tokens).
    """
    assert core.journal is not None
    stored = loaded.record
    reopened = None
    # Shielded and bounded like the mark: a reopen written but never followed by the send
    # would needlessly leave the reply to the operator.
    with trio.CancelScope(shield=True, relative_deadline=JOURNAL_BUDGET_S):
        try:
            # The stored fencing token, as reconcile does: the turn that wrote the reply
            # may be long gone, and no current lease holder writes this record.
            reopened = await reopen_reply(core.journal, scope, loaded, now_ms=core.now_ms())
        except Exception:
            core.count("storage_failures")
            return None
    if reopened is None:
        return None
    buttons: tuple[Any, ...] = ()
    if stored.approval is not None:
        buttons = await reissue_buttons(core, scope, dict(stored.approval))
    state, message_id, reason = await deliver_once(
        core,
        Reply(
            connection_id=stored.connection_id,
            external_conversation_id=stored.external_conversation_id,
            text=stored.text,
            kind="final" if stored.kind == "final" else "notice",
            buttons=buttons,
            thread_id=stored.thread_id,
            in_reply_to=in_reply_to,
            operation_id=stored.operation_id,
            files=reply_files(stored.files),
            staged_at_ms=None if stored.created_us is None else stored.created_us // 1000,
        ),
    )
    marked = await mark_outcome(core, scope, reopened, state, message_id, reason, None)
    return state if marked is not None else None


async def owner_of(
    core: Core,
    connection_id: str,
    external_conversation_id: str,
    actor_id: str,
    thread_id: str | None,
) -> tuple[AgentIdentity, OwnershipScope] | None:
    """The actor's current identity and ownership scope, or ``None`` (no usable grant)."""
    try:
        grant = await authorize_actor(
            core, connection_id, external_conversation_id, actor_id, thread_id, action="message"
        )
    except Exception:
        return None
    if check_grant(core, grant) is not None or not isinstance(grant, Grant):
        return None
    try:
        return grant.identity, ownership_from_identity(grant.identity)
    except Exception:
        return None


@attrs.frozen
class OwnedConversation:
    """A conversation (its thread, if any) whose records are read under its owner's current
    ownership scope."""

    scope: OwnershipScope
    connection_id: str
    external_conversation_id: str
    thread_id: str | None

    def holds(self, record: ReplyRecord | OperationRecord) -> bool:
        """``record`` belongs to this conversation (keys are not escaped: its fields decide)."""
        return (
            record.connection_id == self.connection_id
            and record.external_conversation_id == self.external_conversation_id
            and record.thread_id == self.thread_id
        )


async def _conversation_replies(core: Core, where: OwnedConversation) -> list[Loaded[ReplyRecord]]:
    """The conversation's reply records under exactly its scope created within retention
    (bounded scan, newest ``updated_at`` first)."""
    assert core.journal is not None
    cutoff = core.now_ms() - core.limits.retention_days * DAY_MS
    # reply_key with an empty operation id is the key prefix of every reply of this
    # connection and scope; keys are not escaped, so the record's own fields decide.
    prefix = reply_key(where.connection_id, where.scope, "")
    replies: list[Loaded[ReplyRecord]] = await core.journal.records(
        where.scope,
        NS_REPLY,
        key_prefix=prefix,
        page_size=core.limits.max_journal_page,
        max_pages=MAX_SCAN_PAGES,
    )
    return [
        loaded
        for loaded in replies
        if where.holds(loaded.record) and loaded.record.created_at_ms >= cutoff
    ]


async def _event_id(core: Core, scope: OwnershipScope, record: ReplyRecord) -> str | None:
    """The event id the reply answers (its operation's), when that record is still kept."""
    assert core.journal is not None
    op = await core.journal.load_operation(scope, record.connection_id, record.operation_id)
    return None if op is None else op.record.event_id


def _oldest_first(replies: list[Loaded[ReplyRecord]]) -> list[Loaded[ReplyRecord]]:
    # Replies staged before they carried a microsecond stamp count as their millisecond's
    # first.
    return sorted(
        replies,
        key=lambda r: (r.record.created_at_ms, r.record.created_us or 0, r.record.operation_id),
    )


async def redeliver_pending(
    core: Core,
    *,
    connection_id: str,
    external_conversation_id: str,
    actor_id: str,
    thread_id: str | None = None,
) -> int:
    """Deliver the conversation's held replies, oldest first; returns how many were delivered.

    Called by a channel when the conversation has a live connection again. Never raises:
    store failures count ``storage_failures`` and end the call (the replies stay held).
    """
    if core.journal is None or core.stopped:
        return 0
    owner = await owner_of(core, connection_id, external_conversation_id, actor_id, thread_id)
    if owner is None:
        return 0
    identity, scope = owner
    delivered = 0
    try:
        async with core.delivery_locks.lock(connection_id, external_conversation_id):
            where = OwnedConversation(scope, connection_id, external_conversation_id, thread_id)
            replies = await _conversation_replies(core, where)
            held = _oldest_first([r for r in replies if is_held(r.record)])
            for loaded in held[:MAX_REDELIVER]:
                if core.stopped or not core.active(identity):
                    break
                in_reply_to = await _event_id(core, scope, loaded.record)
                state = await resend(core, scope, loaded, in_reply_to=in_reply_to)
                if state == "delivered":
                    delivered += 1
                elif state == "pending":
                    break  # held again: the connection went away; the rest wait too
    except Exception:
        core.count("storage_failures")
    return delivered


PastReader = Callable[[Core, OwnedConversation, int], Awaitable[list[PastReply]]]
"""Reads a conversation's last ``want`` past replies of one sort, oldest first:
``(core, conversation, want)``."""


async def past_replies(
    core: Core,
    read: PastReader,
    cap: int,
    connection_id: str,
    external_conversation_id: str,
    actor_id: str,
    thread_id: str | None,
    limit: int,
) -> list[PastReply]:
    """The conversation's last ``limit`` (1..``cap``) past replies that ``read`` finds,
    oldest first, only those stored under the actor's current ownership scope. Never raises:
    a store failure counts ``storage_failures`` and returns ``[]``."""
    if core.journal is None:
        return []
    want = max(1, min(int(limit), cap))
    owner = await owner_of(core, connection_id, external_conversation_id, actor_id, thread_id)
    if owner is None:
        return []
    _identity, scope = owner
    where = OwnedConversation(scope, connection_id, external_conversation_id, thread_id)
    try:
        return await read(core, where, want)
    except Exception:
        core.count("storage_failures")
        return []


async def delivered_replies(core: Core, where: OwnedConversation, want: int) -> list[PastReply]:
    """The conversation's last ``want`` delivered replies created within ``retention_days``
    (a :data:`PastReader`). Inbound text is not in the journal after its run
    (docs/architecture.md, "Guarantees"), so this is the agent's side of the exchange only."""
    replies = await _conversation_replies(core, where)
    delivered = [r for r in replies if r.record.state == "delivered"]
    out = []
    for loaded in _oldest_first(delivered)[-want:]:
        record = loaded.record
        out.append(
            PastReply(
                operation_id=record.operation_id,
                kind="final" if record.kind == "final" else "notice",
                text=record.text,
                created_at_ms=record.created_at_ms,
                in_reply_to=await _event_id(core, where.scope, record),
            )
        )
    return out
