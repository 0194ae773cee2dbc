"""CPU per gateway frame on the reading side: the gateway's own WebSocket client
(adapters/discord/_websocket.py) against trio-websocket's, which it replaced. Not a test;
run it by hand::

    .venv/bin/python -m tests.discord.gateway_read_bench [--frames 5000] [--rounds 2]

A trio-websocket server in a subprocess sends MESSAGE_CREATE frames of a DM's size,
``paced`` (one every 2 ms: each frame wakes the reader, as the bot's own replies echoed back
do while replies leave at Discord's global limit) and in a ``burst`` (as a backlog comes).
The client reads and parses each frame (``parse_frame``) and hands it on: trio-websocket's
``get_message`` and a channel to another task, as the gateway did before; the own client
handled in the reading task, as it does now. The reading process's CPU time per frame is
printed for each.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import trio
from trio_websocket import open_websocket_url

from adapters.discord._protocol import Frame, parse_frame
from adapters.discord._websocket import connect

SERVER = r"""
import json, sys, trio
from trio_websocket import serve_websocket
frames, paced = int(sys.argv[1]), sys.argv[2] == "paced"
d = {"id": "1000000000000000001", "channel_id": "3000000000000000001", "content": "m123",
     "author": {"id": "2000000000000000001", "username": "u", "global_name": None},
     "timestamp": "2026-12-05T20:00:00.000000+00:00", "edited_timestamp": None,
     "mentions": [], "mention_roles": [], "mention_everyone": False, "attachments": [],
     "embeds": [], "type": 0, "flags": 0, "nonce": "n", "tts": False, "pinned": False}
async def handler(request):
    ws = await request.accept()
    for s in range(1, frames + 1):
        await ws.send_message(json.dumps({"op": 0, "s": s, "t": "MESSAGE_CREATE", "d": d}))
        if paced:
            await trio.sleep(0.002)
    await trio.sleep(5)
async def main():
    async with trio.open_nursery() as nursery:
        server = await nursery.start(serve_websocket, handler, "127.0.0.1", 0, None)
        print(server.port, flush=True)
trio.run(main)
"""


async def read_frames(client: str, mode: str, frames: int) -> float:
    """CPU seconds this process spent reading ``frames`` frames."""
    command = [sys.executable, "-c", SERVER, str(frames), mode]
    server = await trio.lowlevel.open_process(command, stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None
        line = b""
        with trio.fail_after(120):
            while not line.endswith(b"\n"):
                line += await server.stdout.receive_some(64)
            url = f"ws://127.0.0.1:{int(line)}/"
            if client == "own":
                async with connect(url, 5) as ws:
                    started = time.process_time()
                    for _ in range(frames):
                        parse_frame(await ws.get_message())
                    return time.process_time() - started
            async with open_websocket_url(url) as tws:
                started = time.process_time()
                send, receive = trio.open_memory_channel[Frame](256)
                async with trio.open_nursery() as nursery:

                    async def consume() -> None:
                        for _ in range(frames):
                            await receive.receive()

                    nursery.start_soon(consume)
                    for _ in range(frames):
                        await send.send(parse_frame(await tws.get_message()))
                return time.process_time() - started
    finally:
        server.kill()
        await server.wait()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--frames", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    for _round in range(args.rounds):
        for mode in ("paced", "burst"):
            for client in ("trio-websocket", "own"):
                cpu = await read_frames(client, mode, args.frames)
                print(f"{mode} {client}: {cpu * 1e6 / args.frames:.1f} µs CPU per frame")


if __name__ == "__main__":
    trio.run(main)
