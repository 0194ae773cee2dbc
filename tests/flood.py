"""What the connection-exhaustion tests share: floods of raw loopback connections (idle,
dripping, held) and the checks a flooded server is judged by."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator

import trio


async def wait_until(predicate: Callable[[], bool], step: float = 0.01) -> None:
    """Poll a condition (on Trio's clock); the caller bounds it with its own deadline."""
    while True:
        if predicate():
            return
        await trio.sleep(step)


@contextlib.contextmanager
def idle_connections(host: str, port: int, count: int) -> Iterator[list[socket.socket]]:
    """``count`` TCP connections that send nothing, opened at once (non-blocking connects:
    on loopback the kernel completes them in its accept queue), closed on exit."""
    socks: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.connect((host, port))
        yield socks
    finally:
        for sock in socks:
            sock.close()


def closed_by_peer(sock: socket.socket) -> bool:
    """The server closed this (non-blocking) connection: EOF or a reset is waiting."""
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


async def gone(stream: trio.SocketStream) -> bool:
    """Wait until the server closes ``stream`` unanswered: True for EOF or a reset (a server
    that closes with unread input resets), False when it answered something instead."""
    try:
        return await stream.receive_some(65536) == b""
    except trio.BrokenResourceError:
        return True


async def drip(stream: trio.SocketStream, data: bytes, every_s: float) -> None:
    """Send ``data`` a byte at a time, ``every_s`` apart, until done or the peer is gone."""
    try:
        for byte in data:
            await stream.send_all(bytes([byte]))
            await trio.sleep(every_s)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
