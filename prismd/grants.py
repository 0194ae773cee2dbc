"""Who a turn runs as, and who may talk to which agent (contract §2): verified agent
identities and the ownership scope derived from them, ``authorize``'s question and answer
(:class:`AuthorizeInput`, :class:`Grant`), and the grants that answer it — config
``[[grants]]`` and durable paired grants.

:class:`GrantAuthorizer` is the runtime's ``authorize`` callback (contract §2.2). For an
event on connection ``C`` from actor ``A`` it answers, in order:

1. the first ``[[grants]]`` entry for ``C`` whose ``actors`` holds ``A`` or ``"*"``;
2. for connections with a ``pairing = true`` grant, the durable grant recorded when ``A``
   paired (loaded through ``load_paired`` and cached; :meth:`GrantAuthorizer.on_paired`
   makes a new pairing effective at once);
3. otherwise ``None`` (the runtime answers ``denied/rejected``).

The identity of a granted actor is built here, never from event claims: tenant from the
grant, account = the grant's ``account`` or the connection id, user = the grant's ``user``
or the actor id, principal ``("user", actor id)``, scopes ``("chat",)``. The
``grant_revision`` of a config grant is a stable hash of the entry, so editing an entry
invalidates approvals issued under the old one (contract §10.3).
"""

from __future__ import annotations

import hashlib
import json
import weakref
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from stores import SYSTEM_CLOCK, Clock, OwnershipScope

from .channel import Action, utf8_len

# --------------------------------------------------------------------------- identities


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


_CHECKED: dict[int, weakref.ref[AgentIdentity]] = {}
"""Identities whose shape was found valid, by ``id`` (a weak reference tells a live one from
a new object at a reused address). Their fields cannot change (frozen, of immutable
values), and a turn asks the same identity four or five times, one after another: the
identities of the turns running now are enough (a parked turn woken hours later is checked
once more). Emptied when full: each entry is ~150 bytes (its int key, the weak reference,
the slot), and 4,096 of them were 60 bytes per followed task at 10,000."""
_CHECKED_MAX = 512


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
    if utf8_len(identity.tenant_id) > 256:
        return False
    principal = identity.principal
    if not isinstance(principal, Principal):
        return False
    if not isinstance(principal.id, str) or not principal.id or utf8_len(principal.id) > 256:
        return False
    if not isinstance(principal.kind, str) or not 1 <= utf8_len(principal.kind) <= 64:
        return False
    scopes = identity.scopes
    if not isinstance(scopes, tuple) or not scopes or len(scopes) > 64:
        return False
    return all(isinstance(s, str) and s and utf8_len(s) <= 128 for s in scopes)


# --------------------------------------------------------------------------- authorize


@attrs.frozen
class AuthorizeInput:
    connection_id: str
    external_conversation_id: str
    external_actor_id: str
    event_id: str
    text: str
    action: Action
    received_at_ms: int
    thread_id: str | None = None
    claims: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Grant:
    """What the host's ``authorize`` returns for an allowed actor (ChannelAuthorization)."""

    identity: AgentIdentity
    agent_aliases: tuple[str, ...]
    grant_revision: str
    default_agent_alias: str | None = None
    notifications: bool = False


# --------------------------------------------------------------------------- grants

WILDCARD = "*"
CHAT_SCOPES = ("chat",)
OPERATOR_SCOPES = ("operator",)

# A miss (actor not paired) is cached briefly so a stranger's messages do not each cost
# a store read; a hit is cached longer. on_paired() drops the entry, so neither delays
# a new pairing.
NEGATIVE_TTL_MS = 5_000
POSITIVE_TTL_MS = 60_000
MAX_CACHE_ENTRIES = 4_096
STATIC_MEMO_ENTRIES = 1_024
"""Configured grants remembered (see :meth:`GrantAuthorizer.static_grant`); emptied when
full."""


@attrs.frozen
class GrantConfig:
    """Who may talk to which agents on one connection.

    ``actors == ("*",)`` grants everyone who can reach the connection. The ownership
    scope of a granted actor is ``(tenant, account or connection id, user or actor id)``.
    """

    connection: str
    actors: tuple[str, ...] = ()
    pairing: bool = False
    tenant: str = "default"
    account: str | None = None
    user: str | None = None
    aliases: tuple[str, ...] = ()
    default_alias: str | None = None
    notifications: bool = False


class _Owned(Protocol):
    """Whose scope an entry names: its tenant, account and user."""

    @property
    def tenant(self) -> str: ...
    @property
    def account(self) -> str | None: ...
    @property
    def user(self) -> str | None: ...


class _Aliased(Protocol):
    """Which agents an entry grants: its aliases and the default among them."""

    @property
    def aliases(self) -> tuple[str, ...]: ...
    @property
    def default_alias(self) -> str | None: ...


class GrantEntry(_Owned, _Aliased, Protocol):
    """The fields of :class:`GrantConfig` the authorizer reads."""

    @property
    def connection(self) -> str: ...
    @property
    def actors(self) -> tuple[str, ...]: ...
    @property
    def pairing(self) -> bool: ...
    @property
    def notifications(self) -> bool: ...


class OperatorEntry(_Owned, Protocol):
    """The fields of ``prismd.control.Operator`` the authorizer reads."""

    @property
    def uid(self) -> int: ...


class PairedRecord(_Aliased, Protocol):
    """The fields of ``prismd.journal.GrantRecord`` (a grant recorded by pairing)."""

    @property
    def connection_id(self) -> str: ...
    @property
    def actor_id(self) -> str: ...
    @property
    def created_at_ms(self) -> int: ...


LoadPaired = Callable[[OwnershipScope, str, str], Awaitable[PairedRecord | None]]
"""``load_paired(pairing_scope, connection_id, actor_id)``, i.e. ``GrantStore.load``."""


def grant_revision(entry: GrantEntry) -> str:
    """A stable revision of a config grant: same entry, same revision, across restarts."""
    canonical = json.dumps(
        {
            "connection": entry.connection,
            "actors": list(entry.actors),
            "pairing": entry.pairing,
            "tenant": entry.tenant,
            "account": entry.account,
            "user": entry.user,
            "aliases": list(entry.aliases),
            "default_alias": entry.default_alias,
            "notifications": entry.notifications,
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    return "cfg-" + hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:24]


def missing_grant(connection_id: str, flag: str, actor_id: str | None = None) -> str:
    """What an operator must add to the config, e.g. ``no [[grants]] entry for connection
    'tg-main' with pairing = true`` (``… for actor '202'`` when one actor needs it)."""
    text = f"no [[grants]] entry for connection {connection_id!r} with {flag} = true"
    return text if actor_id is None else f"{text} for actor {actor_id!r}"


def operator_identity(operator: OperatorEntry, *, now_ms: int) -> AgentIdentity:
    """The identity an operator (control socket peer uid) acts as."""
    return AgentIdentity(
        tenant_id=operator.tenant,
        account_id=operator.account,
        user_id=operator.user,
        principal=Principal("operator", str(operator.uid)),
        scopes=OPERATOR_SCOPES,
        issued_at_ms=now_ms,
    )


@attrs.frozen
class _Cached:
    grant: Grant | None
    expires_at_ms: int


@attrs.define(eq=False)
class GrantAuthorizer:
    """The daemon's ``authorize``, ``pairing_scope``, ``on_paired`` and ``identity_for``.

    Guarantees: never widens a grant from event data; an unknown connection or actor is
    ``None``; a store failure while loading a paired grant propagates (the runtime turns
    a raising ``authorize`` into ``denied/authorization_failed``, and nothing is cached).
    """

    grants: Sequence[GrantEntry]
    load_paired: LoadPaired | None = None
    clock: Clock = SYSTEM_CLOCK
    _revisions: dict[int, str] = attrs.field(init=False, factory=dict)
    _pairing_entries: dict[str, int] = attrs.field(init=False, factory=dict)
    _cache: dict[tuple[str, str], _Cached] = attrs.field(init=False, factory=dict)
    _static: dict[tuple[str, str], Grant] = attrs.field(init=False, factory=dict)

    def __attrs_post_init__(self) -> None:
        self.grants = tuple(self.grants)
        for index, entry in enumerate(self.grants):
            self._revisions[index] = grant_revision(entry)
            if entry.pairing:
                # The first pairing grant of a connection names the tenant paired actors join
                # and the notifications flag their grants carry.
                self._pairing_entries.setdefault(entry.connection, index)

    def pairing_scope(self, connection_id: str) -> OwnershipScope | None:
        """Where paired grants of ``connection_id`` live, or None when it has no pairing."""
        index = self._pairing_entries.get(connection_id)
        if index is None:
            return None
        return OwnershipScope(tenant_id=self.grants[index].tenant, account_id=connection_id)

    def pairing_connections(self) -> Iterable[str]:
        return tuple(self._pairing_entries)

    def static_grant(self, connection_id: str, actor_id: str) -> Grant | None:
        """The config grant for (connection, actor), without touching the store. The
        configuration does not change while the process runs: the grant of an actor met
        lately is the one made for it then (:data:`STATIC_MEMO_ENTRIES`), so its identity
        is checked once, not on every message."""
        key = (connection_id, actor_id)
        known = self._static.get(key)
        if known is not None:
            return known
        grant = self._static_grant(connection_id, actor_id)
        if grant is not None:
            if len(self._static) >= STATIC_MEMO_ENTRIES:
                self._static.clear()
            self._static[key] = grant
        return grant

    def _static_grant(self, connection_id: str, actor_id: str) -> Grant | None:
        for index, entry in enumerate(self.grants):
            if entry.connection != connection_id:
                continue
            if actor_id in entry.actors or WILDCARD in entry.actors:
                return self._grant_from_entry(index, entry, connection_id, actor_id)
        return None

    def _grant_from_entry(
        self, index: int, entry: GrantEntry, connection_id: str, actor_id: str
    ) -> Grant:
        account = entry.account if entry.account is not None else connection_id
        user = entry.user if entry.user is not None else actor_id
        owner = (entry.tenant, account, user)
        return self._grant(entry, owner, actor_id, self._revisions[index], entry.notifications)

    def _grant(
        self,
        granted: _Aliased,
        owner: tuple[str, str, str],
        actor_id: str,
        revision: str,
        notifications: bool,
    ) -> Grant:
        """The grant of ``granted``'s aliases to ``actor_id``, owned by ``owner`` (tenant,
        account, user), issued now."""
        tenant, account, user = owner
        identity = AgentIdentity(
            tenant_id=tenant,
            account_id=account,
            user_id=user,
            principal=Principal("user", actor_id),
            scopes=CHAT_SCOPES,
            issued_at_ms=self.clock.now_ms(),
        )
        return Grant(
            identity=identity,
            agent_aliases=tuple(granted.aliases),
            grant_revision=revision,
            default_agent_alias=granted.default_alias,
            notifications=notifications,
        )

    async def authorize(self, request: AuthorizeInput) -> Grant | None:
        """The runtime's ``authorize`` callback (see the module docstring for the order)."""
        connection_id = request.connection_id
        actor_id = request.external_actor_id
        if not isinstance(actor_id, str) or not actor_id:
            return None
        grant = self.static_grant(connection_id, actor_id)
        if grant is not None:
            return grant
        scope = self.pairing_scope(connection_id)
        if scope is None or self.load_paired is None:
            return None
        return await self._paired(scope, connection_id, actor_id)

    async def _paired(
        self, scope: OwnershipScope, connection_id: str, actor_id: str
    ) -> Grant | None:
        now = self.clock.now_ms()
        key = (connection_id, actor_id)
        cached = self._cache.get(key)
        if cached is not None and cached.expires_at_ms > now:
            return cached.grant
        assert self.load_paired is not None
        record = await self.load_paired(scope, connection_id, actor_id)
        grant = None if record is None else self.paired_grant(record)
        if len(self._cache) >= MAX_CACHE_ENTRIES:
            self._cache.clear()
        ttl = POSITIVE_TTL_MS if grant is not None else NEGATIVE_TTL_MS
        self._cache[key] = _Cached(grant, now + ttl)
        return grant

    def paired_grant(self, record: PairedRecord) -> Grant | None:
        """The grant of a paired actor: identity (pairing tenant, connection, actor)."""
        index = self._pairing_entries.get(record.connection_id)
        if index is None or not record.aliases:
            return None
        entry = self.grants[index]
        revision = json.dumps(
            [
                self._revisions[index],
                record.connection_id,
                record.actor_id,
                list(record.aliases),
                record.default_alias,
                record.created_at_ms,
            ],
            separators=(",", ":"),
        )
        owner = (entry.tenant, record.connection_id, record.actor_id)
        paired = "paired-" + hashlib.sha256(revision.encode()).hexdigest()[:24]
        return self._grant(record, owner, record.actor_id, paired, entry.notifications)

    async def on_paired(self, record: PairedRecord) -> None:
        """The runtime's ``on_paired``: the next ``authorize`` for this actor reads the store."""
        self._cache.pop((record.connection_id, record.actor_id), None)

    def identity_for(self, operator: OperatorEntry) -> AgentIdentity:
        """The control socket's ``identity_for``: an operator identity issued now."""
        return operator_identity(operator, now_ms=self.clock.now_ms())
