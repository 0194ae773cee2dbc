"""After a session that could not be resumed: read each known channel's messages after the
last journaled one over REST and admit them (the journal drops what it already has).

Bounded: at most ``pages`` × 100 messages per channel, the channels the shard's cursor
remembers (the newest 256). A channel whose gap is longer is counted and logged —
never silently assumed complete. DM channels cannot be listed by a bot, so only channels
a message was journaled from are known (reference §3, §8).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import trio

from ._parse import snowflake_ms
from ._rest import DiscordApiError, DiscordError
from ._shardparts import ShardParts
from ._status import log

PAGE = 100


def oldest_first(batch: object) -> list[Mapping[str, Any]]:
    """A page of channel history (Discord answers newest first): its messages with an id,
    oldest first."""
    if not isinstance(batch, list):
        return []
    return sorted(
        (m for m in batch if isinstance(m, Mapping) and str(m.get("id", "")).isdigit()),
        key=lambda m: int(m["id"]),
    )


def as_dispatch(
    message: Mapping[str, Any], channel_id: str, guild_id: str | None
) -> dict[str, Any]:
    """A fetched message in a ``MESSAGE_CREATE``'s shape (history carries no guild id)."""
    event = dict(message)
    if guild_id is not None:
        event.setdefault("guild_id", guild_id)
    event.setdefault("channel_id", channel_id)
    return event


async def backfill(shard: ShardParts, pages: int) -> int:
    """Admit what each known channel holds after its watermark; how many were handled."""
    handled = 0
    short = 0
    channels = dict(shard.cursor.state.channels)
    for channel_id, (after, guild_id) in channels.items():
        shard.lease.check()
        complete = False
        for _page in range(pages):
            try:
                batch = await shard.rest.request(
                    "GET",
                    f"/channels/{channel_id}/messages",
                    params={"after": after, "limit": PAGE},
                )
            except DiscordApiError as error:
                if error.code in (10003, 50001, 50013):
                    complete = True  # the channel is gone or closed to us: nothing to read
                    break
                raise
            except DiscordError:
                raise
            messages = oldest_first(batch)
            for message in messages:
                await shard.handle_message(as_dispatch(message, channel_id, guild_id), shard)
                handled += 1
                after = str(message["id"])
            await trio.lowlevel.checkpoint()
            if len(messages) < PAGE:
                complete = True
                break
        if not complete:
            short += 1
    shard.status.backfilled += handled
    shard.status.not_backfilled += short
    if short:
        log.warning(
            "%s: backfill read %d message(s); %d channel(s) had more than %d (not recovered)",
            shard.label,
            handled,
            short,
            pages * PAGE,
        )
    elif handled:
        log.info("%s: backfill recovered %d message(s)", shard.label, handled)
    return handled


async def catch_up_if_new(shard: ShardParts, message: Mapping[str, Any]) -> None:
    """Before the first message of a channel first seen after a lost session:
    :func:`catch_up` (once: its earlier messages come back through the same path)."""
    state = shard.cursor.state
    channel = str(message.get("channel_id"))
    since = state.gap_since_ms
    if since is None or channel in state.channels or channel in state.catching_up:
        return
    state.catching_up.add(channel)
    try:
        await catch_up(shard, message, since)
    finally:
        state.catching_up.discard(channel)


async def catch_up(shard: ShardParts, message: Mapping[str, Any], since_ms: int) -> int:
    """Admit the messages of a channel first seen after a lost session that came before
    ``message`` and after ``since_ms`` (the newest journaled message when the session was
    lost): a user whose first messages fell in the outage. One page, oldest first; what it
    cannot read is counted and logged. How many were handled."""
    channel_id = str(message.get("channel_id"))
    guild_id = message.get("guild_id")
    try:
        batch = await shard.rest.request(
            "GET",
            f"/channels/{channel_id}/messages",
            params={"before": str(message.get("id")), "limit": PAGE},
        )
    except DiscordError as error:
        shard.status.not_backfilled += 1
        log.warning("%s: a new channel's earlier messages not read (%s)", shard.label, error)
        return 0
    batch = batch if isinstance(batch, list) else []
    older = [m for m in oldest_first(batch) if (snowflake_ms(str(m["id"])) or 0) > since_ms]
    for found in older:
        guild = guild_id if isinstance(guild_id, str) else None
        await shard.handle_message(as_dispatch(found, channel_id, guild), shard)
    shard.status.backfilled += len(older)
    if len(batch) >= PAGE and len(older) == len(batch):
        shard.status.not_backfilled += 1
        log.warning("%s: a new channel had more than %d earlier messages", shard.label, PAGE)
    return len(older)
