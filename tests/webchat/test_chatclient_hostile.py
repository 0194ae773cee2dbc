"""``prismctl chat`` fed what a terminal or a server can really produce: undecodable input
(Python reads it as lone surrogates), replies holding lone surrogates, absurdly nested frames."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator

import trio
import trio_websocket

from prismd.cli._chat import chat

ACTOR = "terminal-actor-01"


class StrictOut(io.StringIO):
    """Like a UTF-8 stdout with errors='strict': refuses what a real terminal stream would."""

    def write(self, text: str) -> int:
        text.encode("utf-8")
        return super().write(text)


async def _lines() -> AsyncIterator[str]:
    await trio.lowlevel.checkpoint()
    yield "caf\udce9\n"  # b"caf\xe9" (Latin-1) as stdin's surrogateescape decodes it


async def test_hostile_text_both_ways_does_not_crash_the_client(nursery: trio.Nursery) -> None:
    received: list[str | bytes] = []

    async def handler(request: trio_websocket.WebSocketRequest) -> None:
        ws = await request.accept()
        hello = json.loads(await ws.get_message())
        await ws.send_message(json.dumps({"type": "ready", "actor": hello["actor"]}))
        message = await ws.get_message()
        received.append(message)
        frame = json.loads(message)
        await ws.send_message("[" * 100_000 + "]" * 100_000)
        await ws.send_message(
            json.dumps({"type": "admission", "id": frame["id"], "status": "accepted"})
        )
        await ws.send_message(
            json.dumps(
                {"type": "reply", "kind": "final", "text": "x\ud800y", "inReplyTo": frame["id"]}
            )
        )
        await trio.sleep_forever()

    server = await nursery.start(trio_websocket.serve_websocket, handler, "127.0.0.1", 0, None)
    port = server.port
    out, err = StrictOut(), io.StringIO()
    with trio.fail_after(15):
        code = await chat(
            f"http://127.0.0.1:{port}/", actor=ACTOR, token=None, lines=_lines(), out=out, err=err
        )
    assert code == 0, err.getvalue()
    assert json.loads(received[0])["text"] == "caf\udce9"  # sent escaped; the server cleans it
    assert out.getvalue() == "agent> x\ufffdy\n"


async def test_unparsable_url_is_exit_1_with_a_message() -> None:
    """``urlsplit`` raises ValueError for ``http://[::1``; that escaped as a traceback."""
    out, err = io.StringIO(), io.StringIO()
    with trio.fail_after(10):
        code = await chat("http://[::1", actor=ACTOR, token=None, lines=_lines(), out=out, err=err)
    assert code == 1
    assert err.getvalue() == "prismctl chat: the chat URL cannot be parsed\n"
