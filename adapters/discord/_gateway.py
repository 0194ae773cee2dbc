"""One shard's gateway connection loop, under the shard's fenced receiver lease.

* **One session per shard across instances.** Nothing is opened before the shard's
  :class:`~adapters.toolkit.ReceiverLease` is ours; a standby opens no socket and takes
  over when the lease frees or expires. Losing it cuts the connection (closed 4000, so
  the next holder can resume) and raises :class:`~adapters.toolkit.LeaseLostError`.
* **Resume, not identify.** The session stored at READY (:mod:`._cursor`) is resumed —
  after a reconnect, a restart, or by the instance that took the lease over — from the
  watermark of committed admissions, so Discord replays what was missed. The watermark
  moves only past dispatches handled in order (admitted with a final answer, or nothing
  to admit); it is saved a second after it moved (:mod:`._dispatcher`) and when the
  connection ends, with the fencing token.
* **Closed with 4000 on every path** (a reconnect, a zombie, lease loss, a graceful stop):
  never 1000/1001, which would end the session.
* **Heartbeats** with the first one jittered; a beat due while the last is unacknowledged
  is a zombie connection (close, resume) once nothing says its ACK may still be on the
  way (:class:`~._protocol.Heartbeater`: a short grace, a backlog still being read, a
  stall of this process). Op 1 from Discord beats at once; op 7 resumes;
  op 9 ``true`` resumes, ``false`` forgets the session (identify after 1-5 s); so does a
  Resume turned down twice in a row by a close that may mean the session is gone
  (4003, 4009 …: every close but 4007 and the fatal ones is first resumed).
* **Fatal closes** (4004, 4010-4014) store ``failed`` and raise
  :class:`~prismd.channel.AdapterFatalError`: the connection shows failed, the daemon
  runs on; a standby reading the stored failure does not connect.
* **Identify is budgeted** (:func:`~._protocol.identify_wait_ms`): each one is stored
  before it is sent. After a session that could not be resumed, the known channels are
  backfilled over REST (:mod:`._backfill`).
"""

from __future__ import annotations

import functools
import random as _random
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

import attrs
import trio

from prismd.channel import AdapterFatalError
from stores import Clock

from ..toolkit import Backoff, LeaseLostError, ReceiverLease
from . import _protocol as proto
from ._backfill import backfill
from ._cursor import SessionState, ShardCursor
from ._dispatcher import Dispatcher
from ._identify import IdentifyGate, gateway_url, prepare_identify
from ._parse import snowflake_ms
from ._rest import DiscordApiError, DiscordError, DiscordRest
from ._status import ShardStatus, log
from ._sweep import SETTLE_S, SWEEP_EVERY_S, keep_sweeping
from ._urls import checked_gateway_url
from ._websocket import ConnectionClosed, GatewaySocket, HandshakeError, connect

CLOSE_BUDGET_S = 3.0
CLOSE_HANDSHAKE_S = 0.25
CONNECT_TIMEOUT_S = 15.0
HELLO_TIMEOUT_S = 15.0
"""A socket that sends no Hello within this is left (closed 4000) and tried again."""
MAX_BACKOFF_S = 60.0
RECONNECT_BASE_S = 0.25

HandleMessage = Callable[[Mapping[str, Any], "Shard"], Awaitable[bool]]
"""Admit one message; returns once the admission is final (the watermark may pass it):
whether it was accepted as new (not a duplicate)."""


class _End(Exception):
    """How one connection ended: ``action`` is what to do next."""

    def __init__(
        self, action: proto.CloseAction, why: str, code: int | None = None, refused: bool = False
    ) -> None:
        super().__init__(why)
        self.action = action
        self.why = why
        self.code = code
        self.refused = refused
        """The gateway turned the session down (a close of
        :data:`~._protocol.SESSION_REFUSAL_CODES`, op 9 ``true``)."""


_PRIORITY = (AdapterFatalError, LeaseLostError, _End)


def _first(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The exception that explains a connection's end (fatal, lease, an end, the rest)."""
    leaves: list[BaseException] = []
    stack: list[BaseException] = [group]
    while stack:
        exc = stack.pop()
        if isinstance(exc, BaseExceptionGroup):
            stack.extend(exc.exceptions)
        elif not isinstance(exc, trio.Cancelled):
            leaves.append(exc)
    for kind in _PRIORITY:
        for leaf in leaves:
            if isinstance(leaf, kind):
                return leaf
    return leaves[0] if leaves else group


@attrs.define(eq=False, kw_only=True)
class Shard:
    connection_id: str
    shard: tuple[int, int]
    token: Callable[[], str] = attrs.field(repr=False)
    intents: int
    rest: DiscordRest
    lease: ReceiverLease
    cursor: ShardCursor
    handle_message: HandleMessage
    status: ShardStatus
    clock: Clock
    random: _random.Random
    started_at_ms: int
    """When this daemon started: a stored failure newer than it was a peer's (standby)."""
    identifies_per_day: int = 50
    backfill_pages: int = 5
    sweep_every_s: float = SWEEP_EVERY_S
    sweep_settle_s: float = SETTLE_S
    identify_spacing_ms: int = proto.MIN_IDENTIFY_SPACING_MS
    reidentify_delay_s: float = 1.0
    _heartbeater: proto.Heartbeater | None = attrs.field(default=None, init=False)
    _received_seq: int | None = attrs.field(default=None, init=False)
    _gaps: proto.Gaps = attrs.field(factory=proto.Gaps, init=False)
    _refusals: proto.RefusedResumes = attrs.field(factory=proto.RefusedResumes, init=False)
    gateway: str | None = attrs.field(default=None, init=False)
    """The gateway URL last given by ``GET /gateway[/bot]``."""
    _resume_url_down: bool = attrs.field(default=False, init=False)
    """The resume URL could not be reached: the next attempt resumes through the gateway
    URL (the session is the same wherever it is resumed)."""
    staggered: bool = attrs.field(default=False, init=False)
    """The first Identify waited for its shard bucket."""
    identify_gate: IdentifyGate = attrs.field(factory=IdentifyGate)
    """Shared by the connection's shards: Identifies of one rate-limit key spaced as sent."""
    identify_key: int = attrs.field(default=0, init=False)
    """This shard's rate-limit key (``shard_id % max_concurrency``), set with its budget."""

    @property
    def label(self) -> str:
        return f"discord {self.connection_id} shard {self.shard[0]}/{self.shard[1]}"

    # ------------------------------------------------------------------ the loop

    async def run(self, task_status: trio.TaskStatus[None]) -> None:
        self.status.state = "starting"

        def standby() -> None:
            self.status.state = "standby"
            task_status.started()

        stood_by = await self.lease.acquire(on_standby=standby)
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self.lease.keep)
                if self.sweep_every_s > 0:
                    nursery.start_soon(keep_sweeping, self, self.sweep_every_s, self.sweep_settle_s)
                await self._serve(None if stood_by else task_status)
                nursery.cancel_scope.cancel()
        finally:
            with trio.move_on_after(CLOSE_BUDGET_S, shield=True):
                await self.lease.release()

    async def _serve(self, task_status: trio.TaskStatus[None] | None) -> None:
        state = await self.cursor.load()
        failed = state.failed
        if failed is not None:
            at = failed.get("atMs")
            if isinstance(at, int) and at >= self.started_at_ms:
                # A peer failed after we started: same token, same config; do not retry.
                self.status.state = "failed"
                self.status.reason = str(failed.get("reason", "failed"))
                raise AdapterFatalError(f"Discord {self.label}: {self.status.reason}")
            state.failed = None
            with self.lease.guard():
                await self.cursor.save(self.lease.fencing_token)
        if task_status is not None:
            task_status.started()
        backoff = Backoff(self.random, base_s=RECONNECT_BASE_S, cap_s=MAX_BACKOFF_S)
        while True:
            self.lease.check()
            try:
                with self.lease.guard():
                    await self._connect_once(backoff)
            except _End as end:
                await self._after(_judged(self._refusals, self.label, end), backoff)
            except (
                DiscordError,
                HandshakeError,
                ConnectionClosed,
                OSError,
                trio.TooSlowError,
                trio.BrokenResourceError,
                proto.ProtocolError,
            ) as error:
                if isinstance(error, DiscordApiError) and error.status == 401:
                    await self._after(_End("fatal", "token refused (HTTP 401)", 4004), backoff)
                delay = backoff.next_delay()
                self.status.state = "backoff"
                log.warning(
                    "%s: gateway unavailable (%s); retry in %.1f s",
                    self.label,
                    type(error).__name__,
                    delay,
                )
                await self.lease.sleep(delay)

    async def _after(self, end: _End, backoff: Backoff) -> None:
        """What a connection's end means: stop, or wait before the next attempt."""
        if end.action == "fatal":
            reason = proto.FATAL_CLOSE_CODES.get(end.code or 0, end.why)
            self.status.state = "failed"
            self.status.reason = reason
            log.error("%s: gateway closed %s: %s; not reconnecting", self.label, end.code, reason)
            self.cursor.state.failed = {"code": end.code, "reason": reason}
            self.cursor.state.failed["atMs"] = self.clock.now_ms()
            with trio.move_on_after(CLOSE_BUDGET_S, shield=True):
                try:
                    await self.cursor.save(self.lease.fencing_token)
                except Exception as exc:
                    log.warning(
                        "%s: storing the failure failed (%s)", self.label, type(exc).__name__
                    )
            raise AdapterFatalError(f"Discord {self.label}: {reason}")
        log.info("%s: gateway connection ended (%s); %s", self.label, end.why, end.action)
        if end.action == "identify":
            self.status.session_started_ms = None
            if self.cursor.state.session is not None:
                self.cursor.state.session = None
                await self.cursor.save(self.lease.fencing_token)
            # "a random amount of time between 1 and 5 seconds" before a fresh Identify
            await self.lease.sleep(self.reidentify_delay_s * (1.0 + 4.0 * self.random.random()))
        else:
            # Soon (a fraction of a second), but never a hot loop: a connection that keeps
            # ending before READY/RESUMED (which reset it) waits longer each time.
            await self.lease.sleep(backoff.next_delay())

    # ------------------------------------------------------------------ one connection

    async def _connect_once(self, backoff: Backoff) -> None:
        state = self.cursor.state
        session = state.session
        resume_url: str | None = None
        if session is None:
            url = await prepare_identify(self)
            self.status.state = "connecting"
        else:
            if not self._resume_url_down:
                resume_url = checked_gateway_url(session.resume_url)
            self._resume_url_down = False
            url = resume_url or await gateway_url(self)
            self.status.state = "resuming"
            self.status.session_started_ms = session.started_ms
        self._received_seq = None if session is None else session.seq
        self._refusals.resuming = False
        opened = False
        try:
            async with connect(proto.gateway_url(url), CONNECT_TIMEOUT_S) as ws:
                opened = True
                await self._session(ws, session, backoff)
        except BaseExceptionGroup as group:
            raise _first(group) from None
        except (OSError, HandshakeError, trio.TooSlowError):
            self._resume_url_down = not opened and resume_url is not None
            raise

    async def _session(
        self, ws: GatewaySocket, session: SessionState | None, backoff: Backoff
    ) -> None:
        """One connected socket: read, heartbeat and admit until it ends (:class:`_End`)."""
        dispatcher = Dispatcher(
            cursor=self.cursor,
            lease=self.lease,
            status=self.status,
            handle_message=lambda message: self.handle_message(message, self),
            ready=functools.partial(_ready, self),
        )
        end: _End | None = None
        self._heartbeater = None
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(dispatcher.run)
                nursery.start_soon(self._await_hello)
                try:
                    await self._read(ws, dispatcher, session, backoff, nursery)
                finally:
                    dispatcher.close()
        except _End as caught:
            end = caught
        except BaseExceptionGroup as group:
            first = _first(group)
            if not isinstance(first, _End):
                raise first from None
            end = first
        finally:
            # The close frame goes out at once; its answer may never be read (a cancelled
            # stop has cancelled the socket's reader), so wait for it only briefly.
            with trio.move_on_after(CLOSE_HANDSHAKE_S, shield=True):
                await ws.aclose(proto.RESUMABLE_CLOSE)  # never 1000: keep the session
            with trio.move_on_after(CLOSE_BUDGET_S, shield=True):
                if self.lease.held:
                    try:
                        await self.cursor.save(self.lease.fencing_token)
                    except LeaseLostError:
                        pass
        if end is not None:
            raise end

    async def _read(
        self,
        ws: GatewaySocket,
        dispatcher: Dispatcher,
        session: SessionState | None,
        backoff: Backoff,
        nursery: trio.Nursery,
    ) -> None:
        while True:
            try:
                raw = await ws.get_message()
            except ConnectionClosed as closed:
                code = closed.code
                refused = code in proto.SESSION_REFUSAL_CODES
                raise _End(proto.close_action(code), f"closed {code}", code, refused) from None
            frame = proto.parse_frame(raw)
            self.status.last_event_ms = self.clock.now_ms()
            if self._heartbeater is not None:
                self._heartbeater.heard(trio.current_time())
            if frame.op == proto.HELLO:
                interval = proto.json_number(
                    frame.d.get("heartbeat_interval") if isinstance(frame.d, dict) else None
                )
                if interval is None or interval <= 0:
                    raise proto.ProtocolError("hello without a heartbeat interval")
                self._heartbeater = proto.Heartbeater(interval / 1000, self.random)
                self._heartbeater.start(trio.current_time())
                nursery.start_soon(self._heartbeat, ws)
                if session is None:
                    identify = proto.identify(self.token(), self.intents, self.shard)
                    await self.identify_gate.send(
                        self.identify_key,
                        self.identify_spacing_ms / 1000,
                        functools.partial(ws.send_message, identify),
                    )
                    self.status.identifies += 1
                else:
                    await ws.send_message(
                        proto.resume(self.token(), session.session_id, session.seq)
                    )
                    self._refusals.resuming = True
            elif frame.op == proto.HEARTBEAT_ACK:
                if self._heartbeater is not None:
                    self._heartbeater.ack()
            elif frame.op == proto.HEARTBEAT:  # Discord asks for a beat now
                if self._heartbeater is not None:
                    self._heartbeater.sent(trio.current_time())
                await ws.send_message(proto.heartbeat(self._received_seq))
            elif frame.op == proto.RECONNECT:
                raise _End("resume", "reconnect requested")
            elif frame.op == proto.INVALID_SESSION:
                if frame.d is True and self.cursor.state.session is not None:
                    raise _End("resume", "session invalidated (resumable)", refused=True)
                raise _End("identify", "session invalidated")
            elif frame.op == proto.DISPATCH and frame.s is not None:
                if self._received_seq is None or frame.s > self._received_seq:
                    if self._received_seq is not None and frame.s > self._received_seq + 1:
                        self._gap(self._received_seq + 1)
                    self._received_seq = frame.s
                if frame.t == "READY":
                    self._gaps.new_session()
                if frame.t in ("READY", "RESUMED"):
                    backoff.reset()
                    self._refusals.resumed()
                await dispatcher.put(frame)

    def _gap(self, missing: int) -> None:
        """Dispatches lost on the way: end the connection before this one is handled and
        resume from the watermark, below the gap — Discord replays the missed events —
        unless :class:`~._protocol.Gaps` passes it over."""
        if self._gaps.resume_for(missing, trio.current_time()):
            log.warning("%s: dispatch sequence gap; resuming to replay it", self.label)
            raise _End("resume", "dispatch sequence gap")

    async def _await_hello(self) -> None:
        """Leave a socket that sends no Hello (no heartbeat runs before one)."""
        await trio.sleep(HELLO_TIMEOUT_S)
        if self._heartbeater is None:
            raise _End("resume", "no hello")

    async def _heartbeat(self, ws: GatewaySocket) -> None:
        beat = self._heartbeater
        assert beat is not None
        while await _due(beat) == "beat":
            # Marked before it is sent: its ACK may be read while the send still awaits
            # (the reader runs meanwhile), and would be undone by a mark after it.
            beat.sent(trio.current_time())
            await ws.send_message(proto.heartbeat(self._received_seq))
        log.warning("%s: no heartbeat ACK; zombie connection, resuming", self.label)
        raise _End("resume", "zombie connection")


async def _due(beat: proto.Heartbeater) -> Literal["beat", "zombie"]:
    """Sleep until a beat is due or the connection is judged a zombie. A timer that woke
    later than the grace marks a stall of this process: the reader has yet to read what
    came meanwhile."""
    while True:
        now = trio.current_time()
        due = beat.due(now)
        if due != "wait":
            return due
        planned = now + max(min(beat.wake_at() - now, 1.0), 0.0)
        await trio.sleep_until(planned)
        woke = trio.current_time()
        if woke - planned > beat.grace_s:
            beat.stalled(woke)


def _judged(refusals: proto.RefusedResumes, label: str, end: _End) -> _End:
    """``end``, or identify if the session is given up (:class:`~._protocol.RefusedResumes`)."""
    if not refusals.give_up(end.action, end.refused):
        return end
    log.warning("%s: resume refused %d times; identifying", label, proto.MAX_REFUSED_RESUMES)
    return _End("identify", f"resume refused ({end.why})", end.code)


async def _ready(shard: Shard, frame: proto.Frame) -> None:
    """READY: the new session (stored) and the bot's own user id; then, with channels
    known, the backfill of what the session before it did not deliver — due (stored) until
    it completed: a RESUMED while it is due (a daemon killed during it, a connection lost)
    backfills again."""
    state = shard.cursor.state
    if frame.t == "READY":
        d = frame.d if isinstance(frame.d, Mapping) else {}
        user = d.get("user")
        session_id = d.get("session_id")
        if not isinstance(session_id, str) or not isinstance(user, Mapping):
            raise proto.ProtocolError("READY without a session")
        if isinstance(user.get("id"), str):
            state.bot_user_id = user["id"]
        resume_url = checked_gateway_url(d.get("resume_gateway_url")) or shard.gateway or ""
        assert frame.s is not None
        started = shard.clock.now_ms()
        state.session = SessionState(session_id, resume_url, frame.s, started)
        if state.channels:
            if not state.backfill_due or state.gap_since_ms is None:  # (else a gap still open)
                state.gap_since_ms = max(snowflake_ms(m) or 0 for m, _g in state.channels.values())
            state.backfill_due = True
        shard.status.session_started_ms = started
        log.info("%s: session started (identified)", shard.label)
        await shard.cursor.save(shard.lease.fencing_token)
    if state.backfill_due:
        shard.status.state = "backfilling"
        await backfill(shard, shard.backfill_pages)
        state.backfill_due = False
        await shard.cursor.save(shard.lease.fencing_token)
    shard.status.state = "connected"
