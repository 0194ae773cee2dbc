""":class:`~stores.LeaseStore` over a dict."""

from __future__ import annotations

import attrs
import trio

from .._bases import LeaseAsk, LeaseStoreBase
from .._types import LeaseConflictError, LeaseRecord, OwnershipScope
from ._state import _State


@attrs.define(eq=False)
class MemoryLeaseStore(LeaseStoreBase):
    """:class:`~stores.LeaseStore` over a dict. Released and expired rows are kept, so
    fencing counters survive them (unlike the reference's sweep)."""

    _state: _State

    def _now(self) -> int:
        return self._state.clock.now_ms()

    async def _get(self, namespace: str, key: str, scope: OwnershipScope) -> LeaseRecord | None:
        await trio.lowlevel.checkpoint()
        self._state.check_open()
        return self._state.leases.get((namespace, key))

    async def _held(self, ask: LeaseAsk) -> LeaseRecord | None:
        """The row ``ask`` addresses, in its scope."""
        row = await self._get(ask.namespace, ask.key, ask.scope)
        if row is not None and row.scope != ask.scope:
            raise LeaseConflictError("lease ownership mismatch")
        return row

    async def _acquire(self, ask: LeaseAsk, adopt: bool) -> LeaseRecord | None:
        row = await self._held(ask)
        if (
            row is not None
            and row.expires_at_ms > ask.now
            and not (adopt and row.owner_id == ask.owner_id)
        ):
            return None
        lease = ask.record(1 if row is None else row.fencing_token + 1, ask.now)
        self._state.leases[(ask.namespace, ask.key)] = lease
        return lease

    async def _move(self, ask: LeaseAsk) -> LeaseRecord | None:
        row = await self._held(ask)
        if row is None or row.owner_id != ask.owner_id or row.token != ask.token:
            return None
        if row.expires_at_ms <= ask.now:
            return None
        lease = attrs.evolve(row, expires_at_ms=ask.expires_at, updated_at_ms=ask.now)
        self._state.leases[(ask.namespace, ask.key)] = lease
        return lease
