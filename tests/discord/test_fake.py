"""The fake Discord keeps the reference's rules (reference/discord-protocol.md §1, §4, §5,
§7, §9), checked with a bare WebSocket and HTTP client — what the adapter tests do not
reach on their own. (The WebSocket is trio-websocket's, opened by
:func:`open_websocket_url` below, which closes its TCP stream on every path:
trio-websocket's context leaves it open when the server closes.)"""

from __future__ import annotations

import contextlib
import json
import ssl
import urllib.parse
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, wrap_client_stream

from tests.fakes.discord_api import FakeDiscord

from .conftest import DM, GUILD, GUILD_CHANNEL, USER


@contextlib.asynccontextmanager
async def open_websocket_url(url: str) -> AsyncIterator[WebSocketConnection]:
    """A client WebSocket whose TCP stream is closed on every path (trio-websocket's own
    context closes with 1000, and a cancelled handshake could leave its socket open)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    secure = parts.scheme == "wss"
    port = parts.port or (443 if secure else 80)
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    with trio.fail_after(15):
        stream: trio.abc.Stream = await trio.open_tcp_stream(host, port)
    try:
        if secure:
            stream = trio.SSLStream(stream, ssl.create_default_context(), server_hostname=host)
        async with trio.open_nursery() as nursery:
            with trio.fail_after(15):
                ws = await wrap_client_stream(nursery, stream, host, resource)  # type: ignore[arg-type]
            try:
                yield ws
            finally:
                nursery.cancel_scope.cancel()
    finally:
        await trio.aclose_forcefully(stream)


async def recv(ws: WebSocketConnection) -> dict[str, Any]:
    with trio.fail_after(5):
        payload: dict[str, Any] = json.loads(await ws.get_message())
        return payload


async def identify(ws: WebSocketConnection, fake: FakeDiscord, **d: Any) -> dict[str, Any]:
    assert (await recv(ws))["op"] == 10
    body = {"token": fake.token, "intents": 4609, "properties": {}, "shard": [0, 1], **d}
    await ws.send_message(json.dumps({"op": 2, "d": body}))
    return await recv(ws)


async def close_code(ws: WebSocketConnection) -> int | None:
    with trio.fail_after(5):
        try:
            while True:
                await ws.get_message()
        except ConnectionClosed as closed:
            return None if closed.reason is None else closed.reason.code


def rest(fake: FakeDiscord, token: str | None = None) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        base_url=f"{fake.origin}/api/v10",
        headers={"Authorization": f"Bot {token or fake.token}"},
    )


async def test_second_identify_4005_and_two_sessions_on_one_shard_both_receive(
    fake: FakeDiscord,
) -> None:
    async with open_websocket_url(fake.gateway_url) as a, open_websocket_url(fake.gateway_url) as b:
        ready_a = await identify(a, fake)
        ready_b = await identify(b, fake)
        assert ready_a["t"] == ready_b["t"] == "READY" and ready_a["s"] == 1
        assert ready_a["d"]["session_id"] != ready_b["d"]["session_id"]
        fake.user_message(DM, USER, "to both")
        got_a, got_b = await recv(a), await recv(b)
        assert got_a["d"]["id"] == got_b["d"]["id"] and got_a["s"] == got_b["s"] == 2
        await a.send_message(json.dumps({"op": 2, "d": {"token": fake.token, "intents": 1}}))
        assert await close_code(a) == 4005


async def test_resume_replays_then_resumed_and_4007_for_a_seq_ahead(fake: FakeDiscord) -> None:
    async with open_websocket_url(fake.gateway_url) as ws:
        ready = await identify(ws, fake)
        await ws.aclose(4000)  # resumable: the session stays
    session = ready["d"]["session_id"]
    fake.user_message(DM, USER, "missed 1")
    fake.user_message(DM, USER, "missed 2")
    async with open_websocket_url(fake.resume_gateway_url) as ws:
        await recv(ws)
        resume = {"token": fake.token, "session_id": session, "seq": 1}
        await ws.send_message(json.dumps({"op": 6, "d": resume}))
        replay = [await recv(ws) for _ in range(3)]
        assert [(p["s"], p["t"]) for p in replay] == [
            (2, "MESSAGE_CREATE"),
            (3, "MESSAGE_CREATE"),
            (4, "RESUMED"),
        ]
        await ws.aclose(1000)  # ends the session
    async with open_websocket_url(fake.resume_gateway_url) as ws:
        await recv(ws)
        await ws.send_message(json.dumps({"op": 6, "d": resume}))
        assert await recv(ws) == {"op": 9, "d": False}
    async with open_websocket_url(fake.gateway_url) as ws:
        ready = await identify(ws, fake)
        await ws.aclose(4000)
    async with open_websocket_url(fake.gateway_url) as ws:
        await recv(ws)
        ahead = {"token": fake.token, "session_id": ready["d"]["session_id"], "seq": 99}
        await ws.send_message(json.dumps({"op": 6, "d": ahead}))
        assert await close_code(ws) == 4007


async def test_heartbeats_acked_unless_withheld_and_oversized_payload_4002(
    fake: FakeDiscord,
) -> None:
    async with open_websocket_url(fake.gateway_url) as ws:
        await identify(ws, fake)
        await ws.send_message(json.dumps({"op": 1, "d": 1}))
        assert await recv(ws) == {"op": 11}
        fake.gateway.withhold_acks = 1
        await ws.send_message(json.dumps({"op": 1, "d": 1}))
        fake.gateway.request_heartbeat()
        assert await recv(ws) == {"op": 1, "d": None}  # no ACK came before it
        await ws.send_message(json.dumps({"op": 1, "d": "x" * 5000}))
        assert await close_code(ws) == 4002
    assert [h.d for h in fake.gateway.heartbeats()] == [1, 1]


async def test_intents_filter_and_blank_content(fake: FakeDiscord) -> None:
    fake.channel(GUILD_CHANNEL, GUILD)
    async with open_websocket_url(fake.gateway_url) as ws:
        await identify(ws, fake, intents=512)  # guild messages only, no message content
        fake.user_message(DM, USER, "a DM")  # not subscribed
        fake.user_message(GUILD_CHANNEL, USER, "secret", guild_id=GUILD)
        fake.user_message(GUILD_CHANNEL, USER, "hi bot", guild_id=GUILD, mention_bot=True)
        first, second = await recv(ws), await recv(ws)
        assert first["d"]["content"] == ""  # privileged content withheld
        assert second["d"]["content"].endswith("hi bot")  # mentions keep it


async def test_nonce_window_deleted_original_and_errors(fake: FakeDiscord) -> None:
    fake.route_limit = 100
    inbound = fake.user_message(DM, USER, "q")
    body = {"content": "a", "nonce": "n1", "enforce_nonce": True}
    async with rest(fake) as client:
        one = (await client.post(f"/channels/{DM}/messages", json=body)).json()
        two = (await client.post(f"/channels/{DM}/messages", json=body)).json()
        assert one["id"] == two["id"] and len(fake.bot_messages(DM)) == 1
        plain = {"content": "a", "nonce": "n1"}  # without enforce_nonce: a new message
        assert (await client.post(f"/channels/{DM}/messages", json=plain)).json()["id"] != one["id"]
        three = {**body, "nonce": "n3"}
        posted = (await client.post(f"/channels/{DM}/messages", json=three)).json()
        fake.delete_message(posted["id"])
        gone = await client.post(f"/channels/{DM}/messages", json=three)
        assert (gone.status_code, gone.json().get("code")) == (404, 10008), gone.json()
        long = await client.post(f"/channels/{DM}/messages", json={"content": "x" * 2001})
        assert long.json()["code"] == 50035
        unknown_ref = {"content": "r", "message_reference": {"message_id": "1"}}
        assert (await client.post(f"/channels/{DM}/messages", json=unknown_ref)).status_code == 400
        history = (await client.get(f"/channels/{DM}/messages", params={"after": 0})).json()
        assert history[-1]["id"] == inbound["id"] and all("nonce" not in m for m in history)
        edit = await client.patch(f"/channels/{DM}/messages/{inbound['id']}", json={"content": "x"})
        assert edit.json()["code"] == 50005
        assert (await client.post(f"/channels/{DM}/typing")).status_code == 204
    fake.nonce_window_s = 0.0
    async with rest(fake) as client:
        fresh = await client.post(f"/channels/{DM}/messages", json={**body, "nonce": "n2"})
        await trio.sleep(0.01)
        again = await client.post(f"/channels/{DM}/messages", json={**body, "nonce": "n2"})
        assert fresh.json()["id"] != again.json()["id"]  # outside the window: posted twice


async def test_rate_limit_headers_and_cloudflare_ban(fake: FakeDiscord) -> None:
    fake.route_limit = 1
    fake.ban_after_invalid = 3
    fake.channel(DM)
    async with rest(fake) as client:
        ok = await client.post(f"/channels/{DM}/typing")
        assert ok.headers["x-ratelimit-remaining"] == "0"
        limited = await client.post(f"/channels/{DM}/typing")
        assert limited.status_code == 429
        assert limited.json()["global"] is False and limited.json()["retry_after"] > 0
        assert limited.headers["x-ratelimit-scope"] == "user"
    async with rest(fake, token="wrong") as client:
        for _ in range(2):
            assert (await client.get("/users/@me")).status_code == 401
        banned = await client.get("/users/@me")
        assert banned.status_code == 429 and "x-ratelimit-scope" not in banned.headers
        assert banned.headers["content-type"] == "text/html"


@pytest.mark.parametrize("code", [4004, 4013, 4014, 4010])
async def test_identify_refusals(code: int, fake: FakeDiscord) -> None:
    choices: dict[int, dict[str, Any]] = {
        4004: {"token": "wrong"},
        4013: {"intents": 1 << 40},
        4014: {"intents": 4609 | 32768},
        4010: {"shard": [1, 1]},
    }
    d = choices[code]
    async with open_websocket_url(fake.gateway_url) as ws:
        await recv(ws)
        body = {"token": fake.token, "intents": 4609, "properties": {}, **d}
        await ws.send_message(json.dumps({"op": 2, "d": body}))
        assert await close_code(ws) == code


async def test_max_concurrency_and_daily_total(fake: FakeDiscord) -> None:
    fake.max_concurrency = 1
    fake.identify_remaining = 1
    async with open_websocket_url(fake.gateway_url) as ws:
        assert (await identify(ws, fake))["t"] == "READY"
    async with open_websocket_url(fake.gateway_url) as ws:
        assert await identify(ws, fake) == {"op": 9, "d": False}  # within 5 s
    fake.max_concurrency = 10
    async with open_websocket_url(fake.gateway_url) as ws:
        await recv(ws)
        body = {"token": fake.token, "intents": 4609, "properties": {}}
        await ws.send_message(json.dumps({"op": 2, "d": body}))
        assert await close_code(ws) == 4004  # the daily total ran out: the token is reset
    assert fake.token_reset
