"""The agent card at either well-known path (``reference/a2a-protocol.md`` §1): a peer
that serves only the legacy ``/.well-known/agent.json`` may answer the current path with
anything but its card — a 404, a 401 or 405 from a proxy guarding unknown paths, a 500, or
a web app's catch-all page (200, HTML). Each is followed by the legacy path; a card found
at neither is a clear :class:`CardError`, and a 429 is a refusal (asked again later)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
import trio

from adapters.toolkit import Http11
from prismd.agents.a2a import A2AClient, CardError, Refused
from tests.support.handler_server import serve_handler

CARD = {
    "name": "legacy",
    "url": "http://127.0.0.1:1/rpc",
    "protocolVersion": "0.2.6",
    "capabilities": {"streaming": False},
}


def _peer(
    current: httpx.Response, legacy: httpx.Response | None = None
) -> tuple[list[str], Callable[[httpx.Request], httpx.Response]]:
    asked: list[str] = []

    def handle(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        if request.url.path == "/.well-known/agent-card.json":
            return current
        if request.url.path == "/.well-known/agent.json" and legacy is not None:
            return legacy
        return httpx.Response(404)

    return asked, handle


@pytest.mark.parametrize(
    "current",
    [
        httpx.Response(404),
        httpx.Response(401),
        httpx.Response(405),
        httpx.Response(500),
        httpx.Response(200, text="<html>the web app</html>"),
    ],
)
async def test_the_legacy_card_is_read_when_the_current_path_gives_none(
    current: httpx.Response,
) -> None:
    asked, handle = _peer(current, httpx.Response(200, json=CARD))
    with trio.fail_after(10):
        async with (
            httpx.AsyncClient() as http,
            trio.open_nursery() as nursery,
        ):
            origin = await serve_handler(nursery, handle)
            client = await A2AClient.discover(http, url=origin + "/", rpc=Http11())
            assert client.card.dialect == "0.3" and client.url == CARD["url"]
            assert asked == ["/.well-known/agent-card.json", "/.well-known/agent.json"]
            await client.aclose()
            nursery.cancel_scope.cancel()


async def test_no_card_at_either_path_is_a_clear_error_and_a_429_a_refusal() -> None:
    with trio.fail_after(10):
        async with httpx.AsyncClient() as http, trio.open_nursery() as nursery:
            _, nowhere = _peer(httpx.Response(200, text="<html/>"), httpx.Response(200, text="x"))
            origin = await serve_handler(nursery, nowhere)
            with pytest.raises(CardError, match="not JSON"):
                await A2AClient.discover(http, url=origin, rpc=Http11())
            _, gone = _peer(httpx.Response(404))
            origin = await serve_handler(nursery, gone)
            with pytest.raises(CardError, match="HTTP 404"):
                await A2AClient.discover(http, url=origin, rpc=Http11())
            busy = httpx.Response(429, headers={"Retry-After": "7"})
            asked, limited = _peer(busy, httpx.Response(200, json=CARD))
            origin = await serve_handler(nursery, limited)
            with pytest.raises(Refused) as refused:
                await A2AClient.discover(http, url=origin, rpc=Http11())
            assert refused.value.retry_after == 7.0
            assert asked == ["/.well-known/agent-card.json"]
            nursery.cancel_scope.cancel()
