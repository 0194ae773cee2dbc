"""The webhook spreader itself: a delivery broken off mid-body is counted and leaves nothing
behind for the collector (under ``-W error`` a leftover async generator fails whichever test
the collector happens to run in — it failed a multi-instance kill test in CI)."""

from __future__ import annotations

import gc
import json
import random
import socket
import struct
import warnings

import httpx
import trio
import trio.lowlevel

from tests.support.spreader import Spreader

BODY_BYTES = 8 * 1024 * 1024
"""Far more than loopback's socket buffers hold, so the body's write is still under way when
the server resets the connection."""


async def _reset_after_headers(listener: trio.SocketListener, seen: list[bytes]) -> None:
    stream = await listener.accept()
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = await stream.receive_some(4096)
        assert chunk, "the client closed before its headers ended"
        head += chunk
    seen.append(head.split(b"\r\n\r\n", 1)[0])
    sock = stream.socket
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # a reset, as a killed instance's kernel answers


async def test_a_delivery_broken_between_headers_and_body_is_counted_and_leaves_nothing() -> None:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    listener = listeners[0]
    assert isinstance(listener, trio.SocketListener)
    port = listener.socket.getsockname()[1]
    spreader = Spreader(ports=[port], path="/hook", secret="s", rng=random.Random(1))
    update = {"update_id": 1, "message": {"text": "x" * BODY_BYTES}}
    seen: list[bytes] = []
    with warnings.catch_warnings(record=True) as caught, trio.fail_after(30):
        warnings.simplefilter("always")
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_reset_after_headers, listener, seen)
            async with httpx.AsyncClient(timeout=10) as client:
                assert await spreader._post(client, 0, update) is False
        await listener.aclose()
        gc.collect()
        await trio.lowlevel.checkpoint()  # Trio finalizes a collected generator then
    assert spreader.statuses == {"broken": 1}
    length = f"content-length: {len(json.dumps(update))}".encode()
    assert len(seen) == 1 and length in seen[0].lower()
    leftovers = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert leftovers == []
