"""Telling a user that a message will not be answered (the web chat; issue 38).

A message whose run was cut short by a crash stays ``executing`` and is listed for the
operator; ``reconcile`` files it ``execution_unknown`` (a message never started, left
``accepted``, is filed ``abandoned``). The model is never re-run, so the user would wait
forever. For connections whose adapter declares ``features.unanswered_notices``:

* **Live.** When ``reconcile`` settles such an operation, :func:`tell` sends the
  conversation a notice (:data:`UNANSWERED_TEXT`, in reply to the message's event id) through
  the reply path, in the background and *not journaled*: the operation is already settled
  (its record is the durable fact), and a notice nobody received must not appear in
  ``list_unresolved`` right after the operator emptied it. A channel with no live
  connection holds it (``SendResult.hold()``) and nothing more happens.
* **Next visit.** :func:`unanswered_notices` (through
  :func:`~._delivery.past_replies`) reads the same notices back from the
  conversation's operation records (settled ``execution_unknown`` / ``abandoned`` within
  ``retention_days``), for the channel to show with its history.

Both carry the reply id :func:`notice_id` (``unanswered-<operation id>``), so a client that
sees one live and again in its history shows it once, and it never collides with a reply
the operation staged itself (an approval request before the crash). No message text is
read or logged: the operation record holds none once it ran.
"""

from __future__ import annotations

from ..channel import PastReply
from ..journal import NS_OPERATION, OperationRecord
from ._core import Core
from ._delivery import OwnedConversation, owner_of
from ._replies import Draft, answer

UNANSWERED_TEXT = (
    "This message could not be answered (the service was interrupted). "
    "Send it again if you still need an answer."
)
UNANSWERED_STATES = frozenset({"execution_unknown", "abandoned"})
"""What ``reconcile`` files an operation as when its message will never be answered."""
MAX_SCAN_PAGES = 5
"""Pages of ``max_journal_page`` operation rows read per call (newest first)."""
MAX_NOTICES = 100
DAY_MS = 24 * 60 * 60 * 1000


def notice_id(operation_id: str) -> str:
    """The reply id of the notice about ``operation_id``."""
    return "unanswered-" + operation_id


def _told(core: Core, record: OperationRecord) -> bool:
    return record.kind != "notify" and tells_unanswered(core, record.connection_id)


async def tell(core: Core, record: OperationRecord) -> None:
    """``record`` was just settled into :data:`UNANSWERED_STATES` by an operator: send its
    conversation the notice, in the background (never raises, never journaled), while its
    actor is still granted."""
    if not _told(core, record):
        return
    owner = await owner_of(
        core,
        record.connection_id,
        record.external_conversation_id,
        record.external_actor_id,
        record.thread_id,
    )
    if owner is None:
        return  # the actor is no longer granted: nothing is sent to them
    draft = Draft.for_event(None, notice_id(record.operation_id), record, UNANSWERED_TEXT)
    await answer(core, draft, scope=None, send_later=True)


def tells_unanswered(core: Core, connection_id: str) -> bool:
    """The connection's adapter declares ``features.unanswered_notices``."""
    tells = core.tells_unanswered
    return tells is not None and tells(connection_id)


async def unanswered_notices(core: Core, where: OwnedConversation, want: int) -> list[PastReply]:
    """The conversation's last ``want`` notices for messages settled unanswered within
    retention, oldest first (a :data:`~._delivery.PastReader`)."""
    found = await _settled_unanswered(core, where)
    found.sort(key=lambda r: (r.updated_at_ms, r.operation_id))
    return [
        PastReply(
            operation_id=notice_id(r.operation_id),
            kind="notice",
            text=UNANSWERED_TEXT,
            created_at_ms=r.updated_at_ms,
            in_reply_to=r.event_id,
        )
        for r in found[-want:]
    ]


async def _settled_unanswered(core: Core, where: OwnedConversation) -> list[OperationRecord]:
    assert core.journal is not None
    cutoff = core.now_ms() - core.limits.retention_days * DAY_MS
    out: list[OperationRecord] = []
    cursor: str | None = None
    for _page in range(MAX_SCAN_PAGES):
        rows, cursor = await core.journal.list(
            where.scope, NS_OPERATION, core.limits.max_journal_page, cursor=cursor
        )
        for row in rows:
            if row.scope != where.scope:
                continue
            try:
                record = OperationRecord.from_json(row.value)
            except ValueError:
                continue
            if (
                record.state in UNANSWERED_STATES
                and record.kind != "notify"
                and where.holds(record)
                and record.updated_at_ms >= cutoff
            ):
                out.append(record)
        if cursor is None or not rows:
            break
    return out
