"""Hostile frames on the web chat socket: nesting past the JSON parser's recursion limit and
lone surrogates (legal as ``\\ud800`` escapes in JSON, not storable as UTF-8)."""

from __future__ import annotations

import json

import trio

from prismd.channel import Reply

from ._support import connect, hello, recv, send, start

ACTOR = "actor_0123456789"


async def test_deeply_nested_frame_is_an_error_frame(nursery: trio.Nursery) -> None:
    """It used to raise ``RecursionError`` out of the session and drop the socket."""
    with trio.fail_after(10):
        adapter, recorder = await start(nursery)
        async with connect(adapter) as ws:
            await hello(ws, ACTOR)
            await ws.send_message("[" * 30_000 + "]" * 30_000)
            assert await recv(ws) == {"type": "error", "message": "frame is not valid JSON"}
            await send(ws, {"type": "message", "id": "ok", "text": "fine"})
            assert (await recv(ws))["status"] == "accepted"
    assert [e.text for e in recorder.events] == ["fine"]


async def test_lone_surrogate_text_is_admitted_as_replacement_char(nursery: trio.Nursery) -> None:
    """The journal cannot store a lone surrogate (the store refuses it and the runtime calls
    that ``unavailable``, so the message could never get through): it becomes U+FFFD."""
    with trio.fail_after(10):
        adapter, recorder = await start(nursery)
        async with connect(adapter) as ws:
            await hello(ws, ACTOR)
            await ws.send_message('{"type": "message", "id": "m1", "text": "a\\ud800b"}')
            assert (await recv(ws))["status"] == "accepted"
    assert [e.text for e in recorder.events] == ["a\ufffdb"]


async def test_reply_with_lone_surrogate_is_delivered(nursery: trio.Nursery) -> None:
    """A reply text holding a lone surrogate used to raise inside the WebSocket library's
    UTF-8 encoding (``send`` raising = an ambiguous delivery)."""
    with trio.fail_after(10):
        adapter, _ = await start(nursery)
        async with connect(adapter) as ws:
            await hello(ws, ACTOR)
            result = await adapter.send(
                Reply(
                    connection_id="web",
                    external_conversation_id=ACTOR,
                    text="x\ud800y",
                    kind="final",
                )
            )
            assert result.delivered
            message = await ws.get_message()
            assert isinstance(message, str)
            assert json.loads(message)["text"] in ("x\ud800y", "x\ufffdy")
