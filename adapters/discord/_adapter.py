"""The Discord channel adapter (a bot account): shards, admission, sending.

:class:`DiscordAdapter` wires parts of one job each: one :class:`~._gateway.Shard` per
gateway shard (``shards = N``, or ``"auto"``: the count ``GET /gateway/bot`` recommends),
each under its own receiver lease (``prism.channels.v1.discord.receiver`` /
``r1:<connection>:<shard>``) with its durable session (:mod:`._cursor`); one message →
``admit`` (:meth:`DiscordAdapter._handle_message`, :mod:`._parse`); replies and typing
(:mod:`._send`); REST with rate limits (:mod:`._rest`).

**No secrets out.** The token is read per request and per Identify/Resume; errors and
log lines carry close codes, HTTP statuses and Discord's error codes only — never the
token, message text, or user and channel ids.
"""

from __future__ import annotations

import random as _random
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import trio

from prismd.channel import (
    DEFAULT_TYPING_DELAY_MS,
    FILES_UNSUPPORTED,
    AdapterFatalError,
    AdapterFeatures,
    Admit,
    AttachmentRef,
    OutboundFile,
    Preview,
    Reply,
    SendResult,
)
from stores import SYSTEM_CLOCK, Clock, OwnershipScope, Store, ms_to_iso

from ..toolkit import (
    Activity,
    Backoff,
    LeaseWatch,
    ReceiverLease,
    connection_service_scope,
)
from . import _protocol as proto
from ._backfill import catch_up_if_new
from ._cursor import ShardCursor
from ._gateway import Shard
from ._identify import IdentifyGate
from ._media import DiscordMedia, FetchedAttachment
from ._parse import RespondTo, parse_message
from ._previews import PreviewEditor
from ._rest import DEFAULT_API_ORIGIN, DiscordApiError, DiscordError, DiscordRest
from ._send import DiscordSender
from ._status import ShardStatus, log
from ._sweep import SETTLE_S, SWEEP_EVERY_S

__all__ = ["RECEIVER_NAMESPACE", "DiscordAdapter", "default_intents"]

RECEIVER_NAMESPACE = "prism.channels.v1.discord.receiver"
MAX_SHARDS = 64
_STATE_ORDER = (
    "failed",
    "backoff",
    "identify_wait",
    "resuming",
    "connecting",
    "backfilling",
    "starting",
    "standby",
    "connected",
    "stopped",
    "idle",
)


def default_intents(respond_to: RespondTo) -> int:
    """Guild and direct messages; message content only when every message is answered
    (DMs and mentions carry their content without it, so a new bot never meets 4014)."""
    intents = proto.GUILDS | proto.GUILD_MESSAGES | proto.DIRECT_MESSAGES
    return intents | proto.MESSAGE_CONTENT if respond_to == "all" else intents


def discord_features(previews: bool, typing_delay_ms: int) -> AdapterFeatures:
    """What a Discord connection offers. ``idempotent_send``: a reply's send repeated after
    an unknown outcome posts each chunk with the same nonce inside the window (Discord
    answers the original) and outside it looks for the bot's reply, else raises
    ``DeliveryOutcomeUnknownError`` — never a blind second post (:mod:`._send`)."""
    return AdapterFeatures(
        typing=True,
        previews=previews,
        typing_delay_ms=typing_delay_ms,
        attachments=True,
        idempotent_send=True,
    )


@attrs.define(eq=False, kw_only=True)
class DiscordAdapter:
    """Implements :class:`prismd.channel.ChannelAdapter`. Construction is inert."""

    connection_id: str
    token: Callable[[], str] = attrs.field(repr=False)
    admit: Admit
    store: Store
    owner_id: str
    api_origin: str = DEFAULT_API_ORIGIN
    respond_to: RespondTo = "mentions"
    intents: int | None = None
    """``None``: :func:`default_intents`."""
    allow_guilds: bool = False
    previews: bool = False
    """Show streamed answers by editing one message (at most once a second)."""
    typing_delay_ms: int = DEFAULT_TYPING_DELAY_MS
    """The runtime starts the typing indicator once a turn has run this long."""
    shards: int | None = 1
    """A shard count, or ``None`` for ``"auto"``."""
    lease_ttl_ms: int = 30_000
    adopt: bool = True
    identifies_per_day: int = 50
    backfill_pages: int = 5
    sweep_every_s: float = SWEEP_EVERY_S
    """How often known channels are read for messages the gateway never sent (0: never)."""
    sweep_settle_s: float = SETTLE_S
    """Messages younger than this are left to the gateway by a sweep."""
    max_attachment_bytes: int = 1024 * 1024
    """Images larger than this are not downloaded (the runtime refuses them at admission,
    and the adapter posts its notice)."""
    retention_days: int = 7
    """How long a send's first attempt is kept (the journal's ``retention_days``)."""
    identify_spacing_ms: int = 5_000
    """At least this long between two identifies of a shard (Discord: 5 s)."""
    reidentify_delay_s: float = 1.0
    """A fresh Identify after op 9 waits this long, up to five times it (Discord: 1-5 s)."""
    clock: Clock = SYSTEM_CLOCK
    random: _random.Random = attrs.field(factory=_random.Random)
    _rest: DiscordRest = attrs.field(init=False)
    _sender: DiscordSender = attrs.field(init=False)
    _previews: PreviewEditor = attrs.field(init=False)
    _media: DiscordMedia = attrs.field(init=False)
    _shards: list[Shard] = attrs.field(factory=list, init=False)
    _lease_watch: LeaseWatch = attrs.field(factory=LeaseWatch, init=False, repr=False)
    _status: ShardStatus = attrs.field(factory=ShardStatus, init=False)
    """The state before the shards exist (and when asking for the shard count fails)."""
    _started_at_ms: int = attrs.field(default=0, init=False)
    _identify_gate: IdentifyGate = attrs.field(factory=IdentifyGate, init=False)
    """The Identifies of this connection's shards, spaced as sent (:class:`IdentifyGate`)."""
    _bot_user_id: str | None = attrs.field(default=None, init=False)
    _activity: Activity = attrs.field(factory=Activity, init=False)
    _features: AdapterFeatures = attrs.field(init=False)
    """When a message last reached the adapter (``lastUpdateAt`` in ``health``)."""

    def __attrs_post_init__(self) -> None:
        if self.respond_to not in ("mentions", "all"):
            raise ValueError("respond_to must be 'mentions' or 'all'")
        if self.shards is not None and not 1 <= self.shards <= MAX_SHARDS:
            raise ValueError(f"shards must be in 1..{MAX_SHARDS}")
        if self.intents is None:
            self.intents = default_intents(self.respond_to)
        self._rest = DiscordRest(token=self.token, api_origin=self.api_origin)
        self._sender = DiscordSender(
            connection_id=self.connection_id,
            rest=self._rest,
            checkpoints=self.store.checkpoints,
            scope=self.service_scope,
            clock=self.clock,
            bot_user_id=self._bot_id,
        )
        self._previews = PreviewEditor(connection_id=self.connection_id, rest=self._rest)
        self._features = discord_features(self.previews, self.typing_delay_ms)
        self._media = DiscordMedia(
            connection_id=self.connection_id,
            rest=self._rest,
            max_attachment_bytes=self.max_attachment_bytes,
        )

    @property
    def service_scope(self) -> OwnershipScope:
        return connection_service_scope(self.connection_id)

    # ------------------------------------------------------------------ public surface

    @property
    def features(self) -> AdapterFeatures:
        return self._features  # built once: the runtime asks several times per message

    def health(self) -> Mapping[str, str]:
        """``{"state": …, "gateway": …}``: the least healthy shard's state (one of
        :data:`~._status.STATES`: ``connected``, ``resuming``, ``failed`` …) and
        ``resumable`` / ``no_session``; the times (ISO 8601) once known: ``lastEventAt``
        (the gateway last sent anything; the stalest shard's), ``sessionStartedAt`` (the
        youngest shard session's READY: its age) and ``lastUpdateAt`` (a message reached
        the adapter). Failed: ``lastError`` says why (the close code's fixed words: a token
        rejected, intents disallowed…)."""
        statuses = [s.status for s in self._shards] or [self._status]
        sessions = [s.cursor.state.session is not None for s in self._shards]
        return {**_gateway_health(statuses, sessions), **self._activity.health_fields()}

    @property
    def receiver_lease_held(self) -> bool:
        return any(shard.lease.held for shard in self._shards)

    async def wait_receiver_lease(self, held: bool) -> None:
        await self._lease_watch.wait(lambda: self.receiver_lease_held, held)

    @property
    def shard_statuses(self) -> list[ShardStatus]:
        return [shard.status for shard in self._shards]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run every shard until cancelled. Raises :class:`AdapterFatalError` for a bad
        token or a fatal close (the failure is stored: a standby does not retry it)."""
        self._started_at_ms = self._started_at_ms or self.clock.now_ms()
        self._status.state = "starting"
        count = self.shards if self.shards is not None else await self._recommended_shards()
        if not self._shards or self._shards[0].shard[1] != count:
            self._shards = [self._shard(i, count) for i in range(count)]
        try:
            async with trio.open_nursery() as nursery:
                if self.previews:
                    nursery.start_soon(self._previews.run)
                nursery.start_soon(self._prune_sends)
                for shard in self._shards:
                    await nursery.start(shard.run)
                task_status.started()
        finally:
            for shard in self._shards:
                shard.status.stopped()

    async def _prune_sends(self) -> None:
        """Hourly: forget first-attempt records older than the journal's retention."""
        while True:
            try:
                await self._sender.prune(keep_ms=self.retention_days * 86_400_000)
            except Exception as exc:
                log.debug(
                    "discord %s: pruning send records failed (%s)",
                    self.connection_id,
                    type(exc).__name__,
                )
            await trio.sleep(3600 * (0.9 + 0.2 * self.random.random()))

    async def _recommended_shards(self) -> int:
        backoff = Backoff(self.random, cap_s=60.0)
        while True:
            try:
                info = await self._rest.request("GET", "/gateway/bot")
            except DiscordApiError as error:
                if error.status == 401:
                    self._status.state = "failed"
                    self._status.reason = "Discord rejected the bot token (HTTP 401)"
                    raise AdapterFatalError(self._status.reason) from None
                delay = backoff.next_delay()
            except DiscordError:
                delay = backoff.next_delay()
            else:
                shards = info.get("shards") if isinstance(info, Mapping) else None
                if isinstance(shards, int) and 1 <= shards <= MAX_SHARDS:
                    return shards
                raise AdapterFatalError(f"Discord recommends {shards!r} shards; set shards = N")
            self._status.state = "backoff"
            log.warning(
                "discord %s: GET /gateway/bot failed; retry in %.1f s", self.connection_id, delay
            )
            await trio.sleep(delay)

    def _shard(self, index: int, count: int) -> Shard:
        scope = OwnershipScope(
            tenant_id="prismd-service",
            account_id=self.connection_id,
            user_id=f"shard:{index}/{count}",
        )
        lease = ReceiverLease.for_adapter(
            self,
            kind="discord",
            namespace=RECEIVER_NAMESPACE,
            log=log,
            random=self.random,
            shard=(index, count),
            watch=self._lease_watch,
        )
        assert self.intents is not None
        return Shard(
            connection_id=self.connection_id,
            shard=(index, count),
            token=self.token,
            intents=self.intents,
            rest=self._rest,
            lease=lease,
            cursor=ShardCursor(
                checkpoints=self.store.checkpoints,
                connection_id=self.connection_id,
                scope=scope,
                clock=self.clock,
            ),
            handle_message=self._handle_message,
            status=ShardStatus(),
            clock=self.clock,
            random=self.random,
            started_at_ms=self._started_at_ms,
            identifies_per_day=self.identifies_per_day,
            backfill_pages=self.backfill_pages,
            sweep_every_s=self.sweep_every_s,
            sweep_settle_s=self.sweep_settle_s,
            identify_spacing_ms=self.identify_spacing_ms,
            identify_gate=self._identify_gate,
            reidentify_delay_s=self.reidentify_delay_s,
        )

    # ------------------------------------------------------------------ inbound

    async def _handle_message(self, message: Mapping[str, Any], shard: Shard) -> bool:
        """Admit one message; returns once the admission is final (a retryable one is
        tried again after a backoff, under the shard's lease): whether it was accepted as
        new (a duplicate the journal had already is acknowledged, not new)."""
        state = shard.cursor.state
        if state.bot_user_id is not None:
            self._bot_user_id = state.bot_user_id
        event = parse_message(
            message,
            connection_id=self.connection_id,
            bot_user_id=state.bot_user_id,
            allow_guilds=self.allow_guilds,
            respond_to=self.respond_to,
        )
        if event is None:
            return False
        await catch_up_if_new(shard, message)  # a channel first seen after a lost session
        # A full queue frees as turns end (milliseconds): try again soon, then less often.
        backoff: Backoff | None = None
        while True:
            shard.lease.check()
            self._activity.last_update_ms = self.clock.now_ms()
            admission = await self.admit(event)
            if not admission.retryable:
                break
            backoff = backoff or Backoff(self.random, base_s=0.1, cap_s=10.0)
            await shard.lease.sleep(backoff.next_delay())
        if admission.reason == "oversized" and admission.hint is not None:
            # Too long, or images over the cap: say so (the runtime's fixed text).
            channel = event.external_conversation_id
            await self._sender.notice(channel, event.event_id, admission.hint)
        state.note_message(event.external_conversation_id, event.event_id, message.get("guild_id"))
        return admission.status == "accepted" and not admission.duplicate

    # ------------------------------------------------------------------ outbound

    def _bot_id(self) -> str | None:
        if self._bot_user_id is None:
            for shard in self._shards:
                if shard.cursor.state.bot_user_id is not None:
                    self._bot_user_id = shard.cursor.state.bot_user_id
        return self._bot_user_id

    async def send(self, reply: Reply) -> SendResult:
        if self._bot_id() is None:
            try:
                me = await self._rest.request("GET", "/users/@me")
                if isinstance(me, Mapping) and isinstance(me.get("id"), str):
                    self._bot_user_id = me["id"]
            except DiscordError:
                pass
        if self.previews:
            await self._previews.finish(reply.external_conversation_id)
        return await self._sender.send(reply)

    def send_draft(self, preview: Preview) -> None:
        if self.previews:
            self._previews.offer(preview)

    async def send_typing(
        self, external_conversation_id: str, thread_id: str | None = None
    ) -> None:
        await self._sender.typing(external_conversation_id)

    async def fetch_attachment(self, ref: AttachmentRef) -> FetchedAttachment | None:
        return await self._media.fetch(ref)

    async def send_file(self, reply: Reply, file: OutboundFile) -> SendResult:
        """No files for now (``features.max_file_bytes`` is 0)."""
        return FILES_UNSUPPORTED

    async def aclose(self) -> None:
        await self._rest.aclose()


def _gateway_health(statuses: list[ShardStatus], sessions: list[bool]) -> dict[str, str]:
    """:meth:`DiscordAdapter.health` but the activity's fields, from the shards' statuses
    and whether each has a stored session."""
    state = min(
        (s.state for s in statuses),
        key=lambda s: _STATE_ORDER.index(s) if s in _STATE_ORDER else 0,
    )
    health = {
        "state": state,
        "gateway": "resumable" if sessions and all(sessions) else "no_session",
    }
    events = [s.last_event_ms for s in statuses]
    if events and None not in events:
        health["lastEventAt"] = ms_to_iso(min(e for e in events if e is not None))
    why = [s.reason for s in statuses if s.state == "failed" and s.reason]
    if state == "failed" and why:
        health["lastError"] = why[0]
    started = [s.session_started_ms for s in statuses if s.session_started_ms is not None]
    if started and state not in ("failed", "stopped", "standby"):
        health["sessionStartedAt"] = ms_to_iso(max(started))
    return health
