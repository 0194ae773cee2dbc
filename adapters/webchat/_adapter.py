"""The local web chat channel: a chat page and a WebSocket on one TCP port.

The HTTP front is :mod:`._front`, the WebSocket under it :mod:`._socket`, a socket's session
:mod:`._session` (its frames: :mod:`._frames`), the browsers' resume tokens :mod:`._tokens`.
Routes, access, connection budgets and the WebSocket protocol: docs/webchat-protocol.md.
"""

from __future__ import annotations

import functools
import logging
import uuid
from collections.abc import Mapping

import attrs
import trio

from prismd.channel import (
    AdapterFatalError,
    AdapterFeatures,
    Admit,
    OutboundFile,
    Preview,
    Reply,
    SendResult,
)
from stores import SYSTEM_CLOCK, CheckpointStore, Clock
from stores.memory import MemoryStore

from ..toolkit import (
    AdapterDefaults,
    Budget,
    ConnectionLimiter,
    Slot,
    close_gracefully,
    is_loopback_host,
    open_listeners,
    read_request_head,
    serve_limited,
    server_connection,
)
from ._frames import file_frame, reply_frame
from ._front import HttpFront, parse_listen
from ._past import Conversations
from ._previews import LivePreviews
from ._session import ESTABLISHED, Sessions
from ._socket import Socket, send_frame, serve_websocket, to_each
from ._tokens import DAY_MS, ResumeTokens
from ._typing import TypingSignals

__all__ = ["Conversations", "WebchatAdapter", "WebchatStatistics", "parse_listen"]

log = logging.getLogger("prismd.webchat")

MAX_PENDING = 128
"""Default bound on connections in their HTTP head, being answered, or before their hello."""
MAX_SOCKETS = 256
"""Default bound on established sockets (hello done)."""
IDLE_TIMEOUT_S = 600.0
"""An established socket without a message or a reply for this long is closed (1000)."""
PENDING = "pending"
NOT_CONNECTED = "webchat_not_connected"
HISTORY_LIMIT = 20
"""Delivered replies shown to a reconnecting page (the journal holds no inbound text)."""
SWEEP_INTERVAL_S = 3600.0
MAX_FILE_BYTES = 512 * 1024
"""The largest file sent in a ``file`` frame: its base64 text stays well under the 1 MiB
frame size browsers' and clients' WebSocket libraries accept by default."""


@attrs.frozen
class WebchatStatistics:
    """Bounded counters (no ids, no text)."""

    open_sockets: int
    actors: int
    connections: int
    admissions: int
    """``admit`` calls answered (any status)."""
    rejected_frames: int
    replies_sent: int
    replies_held: int
    """Replies no open socket took (``SendResult.hold()``; re-driven on reconnect)."""
    hellos_refused: int
    """Hellos for an actor id owned by another browser (wrong or missing resume token)."""
    typing_sent: int = 0
    """``typing`` calls that went out as frames (to the open sockets of their actor)."""


@attrs.define(eq=False)
class WebchatAdapter(AdapterDefaults):
    """The web chat channel adapter (:class:`prismd.channel.ChannelAdapter`).

    Guarantees:

    * ``run`` calls ``task_status.started()`` only once the listener accepts connections; the
      bound address is then in :attr:`bound` (bind port 0 in tests).
    * Every valid message frame becomes exactly one ``admit`` call, answered by one
      ``admission`` frame; invalid frames get an ``error`` frame and are never admitted.
    * ``send`` never raises for a closed or slow socket: it returns
      ``SendResult(True, message_id=…)`` when at least one open socket of the conversation took
      the reply, else ``SendResult.hold("webchat_not_connected")`` (not sent, not failed).
    * A socket joins its actor's conversation only after its hello proved the actor's
      resume token (or took a fresh actor); then, with ``conversations``, it gets the
      ``history`` frame and the runtime re-drives the conversation's held replies.
    * A misbehaving client never takes the listener down.

    The page sends no attachments and nothing is held outside ``run``
    (:class:`~adapters.toolkit.AdapterDefaults`).
    """

    _connection_id: str = attrs.field(alias="connection_id")
    listen: str
    admit: Admit
    access_token: str | None = None
    clock: Clock = SYSTEM_CLOCK
    max_message_bytes: int = 64 * 1024
    max_pending: int = MAX_PENDING
    max_sockets: int = MAX_SOCKETS
    idle_timeout_s: float = IDLE_TIMEOUT_S
    pairing_only: bool = False
    """Every grant of this connection needs pairing (``prismctl pair``), so a listener off
    loopback is acceptable without an access token: strangers reach the socket but no agent."""
    checkpoints: CheckpointStore | None = None
    """Where resume tokens are kept (hashed); ``None`` keeps them in memory until the process
    ends (tests), so every browser must start a new chat after a restart."""
    conversations: Conversations | None = None
    """The runtime's history and re-drive (late-bound by the daemon's host)."""
    resume_ttl_days: int = 7
    """An actor id unused this long is free again (the daemon passes ``retention_days``)."""
    history_limit: int = HISTORY_LIMIT
    max_file_bytes: int = MAX_FILE_BYTES
    """Files that go with replies, up to this size (at most :data:`MAX_FILE_BYTES`)."""
    bound: tuple[str, int] | None = attrs.field(default=None, init=False)
    _listening: bool = attrs.field(default=False, init=False)
    limiter: ConnectionLimiter = attrs.field(init=False)
    _replies_sent: int = attrs.field(default=0, init=False)
    _replies_held: int = attrs.field(default=0, init=False)
    _front: HttpFront = attrs.field(init=False)
    _tokens: ResumeTokens = attrs.field(init=False)
    _sessions: Sessions = attrs.field(init=False)
    _previews: LivePreviews = attrs.field(init=False)
    _typing: TypingSignals = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.resume_ttl_days <= 3650:
            raise ValueError("resume_ttl_days must be in 1..3650")
        if not 0 <= self.history_limit <= 100:
            raise ValueError("history_limit must be in 0..100")
        if not 0 <= self.max_file_bytes <= MAX_FILE_BYTES:
            raise ValueError(f"max_file_bytes must be in 0..{MAX_FILE_BYTES}")
        checkpoints = self.checkpoints
        if checkpoints is None:
            checkpoints = MemoryStore(clock=self.clock).checkpoints
        self._front = HttpFront(self.access_token, lambda: self.health()["listener"])
        self._tokens = ResumeTokens(
            checkpoints, self._connection_id, self.clock, self.resume_ttl_days * DAY_MS
        )
        self._sessions = Sessions(
            self._connection_id,
            self.admit,
            self._tokens,
            self.clock,
            self.max_message_bytes,
            self.idle_timeout_s,
            self.history_limit,
            self.conversations,
        )
        self._previews = LivePreviews(self._sessions.to_actor)
        self._typing = TypingSignals(self._sessions.to_actor, self._previews.busy)
        self.limiter = ConnectionLimiter(
            f"web chat {self._connection_id}",
            {
                PENDING: Budget(
                    self.max_pending,
                    "evict",
                    "connections in their HTTP head or before their hello",
                ),
                ESTABLISHED: Budget(self.max_sockets, "evict", "established sockets"),
            },
            logger=log,
        )

    @property
    def connection_id(self) -> str:
        return self._connection_id

    # ------------------------------------------------------------------ supervisor surface

    def health(self) -> Mapping[str, str]:
        return {"listener": "listening" if self._listening else "stopped"}

    @property
    def receiver_lease_held(self) -> bool:
        """The web chat has no receiver lease: each browser is its own transport."""
        return False

    async def wait_receiver_lease(self, held: bool) -> None:
        if held:
            await trio.sleep_forever()
        await trio.lowlevel.checkpoint()

    @property
    def features(self) -> AdapterFeatures:
        """Previews (the answer's live text), typing (:mod:`._typing`), notices for
        messages settled unanswered (:mod:`._past`) and the files that go with replies
        (``file`` frames); the page sends no attachments."""
        return AdapterFeatures(
            previews=True,
            typing=True,
            unanswered_notices=True,
            max_file_bytes=self.max_file_bytes,
        )

    def send_draft(self, preview: Preview) -> None:
        """Show a streaming answer's text in the actor's open tabs (a ``preview`` frame,
        coalesced, never after the reply that ends it; see :mod:`._previews`). Never
        blocks or raises; nothing when no tab of the actor is open."""
        actor = preview.external_conversation_id
        background = self._sessions.background
        if (
            preview.connection_id != self._connection_id
            or background is None
            or not self._sessions.by_actor.get(actor)
        ):
            return
        self._previews.offer(background, actor, preview.text)

    async def send_typing(
        self, external_conversation_id: str, thread_id: str | None = None
    ) -> None:
        """A ``typing`` frame to the actor's open tabs (see :mod:`._typing`); never raises,
        nothing when no tab of the actor is open."""
        if not self._sessions.by_actor.get(external_conversation_id):
            await trio.lowlevel.checkpoint()
            return
        await self._typing.signal(external_conversation_id)

    def statistics(self) -> WebchatStatistics:
        sessions = self._sessions
        return WebchatStatistics(
            open_sockets=sum(len(s) for s in sessions.by_actor.values()),
            actors=len(sessions.by_actor),
            connections=self.limiter.open(),
            admissions=sessions.admissions,
            rejected_frames=sessions.rejected_frames,
            replies_sent=self._replies_sent,
            replies_held=self._replies_held,
            hellos_refused=sessions.hellos_refused,
            typing_sent=self._typing.sent,
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled.

        Raises :class:`AdapterFatalError` for an unusable ``listen`` and for a non-loopback
        address without an access token; ``OSError`` if the port cannot be bound.
        """
        try:
            host, port = parse_listen(self.listen)
        except ValueError:
            raise AdapterFatalError("web chat listen address must be HOST:PORT") from None
        self._front.on_loopback = is_loopback_host(host)
        if not self._front.on_loopback and not self.access_token and not self.pairing_only:
            raise AdapterFatalError("web chat on a non-loopback address needs an access token")
        async with open_listeners(host, port) as (listeners, self.bound):
            try:
                async with trio.open_nursery() as nursery:
                    self._sessions.background = nursery
                    await nursery.start(
                        functools.partial(serve_limited, budget=PENDING),
                        self._handle_connection,
                        listeners,
                        self.limiter,
                    )
                    nursery.start_soon(self._sweep_resume_tokens)
                    self._listening = True
                    log.info("web chat listening on %s port %d", *self.bound)
                    task_status.started()
            finally:
                self._listening = False
                self._sessions.background = None

    async def send(self, reply: Reply) -> SendResult:
        sockets = self._sessions.sockets(reply.external_conversation_id)
        frame = reply_frame(reply)
        taken: list[Socket] = []

        async def deliver(sock: Socket) -> None:
            if await send_frame(sock, frame):
                sock.slot.touch()
                taken.append(sock)

        # under the actor's preview lock, so no stale preview follows the reply
        async with self._previews.replying(reply.external_conversation_id):
            await to_each(sockets, deliver)
        if not taken:
            # No open socket took it: nothing reached the browser (a timed-out write is an
            # incomplete frame), so the runtime keeps it for the actor's next connection.
            self._replies_held += 1
            return SendResult.hold(NOT_CONNECTED)
        self._replies_sent += 1
        return SendResult(True, message_id="webchat-" + uuid.uuid4().hex)

    async def send_file(self, reply: Reply, file: OutboundFile) -> SendResult:
        """A ``file`` frame to the conversation's open sockets, after its reply: delivered
        when one took it, else held (the reply is sent again, files and all, on the next
        connection). A file over :attr:`max_file_bytes` is refused."""
        if len(file.data) > self.max_file_bytes:
            return SendResult(False, reason="file_too_large")
        frame = file_frame(reply, file)
        taken: list[Socket] = []

        async def deliver(sock: Socket) -> None:
            if await send_frame(sock, frame):
                sock.slot.touch()
                taken.append(sock)

        await to_each(self._sessions.sockets(reply.external_conversation_id), deliver)
        if not taken:
            return SendResult.hold(NOT_CONNECTED)
        return SendResult(True, message_id="webchat-" + uuid.uuid4().hex)

    async def _sweep_resume_tokens(self) -> None:
        while True:
            try:
                deleted = await self._tokens.sweep()
            except Exception as exc:
                log.warning("web chat resume sweep failed: %s", type(exc).__name__)
            else:
                if deleted:
                    log.debug("web chat swept %d unused resume record(s)", deleted)
            await trio.sleep(SWEEP_INTERVAL_S)

    async def _handle_connection(self, stream: trio.SocketStream, slot: Slot) -> None:
        try:
            conn = server_connection()
            # A connection that says nothing is answered 408 too (not just closed), as the
            # web chat always did: a client then knows the server gave up, not that it
            # crashed.
            head = await read_request_head(stream, conn, answer_silence=True)
            if head is not None and await self._front.dispatch(stream, conn, head):
                await serve_websocket(
                    stream,
                    head.raw,
                    slot,
                    self._sessions.run,
                    max_message_bytes=self.max_message_bytes,
                )
            else:
                await close_gracefully(stream)
        except* (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the peer went away; nothing to report
        except* Exception as group:
            kinds = sorted({type(e).__name__ for e in group.exceptions})
            log.warning("web chat connection failed: %s", ", ".join(kinds))
        finally:
            await trio.aclose_forcefully(stream)
