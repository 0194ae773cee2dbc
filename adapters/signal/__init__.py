"""The Signal channel (signal-cli JSON-RPC): only its connection kind so far (issue 14)."""

from ._kind import KIND as KIND
from ._kind import SignalConnectionConfig as SignalConnectionConfig
