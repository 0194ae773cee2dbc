"""The memory store: its three facets over one state."""

from __future__ import annotations

import attrs
import trio

from .. import _bases
from .._bases import ClosesOnExit
from .._types import DEFAULT_MAX_VALUE_BYTES, SYSTEM_CLOCK, Clock
from ._checkpoints import MemoryCheckpointStore
from ._inbox import MemoryInboxStore
from ._leases import MemoryLeaseStore
from ._state import _State


@attrs.define(eq=False)
class MemoryStore(ClosesOnExit):
    """A process-local :class:`~stores.Store`: ``.checkpoints``, ``.leases``, ``aclose()``.

    Usable as ``async with MemoryStore() as store:``. After ``aclose()`` every call raises
    :class:`~stores.StoreUnavailableError`. ``max_value_bytes`` bounds the JSON encoding of
    a value (default 1 MiB).
    """

    clock: Clock = SYSTEM_CLOCK
    max_value_bytes: int = attrs.field(
        default=DEFAULT_MAX_VALUE_BYTES,
        validator=lambda _i, _a, v: _bases.check_max_value_bytes(v),
    )
    _state: _State = attrs.field(init=False)
    checkpoints: MemoryCheckpointStore = attrs.field(init=False)
    leases: MemoryLeaseStore = attrs.field(init=False)
    inbox: MemoryInboxStore = attrs.field(init=False)
    polls: None = attrs.field(default=None, init=False)
    """No shared due polls: one instance polls alone (:mod:`stores._polling`)."""

    def __attrs_post_init__(self) -> None:
        self._state = _State(clock=self.clock, max_value_bytes=self.max_value_bytes)
        self.checkpoints = MemoryCheckpointStore(self._state)
        self.leases = MemoryLeaseStore(self._state)
        self.inbox = MemoryInboxStore(self._state)

    @property
    def url(self) -> str:
        return "memory://"

    async def aclose(self) -> None:
        """Close the store; idempotent."""
        self._state.closed = True
        await trio.lowlevel.checkpoint()
