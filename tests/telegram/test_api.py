"""The lean Bot API client (issue 40): one pool per client with a bound on requests in
flight, built-once URLs that still follow a rotated token, one JSON body."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
import trio
from trio.testing import MockClock

from adapters.telegram._api import (
    MAX_CONNECTIONS,
    TelegramApi,
    TelegramCredentialError,
    TelegramNetworkError,
    describe_failure,
)

from .conftest import ServeBotApi

TOKEN = "123456:secret-token"


async def test_requests_in_flight_are_bounded_and_a_wait_is_not_a_timeout(
    autojump_clock: MockClock, serve_bot_api: ServeBotApi
) -> None:
    """Three times as many calls as connections, each answered in 45 s (inside the 50 s
    read timeout): the extra ones wait for a free connection (nothing sent yet), and that
    wait — 90 s for the last — does not count against their deadline (read timeout 50 s +
    30 s)."""
    active = peak = 0
    started: list[float] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        started.append(trio.current_time())
        await trio.sleep(45)
        active -= 1
        return httpx.Response(200, json={"ok": True, "result": True})

    api = TelegramApi(
        token=lambda: TOKEN,
        api_origin=await serve_bot_api(handler),
        read_timeout_s=50.0,
    )
    results: list[object] = []

    async def call() -> None:
        results.append(await api.call("sendChatAction", {"chat_id": "1", "action": "typing"}))

    try:
        async with trio.open_nursery() as nursery:
            for _ in range(3 * MAX_CONNECTIONS):
                nursery.start_soon(call)
    finally:
        await api.aclose()
    assert results == [True] * (3 * MAX_CONNECTIONS)
    assert peak == MAX_CONNECTIONS
    assert sorted(round(t) for t in started) == [
        *[0] * MAX_CONNECTIONS,
        *[45] * MAX_CONNECTIONS,
        *[90] * MAX_CONNECTIONS,
    ]


async def test_urls_follow_the_token_and_the_body_is_compact_json(
    serve_bot_api: ServeBotApi,
) -> None:
    seen: list[tuple[str, bytes, str | None]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.content, request.headers.get("content-type")))
        return httpx.Response(200, json={"ok": True, "result": {"n": len(seen)}})

    tokens = iter([TOKEN, TOKEN, "999:rotated", "bad token"])
    api = TelegramApi(
        token=lambda: next(tokens),
        api_origin=await serve_bot_api(handler),
    )
    try:
        assert await api.call("sendMessage", {"chat_id": "1", "text": "é"}) == {"n": 1}
        assert await api.call("sendMessage", {"chat_id": "1", "text": "b"}) == {"n": 2}
        assert await api.call("getMe") == {"n": 3}
        try:
            await api.call("getMe")
        except TelegramCredentialError:
            pass
        else:
            raise AssertionError("a malformed token was used")
    finally:
        await api.aclose()
    assert [path for path, _body, _type in seen] == [
        f"/bot{TOKEN}/sendMessage",
        f"/bot{TOKEN}/sendMessage",
        "/bot999:rotated/getMe",
    ]
    assert seen[0][1] == json.dumps(
        {"chat_id": "1", "text": "é"}, ensure_ascii=False, separators=(",", ":")
    ).encode("utf-8")
    assert {content_type for _path, _body, content_type in seen} == {"application/json"}


async def test_a_network_failure_names_its_cause_and_carries_no_url() -> None:
    """The h11 client's failures reach the caller as a cause name only: no URL, no token,
    no chained exception (whose text could hold them)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: connections are refused
    api = TelegramApi(token=lambda: TOKEN, api_origin=f"http://127.0.0.1:{port}")
    try:
        with trio.fail_after(20), pytest.raises(TelegramNetworkError) as raised:
            await api.call("sendMessage", {"chat_id": 1, "text": "hi"})
    finally:
        await api.aclose()
    error = raised.value
    assert error.cause == "ConnectError"
    assert error.__cause__ is None and error.__context__ is None
    for text in (str(error), repr(error), describe_failure(error)):
        assert TOKEN not in text and "secret" not in text and str(port) not in text
        assert "/bot" not in text and "sendMessage" not in text
