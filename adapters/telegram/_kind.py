"""The ``telegram`` connection kind: its config keys, secrets and builder."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import attrs

from prismd.channel import (
    DEFAULT_TYPING_DELAY_MS,
    BuildContext,
    ConfigTable,
    ConnectionKind,
    SecretSource,
)

from ..toolkit import TokenConnection, api_origin, token_keys, typing_delay_ms
from ._adapter import TelegramAdapter
from ._api import DEFAULT_API_ORIGIN


@attrs.frozen
class TelegramConnectionConfig(TokenConnection):
    api_origin: str = DEFAULT_API_ORIGIN
    mode: Literal["polling", "webhook"] = "polling"
    webhook_listen: str = "127.0.0.1:8443"
    webhook_path: str | None = None
    """``None`` means ``/telegram/<id>``; see :attr:`effective_webhook_path`."""
    webhook_secret_env: str | None = None
    webhook_inbox: bool = False
    allow_groups: bool = False
    poll_timeout_s: int = 30
    typing_delay_ms: int = DEFAULT_TYPING_DELAY_MS
    """A turn shows ``typing`` only once it has run this long (0..60,000; 0 = at once)."""
    kind: Literal["telegram"] = "telegram"

    @property
    def effective_webhook_path(self) -> str:
        return self.webhook_path if self.webhook_path is not None else f"/telegram/{self.id}"


def _parse(table: ConfigTable, conn_id: str) -> TelegramConnectionConfig:
    token_env, token_file = token_keys(table)
    origin = api_origin(table, DEFAULT_API_ORIGIN)
    mode = table.choice("mode", ("polling", "webhook"), "polling")
    webhook_listen: str = table.get_address("webhook_listen", "127.0.0.1:8443")
    webhook_path = table.get_str("webhook_path")
    if webhook_path is not None and not webhook_path.startswith("/"):
        raise table.error("webhook_path", "must start with '/'")
    webhook_secret_env = table.get_env_name("webhook_secret_env")
    if mode == "webhook" and webhook_secret_env is None:
        # Telegram echoes the secret in a header; without it anyone could post updates.
        raise table.error("webhook_secret_env", "is required in webhook mode")
    webhook_inbox = table.get_bool("webhook_inbox")
    if webhook_inbox and mode != "webhook":
        raise table.error("webhook_inbox", "needs mode = 'webhook'")
    return TelegramConnectionConfig(
        id=conn_id,
        token_env=token_env,
        token_file=token_file,
        api_origin=origin,
        mode=mode,
        webhook_listen=webhook_listen,
        webhook_path=webhook_path,
        webhook_secret_env=webhook_secret_env,
        webhook_inbox=webhook_inbox,
        allow_groups=table.get_bool("allow_groups"),
        poll_timeout_s=table.get_int("poll_timeout_s", 30, low=1, high=50),
        typing_delay_ms=typing_delay_ms(table),
    )


def _secrets(conn: TelegramConnectionConfig) -> Sequence[SecretSource]:
    sources = [conn.token_source]
    if conn.webhook_secret_env is not None:
        sources.append(SecretSource("webhook_secret_env", conn.webhook_secret_env))
    return sources


def _build(conn: TelegramConnectionConfig, context: BuildContext) -> TelegramAdapter:
    # Read once now so a missing token fails the start, not the first poll.
    token = conn.read_token(context)
    secret = None
    if conn.webhook_secret_env:
        secret = context.secret("webhook_secret_env", conn.webhook_secret_env, None)
    # The receiver lease (and the inbox's claims) last the daemon's lease_ttl_ms, so a
    # standby takes over that soon; a long poll must fit inside it with room to spare.
    floor = conn.poll_timeout_s * 1000 + 10_000 if conn.mode == "polling" else 5_000
    lease_ttl_ms = min(max(context.lease_ttl_ms, floor), 300_000)
    return TelegramAdapter(
        connection_id=conn.id,
        token=lambda: token,
        admit=context.admit,
        store=context.store,
        owner_id=context.owner_id,
        adopt=True,
        api_origin=conn.api_origin,
        mode=conn.mode,
        webhook_listen=conn.webhook_listen,
        webhook_path=conn.webhook_path,
        webhook_secret=secret,
        webhook_inbox=conn.webhook_inbox,
        busy_conversations=getattr(context.conversations, "busy_conversations", None),
        allow_groups=conn.allow_groups,
        poll_timeout_s=conn.poll_timeout_s,
        typing_delay_ms=conn.typing_delay_ms,
        lease_ttl_ms=lease_ttl_ms,
        max_attachment_bytes=context.max_attachment_bytes,
    )


KIND = ConnectionKind(
    name="telegram",
    label="telegram",
    parse=_parse,
    build=_build,
    secrets=_secrets,
    listen_address=lambda conn: conn.webhook_listen if conn.mode == "webhook" else None,
    where=lambda conn, _adapter: f"({conn.mode}{', inbox' if conn.webhook_inbox else ''})",
)
"""The ``telegram`` connection kind (collected by :mod:`adapters.kinds`)."""
