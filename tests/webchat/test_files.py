"""The files that go with a reply (``file`` frames, docs/webchat-protocol.md): sent to every
tab of the actor after its reply, held with no tab open, refused over the cap; the cap is
declared in the adapter's features and bounded so a frame stays under 1 MiB."""

from __future__ import annotations

import base64

import pytest
import trio

from adapters.webchat._adapter import MAX_FILE_BYTES, WebchatAdapter
from prismd.channel import OutboundFile, Reply, SendResult

from ._support import Recorder, connect, hello, recv, start

ACTOR = "actor_files_0123"
DATA = bytes(range(256)) * 3 + b"\r\n"


def reply() -> Reply:
    return Reply("web", ACTOR, "a chart", "final", operation_id="op-7")


async def test_a_file_reaches_every_tab_after_its_reply(nursery: trio.Nursery) -> None:
    with trio.fail_after(10):
        adapter, _ = await start(nursery)
        assert adapter.features.max_file_bytes == MAX_FILE_BYTES
        async with connect(adapter) as tab1, connect(adapter) as tab2:
            await hello(tab2, ACTOR, await hello(tab1, ACTOR))
            assert (await adapter.send(reply())).delivered
            file = OutboundFile("chart.png", "image/png", DATA)
            assert (await adapter.send_file(reply(), file)).delivered
            for tab in (tab1, tab2):
                assert (await recv(tab))["type"] == "reply"
                frame = await recv(tab)
                assert frame == {
                    "type": "file",
                    "replyId": "op-7",
                    "name": "chart.png",
                    "mediaType": "image/png",
                    "size": len(DATA),
                    "data": base64.b64encode(DATA).decode(),
                }


async def test_a_file_without_a_tab_is_held_and_one_over_the_cap_refused(
    nursery: trio.Nursery,
) -> None:
    with trio.fail_after(10):
        adapter, _ = await start(nursery, max_file_bytes=100)
        assert adapter.features.max_file_bytes == 100
        small = OutboundFile("a.txt", None, b"x" * 100)
        assert await adapter.send_file(reply(), small) == SendResult.hold("webchat_not_connected")
        big = OutboundFile("b.txt", None, b"x" * 101)
        assert await adapter.send_file(reply(), big) == SendResult(False, reason="file_too_large")


def test_the_cap_keeps_a_frame_under_one_mebibyte() -> None:
    assert 4 * MAX_FILE_BYTES / 3 + 4096 < 1024 * 1024
    with pytest.raises(ValueError, match="max_file_bytes"):
        WebchatAdapter(
            connection_id="web",
            listen="127.0.0.1:0",
            admit=Recorder(),
            max_file_bytes=MAX_FILE_BYTES + 1,
        )
