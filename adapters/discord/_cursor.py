"""A shard's durable state: the journal's connection cursor (``prism.channels.v1.cursor``,
the key :func:`prismd.journal.cursor_key` names) under the shard's service scope, written
only with the shard's receiver-lease fencing token — as the Telegram offset is.

Beside the cursor's own fields (``admitted``, ``lastEventId``, ``updatedAt``) it holds,
under ``discord``:

* ``session`` — ``sessionId``, ``resumeUrl``, ``startedAtMs`` (stored at READY) and
  ``seq``, the contiguous
  watermark of dispatches whose admissions the journal committed (never past one still
  being admitted): the next holder — a restarted daemon or another instance — resumes
  from it and Discord replays the rest;
* ``botUserId`` — learnt at READY (a resumed session sends no READY);
* ``channels`` — the last journaled message id per channel (at most
  :data:`MAX_CHANNELS`, newest kept): what a backfill reads after, when a session could
  not be resumed;
* ``swept`` — per known channel, the newest message a sweep (:mod:`._sweep`) read or
  the first one journaled from it: the next sweep reads after it;
* ``identifies`` — the times of this shard's identifies in the last 24 hours, written
  *before* each Identify is sent, so a crash loop counts every one;
* ``backfillDue`` — a new session (READY) began while channels were known: what the
  session before it did not deliver is read over REST; stored until that backfill
  completed, so a daemon killed during it (or a connection lost) backfills again once it
  resumed;
* ``gapSinceMs`` — set with it: the time of the newest journaled message then. A channel
  first seen later (a user whose first messages fell in the outage: bots cannot list their
  DMs) has its messages since then read before its first one is admitted;
* ``failed`` — a fatal close (4004, 4013, 4014 …): its code, reason and time. A standby
  that takes the lease later reads it and does not connect; a daemon started after it
  tries once more (the operator fixed the token or the portal and restarted).

No secret is stored: no token, no message text.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import attrs
import trio

from prismd.journal import NS_CURSOR, cursor_key
from stores import CheckpointConflictError, CheckpointStore, Clock, OwnershipScope, ms_to_iso

from ..toolkit import LeaseLostError

CURSOR_CATEGORY = "channel-cursor"
MAX_CHANNELS = 256
MAX_RECENT = 4096
"""Message ids remembered as handled (:attr:`ShardState.recent`)."""
DAY_MS = 24 * 3600 * 1000


@attrs.define(eq=False)
class SessionState:
    session_id: str
    resume_url: str
    seq: int
    started_ms: int | None = None
    """When READY began it (Unix ms): its age in ``prismctl health``."""


@attrs.define(eq=False)
class ShardState:
    session: SessionState | None = None
    bot_user_id: str | None = None
    channels: dict[str, tuple[str, str | None]] = attrs.field(factory=dict)
    """channel id → (last journaled message id, guild id or ``None`` for a DM)."""
    swept: dict[str, str] = attrs.field(factory=dict)
    """channel id → the message id a sweep reads after (:mod:`._sweep`)."""
    recent: OrderedDict[str, None] = attrs.field(factory=OrderedDict)
    """Message ids handled lately (not stored): a sweep passes over them."""
    identifies: list[int] = attrs.field(factory=list)
    failed: dict[str, Any] | None = None
    backfill_due: bool = False
    gap_since_ms: int | None = None
    catching_up: set[str] = attrs.field(factory=set)
    """Channels whose earlier messages are being read now (not stored)."""
    admitted: int = 0
    last_event_id: str | None = None

    def note_message(self, channel_id: str, message_id: str, guild_id: object) -> None:
        """``message_id`` was journaled from ``channel_id`` (``guild_id``: the event's, any
        value; a DM's is absent)."""
        recent = self.recent
        recent[message_id] = None
        if len(recent) > MAX_RECENT:
            recent.popitem(last=False)
        known = self.channels.get(channel_id)
        if known is None or _snowflake(message_id) > _snowflake(known[0]):
            guild = guild_id if isinstance(guild_id, str) else None
            self.channels[channel_id] = (message_id, guild)
        # A channel first seen: what came before it is no sweep's (a backfill's, a
        # catch-up's); one known already keeps its point.
        self.swept.setdefault(channel_id, message_id)
        if len(self.channels) > MAX_CHANNELS:
            newest = sorted(self.channels.items(), key=lambda kv: -_snowflake(kv[1][0]))
            self.channels = dict(newest[:MAX_CHANNELS])
            self.swept = {c: m for c, m in self.swept.items() if c in self.channels}

    def to_json(self, now_ms: int) -> dict[str, Any]:
        discord: dict[str, Any] = {
            "channels": {k: list(v) for k, v in self.channels.items()},
            "swept": {k: v for k, v in self.swept.items() if k in self.channels},
            "identifies": [t for t in self.identifies if now_ms - t < DAY_MS],
        }
        if self.session is not None:
            discord["session"] = {
                "sessionId": self.session.session_id,
                "resumeUrl": self.session.resume_url,
                "seq": self.session.seq,
            }
            if self.session.started_ms is not None:
                discord["session"]["startedAtMs"] = self.session.started_ms
        if self.bot_user_id is not None:
            discord["botUserId"] = self.bot_user_id
        if self.failed is not None:
            discord["failed"] = dict(self.failed)
        if self.backfill_due:
            discord["backfillDue"] = True
        if self.gap_since_ms is not None:
            discord["gapSinceMs"] = self.gap_since_ms
        out: dict[str, Any] = {
            "admitted": self.admitted,
            "updatedAt": ms_to_iso(now_ms),
            "updatedAtMs": now_ms,
            "discord": discord,
        }
        if self.last_event_id is not None:
            out["lastEventId"] = self.last_event_id
        return out

    @classmethod
    def from_json(cls, value: object) -> ShardState:
        raw = value if isinstance(value, Mapping) else {}
        discord = raw.get("discord")
        discord = discord if isinstance(discord, Mapping) else {}
        state = cls()
        admitted = raw.get("admitted")
        state.admitted = admitted if isinstance(admitted, int) and admitted >= 0 else 0
        last = raw.get("lastEventId")
        state.last_event_id = last if isinstance(last, str) else None
        session = discord.get("session")
        if isinstance(session, Mapping):
            sid, url, seq = session.get("sessionId"), session.get("resumeUrl"), session.get("seq")
            if isinstance(sid, str) and isinstance(url, str) and isinstance(seq, int):
                started = session.get("startedAtMs")
                started = started if isinstance(started, int) and started > 0 else None
                state.session = SessionState(sid, url, max(0, seq), started)
        bot = discord.get("botUserId")
        state.bot_user_id = bot if isinstance(bot, str) and bot.isdigit() else None
        channels = discord.get("channels")
        if isinstance(channels, Mapping):
            for key, value in channels.items():
                if isinstance(value, list) and len(value) == 2 and str(key).isdigit():
                    message_id, guild_id = value
                    if isinstance(message_id, str) and message_id.isdigit():
                        guild = guild_id if isinstance(guild_id, str) else None
                        state.channels[str(key)] = (message_id, guild)
        swept = discord.get("swept")
        swept = swept if isinstance(swept, Mapping) else {}
        for channel_id, (message_id, _guild) in state.channels.items():
            # A state written before sweeps: they start at the newest journaled message.
            point = swept.get(channel_id)
            ok = isinstance(point, str) and point.isdigit()
            state.swept[channel_id] = point if ok else message_id  # type: ignore[assignment]
        identifies = discord.get("identifies")
        if isinstance(identifies, list):
            state.identifies = [t for t in identifies if isinstance(t, int)][-1000:]
        failed = discord.get("failed")
        state.failed = dict(failed) if isinstance(failed, Mapping) else None
        state.backfill_due = discord.get("backfillDue") is True
        gap = discord.get("gapSinceMs")
        state.gap_since_ms = gap if isinstance(gap, int) and not isinstance(gap, bool) else None
        return state


def _snowflake(value: str) -> int:
    return int(value) if value.isdigit() else 0


@attrs.define(eq=False, kw_only=True)
class ShardCursor:
    """Load and save one shard's :class:`ShardState` (compare-and-swap, fenced)."""

    checkpoints: CheckpointStore
    connection_id: str
    scope: OwnershipScope
    clock: Clock
    state: ShardState = attrs.field(factory=ShardState)
    _version: int | None = attrs.field(default=None, init=False)
    _saving: trio.Lock = attrs.field(factory=trio.Lock, init=False)
    """One save at a time (READY's and the watermark's run in two tasks)."""

    @property
    def key(self) -> str:
        return cursor_key(self.connection_id, self.scope)

    async def load(self) -> ShardState:
        record = await self.checkpoints.load_checkpoint(
            namespace=NS_CURSOR, key=self.key, scope=self.scope
        )
        if record is None:
            self._version = 0
            self.state = ShardState()
        else:
            self._version = record.version
            self.state = ShardState.from_json(record.value)
        return self.state

    async def save(self, fencing_token: int | None) -> None:
        """Write :attr:`state` at the loaded version; a lost compare-and-swap (another
        holder wrote) raises :class:`LeaseLostError`."""
        async with self._saving:
            await self._save(fencing_token)

    async def _save(self, fencing_token: int | None) -> None:
        if self._version is None:
            raise LeaseLostError("shard cursor not loaded")
        current = self._version
        try:
            await self.checkpoints.save_checkpoint(
                namespace=NS_CURSOR,
                key=self.key,
                scope=self.scope,
                version=current + 1,
                expected_version=current,
                fencing_token=fencing_token,
                value=self.state.to_json(self.clock.now_ms()),
                category=CURSOR_CATEGORY,
            )
        except CheckpointConflictError:
            self._version = None
            raise LeaseLostError("shard cursor written by another receiver") from None
        self._version = current + 1
