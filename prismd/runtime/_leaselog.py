"""DEBUG lines for the runtime's binding lease decisions, in one place.

Every binding lease call of the runtime goes through ``Core.leases``; wrapping it logs each
outcome: ``acquired`` / ``held elsewhere``, ``renewed`` / ``lost``, ``released``. A lease
that expired before its renewal was due is never renewed (the runtime acquires again): the
wrapper remembers the keys it saw acquired, so that re-acquisition is logged ``lost`` first.
Routes are named by :func:`route_tag` (a hash): keys hold chat and actor ids, tokens are
never logged.
"""

from __future__ import annotations

import hashlib
import logging

import attrs

from stores import LeaseRecord, LeaseStore, OwnershipScope

log = logging.getLogger("prismd.runtime")


def route_tag(binding_key: str) -> str:
    """12 hex of SHA-256 of a binding key: names a route in logs."""
    return hashlib.sha256(binding_key.encode("utf-8", "surrogatepass")).hexdigest()[:12]


@attrs.define(eq=False)
class LoggedLeases:
    """A :class:`~stores.LeaseStore` that logs each binding lease decision at DEBUG."""

    inner: LeaseStore
    _held: set[str] = attrs.field(factory=set, init=False)

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
        lease = await self.inner.try_acquire_lease(
            namespace=namespace,
            key=key,
            scope=scope,
            owner_id=owner_id,
            ttl_ms=ttl_ms,
            reclaim=reclaim,
        )
        if key in self._held:
            self._lost(key, "expired before renewal")
        if lease is not None:
            self._held.add(key)
        log.debug(
            "binding lease %s: route %s",
            "acquired" if lease is not None else "held elsewhere",
            route_tag(key),
        )
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
        lease = await self.inner.renew_lease(
            namespace=namespace,
            key=key,
            scope=scope,
            owner_id=owner_id,
            token=token,
            ttl_ms=ttl_ms,
        )
        if lease is None:
            self._lost(key, "not renewable")
        else:
            log.debug("binding lease renewed: route %s", route_tag(key))
        return lease

    async def release_lease(
        self, *, namespace: str, key: str, scope: OwnershipScope, owner_id: str, token: str
    ) -> bool:
        released = await self.inner.release_lease(
            namespace=namespace, key=key, scope=scope, owner_id=owner_id, token=token
        )
        self._held.discard(key)
        log.debug(
            "binding lease %s: route %s",
            "released" if released else "already gone at release",
            route_tag(key),
        )
        return released

    async def get_lease(
        self, *, namespace: str, key: str, scope: OwnershipScope
    ) -> LeaseRecord | None:
        return await self.inner.get_lease(namespace=namespace, key=key, scope=scope)

    def _lost(self, key: str, why: str) -> None:
        self._held.discard(key)
        log.debug("binding lease lost (%s): route %s", why, route_tag(key))
