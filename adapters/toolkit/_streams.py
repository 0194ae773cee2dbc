"""Closing a server-side stream so that the last thing we wrote reaches the peer."""

from __future__ import annotations

import trio

__all__ = ["DRAIN_BYTES", "DRAIN_S", "close_gracefully"]

DRAIN_S = 1.0
"""How long :func:`close_gracefully` waits for the peer to finish sending."""
DRAIN_BYTES = 4 * 1024 * 1024
"""How much it reads (and discards) at most meanwhile."""
_CHUNK = 65536


async def close_gracefully(
    stream: trio.SocketStream, *, drain_s: float = DRAIN_S, max_bytes: int = DRAIN_BYTES
) -> None:
    """Half-close, discard what the peer still sends (bounded in time and bytes), close.

    Closing a socket with unread input makes the kernel send a reset, and the peer may then
    lose the answer we just wrote: a ``413`` to a client still uploading, a JSON-RPC error
    to a client that sent more lines. Never raises for a peer that went away; cancellation
    propagates (the stream is still closed).
    """
    try:
        await stream.send_eof()
        discarded = 0
        with trio.move_on_after(drain_s):
            while discarded < max_bytes:
                data = await stream.receive_some(_CHUNK)
                if not data:
                    break
                discarded += len(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        await trio.aclose_forcefully(stream)
