"""``open_jsonrpc_client(close_on_bad_frame=True)``: a bad frame ends the connection (after
every notification read before it) and ``closed_reason`` says why; the default keeps
dropping unreadable frames. Also ``parse_message(strict=True)``."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from adapters.toolkit import Incoming, JsonRpcConnectionError, open_jsonrpc_client
from prismd.jsonrpc import FrameError, Response, parse_message

DEADLINE = 10
NOTE = b'{"jsonrpc":"2.0","method":"receive","params":{"n":1}}\n'


async def _client_reading(data: bytes, **kwargs: Any) -> tuple[list[Incoming], str]:
    """A client over a memory stream whose server sent ``data`` (and then nothing): the
    notifications it delivered and why the connection ended."""
    client_side, server_side = trio.testing.memory_stream_pair()
    seen: list[Incoming] = []
    with trio.fail_after(DEADLINE):
        async with open_jsonrpc_client(client_side, **kwargs) as client:
            await server_side.send_all(data)
            with trio.move_on_after(1):
                async for note in client.notifications:
                    seen.append(note)
            reason = client.closed_reason
    await server_side.aclose()
    return seen, reason


@pytest.mark.parametrize(
    "bad",
    [
        b"not json\n",
        b"[1,2]\n",
        b'{"jsonrpc":"1.0","method":"receive"}\n',
        b'{"method":"receive"}\n',
        b'"just a string"\n',
    ],
)
async def test_a_bad_frame_closes_after_what_came_before(bad: bytes) -> None:
    seen, reason = await _client_reading(NOTE + bad + NOTE, close_on_bad_frame=True)
    assert [n.params for n in seen] == [{"n": 1}]
    assert reason == "malformed"


@pytest.mark.slow
async def test_the_default_drops_unreadable_frames_and_goes_on() -> None:
    seen, reason = await _client_reading(NOTE + b"not json\n" + NOTE)
    assert len(seen) == 2 and reason == "open"


async def test_an_oversized_frame_is_its_own_reason() -> None:
    big = b'{"jsonrpc":"2.0","method":"receive","params":"' + b"x" * 3000 + b'"}\n'
    seen, reason = await _client_reading(NOTE + big, max_frame_bytes=1024, close_on_bad_frame=True)
    assert len(seen) == 1 and reason == "oversized"


async def test_eof_closed_and_broken_are_told_apart() -> None:
    client_side, server_side = trio.testing.memory_stream_pair()
    with trio.fail_after(DEADLINE):
        async with open_jsonrpc_client(client_side, close_on_bad_frame=True) as client:
            # One tuple: `closed_reason == "open"` alone would narrow the attribute for mypy
            # past the awaits below, where it changes.
            assert (client.closed_reason, client.closed) == ("open", False)
            await server_side.send_eof()
            with pytest.raises(trio.EndOfChannel):
                await client.notifications.receive()
            assert client.closed_reason == "eof" and client.closed
            with pytest.raises(JsonRpcConnectionError):
                await client.call("version")
        assert client.closed_reason == "eof"  # the first reason stays
    left, _right = trio.testing.memory_stream_pair()
    async with open_jsonrpc_client(left) as other:
        pass
    assert other.closed_reason == "closed"


def test_parse_message_strict_requires_jsonrpc_2() -> None:
    frame = b'{"id":1,"result":5}'
    assert parse_message(frame) == Response(1, result=5)
    with pytest.raises(FrameError):
        parse_message(frame, strict=True)
    assert parse_message(b'{"jsonrpc":"2.0","id":1,"result":5}', strict=True) == Response(
        1, result=5
    )
