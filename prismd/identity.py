"""Verified agent identities, grants and the ownership scope derived from them (§2)."""

from __future__ import annotations

import datetime as _dt
import weakref
from collections.abc import Mapping
from typing import Any

import attrs

from stores import OwnershipScope


@attrs.frozen
class Principal:
    kind: str
    id: str
    display_name: str | None = None


@attrs.frozen
class AgentIdentity:
    """Who a turn runs as. Built by the host (the daemon's grants), never from event claims."""

    tenant_id: str
    principal: Principal
    scopes: tuple[str, ...]
    issued_at_ms: int
    account_id: str | None = None
    user_id: str | None = None
    expires_at_ms: int | None = None
    revoked_at_ms: int | None = None
    verified: bool = True
    metadata: Mapping[str, Any] | None = None


def ownership_from_identity(identity: AgentIdentity) -> OwnershipScope:
    """The only way ownership is ever derived (§2.1)."""
    return OwnershipScope(identity.tenant_id, identity.account_id, identity.user_id)


def _utf8_len(value: str) -> int:
    return len(value.encode("utf-8", "surrogatepass"))


_CHECKED: dict[int, weakref.ref[AgentIdentity]] = {}
"""Identities whose shape was found valid, by ``id`` (a weak reference tells a live one from
a new object at a reused address). Their fields cannot change (frozen, of immutable
values), and a turn asks the same identity four or five times; emptied when full."""
_CHECKED_MAX = 4_096


def identity_is_active(identity: object, now_ms: int) -> bool:
    """``assertIdentityActive`` as a boolean: shape, limits, verified, not revoked/expired."""
    if not isinstance(identity, AgentIdentity):
        return False
    checked = _CHECKED.get(id(identity))
    if checked is None or checked() is not identity:
        if not _well_formed(identity):
            return False
        if len(_CHECKED) >= _CHECKED_MAX:
            _CHECKED.clear()
        _CHECKED[id(identity)] = weakref.ref(identity)
    if identity.revoked_at_ms is not None and identity.revoked_at_ms <= now_ms:
        return False
    if identity.expires_at_ms is not None and identity.expires_at_ms <= now_ms:
        return False
    return identity.issued_at_ms <= now_ms + 60_000


def _well_formed(identity: AgentIdentity) -> bool:
    """Shape and limits: verified, ids and scopes within their bounds."""
    if identity.verified is not True:
        return False
    if not isinstance(identity.tenant_id, str) or not identity.tenant_id:
        return False
    if _utf8_len(identity.tenant_id) > 256:
        return False
    principal = identity.principal
    if not isinstance(principal, Principal):
        return False
    if not isinstance(principal.id, str) or not principal.id or _utf8_len(principal.id) > 256:
        return False
    if not isinstance(principal.kind, str) or not 1 <= _utf8_len(principal.kind) <= 64:
        return False
    scopes = identity.scopes
    if not isinstance(scopes, tuple) or not scopes or len(scopes) > 64:
        return False
    return all(isinstance(s, str) and s and _utf8_len(s) <= 128 for s in scopes)


def epoch_ms(value: _dt.datetime) -> int:
    return int(value.timestamp() * 1000)
