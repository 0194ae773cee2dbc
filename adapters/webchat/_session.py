"""The web chat's sessions: one per proved WebSocket, joined to its actor's conversation.

A socket joins its actor only after its hello proved the actor's resume token (or claimed a
fresh actor); then it gets the ``history`` frame, the runtime re-drives the actor's held
replies, and every valid frame becomes one ``admit`` call answered by one ``admission``
frame. Frames: docs/webchat-protocol.md.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Sequence

import attrs
import trio

from prismd.channel import Admit, PastReply
from stores import Clock

from ._frames import (
    BadFrame,
    admission_frame,
    decode_frame,
    error_frame,
    event_from,
    hello_from,
    history_frame,
)
from ._past import Conversations, conversation_past
from ._socket import Socket, get_message, send_frame, to_each
from ._tokens import ResumeTokens

__all__ = ["ESTABLISHED", "Sessions"]

log = logging.getLogger("prismd.webchat")

HELLO_TIMEOUT_S = 30.0
"""A socket that sends no valid hello in this time is closed (1008)."""
CLOSE_BUDGET_S = 2.0
RESUME_CHECK_TIMEOUT_S = 10.0
ESTABLISHED = "established"


@attrs.define(eq=False)
class Sessions:
    """The open sockets of one web chat connection, by actor, and what they count."""

    connection_id: str
    admit: Admit
    tokens: ResumeTokens
    clock: Clock
    max_message_bytes: int
    idle_timeout_s: float
    history_limit: int
    conversations: Conversations | None = None
    background: trio.Nursery | None = None
    """The listener's nursery, where re-drives run (they outlive a socket)."""
    by_actor: dict[str, set[Socket]] = attrs.field(factory=dict)
    admissions: int = 0
    rejected_frames: int = 0
    hellos_refused: int = 0

    def sockets(self, actor: str) -> list[Socket]:
        return list(self.by_actor.get(actor, ()))

    async def to_actor(self, actor: str, frame: str) -> None:
        """``frame`` to every open socket of ``actor``."""
        await to_each(self.sockets(actor), functools.partial(send_frame, frame=frame))

    async def run(self, sock: Socket) -> None:
        """The whole life of one socket after its handshake."""
        hello = await self._hello(sock)
        if hello is None:
            return
        actor, presented = hello
        try:
            with trio.fail_after(RESUME_CHECK_TIMEOUT_S):
                resumed = await self.tokens.redeem(actor, presented)
        except Exception as exc:
            log.warning("web chat resume check failed: %s", type(exc).__name__)
            await send_frame(
                sock, error_frame("the chat is unavailable; try again later", "unavailable")
            )
            await sock.ws.aclose(1011, "unavailable")
            return
        if resumed is None:
            # Wrong or missing token for an actor another browser owns: this socket never
            # joins that conversation (no replies, no history).
            self.hellos_refused += 1
            await send_frame(
                sock,
                error_frame(
                    "this chat belongs to another browser; start a new one", "resume_refused"
                ),
            )
            await sock.ws.aclose(1008, "resume refused")
            return
        # Proved: from now on an established socket (the idlest one gives way if full).
        sock.slot.move(ESTABLISHED)
        ready: dict[str, str] = {"type": "ready", "actor": actor}
        if resumed.issued is not None:
            ready["resume"] = resumed.issued
        if not await send_frame(sock, json.dumps(ready)):
            return
        self.by_actor.setdefault(actor, set()).add(sock)
        try:
            await self._joined(sock, actor)
        finally:
            peers = self.by_actor.get(actor)
            if peers is not None:
                peers.discard(sock)
                if not peers:
                    del self.by_actor[actor]

    async def _hello(self, sock: Socket) -> tuple[str, str | None] | None:
        """The socket's valid hello, or ``None`` once it closed or sent none in time."""
        with trio.move_on_after(HELLO_TIMEOUT_S):
            while True:
                message = await get_message(sock.ws)
                if message is None:
                    return None
                try:
                    return hello_from(decode_frame(message, self.max_message_bytes))
                except BadFrame as bad:
                    self.rejected_frames += 1
                    if not await send_frame(sock, error_frame(bad.args[0])):
                        return None
        await send_frame(sock, error_frame("no hello received in time"))
        await sock.ws.aclose(1008, "no hello")
        return None

    async def _joined(self, sock: Socket, actor: str) -> None:
        conversations = self.conversations
        if conversations is not None:
            # Joined first, then history: a reply marked delivered meanwhile is either in
            # the history or sent live (the page shows a replyId once), never missed.
            # Frames are read only after it, so ``history`` is the first frame after
            # ``ready`` that the socket's own messages can cause.
            if not await self._send_history(sock, actor, conversations):
                return
            if self.background is not None:
                # In the listener's nursery, not this socket's: a re-drive cut short by the
                # tab closing again would leave a claimed reply for the operator.
                self.background.start_soon(self._redeliver, actor, conversations)
        while True:
            message = await self._next_message(sock)
            if message is None:
                return
            sock.slot.touch()
            try:
                frame = decode_frame(message, self.max_message_bytes)
                event, client_id = event_from(self.connection_id, actor, frame, self.clock.now_ms())
            except BadFrame as bad:
                self.rejected_frames += 1
                if not await send_frame(sock, error_frame(bad.args[0])):
                    return
                continue
            try:
                admission = await self.admit(event)
            except Exception as exc:
                # the client keeps the message and re-sends it; the journal dedups it
                log.warning("web chat admit failed: %s", type(exc).__name__)
                if not await send_frame(sock, error_frame("the message could not be admitted")):
                    return
                continue
            self.admissions += 1
            if not await send_frame(sock, admission_frame(client_id, admission)):
                return

    async def _next_message(self, sock: Socket) -> str | bytes | None:
        """The socket's next message; ``None`` once it closed, or after closing it (1000
        "idle") when it had neither a message nor a reply for ``idle_timeout_s``."""
        while True:
            with trio.move_on_at(sock.slot.last_active + self.idle_timeout_s):
                return await get_message(sock.ws)
            if trio.current_time() >= sock.slot.last_active + self.idle_timeout_s:
                with trio.move_on_after(CLOSE_BUDGET_S):
                    await sock.ws.aclose(1000, "idle")
                return None
            # a reply went out meanwhile: the socket is not idle, wait on

    async def _send_history(self, sock: Socket, actor: str, conversations: Conversations) -> bool:
        """The ``history`` frame (empty when the journal cannot be read); False when the
        socket did not take it."""
        past: Sequence[PastReply] = ()
        if self.history_limit:
            past = await conversation_past(
                conversations,
                self.connection_id,
                actor,
                self.history_limit,
                RESUME_CHECK_TIMEOUT_S,
            )
        return await send_frame(sock, history_frame(actor, past))

    async def _redeliver(self, actor: str, conversations: Conversations) -> None:
        """Ask the runtime to re-drive the actor's held replies (they reach every open
        socket of the actor through the adapter's ``send``). Never raises."""
        try:
            await conversations.redeliver_pending(
                connection_id=self.connection_id,
                external_conversation_id=actor,
                external_actor_id=actor,
            )
        except Exception as exc:
            log.warning("web chat re-drive failed: %s", type(exc).__name__)
