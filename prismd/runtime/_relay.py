"""Relays: a message a followed run sends to the chat *before* its answer (the runtime's
side of :meth:`~prismd.agents.RunHooks.relay`), such as the status message of a remote
A2A task that waits for authorization (``auth-required``) and goes on afterwards.

A relay is a reply record of its own, keyed ``<operation id>~<key>`` beside the
operation's answer: the agent derives ``key`` from what it observed (the remote status),
so the same observation gives the same key in any process. Guarantees:

* **Once, never twice.** The record is staged create-only, in one store transaction with
  a compare-and-swap of the operation record that requires it to be still ``following``
  (under the turn's lease fence): nothing is staged for a settled turn, and a key staged
  before — by this process, an earlier one (a restart) or another instance — is never
  sent again, whatever became of that send. Only a record staged here is delivered.
* **Persist before send**, as every reply: staged ``pending``, delivered, its outcome
  marked; a channel that holds it (the web chat with no tab open) gets it again on
  reconnect, as any held reply.
* The text is redacted and bounded like an answer; nothing of it is logged.
"""

from __future__ import annotations

import weakref

import trio

from ..channel import Reply
from ..journal import (
    FOLLOWING_STATE,
    NS_OPERATION,
    NS_REPLY,
    Committed,
    Loaded,
    OperationRecord,
    ReplyRecord,
    Write,
)
from ._core import JOURNAL_BUDGET_S, Core, deliver_and_mark
from ._replies import Draft, _record
from ._routes import Turn

_SENT_WITHOUT_JOURNAL: weakref.WeakKeyDictionary[Turn, set[str]] = weakref.WeakKeyDictionary()
"""Without a journal (nothing durable): the keys relayed per turn, so each is sent once
while the turn lives."""
RELAY_SEPARATOR = "~"
"""Between the operation id and the relay's key in the relay's reply record id."""


def relay_id(operation_id: str, key: str) -> str:
    return f"{operation_id}{RELAY_SEPARATOR}{key}"


async def relay(core: Core, turn: Turn, fence: int | None, key: str, text: str) -> bool:
    """Stage and send one relay of ``turn`` (see the module's guarantees); whether it was
    staged here and handed to the channel."""
    journal = core.journal
    if turn.settled or core.stopped or not turn.following:
        return False
    draft = Draft.for_event(
        turn.grant.identity, relay_id(turn.operation_id, key), turn.event, core.redact(text)
    )
    if not core.active(turn.grant.identity):
        return False
    record, bounded = _record(core, draft)
    staged: Loaded[ReplyRecord] | None = None
    if journal is not None:
        committed: Committed | None = None
        with trio.CancelScope(shield=True, relative_deadline=JOURNAL_BUDGET_S):
            try:
                current: Loaded[OperationRecord] | None = turn.op
                if current is None:
                    current = await journal.load_operation(
                        turn.scope, turn.event.connection_id, turn.operation_id
                    )
                if current is None or current.record.state != FOLLOWING_STATE:
                    return False
                touched = current.record.replace(updated_at_ms=core.now_ms())
                committed = await journal.commit(
                    (
                        Write(
                            NS_OPERATION,
                            turn.scope,
                            touched,
                            current.version,
                            current.fencing_token if fence is None else fence,
                        ),
                        Write(NS_REPLY, turn.scope, record, 0),
                    ),
                    atomic=True,
                )
            except Exception:
                core.count("storage_failures")
                return False
        if committed is None:  # the store did not answer in time: maybe staged, not sent
            core.count("storage_failures")
            return False
        if not committed.ok:
            if committed.lost(0):
                turn.op = None  # someone wrote the operation: re-read next time
            return False
        turn.op = committed.items[0]
        staged = committed.items[1]
    else:
        sent = _SENT_WITHOUT_JOURNAL.setdefault(turn, set())
        if key in sent:
            return False
        sent.add(key)
    reply = Reply(
        connection_id=draft.connection_id,
        external_conversation_id=draft.external_conversation_id,
        text=bounded,
        kind="notice",
        thread_id=draft.thread_id,
        in_reply_to=draft.in_reply_to,
        operation_id=draft.operation_id,
    )
    await deliver_and_mark(core, reply, staged, turn.scope, fence)
    return True
