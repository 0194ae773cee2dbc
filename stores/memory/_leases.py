""":class:`~stores.LeaseStore` over a dict."""

from __future__ import annotations

import os

import attrs
import trio

from .. import _common
from .._types import InvalidLeaseError, LeaseConflictError, LeaseRecord, OwnershipScope
from ._state import _State


@attrs.define(eq=False)
class MemoryLeaseStore:
    """:class:`~stores.LeaseStore` over a dict. Released and expired rows are kept, so
    fencing counters survive them (unlike the reference's sweep)."""

    _state: _State

    def _row(self, namespace: str, key: str, scope: OwnershipScope) -> LeaseRecord | None:
        self._state.check_open()
        _common.check_lease_address(namespace, key, scope)
        row = self._state.leases.get((namespace, key))
        if row is not None and row.scope != scope:
            raise LeaseConflictError("lease ownership mismatch")
        return row

    async def try_acquire_lease(
        self,
        *,
        namespace: str,
        key: str,
        scope: OwnershipScope,
        owner_id: str,
        ttl_ms: int,
        reclaim: bool = False,
    ) -> LeaseRecord | None:
        """A fresh lease (new token, fencing token + 1), or ``None`` while someone else holds it.

        With ``reclaim=True`` an unexpired lease held by the same ``owner_id`` is taken over.
        Raises :class:`~stores.LeaseConflictError` for a foreign scope or bad input.
        """
        await trio.lowlevel.checkpoint()
        row = self._row(namespace, key, scope)
        _common.check_name(owner_id, "owner_id", InvalidLeaseError)
        ttl = _common.check_ttl(ttl_ms)
        if not isinstance(reclaim, bool):
            raise InvalidLeaseError("reclaim must be a bool")
        now = self._state.clock.now_ms()
        if (
            row is not None
            and row.expires_at_ms > now
            and not (reclaim and row.owner_id == owner_id)
        ):
            return None
        lease = LeaseRecord(
            namespace=namespace,
            key=key,
            scope=scope,
            owner_id=owner_id,
            token=os.urandom(16).hex(),
            fencing_token=1 if row is None else row.fencing_token + 1,
            acquired_at_ms=now,
            expires_at_ms=now + ttl,
            updated_at_ms=now,
        )
        self._state.leases[(namespace, key)] = lease
        return lease

    async def renew_lease(
        self,
        *,
        namespace: str,
        key: str,
        scope: OwnershipScope,
        owner_id: str,
        token: str,
        ttl_ms: int,
    ) -> LeaseRecord | None:
        """Move the expiry of an unexpired lease held by (owner_id, token); else ``None``."""
        await trio.lowlevel.checkpoint()
        row = self._row(namespace, key, scope)
        _common.check_name(owner_id, "owner_id", InvalidLeaseError)
        _common.check_name(token, "token", InvalidLeaseError)
        ttl = _common.check_ttl(ttl_ms)
        now = self._state.clock.now_ms()
        if row is None or row.owner_id != owner_id or row.token != token:
            return None
        if row.expires_at_ms <= now:
            return None
        lease = attrs.evolve(row, expires_at_ms=now + ttl, updated_at_ms=now)
        self._state.leases[(namespace, key)] = lease
        return lease

    async def release_lease(
        self, *, namespace: str, key: str, scope: OwnershipScope, owner_id: str, token: str
    ) -> bool:
        """Expire the lease now when (owner_id, token) holds it; ``False`` otherwise."""
        await trio.lowlevel.checkpoint()
        row = self._row(namespace, key, scope)
        _common.check_name(owner_id, "owner_id", InvalidLeaseError)
        _common.check_name(token, "token", InvalidLeaseError)
        now = self._state.clock.now_ms()
        if row is None or row.owner_id != owner_id or row.token != token:
            return False
        if row.expires_at_ms <= now:
            return False
        self._state.leases[(namespace, key)] = attrs.evolve(
            row, expires_at_ms=now, updated_at_ms=now
        )
        return True

    async def get_lease(
        self, *, namespace: str, key: str, scope: OwnershipScope
    ) -> LeaseRecord | None:
        """The unexpired lease, or ``None``; a foreign scope raises LeaseConflictError."""
        await trio.lowlevel.checkpoint()
        row = self._row(namespace, key, scope)
        if row is None or row.expires_at_ms <= self._state.clock.now_ms():
            return None
        return row
