"""The fake OpenAI-compatible server answers as the real API does (raw HTTP, no agent)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import httpx_sse
import pytest
import trio

from tests.fakes.openai_api import Answer, Failure, FakeOpenAI, start_fake_openai

KEY = "sk-test-FAKE-KEY-0123456789abcdef"


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with trio.open_nursery() as nursery:
        yield await start_fake_openai(nursery, api_key=KEY)
        nursery.cancel_scope.cancel()


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], **extra}


async def events(client: httpx.AsyncClient, fake: FakeOpenAI) -> list[Any]:
    chunks: list[Any] = []
    async with httpx_sse.aconnect_sse(
        client, "POST", f"{fake.base_url}/chat/completions",
        json=body(stream=True), headers={"authorization": f"Bearer {KEY}"},
    ) as source:  # fmt: skip
        assert source.response.headers["content-type"].startswith("text/event-stream")
        async for event in source.aiter_sse():
            chunks.append(event.data if event.data == "[DONE]" else json.loads(event.data))
    return chunks


async def test_a_streamed_text_answer_has_openais_chunk_shape(fake: FakeOpenAI) -> None:
    fake.push(Answer("Hello there", chunk_chars=5))
    async with httpx.AsyncClient() as client:
        chunks = await events(client, fake)
    assert chunks[-1] == "[DONE]"
    first, *middle, last = chunks[:-1]
    for chunk in chunks[:-1]:
        assert chunk["object"] == "chat.completion.chunk" and chunk["model"] == "gpt-4o-mini"
        assert chunk["id"].startswith("chatcmpl-") and isinstance(chunk["created"], int)
        assert set(chunk["choices"][0]) == {"index", "delta", "logprobs", "finish_reason"}
    assert len({c["id"] for c in chunks[:-1]}) == 1
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "", "refusal": None}
    assert [c["choices"][0]["delta"]["content"] for c in middle] == ["Hello", " ther", "e"]
    assert all(c["choices"][0]["finish_reason"] is None for c in [first, *middle])
    assert last["choices"][0] == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop",
    }  # fmt: skip


async def test_tool_calls_stream_by_index_with_split_arguments(fake: FakeOpenAI) -> None:
    fake.push(Answer(tool_calls=(("get_weather", {"city": "Paris"}), ("noop", {})), split=3))
    async with httpx.AsyncClient() as client:
        chunks = await events(client, fake)
    deltas = [c["choices"][0]["delta"] for c in chunks[:-1]]
    assert deltas[0] == {"role": "assistant", "content": None}
    parts = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    opening = [p for p in parts if "id" in p]
    assert [(p["index"], p["type"], p["function"]) for p in opening] == [
        (0, "function", {"name": "get_weather", "arguments": ""}),
        (1, "function", {"name": "noop", "arguments": ""}),
    ]
    fragments = [p["function"]["arguments"] for p in parts if p["index"] == 0 and "id" not in p]
    assert len(fragments) == 3 and json.loads("".join(fragments)) == {"city": "Paris"}
    assert chunks[-2]["choices"][0]["finish_reason"] == "tool_calls"


async def test_errors_have_openais_status_and_body(fake: FakeOpenAI) -> None:
    url = f"{fake.base_url}/chat/completions"
    auth = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient() as client:
        missing = await client.post(url, json=body())
        assert missing.status_code == 401
        assert "You didn't provide an API key" in missing.json()["error"]["message"]
        wrong = await client.post(
            url, json=body(), headers={"authorization": "Bearer sk-wrong-0000-9999"}
        )
        error = wrong.json()["error"]
        assert (wrong.status_code, error["type"], error["code"], error["param"]) == (
            401, "invalid_request_error", "invalid_api_key", None,
        )  # fmt: skip
        assert (
            error["message"].startswith("Incorrect API key provided: sk-wr")
            and "9999" in (error["message"])
        )
        fake.push(Failure(429, retry_after="2"), Failure(500))
        limited = await client.post(url, json=body(), headers=auth)
        assert limited.status_code == 429 and limited.headers["retry-after"] == "2"
        assert limited.json()["error"]["code"] == "rate_limit_exceeded"
        assert limited.headers["x-ratelimit-remaining-requests"] == "0"
        failed = await client.post(url, json=body(), headers=auth)
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
        orphan = body(messages=[{"role": "tool", "tool_call_id": "call_1", "content": "x"}])
        rejected = await client.post(url, json=orphan, headers=auth)
        assert rejected.status_code == 400
        assert (
            "must be a response to a preceeding message with 'tool_calls'"
            in (rejected.json()["error"]["message"])
        )
        unanswered = body(
            messages=[
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_9", "type": "function",
                     "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "user", "content": "and?"},
            ]
        )  # fmt: skip
        rejected = await client.post(url, json=unanswered, headers=auth)
        assert rejected.status_code == 400 and "call_9" in rejected.json()["error"]["message"]
        assert (await client.post(url, json={"messages": []}, headers=auth)).status_code == 400
        gone = await client.post(f"{fake.base_url}/completions", json=body(), headers=auth)
        assert gone.status_code == 404
        models = await client.get(f"{fake.base_url}/models", headers=auth)
        assert models.json()["data"][0]["id"] == "gpt-4o-mini"


async def test_a_non_streamed_completion(fake: FakeOpenAI) -> None:
    fake.push(Answer("whole"))
    async with httpx.AsyncClient() as client:
        response = await client.post(
            f"{fake.base_url}/chat/completions", json=body(),
            headers={"authorization": f"Bearer {KEY}"},
        )  # fmt: skip
    completion = response.json()
    assert completion["object"] == "chat.completion"
    assert completion["choices"][0]["message"] == {"role": "assistant", "content": "whole"}
    assert completion["choices"][0]["finish_reason"] == "stop"
    assert completion["usage"]["total_tokens"] == 15
