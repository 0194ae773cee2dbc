"""The four calls of :class:`~stores.LeaseStore` written once: their checks, the clock and
the fresh token here; each backend gives the three steps that touch its rows (take a lease,
move its expiry, read it)."""

from __future__ import annotations

import abc
import os
from collections.abc import Sequence
from typing import Any

import attrs

from . import _common
from ._types import InvalidLeaseError, LeaseConflictError, LeaseRecord, OwnershipScope


@attrs.frozen
class LeaseAsk:
    """A checked acquire, renew or release: the lease ``(owner_id, token)`` wants on
    ``(namespace, key, scope)`` at ``now``, until ``expires_at``."""

    namespace: str
    key: str
    scope: OwnershipScope
    owner_id: str
    token: str
    now: int
    expires_at: int

    def record(self, fencing_token: int, acquired_at_ms: int) -> LeaseRecord:
        """The lease this ask holds once granted, stamped ``now``."""
        return LeaseRecord(
            namespace=self.namespace,
            key=self.key,
            scope=self.scope,
            owner_id=self.owner_id,
            token=self.token,
            fencing_token=fencing_token,
            acquired_at_ms=acquired_at_ms,
            expires_at_ms=self.expires_at,
            updated_at_ms=self.now,
        )


LEASE_COLUMNS = (
    "namespace, key, tenant_id, account_id, user_id, owner_id, token, fencing_token,"
    " acquired_at, expires_at, updated_at"
)
"""The columns of ``prism_leases`` in both SQL backends, in the order of :func:`lease_from_row`."""


def lease_from_row(row: Sequence[Any]) -> LeaseRecord:
    """A ``prism_leases`` row (:data:`LEASE_COLUMNS`) as a record."""
    namespace, key, tenant, account, user, *held = row
    return LeaseRecord(namespace, key, OwnershipScope(tenant, account, user), *held)


class LeaseStoreBase(abc.ABC):
    """:class:`~stores.LeaseStore` over a backend's ``_now``, ``_acquire``, ``_move`` and
    ``_get``. A foreign scope raises :class:`~stores.LeaseConflictError` (the backend's
    ``_acquire``/``_move`` raise it, ``get_lease`` checks what ``_get`` read)."""

    @abc.abstractmethod
    def _now(self) -> int:
        """The backend's own step (see the class)."""

    @abc.abstractmethod
    async def _acquire(self, ask: LeaseAsk, adopt: bool) -> LeaseRecord | None:
        """A fresh lease (fencing token + 1) unless another unexpired holder has it (with
        ``adopt``, one held by the same owner is taken over)."""

    @abc.abstractmethod
    async def _move(self, ask: LeaseAsk) -> LeaseRecord | None:
        """Set the expiry of the unexpired lease ``(owner_id, token)`` holds; ``None`` when
        it holds none."""

    @abc.abstractmethod
    async def _get(self, namespace: str, key: str, scope: OwnershipScope) -> LeaseRecord | None:
        """The row as stored (any scope, expired or not), or ``None``."""

    def _ask(
        self,
        namespace: str,
        key: str,
        scope: OwnershipScope,
        owner_id: str,
        token: str | None,
        ttl_ms: int | None,
    ) -> LeaseAsk:
        _common.check_lease_address(namespace, key, scope)
        _common.check_name(owner_id, "owner_id", InvalidLeaseError)
        if token is None:
            token = os.urandom(16).hex()
        else:
            _common.check_name(token, "token", InvalidLeaseError)
        ttl = 0 if ttl_ms is None else _common.check_ttl(ttl_ms)
        now = self._now()
        return LeaseAsk(namespace, key, scope, owner_id, token, now, now + ttl)

    async def try_acquire_lease(
        self,
        *,
        namespace: str,
        key: str,
        scope: OwnershipScope,
        owner_id: str,
        ttl_ms: int,
        adopt: bool = False,
    ) -> LeaseRecord | None:
        """A fresh lease (new token, fencing token + 1), or ``None`` while someone else holds it.

        With ``adopt=True`` an unexpired lease held by the same ``owner_id`` is taken over.
        Raises :class:`~stores.LeaseConflictError` for a foreign scope or bad input.
        """
        ask = self._ask(namespace, key, scope, owner_id, None, ttl_ms)
        if not isinstance(adopt, bool):
            raise InvalidLeaseError("adopt must be a bool")
        return await self._acquire(ask, adopt)

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
        return await self._move(self._ask(namespace, key, scope, owner_id, token, ttl_ms))

    async def release_lease(
        self, *, namespace: str, key: str, scope: OwnershipScope, owner_id: str, token: str
    ) -> bool:
        """Expire the lease now when (owner_id, token) holds it; ``False`` otherwise."""
        ask = self._ask(namespace, key, scope, owner_id, token, None)
        return await self._move(ask) is not None

    async def get_lease(
        self, *, namespace: str, key: str, scope: OwnershipScope
    ) -> LeaseRecord | None:
        """The unexpired lease, or ``None``; a foreign scope raises LeaseConflictError."""
        _common.check_lease_address(namespace, key, scope)
        now = self._now()
        lease = await self._get(namespace, key, scope)
        if lease is None:
            return None
        if lease.scope != scope:
            raise LeaseConflictError("lease ownership mismatch")
        return lease if lease.expires_at_ms > now else None
