"""The ``signal`` connection kind (signal-cli over JSON-RPC): its config keys and builder.

Keys: ``account`` (the phone number signal-cli runs with, ``+…``), exactly one of
``socket`` (signal-cli's Unix socket) and ``tcp`` (``host:port`` on loopback: signal-cli's
TCP socket has neither authentication nor encryption), ``allow_groups`` (default false:
group messages are refused and counted) and ``receiver_lease_ttl_ms`` (the receiver
lease's TTL, 5 s..5 min, default 90 s; a standby daemon takes over within a third of it
once the holder released it), ``typing_delay_ms`` (0..60,000, default 1,000: how long a
turn runs before its typing indicator starts; the runtime's rule, shared with Telegram).
"""

from __future__ import annotations

from typing import Literal

import attrs

from prismd.channel import DEFAULT_TYPING_DELAY_MS, BuildContext, ConfigTable, ConnectionKind

from ..toolkit import is_loopback_host, parse_host_port, typing_delay_ms
from ._adapter import ACCOUNT_RE, SignalAdapter
from ._client import MAX_UNIX_PATH_BYTES


@attrs.frozen
class SignalConnectionConfig:
    id: str
    account: str
    socket: str | None = None
    tcp: str | None = None
    """Exactly one of ``socket`` (a Unix socket path) and ``tcp`` (``host:port``) is set."""
    allow_groups: bool = False
    receiver_lease_ttl_ms: int = 90_000
    typing_delay_ms: int = DEFAULT_TYPING_DELAY_MS
    kind: Literal["signal"] = "signal"


def _parse(table: ConfigTable, conn_id: str) -> SignalConnectionConfig:
    account: str = table.get_str("account", required=True)
    if not ACCOUNT_RE.fullmatch(account):
        raise table.error("account", "must be the phone number in international format (+…)")
    socket = table.get_str("socket")
    tcp = table.get_str("tcp")
    if (socket is None) == (tcp is None):
        raise table.error("socket", "set exactly one of socket and tcp")
    if socket is not None:
        raw = socket.encode("utf-8", "surrogatepass")
        if b"\0" in raw or len(raw) > MAX_UNIX_PATH_BYTES:
            raise table.error("socket", f"must be a path of at most {MAX_UNIX_PATH_BYTES} bytes")
    if tcp is not None:
        tcp = table.get_address("tcp")
        host, _port = parse_host_port(tcp)
        if not is_loopback_host(host):
            raise table.error(
                "tcp",
                "must be a loopback address: signal-cli's TCP socket has no authentication "
                "or encryption (use socket = … for another local user)",
            )
    return SignalConnectionConfig(
        id=conn_id,
        account=account,
        socket=socket,
        tcp=tcp,
        allow_groups=table.get_bool("allow_groups"),
        receiver_lease_ttl_ms=table.get_int(
            "receiver_lease_ttl_ms", 90_000, low=5_000, high=300_000
        ),
        typing_delay_ms=typing_delay_ms(table),
    )


def _build(conn: SignalConnectionConfig, context: BuildContext) -> SignalAdapter:
    return SignalAdapter(
        connection_id=conn.id,
        account=conn.account,
        admit=context.admit,
        store=context.store,
        owner_id=context.owner_id,
        socket=conn.socket,
        tcp=conn.tcp,
        allow_groups=conn.allow_groups,
        lease_ttl_ms=conn.receiver_lease_ttl_ms,
        typing_delay_ms=conn.typing_delay_ms,
        adopt=True,
    )


def _where(conn: SignalConnectionConfig, _adapter: object) -> str:
    return f"(signal-cli at {'unix:' + conn.socket if conn.socket else 'tcp:' + str(conn.tcp)})"


KIND = ConnectionKind(
    name="signal",
    label="signal (experimental)",
    parse=_parse,
    build=_build,
    where=_where,
)
"""The ``signal`` connection kind (collected by :mod:`adapters.kinds`)."""
