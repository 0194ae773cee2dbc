"""A message an operator settled unanswered is shown to its user (issue 38): live as a
notice when the tab is open at the ``reconcile``, and in the history of the next visit —
never listed for the operator again, never for a connection that does not declare it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from prismd.channel import InboundEvent, Reply, SendResult
from prismd.grants import AuthorizeInput, Grant
from prismd.journal import operation_id_for
from prismd.runtime import open_messaging_runtime
from prismd.runtime._unanswered import UNANSWERED_TEXT, notice_id
from stores import open_store
from tests.daemon.helpers import chat

from ._stack import OPERATOR, authorize_everyone, chat_stack, sqlite_url

ACTOR = "unanswered-actor-01"


async def wait_states(runtime: Any, states: list[str]) -> list[Any]:
    with trio.fail_after(10):
        while True:
            entries = await runtime.list_unresolved(identity=OPERATOR)
            if sorted(e.state for e in entries) == sorted(states):
                return list(entries)
            await trio.sleep(0.02)


async def test_settled_messages_are_told_live_and_on_the_next_visit(tmp_path: Path) -> None:
    first, second = (operation_id_for("web", f"{ACTOR}:{m}") for m in ("m1", "m2"))
    with trio.fail_after(30):
        async with chat_stack("mock", {"delay_ms": 60_000}, store_url=sqlite_url(tmp_path)) as (
            adapter,
            runtime,
        ):
            assert adapter.features.unanswered_notices
            assert adapter.bound is not None
            async with chat(adapter.bound[1], ACTOR) as client:
                assert (await client.send_message("m1", "a long one"))["status"] == "accepted"
                assert (await client.send_message("m2", "queued"))["status"] == "accepted"
                entries = {
                    e.operation_id: e for e in await wait_states(runtime, ["accepted", "executing"])
                }
                # the queued message, never started: abandoned
                queued = entries[second]
                result = await runtime.reconcile(
                    identity=OPERATOR,
                    connection_id="web",
                    operation_id=second,
                    expected_version=queued.version,
                )
                assert (result.status, result.outcome) == ("resolved", "abandoned")
                told = await client.next_frame("reply", limit_s=5)
                # Settled a millisecond later at least: notices are ordered by the time
                # they were settled, and one millisecond's ties by operation id.
                await trio.sleep(0.002)
                # the running one: filed execution_unknown (the model is never re-run)
                running = entries[first]
                result = await runtime.reconcile(
                    identity=OPERATOR,
                    connection_id="web",
                    operation_id=first,
                    expected_version=running.version,
                    acknowledge_duplicate_risk=True,
                )
                assert (result.status, result.outcome) == ("resolved", "execution_unknown")
                told_first = await client.next_frame("reply", limit_s=5)
            assert told == {
                "type": "reply",
                "replyId": notice_id(second),
                "kind": "notice",
                "text": UNANSWERED_TEXT,
                "controls": [],
                "inReplyTo": "m2",
            }
            assert (told_first["replyId"], told_first["inReplyTo"]) == (notice_id(first), "m1")
            # nothing is left for the operator: the notices are not journaled replies
            assert await runtime.list_unresolved(identity=OPERATOR) == []
            # the next visit shows both in its history, oldest first
            async with chat(adapter.bound[1], ACTOR) as again:
                history = await again.next_frame("history")
            assert [
                (r["replyId"], r["kind"], r["text"], r["inReplyTo"]) for r in history["replies"]
            ] == [
                (notice_id(second), "notice", UNANSWERED_TEXT, "m2"),
                (notice_id(first), "notice", UNANSWERED_TEXT, "m1"),
            ]
            # another actor's conversation shows none of them
            async with chat(adapter.bound[1], "someone-else-0001") as other:
                assert (await other.next_frame("history"))["replies"] == []
            assert runtime.diagnostics().deliveries == 2


@pytest.mark.parametrize(
    ("declared", "granted", "told"),
    [(False, True, False), (True, False, False), (True, True, True)],
    ids=["not-declared", "revoked", "told"],
)
async def test_only_a_declaring_connection_and_a_granted_actor_are_told(
    tmp_path: Path, declared: bool, granted: bool, told: bool
) -> None:
    sent: list[Reply] = []
    done = trio.Event()
    revoked = trio.Event()

    async def authorize(request: AuthorizeInput) -> Grant:
        if revoked.is_set():
            raise PermissionError("revoked")
        return await authorize_everyone(request)

    async def deliver(reply: Reply) -> SendResult:
        sent.append(reply)
        await trio.lowlevel.checkpoint()
        return SendResult(True, message_id="x")

    async def resolve_agent(_request: Any) -> Any:
        await done.wait()  # holds the message accepted until the test ends
        raise AssertionError("never answers")

    with trio.fail_after(30):
        async with (
            open_store(sqlite_url(tmp_path)) as store,
            open_messaging_runtime(
                authorize=authorize,
                resolve_agent=resolve_agent,
                deliver=deliver,
                store=store,
                tells_unanswered=lambda connection_id: declared and connection_id == "tg",
            ) as runtime,
        ):
            event = InboundEvent(
                connection_id="tg",
                external_conversation_id="chat-1",
                external_actor_id="u1",
                event_id="e1",
                text="hello",
            )
            assert (await runtime.admit(event)).status == "accepted"
            [entry] = await wait_states(runtime, ["accepted"])
            if not granted:
                revoked.set()
            result = await runtime.reconcile(
                identity=OPERATOR,
                connection_id="tg",
                operation_id=entry.operation_id,
                expected_version=entry.version,
            )
            assert (result.status, result.outcome) == ("resolved", "abandoned")
            await runtime.drain(deadline_ms=2000)
            notices = await runtime.unanswered_notices(
                connection_id="tg", external_conversation_id="chat-1", external_actor_id="u1"
            )
            before_the_end = list(sent)
            done.set()  # (the held run then fails: its own failure notice is not ours)
    if told:
        [reply] = before_the_end
        assert (reply.operation_id, reply.kind, reply.text, reply.in_reply_to) == (
            notice_id(entry.operation_id),
            "notice",
            UNANSWERED_TEXT,
            "e1",
        )
        assert [(n.operation_id, n.in_reply_to) for n in notices] == [
            (notice_id(entry.operation_id), "e1")
        ]
    else:
        assert before_the_end == [] and notices == []
