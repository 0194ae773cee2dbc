"""The web chat's live text: a streamed answer reaches the open tabs as ``preview`` frames
(growing, coalesced) before its reply, and never after it."""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
import trio.testing

from adapters.webchat._previews import LivePreviews
from tests.daemon.helpers import chat
from tests.fakes.openai_api import Answer, FakeOpenAI, start_fake_openai

from ._stack import chat_stack


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with trio.open_nursery() as nursery:
        yield await start_fake_openai(nursery, api_key=None)
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_a_streamed_answer_is_previewed_then_replied(fake: FakeOpenAI) -> None:
    text = "The answer arrives in many small pieces, one after another."
    fake.push(Answer(text, chunk_chars=4, delay_s=0.02))
    options = {"base_url": fake.base_url, "model": "gpt-4o-mini"}
    frames: list[dict[str, Any]] = []
    with trio.fail_after(30):
        async with chat_stack("openai", options, previews=True) as (adapter, _runtime):
            assert adapter.features.previews
            assert adapter.bound is not None
            async with chat(adapter.bound[1], "preview-actor-01") as client:
                await client.ws.send_message(
                    json.dumps({"type": "message", "id": "m1", "text": "explain"})
                )
                while not frames or frames[-1]["type"] != "reply":
                    frames.append(json.loads(await client.ws.get_message()))
                # nothing follows the reply (the stream had ended before it)
                with trio.move_on_after(0.3):
                    frames.append(json.loads(await client.ws.get_message()))
    previews = [f["text"] for f in frames if f["type"] == "preview"]
    assert len(previews) >= 3
    assert all(text.startswith(p) for p in previews)
    assert all(len(a) < len(b) for a, b in itertools.pairwise(previews))
    last = [f["type"] for f in frames if f["type"] in ("preview", "reply")][-1]
    assert last == "reply" and frames[-1]["type"] == "reply"
    assert frames[-1]["text"] == text


async def test_previews_are_coalesced_and_never_follow_the_reply(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sent: list[tuple[str, str]] = []
    gate = trio.Event()

    async def slow_send(actor: str, frame: str) -> None:
        await gate.wait()  # a slow tab
        sent.append((actor, json.loads(frame)["text"]))

    previews = LivePreviews(slow_send)
    async with trio.open_nursery() as nursery:
        previews.offer(nursery, "a", "one")
        await trio.testing.wait_all_tasks_blocked()
        for text in ("one two", "one two three", "one two three four"):
            previews.offer(nursery, "a", text)
        gate.set()
        await trio.testing.wait_all_tasks_blocked()
        # the first send, then only the newest text: no backlog
        assert sent == [("a", "one"), ("a", "one two three four")]
        # a reply drops what is pending and holds previews back until it went out
        gate = trio.Event()
        previews.offer(nursery, "a", "stale")
        await trio.testing.wait_all_tasks_blocked()
        previews.offer(nursery, "a", "staler")
        replied: list[str] = []

        async def reply() -> None:
            async with previews.replying("a"):
                replied.append("reply")

        nursery.start_soon(reply)
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
        await trio.testing.wait_all_tasks_blocked()
    assert replied == ["reply"]
    assert sent[2:] == [("a", "stale")]  # already under way; "staler" was dropped
    assert previews._locks == {} and previews._latest == {}
