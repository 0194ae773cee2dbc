"""Answers for a closed tab: held ``pending``, re-driven by the runtime when the same browser
reconnects, delivered exactly once — real adapter + runtime + SQLite over loopback sockets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing
import trio_websocket

from adapters.webchat import _frames as webchat
from adapters.webchat._adapter import WebchatAdapter
from prismd.agents._base import AgentContext
from prismd.agents.registry import build_agent
from prismd.channel import InboundEvent, Reply, SendResult
from prismd.journal import NS_REPLY, operation_id_for
from prismd.journal._journal import ChannelJournal
from prismd.journal._records import ReplyRecord
from prismd.runtime import ResolveAgentInput, open_messaging_runtime
from stores import OwnershipScope, open_store
from stores.memory import MemoryStore
from tests.support.builders import write
from tests.support.clocks import ManualClock

from ._stack import OPERATOR, authorize_everyone, chat_stack, sqlite_url
from ._support import connect, hello, recv, send

ACTOR = "held-actor-000001"
OTHER = "other-actor-00002"
OP1 = operation_id_for("web", f"{ACTOR}:m1")
SLOW = {"delay_ms": 200}
DAY_MS = 24 * 60 * 60 * 1000


def scope(actor: str = ACTOR) -> OwnershipScope:
    return OwnershipScope("default", "web", actor)


async def reply_record(adapter: WebchatAdapter, op: str = OP1) -> ReplyRecord:
    assert adapter.checkpoints is not None
    loaded = await ChannelJournal(adapter.checkpoints).load_reply(scope(), "web", op)
    assert loaded is not None
    return loaded.record


async def reply_in_state(adapter: WebchatAdapter, state: str) -> ReplyRecord:
    """The reply record once it reached ``state`` (the mark follows ``deliver``)."""
    for _ in range(500):
        record = await reply_record(adapter)
        if record.state == state:
            return record
        await trio.sleep(0.01)
    raise AssertionError(f"reply never became {state}: {record}")


async def leave_an_answer_behind(
    adapter: WebchatAdapter, results: trio.MemoryReceiveChannel[SendResult]
) -> str:
    """A browser sends m1 and its tab closes before the (slow) agent answers; returns the
    browser's resume token once the answer was held."""
    async with connect(adapter) as ws:
        resume = await hello(ws, ACTOR, history=True)
        await send(ws, {"type": "message", "id": "m1", "text": "while away"})
        assert (await recv(ws))["status"] == "accepted"
    assert await results.receive() == SendResult.hold("webchat_not_connected")
    return resume


def reply_frame(op: str = OP1, text: str = "mock: while away", in_reply_to: str = "m1") -> Any:
    return {
        "type": "reply",
        "replyId": op,
        "kind": "final",
        "text": text,
        "controls": [],
        "inReplyTo": in_reply_to,
    }


async def test_answer_for_a_closed_tab_is_held_then_delivered_once_on_reconnect(
    tmp_path: Path,
) -> None:
    results_in, results = trio.open_memory_channel[SendResult](10)
    with trio.fail_after(20):
        async with chat_stack("mock", SLOW, results_in, store_url=sqlite_url(tmp_path)) as (
            adapter,
            runtime,
        ):
            resume = await leave_an_answer_behind(adapter, results)
            assert (await runtime.drain(deadline_ms=5000)).settled
            held = await reply_record(adapter)
            # journaled, kept pending (not delivery_failed), marked as held by the channel
            assert (held.state, held.reason, held.attempts) == ("pending", "held", 1)
            assert held.text == "mock: while away"
            [entry] = await runtime.list_unresolved(identity=OPERATOR)
            assert (entry.operation_id, entry.state, entry.reply_state) == (
                OP1,
                "succeeded",
                "pending",
            )
            diagnostics = runtime.diagnostics()
            assert (diagnostics.deliveries, diagnostics.delivery_failures) == (0, 0)
            assert adapter.statistics().replies_held == 1

            async with connect(adapter) as ws:
                await hello(ws, ACTOR, resume, history=True)  # nothing delivered yet
                assert await recv(ws) == reply_frame()
                assert (await results.receive()).delivered
                delivered = await reply_in_state(adapter, "delivered")
                assert (delivered.attempts, delivered.reason) == (2, None)
                assert delivered.message_id is not None
                assert await runtime.list_unresolved(identity=OPERATOR) == []

            # The same browser once more: the answer is history now and is not sent again.
            async with connect(adapter) as ws:
                await hello(ws, ACTOR, resume)
                assert await recv(ws) == {
                    "type": "history",
                    "replies": [
                        {
                            "replyId": OP1,
                            "kind": "final",
                            "text": "mock: while away",
                            "inReplyTo": "m1",
                            "at": held.created_at_ms,
                        }
                    ],
                }
                await send(ws, {"type": "message", "id": "m2", "text": "next"})
                assert (await recv(ws))["status"] == "accepted"
                assert await recv(ws) == reply_frame(
                    operation_id_for("web", f"{ACTOR}:m2"), "mock: next", "m2"
                )
            assert (await results.receive()).delivered
            with pytest.raises(trio.WouldBlock):
                results.receive_nowait()
            assert runtime.diagnostics().deliveries == 2


@pytest.mark.slow
async def test_two_tabs_reconnecting_at_once_get_it_delivered_once(tmp_path: Path) -> None:
    results_in, results = trio.open_memory_channel[SendResult](10)
    with trio.fail_after(20):
        async with chat_stack("mock", SLOW, results_in, store_url=sqlite_url(tmp_path)) as (
            adapter,
            runtime,
        ):
            resume = await leave_an_answer_behind(adapter, results)
            assert (await runtime.drain(deadline_ms=5000)).settled
            async with connect(adapter) as tab1, connect(adapter) as tab2:
                async with trio.open_nursery() as both:
                    for tab in (tab1, tab2):
                        both.start_soon(hello, tab, ACTOR, resume)
                assert (await results.receive()).delivered  # the one re-drive that won
                await reply_in_state(adapter, "delivered")
                # Read both tabs up to the next answer (which every tab of the actor gets):
                # a second delivery of m1 would have reached them before it.
                await send(tab1, {"type": "message", "id": "p1", "text": "ping"})
                for tab in (tab1, tab2):
                    live, in_history = 0, 0
                    while True:
                        frame = await recv(tab)
                        if frame["type"] == "history":
                            in_history += sum(r["replyId"] == OP1 for r in frame["replies"])
                        elif frame["type"] == "reply" and frame["replyId"] == OP1:
                            live += 1
                            assert frame == reply_frame()
                        elif frame["type"] == "reply":
                            assert frame["text"] == "mock: ping"
                            break
                    # live at most once; a tab that joined after the delivery sees it in its
                    # history instead (the page shows a replyId once)
                    assert live <= 1 and live + in_history >= 1, (live, in_history)
            assert (await results.receive()).delivered  # the ping's answer
            with pytest.raises(trio.WouldBlock):
                results.receive_nowait()
            assert (await reply_record(adapter)).attempts == 2
            assert runtime.diagnostics().deliveries == 2  # m1 once, the ping once


async def test_a_restart_between_the_answer_and_the_reconnect_still_delivers_it(
    tmp_path: Path,
) -> None:
    url = sqlite_url(tmp_path)
    results_in, results = trio.open_memory_channel[SendResult](10)
    with trio.fail_after(30):
        async with chat_stack("mock", SLOW, results_in, store_url=url) as (adapter, runtime):
            resume = await leave_an_answer_behind(adapter, results)
            assert (await runtime.drain(deadline_ms=5000)).settled
        # the daemon restarted: a new runtime, adapter and store connection on the same file
        async with chat_stack("mock", SLOW, store_url=url) as (adapter, runtime):
            [entry] = await runtime.list_unresolved(identity=OPERATOR)
            assert entry.reply_state == "pending"
            async with connect(adapter) as ws:
                # the resume token survived in the journal's store: same browser, same chat
                await hello(ws, ACTOR, resume, history=True)
                assert await recv(ws) == reply_frame()
                await reply_in_state(adapter, "delivered")
            assert await runtime.list_unresolved(identity=OPERATOR) == []
            assert runtime.diagnostics().deliveries == 1


@pytest.mark.slow
async def test_a_wrong_or_missing_resume_token_gets_nothing_of_the_conversation(
    tmp_path: Path,
) -> None:
    results_in, results = trio.open_memory_channel[SendResult](10)
    with trio.fail_after(20):
        async with chat_stack("mock", SLOW, results_in, store_url=sqlite_url(tmp_path)) as (
            adapter,
            runtime,
        ):
            resume = await leave_an_answer_behind(adapter, results)
            assert (await runtime.drain(deadline_ms=5000)).settled
            for presented in (None, "B" * 43, resume[:-1] + ("A" if resume[-1] != "A" else "B")):
                async with connect(adapter) as ws:
                    frame: dict[str, Any] = {"type": "hello", "actor": ACTOR}
                    if presented is not None:
                        frame["resume"] = presented
                    await send(ws, frame)
                    assert await recv(ws) == {
                        "type": "error",
                        "message": "this chat belongs to another browser; start a new one",
                        "code": "resume_refused",
                    }
                    with pytest.raises(trio_websocket.ConnectionClosed) as info:
                        await ws.get_message()  # no ready, no history, no reply
                    assert info.value.reason is not None and info.value.reason.code == 1008
            # another browser's own chat sees nothing of it either
            async with connect(adapter) as ws:
                await hello(ws, OTHER, history=True)
                await send(ws, {"type": "message", "id": "m1", "text": "mine"})
                assert (await recv(ws))["status"] == "accepted"
                mine = operation_id_for("web", f"{OTHER}:m1")
                assert await recv(ws) == reply_frame(mine, "mock: mine")
            assert (await results.receive()).delivered  # OTHER's answer, nothing else
            with pytest.raises(trio.WouldBlock):
                results.receive_nowait()
            held = await reply_record(adapter)
            assert (held.state, held.reason) == ("pending", "held")
            assert adapter.statistics().hellos_refused == 3
            # the right browser still gets its answer
            async with connect(adapter) as ws:
                await hello(ws, ACTOR, resume, history=True)
                assert await recv(ws) == reply_frame()
            await reply_in_state(adapter, "delivered")


async def test_history_is_bounded_oldest_first_delivered_only_and_within_retention() -> None:
    clock = ManualClock(1_780_000_000_000)
    with trio.fail_after(30):
        async with chat_stack(clock=clock) as (adapter, runtime):
            async with connect(adapter) as ws:
                resume = await hello(ws, ACTOR, history=True)
                for n in range(23):
                    clock.ms += 1000
                    await send(ws, {"type": "message", "id": f"m{n}", "text": f"t{n}"})
                    assert (await recv(ws))["status"] == "accepted"
                    assert (await recv(ws))["text"] == f"t{n}"
            async with connect(adapter) as ws:
                await hello(ws, ACTOR, resume)
                history = await recv(ws)
            replies = history["replies"]
            assert [r["text"] for r in replies] == [f"t{n}" for n in range(3, 23)]
            assert [r["inReplyTo"] for r in replies] == [f"m{n}" for n in range(3, 23)]
            assert [r["at"] for r in replies] == sorted(r["at"] for r in replies)
            assert all(r["kind"] == "final" for r in replies)
            # only the actor's own conversation, and only within retention
            other = await runtime.recent_replies(
                connection_id="web", external_conversation_id=OTHER, external_actor_id=OTHER
            )
            assert other == []
            clock.ms += 8 * DAY_MS  # retention_days = 7
            gone = await runtime.recent_replies(
                connection_id="web", external_conversation_id=ACTOR, external_actor_id=ACTOR
            )
            assert gone == []


async def test_a_held_answer_older_than_retention_waits_for_the_operator() -> None:
    clock = ManualClock(1_780_000_000_000)
    results_in, results = trio.open_memory_channel[SendResult](10)
    with trio.fail_after(20):
        async with chat_stack("mock", SLOW, results_in, clock=clock) as (adapter, runtime):
            await leave_an_answer_behind(adapter, results)
            assert (await runtime.drain(deadline_ms=5000)).settled
            clock.ms += 8 * DAY_MS
            async with connect(adapter) as ws:
                # the browser's id expired with it: a new token for the same id
                await send(ws, {"type": "hello", "actor": ACTOR})
                assert (await recv(ws))["type"] == "ready"
                assert await recv(ws) == {"type": "history", "replies": []}
                assert (
                    await runtime.redeliver_pending(
                        connection_id="web", external_conversation_id=ACTOR, external_actor_id=ACTOR
                    )
                    == 0
                )
                with pytest.raises(trio.WouldBlock):
                    results.receive_nowait()
                [entry] = await runtime.list_unresolved(identity=OPERATOR)
                assert entry.reply_state == "pending"
                # held = proven unsent: the operator resends it without the acknowledgement
                result = await runtime.reconcile(
                    identity=OPERATOR,
                    connection_id="web",
                    operation_id=OP1,
                    expected_version=entry.version,
                )
                assert (result.status, result.outcome) == ("resolved", "reply_delivered")
                frame = await recv(ws)
                assert frame["replyId"] == OP1 and frame["text"] == "mock: while away"
                assert frame["inReplyTo"] is None  # a resend names no event (contract §13.2)
            assert (await reply_record(adapter)).state == "delivered"
            assert await runtime.list_unresolved(identity=OPERATOR) == []


async def test_reconcile_of_a_held_answer_with_no_tab_open_keeps_it_held() -> None:
    results_in, results = trio.open_memory_channel[SendResult](10)
    with trio.fail_after(20):
        async with chat_stack("mock", SLOW, results_in) as (adapter, runtime):
            resume = await leave_an_answer_behind(adapter, results)
            assert (await runtime.drain(deadline_ms=5000)).settled
            [entry] = await runtime.list_unresolved(identity=OPERATOR)
            result = await runtime.reconcile(
                identity=OPERATOR,
                connection_id="web",
                operation_id=OP1,
                expected_version=entry.version,
            )
            assert (result.status, result.outcome) == ("resolved", "reply_held")
            held = await reply_record(adapter)
            assert (held.state, held.reason, held.attempts) == ("pending", "held", 2)
            assert [e.reply_state for e in await runtime.list_unresolved(identity=OPERATOR)] == [
                "pending"
            ]
            async with connect(adapter) as ws:
                await hello(ws, ACTOR, resume, history=True)
                assert await recv(ws) == reply_frame()
            await reply_in_state(adapter, "delivered")


async def test_a_reply_claimed_but_never_marked_is_left_to_the_operator() -> None:
    """A daemon killed between a re-drive's claim and its mark: the send may have happened,
    so the reply is never re-driven automatically; reconcile needs the acknowledgement."""
    results_in, results = trio.open_memory_channel[SendResult](10)
    with trio.fail_after(20):
        async with chat_stack("mock", SLOW, results_in) as (adapter, runtime):
            resume = await leave_an_answer_behind(adapter, results)
            assert (await runtime.drain(deadline_ms=5000)).settled
            assert adapter.checkpoints is not None
            journal = ChannelJournal(adapter.checkpoints)
            loaded = await journal.load_reply(scope(), "web", OP1)
            assert loaded is not None
            claimed = attrs.evolve(loaded.record, reason=None)  # what the claim writes
            assert await write(
                journal, NS_REPLY, scope(), claimed, loaded.version, loaded.fencing_token
            )
            async with connect(adapter) as ws:
                await hello(ws, ACTOR, resume, history=True)
                assert (
                    await runtime.redeliver_pending(
                        connection_id="web", external_conversation_id=ACTOR, external_actor_id=ACTOR
                    )
                    == 0
                )
                [entry] = await runtime.list_unresolved(identity=OPERATOR)
                refused = await runtime.reconcile(
                    identity=OPERATOR,
                    connection_id="web",
                    operation_id=OP1,
                    expected_version=entry.version,
                )
                assert (refused.status, refused.detail) == ("conflict", "duplicate_risk")
                resent = await runtime.reconcile(
                    identity=OPERATOR,
                    connection_id="web",
                    operation_id=OP1,
                    expected_version=entry.version,
                    acknowledge_duplicate_risk=True,
                )
                assert resent.outcome == "reply_delivered"
                assert (await recv(ws))["replyId"] == OP1
            assert (await results.receive()).delivered  # the operator's resend
            with pytest.raises(trio.WouldBlock):
                results.receive_nowait()  # and nothing else: no automatic re-drive


async def test_two_runtimes_sharing_a_journal_deliver_a_held_reply_once(tmp_path: Path) -> None:
    """Two processes' re-drives of the same conversation (the per-process delivery turn does
    not span them): the CAS claim lets exactly one send."""
    url = sqlite_url(tmp_path)
    sent: list[tuple[str, Reply]] = []
    holding = True

    def deliver_as(name: str) -> Any:
        async def deliver(reply: Reply) -> SendResult:
            await trio.lowlevel.checkpoint()
            if holding:
                return SendResult.hold("no tab")
            sent.append((name, reply))
            await trio.sleep(0.05)  # a slow send: the other runtime has every chance to race
            return SendResult(True, message_id=f"{name}-1")

        return deliver

    with trio.fail_after(30):
        async with open_store(url) as store_a, open_store(url) as store_b:
            agent = build_agent(
                "echo", AgentContext(alias="primary", options={}, checkpoints=store_a.checkpoints)
            )

            async def resolve_agent(request: ResolveAgentInput) -> Any:
                await trio.lowlevel.checkpoint()
                return agent

            async with (
                open_messaging_runtime(
                    authorize=authorize_everyone,
                    resolve_agent=resolve_agent,
                    deliver=deliver_as("a"),
                    store=store_a,
                    owner_id="runtime-a",
                ) as a,
                open_messaging_runtime(
                    authorize=authorize_everyone,
                    resolve_agent=resolve_agent,
                    deliver=deliver_as("b"),
                    store=store_b,
                    owner_id="runtime-b",
                ) as b,
            ):
                event = InboundEvent(
                    connection_id="web",
                    external_conversation_id=ACTOR,
                    external_actor_id=ACTOR,
                    event_id=f"{ACTOR}:m1",
                    text="hello",
                )
                assert (await a.admit(event)).status == "accepted"
                assert (await a.drain(deadline_ms=5000)).settled
                holding = False
                counts: list[int] = []

                async def redrive(runtime: Any) -> None:
                    counts.append(
                        await runtime.redeliver_pending(
                            connection_id="web",
                            external_conversation_id=ACTOR,
                            external_actor_id=ACTOR,
                        )
                    )

                async with trio.open_nursery() as both:
                    both.start_soon(redrive, a)
                    both.start_soon(redrive, b)
                assert sorted(counts) == [0, 1]
                [(_, reply)] = sent
                assert (reply.text, reply.operation_id, reply.in_reply_to) == (
                    "hello",
                    OP1,
                    f"{ACTOR}:m1",
                )
                loaded = await ChannelJournal(store_a.checkpoints).load_reply(scope(), "web", OP1)
                assert loaded is not None and loaded.record.state == "delivered"


async def test_a_reconnect_while_the_send_is_being_held_still_gets_the_answer() -> None:
    """The tab reconnects after ``deliver`` decided "hold" but before that was journaled: the
    re-drive waits for the conversation's send to be marked, so it is not missed."""
    deciding, release = trio.Event(), trio.Event()
    calls: list[Reply] = []

    async def deliver(reply: Reply) -> SendResult:
        calls.append(reply)
        if len(calls) == 1:
            deciding.set()
            await release.wait()  # "no socket" was decided; the mark is not written yet
            return SendResult.hold("no tab")
        await trio.lowlevel.checkpoint()
        return SendResult(True, message_id="live-1")

    with trio.fail_after(10):
        async with MemoryStore() as store:
            agent = build_agent(
                "echo", AgentContext(alias="primary", options={}, checkpoints=store.checkpoints)
            )

            async def resolve_agent(request: ResolveAgentInput) -> Any:
                await trio.lowlevel.checkpoint()
                return agent

            async with open_messaging_runtime(
                authorize=authorize_everyone,
                resolve_agent=resolve_agent,
                deliver=deliver,
                store=store,
            ) as runtime:
                event = InboundEvent(
                    connection_id="web",
                    external_conversation_id=ACTOR,
                    external_actor_id=ACTOR,
                    event_id=f"{ACTOR}:m1",
                    text="hello",
                )
                assert (await runtime.admit(event)).status == "accepted"
                await deciding.wait()
                counts: list[int] = []

                async def reconnect() -> None:
                    counts.append(
                        await runtime.redeliver_pending(
                            connection_id="web",
                            external_conversation_id=ACTOR,
                            external_actor_id=ACTOR,
                        )
                    )

                async with trio.open_nursery() as nursery:
                    nursery.start_soon(reconnect)
                    await trio.testing.wait_all_tasks_blocked()
                    assert counts == []  # waiting for the send in flight, not done with nothing
                    release.set()
                assert counts == [1]
                assert [r.operation_id for r in calls] == [OP1, OP1]
                loaded = await ChannelJournal(store.checkpoints).load_reply(scope(), "web", OP1)
                assert loaded is not None and loaded.record.state == "delivered"


async def test_a_held_approval_notice_comes_back_with_fresh_working_buttons() -> None:
    """Approval tokens are never journaled (SPEC difference 4): the re-driven notice gets
    fresh controls, and pressing one resumes the run."""
    results_in, results = trio.open_memory_channel[SendResult](10)
    options = {"delay_ms": 200, "suspend_for_tool": "shell"}
    with trio.fail_after(20):
        async with chat_stack("mock", options, results_in) as (adapter, runtime):
            async with connect(adapter) as ws:
                resume = await hello(ws, ACTOR, history=True)
                await send(ws, {"type": "message", "id": "m1", "text": "run it"})
                assert (await recv(ws))["status"] == "accepted"
            assert (await results.receive()).held
            assert (await runtime.drain(deadline_ms=5000)).settled
            stored = await reply_record(adapter)
            assert stored.kind == "notice" and [c.label for c in stored.buttons] == [
                "Allow once",
                "Deny",
            ]
            async with connect(adapter) as ws:
                await hello(ws, ACTOR, resume, history=True)
                notice = await recv(ws)
                assert (notice["replyId"], notice["kind"]) == (OP1, "notice")
                assert [c["label"] for c in notice["controls"]] == ["Allow once", "Deny"]
                allow = notice["controls"][0]["value"]
                assert allow.startswith("p:a:") and allow[4:] not in json.dumps(stored.to_json())
                await send(ws, {"type": "approve", "value": allow, "id": "b1"})
                assert (await recv(ws))["status"] == "accepted"
                final = await recv(ws)
                assert (final["kind"], final["text"]) == ("final", "mock: run it")


async def test_the_history_frame_keeps_the_newest_replies_that_fit() -> None:
    big = "é" * 10_000  # 20 000 UTF-8 bytes, 60 000 as an ASCII-escaped JSON string
    with trio.fail_after(30):
        async with chat_stack() as (adapter, _):
            async with connect(adapter) as ws:
                resume = await hello(ws, ACTOR, history=True)
                for n in range(6):
                    await send(ws, {"type": "message", "id": f"m{n}", "text": f"{n}{big}"})
                    assert (await recv(ws))["status"] == "accepted"
                    assert (await recv(ws))["text"] == f"{n}{big}"
            async with connect(adapter) as ws:
                await hello(ws, ACTOR, resume)
                raw = await ws.get_message()
    assert len(raw) <= webchat.MAX_HISTORY_FRAME_BYTES + 64
    replies = json.loads(raw)["replies"]
    # the newest four fit (4 x ~60 kB); the older ones are left out, not the frame cut
    assert [r["inReplyTo"] for r in replies] == ["m2", "m3", "m4", "m5"]
    assert all(r["text"][1:] == big for r in replies)
