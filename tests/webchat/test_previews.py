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

from adapters.webchat._previews import PREVIEW_INTERVAL_S, LivePreviews
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


INTERVAL = PREVIEW_INTERVAL_S


def _settled(previews: LivePreviews) -> bool:
    return (
        previews._locks == {}
        and previews._latest == {}
        and previews._due == {}
        and previews._streaming == set()
    )


async def test_an_answer_replied_within_the_interval_is_never_previewed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sent: list[tuple[str, str]] = []

    async def send(actor: str, frame: str) -> None:
        sent.append((actor, json.loads(frame)["text"]))

    previews = LivePreviews(send)
    async with trio.open_nursery() as nursery:
        previews.offer(nursery, "a", "quick")
        previews.offer(nursery, "b", "slow")
        await trio.sleep(INTERVAL / 2)
        assert sent == []  # not before its interval
        async with previews.replying("a"):
            pass
        await trio.sleep(INTERVAL)
        # "a" was replied to in time: no preview; "b" was not, and its preview went out
        assert sent == [("b", "slow")]
        async with previews.replying("b"):
            pass
        await trio.sleep(INTERVAL * 3)
        assert sent == [("b", "slow")]
        assert _settled(previews)
        nursery.cancel_scope.cancel()


async def test_previews_go_at_most_once_per_interval_with_the_newest_text(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sent: list[tuple[float, str]] = []

    async def send(actor: str, frame: str) -> None:
        sent.append((trio.current_time(), json.loads(frame)["text"]))

    previews = LivePreviews(send)
    words = [f"w{i}" for i in range(40)]
    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        for i in range(len(words)):  # a delta every 5 ms for 200 ms
            previews.offer(nursery, "a", " ".join(words[: i + 1]))
            await trio.sleep(0.005)
        await trio.sleep(INTERVAL * 3)
        nursery.cancel_scope.cancel()
    times = [t for t, _ in sent]
    assert times[0] - start >= INTERVAL * 0.8  # the first one interval after the first delta
    assert all(b - a >= INTERVAL - 1e-9 for a, b in itertools.pairwise(times)), times
    assert 3 <= len(sent) <= 0.2 / INTERVAL + 1  # 40 deltas, a handful of frames
    texts = [text for _, text in sent]
    assert all(len(a) < len(b) for a, b in itertools.pairwise(texts))
    assert texts[-1] == " ".join(words)  # nothing of the end is lost
    assert _settled(previews)


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
        await trio.sleep(INTERVAL * 2)  # its send is under way, held by the slow tab
        for text in ("one two", "one two three", "one two three four"):
            previews.offer(nursery, "a", text)
        gate.set()
        await trio.sleep(INTERVAL * 2)
        # the first send, then only the newest text: no backlog
        assert sent == [("a", "one"), ("a", "one two three four")]
        # a reply drops what is pending and holds previews back until it went out
        gate = trio.Event()
        await trio.sleep(INTERVAL * 2)
        previews.offer(nursery, "a", "stale")
        await trio.sleep(INTERVAL * 2)  # under way, held by the slow tab
        previews.offer(nursery, "a", "staler")
        replied: list[str] = []

        async def reply() -> None:
            async with previews.replying("a"):
                replied.append("reply")

        nursery.start_soon(reply)
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
        await trio.sleep(INTERVAL * 3)
        nursery.cancel_scope.cancel()
    assert replied == ["reply"]
    assert sent[2:] == [("a", "stale")]  # already under way; "staler" was dropped
    assert _settled(previews)


async def test_previews_go_on_in_the_next_run_of_the_adapter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The adapter's nursery ended (a restart): the next one schedules previews afresh."""
    sent: list[str] = []

    async def send(actor: str, frame: str) -> None:
        sent.append(json.loads(frame)["text"])

    previews = LivePreviews(send)
    async with trio.open_nursery() as first:
        previews.offer(first, "a", "cut short")
        first.cancel_scope.cancel()
    assert sent == [] and previews._due == {}
    async with previews.replying("a"):
        pass  # the old run's answer, replied to by the runtime's redelivery
    async with trio.open_nursery() as second:
        previews.offer(second, "a", "next run")
        await trio.sleep(INTERVAL * 2)
        second.cancel_scope.cancel()
    assert sent == ["next run"]
    assert _settled(previews)
