"""The web chat adapter with a real messaging runtime (memory store, echo and mock agents)."""

from __future__ import annotations

import trio

from prismd.journal import operation_id_for

from ._stack import chat_stack
from ._support import connect, hello, recv, send

ACTOR = "browser-actor-0001"


async def test_message_gets_the_agents_reply() -> None:
    with trio.fail_after(15):
        async with chat_stack() as (adapter, runtime), connect(adapter) as ws:
            await hello(ws, ACTOR, history=True)
            await send(ws, {"type": "message", "id": "m1", "text": "hello prismd"})
            assert await recv(ws) == {
                "type": "admission",
                "id": "m1",
                "status": "accepted",
                "reason": None,
                "duplicate": False,
            }
            assert await recv(ws) == {
                "type": "reply",
                "replyId": operation_id_for("web", f"{ACTOR}:m1"),
                "kind": "final",
                "text": "hello prismd",
                "controls": [],
                "inReplyTo": "m1",
            }
            drained = await runtime.drain(deadline_ms=5000)
            assert drained.settled and drained.completed == 1
            diagnostics = runtime.diagnostics()
            assert diagnostics.admitted == 1 and diagnostics.deliveries == 1


async def test_resent_client_id_is_a_duplicate_and_runs_once() -> None:
    with trio.fail_after(15):
        async with chat_stack() as (adapter, runtime):
            async with connect(adapter) as ws:
                resume = await hello(ws, ACTOR, history=True)
                await send(ws, {"type": "message", "id": "m1", "text": "first"})
                assert (await recv(ws))["duplicate"] is False
                assert (await recv(ws))["text"] == "first"
            # the page re-sends a message it saw no admission for after reconnecting
            async with connect(adapter) as ws:
                await hello(ws, ACTOR, resume)
                history = await recv(ws)
                assert [r["text"] for r in history["replies"]] == ["first"]
                await send(ws, {"type": "message", "id": "m1", "text": "first"})
                frame = await recv(ws)
                assert frame["status"] == "accepted" and frame["duplicate"] is True
                await send(ws, {"type": "message", "id": "m2", "text": "second"})
                assert (await recv(ws))["duplicate"] is False
                # had m1 run again, its reply would come before m2's on this route
                reply = await recv(ws)
                assert reply["text"] == "second" and reply["inReplyTo"] == "m2"
            assert runtime.diagnostics().duplicates == 1


async def test_approval_buttons_resume_the_run() -> None:
    with trio.fail_after(15):
        async with (
            chat_stack("mock", {"suspend_for_tool": "shell"}) as (adapter, _),
            connect(adapter) as ws,
        ):
            await hello(ws, ACTOR, history=True)
            await send(ws, {"type": "message", "id": "m1", "text": "run it"})
            assert (await recv(ws))["status"] == "accepted"
            notice = await recv(ws)
            assert notice["kind"] == "notice" and notice["inReplyTo"] == "m1"
            assert "shell" in notice["text"]
            labels = [c["label"] for c in notice["controls"]]
            assert labels == ["Allow once", "Deny"]
            allow = notice["controls"][0]["value"]
            assert allow.startswith("p:a:")

            await send(ws, {"type": "approve", "value": allow, "id": "b1"})
            assert await recv(ws) == {
                "type": "admission",
                "id": "b1",
                "status": "accepted",
                "reason": None,
                "duplicate": False,
            }
            final = await recv(ws)
            assert final["kind"] == "final" and final["text"] == "mock: run it"
            assert final["controls"] == []

            # pressing the spent button again changes nothing
            await send(ws, {"type": "approve", "value": allow, "id": "b2"})
            again = await recv(ws)
            assert again["id"] == "b2" and again["status"] == "accepted"
            assert again["duplicate"] is True


async def test_deny_button_ends_the_run() -> None:
    with trio.fail_after(15):
        async with (
            chat_stack("mock", {"suspend_for_tool": "shell"}) as (adapter, _),
            connect(adapter) as ws,
        ):
            await hello(ws, ACTOR, history=True)
            await send(ws, {"type": "message", "id": "m1", "text": "run it"})
            await recv(ws)
            notice = await recv(ws)
            deny = notice["controls"][1]["value"]
            assert deny.startswith("p:d:")
            await send(ws, {"type": "approve", "value": deny})
            assert (await recv(ws))["status"] == "accepted"
            final = await recv(ws)
            assert final["text"] == "Approval denied. The request will not continue."
