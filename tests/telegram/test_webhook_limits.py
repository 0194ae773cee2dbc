"""The webhook's connection budgets in process: idle or dripping connections beyond the
pending cap cannot keep Telegram's POST out, and authenticated requests are bounded apart
from them (503 past the cap, which Telegram retries)."""

from __future__ import annotations

import json
from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio

from adapters.telegram import TelegramAdapter
from adapters.telegram._webhook import MAX_PENDING, MAX_SERVING
from tests.fakes.telegram_api import FakeBotApi
from tests.flood import closed_by_peer, drip, idle_connections, wait_until

from .conftest import Recorder, private_message
from .test_webhook import SECRET, post, webhook_adapter

FLOOD = 300
"""More connections than MAX_PENDING."""


def limiter_of(adapter: TelegramAdapter) -> Any:
    server = adapter._webhook
    assert server is not None
    return server.limiter


def request_head(adapter: TelegramAdapter, length: int, *, secret: str = SECRET) -> bytes:
    return (
        f"POST {adapter.webhook_path} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n"
        f"X-Telegram-Bot-Api-Secret-Token: {secret}\r\n\r\n"
    ).encode()


async def test_idle_connections_cannot_keep_a_valid_post_out(
    fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    adapter = webhook_adapter(make_adapter)
    update = {"update_id": 41, **private_message("through the flood")}
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        assert adapter.webhook_address is not None
        limiter = limiter_of(adapter)
        with trio.fail_after(30), idle_connections(*adapter.webhook_address, FLOOD) as flood:
            await wait_until(lambda: limiter.statistics()["pending"].evicted >= FLOOD - MAX_PENDING)
            assert limiter.open("pending") == MAX_PENDING
            assert await post(adapter, update) == 204
            assert [e.event_id for e in recorder.events] == ["41"]
            assert limiter.open() <= MAX_PENDING
            assert closed_by_peer(flood[0])  # the oldest gave way
        nursery.cancel_scope.cancel()


@pytest.mark.slow
async def test_dripping_heads_cannot_keep_a_valid_post_out(
    fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    adapter = webhook_adapter(make_adapter)
    update = {"update_id": 42, **private_message("past the drips")}
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        assert adapter.webhook_address is not None
        limiter = limiter_of(adapter)
        head = request_head(adapter, 10)
        with trio.fail_after(30):
            async with AsyncExitStack() as held, trio.open_nursery() as drips:
                for _ in range(FLOOD):
                    stream = await trio.open_tcp_stream(*adapter.webhook_address)
                    await held.enter_async_context(stream)
                    drips.start_soon(drip, stream, head, 0.5)
                await wait_until(lambda: limiter.open("pending") == MAX_PENDING)
                assert await post(adapter, update) == 204
                assert [e.event_id for e in recorder.events] == ["42"]
                drips.cancel_scope.cancel()
        nursery.cancel_scope.cancel()


async def test_authenticated_requests_are_bounded_apart_from_heads(
    fake: FakeBotApi, make_adapter: Any, recorder: Recorder
) -> None:
    """MAX_SERVING requests past the secret check (their bodies still coming): one more is
    answered 503, before its body; a wrong secret is still 401, not a place taken."""
    adapter = webhook_adapter(make_adapter, max_request_bytes=4096)
    body = json.dumps({"update_id": 43, **private_message("slow body")}).encode()
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        assert adapter.webhook_address is not None
        limiter = limiter_of(adapter)
        with trio.fail_after(30):
            async with AsyncExitStack() as held:
                streams = []
                for _ in range(MAX_SERVING):
                    stream = await trio.open_tcp_stream(*adapter.webhook_address)
                    await held.enter_async_context(stream)
                    await stream.send_all(request_head(adapter, len(body)) + body[:5])
                    streams.append(stream)
                await wait_until(lambda: limiter.open("serving") == MAX_SERVING)
                assert await post(adapter, {"update_id": 44, **private_message("x")}) == 503
                assert await post(adapter, {"update_id": 45}, secret="wrong") == 401
                for stream in streams[:2]:  # the slow bodies complete: they are served
                    await stream.send_all(body[5:])
                    answer = await stream.receive_some(65536)
                    assert answer.startswith(b"HTTP/1.1 204 "), answer[:40]
                assert limiter.statistics()["serving"].refused == 1
        nursery.cancel_scope.cancel()
    assert [e.event_id for e in recorder.events] == ["43", "43"]
