"""The ``signal`` connection kind (signal-cli over JSON-RPC): its config keys.

Not built yet (issue 14): a config may name it and parses, ``check-config`` and ``run``
refuse it. The adapter will be a :class:`~adapters.toolkit.JsonRpcClient` on ``socket`` or
``tcp`` under a :class:`~adapters.toolkit.ReceiverLease`; its builder goes in ``KIND``.
"""

from __future__ import annotations

from typing import Literal

import attrs

from prismd.channel import ConfigTable, ConnectionKind


@attrs.frozen
class SignalConnectionConfig:
    id: str
    account: str
    socket: str | None = None
    tcp: str | None = None
    """Exactly one of ``socket`` (a Unix socket path) and ``tcp`` (``host:port``) is set."""
    kind: Literal["signal"] = "signal"


def _parse(table: ConfigTable, conn_id: str) -> SignalConnectionConfig:
    account: str = table.get_str("account", required=True)
    socket = table.get_str("socket")
    tcp = table.get_str("tcp")
    if (socket is None) == (tcp is None):
        raise table.error("socket", "set exactly one of socket and tcp")
    if tcp is not None:
        tcp = table.get_address("tcp")
    return SignalConnectionConfig(id=conn_id, account=account, socket=socket, tcp=tcp)


KIND = ConnectionKind(name="signal", label="signal", parse=_parse)
"""The ``signal`` connection kind (collected by :mod:`adapters.kinds`; not built yet)."""
