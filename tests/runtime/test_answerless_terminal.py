"""A kill between the terminal operation write and the reply staging (found by the Telegram
kill loop, seed 1220673826): the agent ran, the operation says ``succeeded`` with
``replyStaged`` false and no reply record exists. The answer never went out, and before the
fix nothing listed it — the message was lost silently. Now it is listed (state
``succeeded``, no reply state) until an operator reconciles it; reconcile reports ``none``
(the model is never re-run), marks it handled and it leaves the list.
"""

from __future__ import annotations

from prismd.grants import ownership_from_identity
from prismd.journal import NS_OPERATION
from prismd.journal._journal import ChannelJournal
from prismd.journal._records import OperationRecord
from tests.support.builders import identity, write
from tests.support.harness import Host, StoreFactory, runtime

IDENT = identity()
SCOPE = ownership_from_identity(IDENT)


def _op(op_id: str, state: str, *, run_id: str | None, staged: bool) -> OperationRecord:
    return OperationRecord(
        operation_id=op_id,
        event_id=op_id,
        kind="message",
        connection_id="tg-1",
        external_conversation_id="chat-1",
        external_actor_id="user-1",
        agent_alias="primary",
        state=state,
        created_at_ms=1,
        updated_at_ms=1,
        run_id=run_id,
        reply_staged=staged,
    )


async def test_answerless_terminal_op_is_listed_then_reconciled(stores: StoreFactory) -> None:
    store = await stores()
    journal = ChannelJournal(store.checkpoints)
    await write(
        journal, NS_OPERATION, SCOPE, _op("lost", "succeeded", run_id="run-1", staged=False)
    )
    await write(journal, NS_OPERATION, SCOPE, _op("fail", "failed", run_id="run-2", staged=False))
    # Not listed: answered (flag set), cancelled by stop (no answer by design), no run.
    await write(journal, NS_OPERATION, SCOPE, _op("done", "succeeded", run_id="run-3", staged=True))
    await write(
        journal, NS_OPERATION, SCOPE, _op("stop", "cancelled", run_id="run-4", staged=False)
    )
    await write(journal, NS_OPERATION, SCOPE, _op("norun", "failed", run_id=None, staged=False))
    host = Host()
    async with runtime(host, store) as rt:
        listed = await rt.list_unresolved(identity=IDENT)
        assert sorted((e.operation_id, e.state, e.reply_state) for e in listed) == [
            ("fail", "failed", None),
            ("lost", "succeeded", None),
        ]
        entry = next(e for e in listed if e.operation_id == "lost")
        result = await rt.reconcile(
            identity=IDENT,
            connection_id="tg-1",
            operation_id="lost",
            expected_version=entry.version,
        )
        assert (result.status, result.outcome) == ("resolved", "none")
        assert [e.operation_id for e in await rt.list_unresolved(identity=IDENT)] == ["fail"]
        stale = await rt.reconcile(
            identity=IDENT, connection_id="tg-1", operation_id="fail", expected_version=99
        )
        assert stale.status == "conflict"
    assert host.scripted.provider_calls == 0 and host.replies == []
    loaded = await journal.load_operation(SCOPE, "tg-1", "lost")
    assert loaded is not None and loaded.record.reply_staged and loaded.record.state == "succeeded"
