"""The ``webchat`` connection kind: its config keys, exposure rule, secrets and builder."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs

from prismd.channel import BuildContext, ConfigTable, ConnectionKind, GrantView, SecretSource

from ..toolkit import is_loopback_host, parse_host_port
from ._adapter import MAX_FILE_BYTES, WebchatAdapter


@attrs.frozen
class WebchatConnectionConfig:
    id: str
    listen: str = "127.0.0.1:8787"
    access_token_env: str | None = None
    """Required (or a pairing grant) when ``listen`` is not a loopback address."""
    kind: Literal["webchat"] = "webchat"


def _parse(table: ConfigTable, conn_id: str) -> WebchatConnectionConfig:
    listen: str = table.get_address("listen", "127.0.0.1:8787")
    access_token_env = table.get_env_name("access_token_env")
    return WebchatConnectionConfig(id=conn_id, listen=listen, access_token_env=access_token_env)


def _check_grants(
    conn: WebchatConnectionConfig, grants: Sequence[GrantView]
) -> tuple[str, str] | None:
    """Off loopback without a token, anyone who reaches the port could talk to the agent:
    only pairing grants make that acceptable."""
    host, _port = parse_host_port(conn.listen)
    if is_loopback_host(host) or conn.access_token_env is not None:
        return None
    if any("*" in g.actors for g in grants):
        return (
            "listen",
            "a non-loopback listen address without access_token_env cannot be granted to "
            'actors = ["*"] (anyone who reaches the port would talk to the agent)',
        )
    if any(g.pairing for g in grants):
        return None
    return (
        "listen",
        "a non-loopback listen address needs access_token_env or a grant with pairing = true",
    )


def _secrets(conn: WebchatConnectionConfig) -> Sequence[SecretSource]:
    if conn.access_token_env is None:
        return ()
    return (SecretSource("access_token_env", conn.access_token_env),)


def _build(conn: WebchatConnectionConfig, context: BuildContext) -> WebchatAdapter:
    token = None
    if conn.access_token_env:
        token = context.secret("access_token_env", conn.access_token_env, None)
    # Off loopback without a token, config allows only pairing (no "*" grant): then
    # strangers reach the socket but no agent until an operator pairs them.
    mine = context.grants
    pairing_only = bool(mine) and not any("*" in g.actors for g in mine)
    return WebchatAdapter(
        connection_id=conn.id,
        listen=conn.listen,
        admit=context.admit,
        access_token=token,
        pairing_only=pairing_only and any(g.pairing for g in mine),
        checkpoints=context.store.checkpoints,
        conversations=context.conversations,
        resume_ttl_days=context.retention_days,
        max_file_bytes=min(context.max_attachment_bytes, MAX_FILE_BYTES),
    )


def _where(conn: WebchatConnectionConfig, adapter: Any) -> str:
    # Once listening, the bound address (port 0 resolved); before, the configured one.
    bound = getattr(adapter, "bound", None)
    host, port = bound if bound is not None else parse_host_port(conn.listen)
    shown = f"[{host}]" if ":" in str(host) else str(host)
    return f"http://{shown}:{port}/"


KIND = ConnectionKind(
    name="webchat",
    label="web chat",
    parse=_parse,
    build=_build,
    secrets=_secrets,
    check_grants=_check_grants,
    listen_address=lambda conn: conn.listen,
    where=_where,
)
"""The ``webchat`` connection kind (collected by :mod:`adapters.kinds`)."""
