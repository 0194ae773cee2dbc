"""The web chat's typing indicator: a ``typing`` frame while a turn of the actor runs.

The runtime calls :meth:`~adapters.webchat.WebchatAdapter.send_typing` while the agent of a
turn runs, renewed every few seconds (``features.typing``; see
:func:`prismd.runtime._replies.typing_loop`). Each call becomes one ``{"type": "typing"}``
frame to every open socket of the actor; nothing when none is open. The page shows an
indicator (and its Stop button) for :data:`TYPING_TTL_MS` after the last frame, until a
``preview`` or a ``reply`` ends it; it also shows it itself from the ``admission`` of its own
message, so the indicator appears at once whatever delay the runtime waits before typing.

Frames are ordered against replies as previews are: a typing frame is not sent while a
reply (or a preview) is being written to the actor, so none lands right after the reply
that ends the turn (the run has ended before its reply is sent, and its typing task with it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import attrs
import trio

TYPING_FRAME = '{"type": "typing"}'
TYPING_TTL_MS = 8000
"""How long the page shows the indicator after the last signal (the runtime renews it
every 4–4.5 s while the agent runs); stated here for the protocol's description."""


@attrs.define(eq=False)
class TypingSignals:
    """Sends typing frames; counts them (no ids, no text)."""

    send: Callable[[str, str], Awaitable[None]]
    """``send(actor, frame)``: the frame to every open socket of the actor."""
    replying: Callable[[str], bool]
    """A reply or a preview is being written to the actor right now."""
    sent: int = 0

    async def signal(self, actor: str) -> None:
        """One typing frame to the actor's open sockets; never raises for a closed one."""
        if self.replying(actor):
            await trio.lowlevel.checkpoint()
            return
        await self.send(actor, TYPING_FRAME)
        self.sent += 1
