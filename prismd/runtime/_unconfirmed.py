"""Replies whose first send's outcome is unknown, re-driven after a start (issue 39).

A daemon killed between a reply's send and its mark leaves the reply ``pending`` without
the held mark: it may have been posted. For most channels only an operator can settle it
(``reconcile``). A channel whose adapter declares ``features.idempotent_send`` (Discord:
the same nonce per chunk inside the platform's window, the bot's reply looked for outside
it, else ``delivery_unknown``) can be asked again without a blind second post, so when its
adapter is up after a start (the daemon calls :func:`resend_unconfirmed` each time the
adapter reports started, and when it takes its receiver lease over from a dead instance:
:mod:`prismd.daemon._resending`) the runtime re-drives that connection's such replies:

* **Never twice.** Each goes through :func:`~._delivery.resend`: the reopen
  compare-and-swap first, so of two processes (or a re-drive and an operator's
  ``reconcile``) exactly one sends, and the adapter's own window/lookup decides between a
  repeat (deduplicated by the platform), a proof (the reply found) and
  ``delivery_unknown`` (with its reason, listed for the operator). A crash after the
  reopen leaves the reply ``pending`` again; the next start re-drives it again, safe by the
  same argument.
* **Not this process's own.** Only replies staged before the runtime was opened (after a
  takeover: before the takeover): a reply staged since is a turn's of this process, sent
  and marked by that turn. (Should one still be on its way, the repeat is the channel's
  to deduplicate, and the turn's mark loses the compare-and-swap: never a second post.)
* **Bounded, in order, within retention.** At most :data:`MAX_SCAN_PAGES` pages of open
  reply rows are read; replies created within ``retention_days`` are re-driven oldest
  first, at most :data:`MAX_RESEND` per call, each under its conversation's delivery lock
  (a conversation's replies go out in the order they were staged).
* **Only the owner's.** A reply is re-driven only when ``authorize`` says its operation's
  actor is granted now and that grant's ownership scope is exactly the row's (a revoked
  actor's reply stays listed); its operation must be settled (an unresolved operation is
  the operator's, listed with it). Relays (no operation of their own) stay listed.
"""

from __future__ import annotations

from ..journal import NS_REPLY, UNRESOLVED_OPERATION_STATES, Loaded, OwnershipScope, ReplyRecord
from ._core import Core, is_held
from ._delivery import owner_of, resend

MAX_SCAN_PAGES = 5
"""Pages of ``max_journal_page`` open reply rows read per call (newest first)."""
MAX_RESEND = 100
"""Replies re-driven per call; more wait for the next start."""
DAY_MS = 24 * 60 * 60 * 1000


async def _candidates(
    core: Core, connection_id: str, staged_before_ms: int
) -> list[tuple[ReplyRecord, OwnershipScope]]:
    """The connection's ``pending``, non-held reply rows created within retention and
    before ``staged_before_ms``, oldest first."""
    assert core.journal is not None
    cutoff = core.now_ms() - core.limits.retention_days * DAY_MS
    replies: list[Loaded[ReplyRecord]] = await core.journal.open_records(
        NS_REPLY, page_size=core.limits.max_journal_page, max_pages=MAX_SCAN_PAGES
    )
    found = [
        (loaded.record, loaded.scope)
        for loaded in replies
        if loaded.record.state == "pending"
        and loaded.record.connection_id == connection_id
        and not is_held(loaded.record)
        and cutoff <= loaded.record.created_at_ms < staged_before_ms
    ]
    return sorted(
        found,
        key=lambda f: (f[0].created_at_ms, f[0].created_us or 0, f[0].operation_id),
    )


async def resend_unconfirmed(
    core: Core, connection_id: str, *, staged_before_ms: int
) -> dict[str, int]:
    """Re-drive ``connection_id``'s pending, non-held replies staged before
    ``staged_before_ms`` (when this process opened: later ones are its own turns' sends, in
    progress or marked; see the module docstring); returns how many ended in each state
    (``delivered``, ``delivery_unknown``…). Only for a connection whose adapter declares
    ``features.idempotent_send`` — the caller checks.
    Never raises: a store failure counts ``storage_failures`` and ends the call."""
    outcomes: dict[str, int] = {}
    if core.journal is None or core.stopped:
        return outcomes
    try:
        found = await _candidates(core, connection_id, staged_before_ms)
        for record, stored in found[:MAX_RESEND]:
            if core.stopped:
                break
            state = await resend_one(core, record, stored)
            if state is not None:
                outcomes[state] = outcomes.get(state, 0) + 1
    except Exception:
        core.count("storage_failures")
    return outcomes


async def resend_one(core: Core, record: ReplyRecord, stored: OwnershipScope) -> str | None:
    """Re-drive one reply when its owner is still granted; its end state, or ``None``."""
    assert core.journal is not None
    op = await core.journal.load_operation(stored, record.connection_id, record.operation_id)
    if op is None or op.record.state in UNRESOLVED_OPERATION_STATES:
        return None
    owner = await owner_of(
        core,
        record.connection_id,
        record.external_conversation_id,
        op.record.external_actor_id,
        record.thread_id,
    )
    if owner is None:
        return None
    identity, scope = owner
    if scope != stored or not core.active(identity):
        return None
    async with core.delivery_locks.lock(record.connection_id, record.external_conversation_id):
        # Read again under the lock: this process may have marked it meanwhile.
        current = await core.journal.load_reply(scope, record.connection_id, record.operation_id)
        if current is None or current.record.state != "pending" or is_held(current.record):
            return None
        return await resend(core, scope, current, in_reply_to=op.record.event_id)
