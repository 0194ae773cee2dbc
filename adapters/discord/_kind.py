"""The ``discord`` connection kind: its config keys, secrets and builder."""

from __future__ import annotations

from typing import Any, Literal

import attrs

from prismd.channel import DEFAULT_TYPING_DELAY_MS, BuildContext, ConfigTable, ConnectionKind

from ..toolkit import TokenConnection, api_origin, token_keys, typing_delay_ms
from . import _protocol as proto
from ._adapter import MAX_SHARDS, DiscordAdapter, default_intents
from ._rest import DEFAULT_API_ORIGIN
from ._sweep import SWEEP_EVERY_S


@attrs.frozen
class DiscordConnectionConfig(TokenConnection):
    api_origin: str = DEFAULT_API_ORIGIN
    intents: int = default_intents("mentions")
    allow_guilds: bool = False
    previews: bool = False
    respond_to: Literal["mentions", "all"] = "mentions"
    shards: int | None = None
    """A count, or ``None`` for ``"auto"`` (the default: what ``GET /gateway/bot`` says)."""
    typing_delay_ms: int = DEFAULT_TYPING_DELAY_MS
    """"typing…" only for a turn whose agent has run this long (the runtime's one rule)."""
    sweep_every_s: int = int(SWEEP_EVERY_S)
    """How often known channels are read for messages the gateway never sent (0: never)."""
    kind: Literal["discord"] = "discord"


def _parse(table: ConfigTable, conn_id: str) -> DiscordConnectionConfig:
    token_env, token_file = token_keys(table)
    origin = api_origin(table, DEFAULT_API_ORIGIN)
    respond_to = table.choice("respond_to", ("mentions", "all"), "mentions")
    intents = _intents(table, respond_to)
    return DiscordConnectionConfig(
        id=conn_id,
        token_env=token_env,
        token_file=token_file,
        api_origin=origin,
        intents=intents,
        allow_guilds=table.get_bool("allow_guilds"),
        previews=table.get_bool("previews"),
        respond_to=respond_to,
        shards=_shards(table),
        typing_delay_ms=typing_delay_ms(table),
        sweep_every_s=table.get_int("sweep_every_s", int(SWEEP_EVERY_S), low=0, high=3600),
    )


def _shards(table: ConfigTable) -> int | None:
    try:
        value: Any = table.get_str("shards", "auto")
    except Exception:
        value = table.get_int("shards", low=1, high=MAX_SHARDS)
    if value == "auto":
        return None
    if isinstance(value, int):
        return value
    raise table.error("shards", f'must be "auto" or a shard count (1..{MAX_SHARDS})')


def _intents(table: ConfigTable, respond_to: str) -> int:
    names = table.str_list("intents")
    if names is None:
        return default_intents("all" if respond_to == "all" else "mentions")
    intents = 0
    for name in names:
        bit = proto.INTENT_NAMES.get(name)
        if bit is None:
            known = ", ".join(proto.INTENT_NAMES)
            raise table.error("intents", f"unknown intent {name!r} (known: {known})")
        intents |= bit
    if not intents & (proto.GUILD_MESSAGES | proto.DIRECT_MESSAGES):
        raise table.error("intents", "needs guild_messages or direct_messages")
    if respond_to == "all" and not intents & proto.MESSAGE_CONTENT:
        raise table.error("intents", 'respond_to = "all" needs "message_content"')
    return intents


def _build(conn: DiscordConnectionConfig, context: BuildContext) -> DiscordAdapter:
    token = conn.read_token(context)
    return DiscordAdapter(
        connection_id=conn.id,
        token=lambda: token,
        admit=context.admit,
        store=context.store,
        owner_id=context.owner_id,
        api_origin=conn.api_origin,
        respond_to=conn.respond_to,
        intents=conn.intents,
        allow_guilds=conn.allow_guilds,
        previews=conn.previews,
        typing_delay_ms=conn.typing_delay_ms,
        sweep_every_s=float(conn.sweep_every_s),
        shards=conn.shards,
        lease_ttl_ms=min(max(context.lease_ttl_ms, 5_000), 300_000),
        retention_days=context.retention_days,
        max_attachment_bytes=context.max_attachment_bytes,
    )


KIND = ConnectionKind(
    name="discord",
    label="discord",
    parse=_parse,
    build=_build,
    secrets=lambda conn: [conn.token_source],
    where=lambda conn, _adapter: f"(gateway, {conn.respond_to})",
)
"""The ``discord`` connection kind (collected by :mod:`adapters.kinds`)."""
