"""Messages the gateway never sent, in a session that is still live.

Discord promises no delivery: events "may never be sent to a client" (reference §1.6,
"Consistency"). A dispatch lost with its sequence number shows as a gap and is replayed by
a resume (:meth:`._gateway.Shard._gap`); one never sent at all leaves no trace on the
gateway. So now and then each known channel is read over REST after its sweep point (the
newest message an earlier sweep read, or the first one journaled from the channel), and
what is there goes through the same path as a gateway message: the journal drops what it
already has, and messages handled lately are passed over without asking it.

Bounded: a round every :data:`SWEEP_EVERY_S` reads at most :data:`CHANNELS_PER_ROUND`
channels (those swept longest ago first; one page of 100 each), so a bot in many channels
spends at most that many requests a round. A message is admitted by a round only when it
was found unhandled by one at least :data:`SETTLE_S` before (it may be on its way on the
gateway still); the round after one that found such a message comes that much later, not
a whole period. A channel the bot can
no longer read (10003, 50001, 50013) is forgotten. A DM channel is known once a message was
journaled from it, and read after that message: a user's very first message, never sent,
cannot be found (bots cannot list their DMs), not even once the user writes again.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import trio

from ..toolkit import LeaseLostError
from ._backfill import as_dispatch, oldest_first
from ._rest import DiscordApiError, DiscordError
from ._shardparts import ShardParts
from ._status import log

SWEEP_EVERY_S = 60.0
"""From one round's start to the next."""
CHANNELS_PER_ROUND = 25
"""Channels read per round at most (one request each)."""
SETTLE_S = 10.0
"""Messages younger than this are left to the gateway."""
PAGE = 100
MAX_SUSPECTS = 10 * PAGE * CHANNELS_PER_ROUND
GONE_CODES = (10003, 50001, 50013)
"""Unknown channel, missing access, missing permissions: nothing to read there."""


@attrs.define(eq=False)
class Sweeps:
    """What rounds remember between them (not stored)."""

    swept_at: dict[str, float] = attrs.field(factory=dict)
    """channel id → when a round last read it (Trio time)."""
    suspects: dict[str, float] = attrs.field(factory=dict)
    """Message id → when a round first found it unhandled (Trio time): admitted by a round
    :data:`SETTLE_S` or more later if still unhandled then."""


async def keep_sweeping(shard: ShardParts, every_s: float, settle_s: float = SETTLE_S) -> None:
    """Sweep rounds while the shard holds its lease; a round only while connected (the
    next one sooner when a message waits to settle). Ends quietly when the lease is lost
    (the shard's loop deals with that). A period shorter than twice the settle time
    settles in half a period."""
    settle_s = min(settle_s, every_s / 2)
    sweeps = Sweeps()
    try:
        while True:
            await shard.lease.sleep(min(every_s, settle_s) if sweeps.suspects else every_s)
            if shard.status.state != "connected":
                continue
            try:
                with shard.lease.guard():
                    await sweep_round(shard, sweeps, settle_s)
            except DiscordError as error:
                log.info("%s: sweep stopped for this round (%s)", shard.label, error)
    except LeaseLostError:
        return


async def sweep_round(shard: ShardParts, sweeps: Sweeps, settle_s: float = SETTLE_S) -> int:
    """Read up to :data:`CHANNELS_PER_ROUND` channels after their sweep points and admit
    what the gateway did not deliver; how many messages were admitted that way.

    A message not handled yet is admitted only when a round :data:`SETTLE_S` or more after
    the one that first found it finds it still unhandled (the gateway may be delivering it:
    only local time is compared, never Discord's snowflake time with the host's clock).
    The sweep point stops before the first message still settling."""
    state = shard.cursor.state
    swept_at = sweeps.swept_at
    for gone in [c for c in swept_at if c not in state.channels]:
        del swept_at[gone]
    due = sorted(state.channels, key=lambda c: swept_at.get(c, -1.0))[:CHANNELS_PER_ROUND]
    found = 0
    moved = False
    for channel_id in due:
        now = trio.current_time()
        swept_at[channel_id] = now
        after = state.swept.get(channel_id) or state.channels[channel_id][0]
        try:
            batch = await shard.rest.request(
                "GET", f"/channels/{channel_id}/messages", params={"after": after, "limit": PAGE}
            )
        except DiscordApiError as error:
            if error.code not in GONE_CODES:
                raise
            state.channels.pop(channel_id, None)
            state.swept.pop(channel_id, None)
            moved = True
            continue
        messages = oldest_first(batch)
        guild_id = state.channels.get(channel_id, (None, None))[1]
        settling = False
        for message in messages:
            message_id = str(message["id"])
            author = message.get("author")
            own = isinstance(author, Mapping) and author.get("id") == state.bot_user_id
            if own or message_id in state.recent:
                sweeps.suspects.pop(message_id, None)
            else:
                first = sweeps.suspects.setdefault(message_id, now)
                if now - first < settle_s:
                    settling = True  # the gateway may be delivering it: a later round
                    continue
                del sweeps.suspects[message_id]
                if await shard.handle_message(as_dispatch(message, channel_id, guild_id), shard):
                    found += 1  # accepted now: the journal did not have it
            if not settling and channel_id in state.channels:
                state.swept[channel_id] = message_id
                moved = True
        await trio.lowlevel.checkpoint()
    if len(sweeps.suspects) > MAX_SUSPECTS:
        sweeps.suspects.clear()  # (each is found again by the next round)
    if found:
        shard.status.swept += found
        log.warning(
            "%s: %d message(s) the gateway had not sent, read over REST", shard.label, found
        )
    if moved:
        await shard.cursor.save(shard.lease.fencing_token)
    return found
