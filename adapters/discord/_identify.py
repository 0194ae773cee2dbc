"""The identify budget of one shard: a new session is started only when Discord's
``session_start_limit`` and the shard's durable identify history allow it
(:func:`~._protocol.identify_wait_ms`), shards in buckets of ``max_concurrency``, and the
Identify is stored before it is sent — so a crash loop counts every one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import attrs
import trio

from . import _protocol as proto
from ._shardparts import ShardParts
from ._status import log
from ._urls import checked_gateway_url

IDENTIFY_MARGIN_S = 0.1
"""Added to the spacing of two Identifies of one rate-limit key: Discord counts the window
where it receives them, so the jitter between our send and its receipt must not shorten it."""


@attrs.define(eq=False)
class IdentifyGate:
    """The Identifies of one connection's shards, spaced as they are *sent*: Discord lets
    one shard per rate-limit key (``shard_id % max_concurrency``) identify per window, and a
    shard whose connection opened faster than its predecessor's must not shorten the gap
    (the budget in :func:`prepare_identify` counts from before the connection opens)."""

    _last_sent: dict[int, float] = attrs.field(factory=dict)

    async def send(self, key: int, spacing_s: float, send: Callable[[], Awaitable[None]]) -> None:
        """``send()`` (the Identify frame) once ``spacing_s`` passed since the last one of
        ``key`` was sent."""
        while True:
            last = self._last_sent.get(key)
            wait = (
                0.0 if last is None else last + spacing_s + IDENTIFY_MARGIN_S - trio.current_time()
            )
            if wait <= 0:
                break
            await trio.sleep(wait)
        self._last_sent[key] = trio.current_time()
        await send()


async def gateway_url(shard: ShardParts) -> str:
    """The cached gateway URL (``GET /gateway`` once): where a lost resume URL reconnects."""
    if shard.gateway is None:
        info = await shard.rest.request("GET", "/gateway")
        url = checked_gateway_url(info.get("url") if isinstance(info, Mapping) else None)
        if url is None:
            raise proto.ProtocolError("gateway URL refused (wss://, or ws:// on loopback)")
        shard.gateway = url
    return shard.gateway


async def prepare_identify(shard: ShardParts) -> str:
    """Wait for the identify budget, record the identify durably; the gateway URL."""
    while True:
        info = await shard.rest.request("GET", "/gateway/bot")
        info = info if isinstance(info, Mapping) else {}
        url = checked_gateway_url(info.get("url"))
        if url is None:
            raise proto.ProtocolError("gateway URL refused (wss://, or ws:// on loopback)")
        shard.gateway = url
        now = shard.clock.now_ms()
        limit = proto.StartLimit.from_json(info.get("session_start_limit"))
        wait_ms = proto.identify_wait_ms(
            now_ms=now,
            history=shard.cursor.state.identifies,
            limit=limit,
            own_daily_cap=shard.identifies_per_day,
            spacing_ms=shard.identify_spacing_ms,
        )
        shard.identify_key = shard.shard[0] % (limit.max_concurrency if limit else 1)
        if not shard.staggered:
            # Shards start in buckets of max_concurrency, one bucket per 5 s window.
            shard.staggered = True
            bucket = shard.shard[0] // (limit.max_concurrency if limit else 1)
            wait_ms = max(wait_ms, bucket * shard.identify_spacing_ms)
        if wait_ms <= 0:
            break
        shard.status.state = "identify_wait"
        log.warning("%s: identify budget: waiting %.1f s", shard.label, wait_ms / 1000)
        await shard.lease.sleep(min(wait_ms / 1000, 600.0))
    shard.cursor.state.identifies.append(shard.clock.now_ms())
    shard.lease.check()
    await shard.cursor.save(shard.lease.fencing_token)
    return shard.gateway
