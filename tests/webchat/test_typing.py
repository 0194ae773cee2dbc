"""The web chat's typing indicator over a real WebSocket: the runtime's typing calls reach
the actor's open sockets as ``typing`` frames while its agent runs, before the reply and
never after it; a turn answered at once sends none to a closed tab."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from adapters.webchat._typing import TYPING_FRAME
from tests.daemon.helpers import chat

from ._stack import chat_stack

ACTOR = "typing-actor-0001"


async def frames_until_reply(ws: Any) -> list[dict[str, Any]]:
    frames: list[dict[str, Any]] = []
    while not frames or frames[-1]["type"] != "reply":
        frame = json.loads(await ws.get_message())
        if frame["type"] != "history":  # right after ready
            frames.append(frame)
    return frames


@pytest.mark.slow  # a turn that lasts 2.5 s of real time
async def test_typing_frames_come_while_the_agent_runs_and_stop_with_its_reply() -> None:
    with trio.fail_after(30):
        async with chat_stack("mock", {"delay_ms": 2500}, typing=True) as (adapter, _runtime):
            assert adapter.features.typing
            assert adapter.bound is not None
            async with (
                chat(adapter.bound[1], ACTOR) as client,
                chat(adapter.bound[1], ACTOR) as second_tab,
            ):
                await client.ws.send_message(
                    json.dumps({"type": "message", "id": "m1", "text": "think"})
                )
                frames = await frames_until_reply(client.ws)
                other = await frames_until_reply(second_tab.ws)
                # nothing follows the reply: the run (and its typing) ended before it
                with trio.move_on_after(0.5):
                    frames.append(json.loads(await client.ws.get_message()))
            sent = adapter.statistics().typing_sent
    kinds = [f["type"] for f in frames]
    assert kinds[0] == "admission" and kinds[-1] == "reply"
    assert set(kinds[1:-1]) == {"typing"}, kinds
    assert frames[1] == json.loads(TYPING_FRAME) == {"type": "typing"}
    assert frames[-1]["text"] == "mock: think" and frames[-1]["inReplyTo"] == "m1"
    # every open tab of the actor is told, not only the one that sent the message
    assert [f["type"] for f in other][-1] == "reply" and "typing" in [f["type"] for f in other]
    assert sent == kinds.count("typing") >= 1


async def test_send_typing_reaches_only_the_open_tabs_of_its_actor() -> None:
    with trio.fail_after(30):
        async with chat_stack() as (adapter, _runtime):
            assert adapter.bound is not None
            await adapter.send_typing(ACTOR)  # no tab open: nothing to send
            assert adapter.statistics().typing_sent == 0
            async with (
                chat(adapter.bound[1], ACTOR) as mine,
                chat(adapter.bound[1], "someone-else-0001") as theirs,
            ):
                await mine.next_frame("history")
                await theirs.next_frame("history")
                await adapter.send_typing(ACTOR)
                assert await mine.next_frame("typing") == {"type": "typing"}
                with trio.move_on_after(0.3):
                    unexpected = json.loads(await theirs.ws.get_message())
                    raise AssertionError(f"another actor got {unexpected}")
            assert adapter.statistics().typing_sent == 1
            await adapter.send_typing(ACTOR)  # closed again
            assert adapter.statistics().typing_sent == 1
