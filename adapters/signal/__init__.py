"""The Signal channel (experimental, contract §12): signal-cli's JSON-RPC in manual receive mode.

:class:`SignalAdapter` is the adapter (:mod:`._adapter`), wiring parts of one job each:
:mod:`._client` (the Unix socket / TCP transport), :mod:`._receive` (the receiver lease,
pausing and reconnecting), :mod:`._subscription` (one subscription: the journal-then-admit
intake and its wind-down), :mod:`._held` (the events read and not yet admitted),
:mod:`._readiness`
(the probe before each subscription), :mod:`._inbox` (every received message, durably,
until admitted), :mod:`._filter` and :mod:`._parse` (notification → event, the group and
attachment policy), :mod:`._send` (chunks, approval lines, results), :mod:`._status`
(health and counters); :mod:`._kind` is the connection kind.
"""

from ._adapter import ACCOUNT_RE as ACCOUNT_RE
from ._adapter import SignalAdapter as SignalAdapter
from ._client import Endpoint as Endpoint
from ._inbox import INBOX_NAMESPACE as INBOX_NAMESPACE
from ._kind import KIND as KIND
from ._kind import SignalConnectionConfig as SignalConnectionConfig
from ._parse import IGNORE_REASONS as IGNORE_REASONS
from ._parse import event_id_for as event_id_for
from ._readiness import RECEIVER_NAMESPACE as RECEIVER_NAMESPACE
from ._send import MAX_CHUNK_UNITS as MAX_CHUNK_UNITS
from ._status import SignalStatistics as SignalStatistics

__all__ = [
    "ACCOUNT_RE",
    "IGNORE_REASONS",
    "INBOX_NAMESPACE",
    "KIND",
    "MAX_CHUNK_UNITS",
    "RECEIVER_NAMESPACE",
    "Endpoint",
    "SignalAdapter",
    "SignalConnectionConfig",
    "SignalStatistics",
    "event_id_for",
]
