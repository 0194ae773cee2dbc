"""Control records: approval controls, pairing tokens and durable grants (contract §5.5, §5.6, §10).

Approval and pairing tokens are 32 random bytes (base64url, 43 chars). They are shown to the
user exactly once and **never stored**: a control record is keyed by the first 40 hex chars of
the token's SHA-256 (``a1:``/``p1:`` keys in the ``prism.channels.v1.control`` namespace), so a
leaked journal cannot be replayed into an approval or a grant. Consumption is a compare-and-swap
``pending -> consumed`` on the loaded version, so exactly one concurrent consumer wins.

Grants recorded by pairing live in their own namespace (``prismd.v1.grant``), one record per
(connection, actor), upserted idempotently.
"""

from __future__ import annotations

import base64
import hashlib
import secrets
from collections.abc import Mapping
from typing import Any, Literal, TypeAlias

import attrs

from stores import (
    SYSTEM_CLOCK,
    CheckpointConflictError,
    CheckpointRecord,
    CheckpointStore,
    Clock,
    Keep,
    OwnershipScope,
    Replace,
    compact_json,
    update_checkpoint,
)

from ..channel import ApprovalOutcome, Button, utf8_len
from ._journal import _part, _scope_parts
from ._records import (
    MAX_SAFE_INTEGER,
    CorruptRecordError,
    _compact,
    _mapping,
    _opt_int,
    _opt_str,
    _req_int,
    _req_str,
)

NS_CONTROL = "prism.channels.v1.control"
CATEGORY_CONTROL = "channel-control"
NS_GRANT = "prismd.v1.grant"
CATEGORY_GRANT = "prismd-grant"

APPROVAL_TTL_MAX_MS = 5 * 60 * 1000
PAIRING_TTL_DEFAULT_MS = 5 * 60 * 1000
PAIRING_TTL_MIN_MS = 1000
PAIRING_TTL_MAX_MS = 5 * 60 * 1000

ConsumeStatus: TypeAlias = Literal["consumed", "invalid", "already_consumed", "expired"]
ControlState: TypeAlias = Literal["pending", "consumed"]


class ControlRecordTooLargeError(ValueError):
    """A control record's JSON encoding exceeds ``max_journal_record_bytes``."""


# --------------------------------------------------------------------------- tokens and keys


def new_token() -> str:
    """32 random bytes, base64url without padding (43 chars, matches the approval regex)."""
    return base64.urlsafe_b64encode(secrets.token_bytes(32)).rstrip(b"=").decode("ascii")


def token_hash(token: str) -> str:
    """First 40 lowercase hex chars of SHA-256(token): the only form a token is stored in."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()[:40]


def control_key(prefix: str, scope: OwnershipScope, connection_id: str, token: str) -> str:
    """``<prefix>:<conn>:<T>:<A>:<U>:<hash>`` (§5); absent scope parts and empty conn are ``-``."""
    return f"{prefix}:{_part(connection_id)}:{_scope_parts(scope)}:{token_hash(token)}"


def _encoded_size(value: Mapping[str, Any]) -> int:
    return utf8_len(compact_json(value))


def _check_size(value: Mapping[str, Any], max_record_bytes: int) -> None:
    limit = max(1024, max_record_bytes)
    if _encoded_size(value) > limit:
        raise ControlRecordTooLargeError(
            f"control record exceeds max_journal_record_bytes ({limit} bytes)"
        )


def _aliases(raw: Mapping[str, Any]) -> tuple[str, ...]:
    aliases = raw.get("aliases")
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise CorruptRecordError("aliases")
    return tuple(aliases)


def _state(raw: Mapping[str, Any]) -> ControlState:
    value = raw.get("state")
    if value == "pending":
        return "pending"
    if value == "consumed":
        return "consumed"
    raise CorruptRecordError("state")


# --------------------------------------------------------------------------- approvals


@attrs.frozen
class ApprovalTarget:
    """What an approval control is bound to (everything §10.3 re-checks on consumption)."""

    connection_id: str
    external_conversation_id: str
    external_actor_id: str
    thread_id: str | None
    principal_kind: str
    principal_id: str
    grant_revision: str
    agent_alias: str
    definition_revision: str
    session_id: str
    run_id: str
    approval_id: str
    expected_version: int
    """The agent's run-state version the decision applies to (safe int >= 1)."""


@attrs.frozen
class ApprovalRecord(ApprovalTarget):
    """A stored approval control (§5.5): its target (the leading fields), then its outcome
    and state. Carries no token, only what the token unlocks."""

    outcome: ApprovalOutcome
    state: ControlState
    created_at_ms: int
    expires_at_ms: int
    consumed_at_ms: int | None = None

    @property
    def target(self) -> ApprovalTarget:
        # The record's leading fields are the target's (the class it extends).
        return ApprovalTarget(
            **{f.name: getattr(self, f.name) for f in attrs.fields(ApprovalTarget)}
        )

    def to_json(self) -> dict[str, Any]:
        return _compact(
            {
                "connectionId": self.connection_id,
                "externalConversationId": self.external_conversation_id,
                "externalActorId": self.external_actor_id,
                "principalKind": self.principal_kind,
                "principalId": self.principal_id,
                "grantRevision": self.grant_revision,
                "agentAlias": self.agent_alias,
                "definitionRevision": self.definition_revision,
                "sessionId": self.session_id,
                "runId": self.run_id,
                "approvalId": self.approval_id,
                "expectedVersion": self.expected_version,
                "outcome": self.outcome,
                "state": self.state,
                "createdAt": self.created_at_ms,
                "expiresAt": self.expires_at_ms,
                "threadId": self.thread_id,
                "consumedAt": self.consumed_at_ms,
            }
        )

    @classmethod
    def from_json(cls, raw: object) -> ApprovalRecord:
        """Parse a stored value; raises ``ValueError`` naming the first bad field."""
        raw = _mapping(raw)
        outcome = raw.get("outcome")
        if outcome not in ("allow_once", "reject_once"):
            raise ValueError("outcome")
        expected_version = _req_int(raw, "expectedVersion")
        if not 1 <= expected_version <= MAX_SAFE_INTEGER:
            raise ValueError("expectedVersion")
        return cls(
            connection_id=_req_str(raw, "connectionId"),
            external_conversation_id=_req_str(raw, "externalConversationId"),
            external_actor_id=_req_str(raw, "externalActorId"),
            thread_id=_opt_str(raw, "threadId"),
            principal_kind=_req_str(raw, "principalKind"),
            principal_id=_req_str(raw, "principalId"),
            grant_revision=_req_str(raw, "grantRevision"),
            agent_alias=_req_str(raw, "agentAlias"),
            definition_revision=_req_str(raw, "definitionRevision"),
            session_id=_req_str(raw, "sessionId"),
            run_id=_req_str(raw, "runId"),
            approval_id=_req_str(raw, "approvalId"),
            expected_version=expected_version,
            outcome="allow_once" if outcome == "allow_once" else "reject_once",
            state=_state(raw),
            created_at_ms=_req_int(raw, "createdAt"),
            expires_at_ms=_req_int(raw, "expiresAt"),
            consumed_at_ms=_opt_int(raw, "consumedAt"),
        )


@attrs.frozen
class IssuedButtons:
    """The two controls shown on an approval notice. The tokens live only in ``controls``."""

    buttons: tuple[Button, Button]
    expires_at_ms: int


@attrs.frozen
class LoadedApproval:
    version: int
    record: ApprovalRecord


@attrs.define(eq=False)
class ApprovalStore:
    """Approval controls in the control namespace (§10.2, §10.3).

    Guarantees: the raw token is never written to the store (only its hash is in the key);
    :meth:`consume` is a single CAS, so of any number of concurrent consumers of one token
    exactly one gets ``"consumed"``. Store errors propagate unchanged (the runtime maps
    them to ``unavailable``).
    """

    checkpoints: CheckpointStore
    clock: Clock = attrs.field(default=SYSTEM_CLOCK, kw_only=True)
    max_record_bytes: int = attrs.field(default=128 * 1024, kw_only=True)

    async def issue(
        self, scope: OwnershipScope, target: ApprovalTarget, ttl_ms: int
    ) -> IssuedButtons:
        """Create an ``allow_once`` and a ``reject_once`` record, each under a fresh token.

        ``ttl_ms`` is clamped to [1 ms, 5 min]. Returns the controls
        ``("Allow once", "p:a:<t1>")`` and ``("Deny", "p:d:<t2>")``.
        """
        if not 1 <= target.expected_version <= MAX_SAFE_INTEGER:
            raise ValueError("expected_version must be a safe integer >= 1")
        now = self.clock.now_ms()
        expires_at = now + max(1, min(int(ttl_ms), APPROVAL_TTL_MAX_MS))
        allow_token = new_token()
        deny_token = new_token()
        for token, outcome in ((allow_token, "allow_once"), (deny_token, "reject_once")):
            record = ApprovalRecord(
                **attrs.asdict(target, recurse=False),
                outcome="allow_once" if outcome == "allow_once" else "reject_once",
                state="pending",
                created_at_ms=now,
                expires_at_ms=expires_at,
            )
            value = record.to_json()
            _check_size(value, self.max_record_bytes)
            await self.checkpoints.save_checkpoint(
                namespace=NS_CONTROL,
                key=control_key("a1", scope, target.connection_id, token),
                scope=scope,
                version=1,
                value=value,
                expected_version=0,
                category=CATEGORY_CONTROL,
                metadata={"kind": "approval", "state": "pending"},
            )
        return IssuedButtons(
            buttons=(
                Button("Allow once", f"p:a:{allow_token}"),
                Button("Deny", f"p:d:{deny_token}"),
            ),
            expires_at_ms=expires_at,
        )

    async def load(
        self, scope: OwnershipScope, connection_id: str, token: str
    ) -> LoadedApproval | None:
        """The record for ``token``, or ``None`` when missing, unparsable or another connection."""
        stored = await self.checkpoints.load_checkpoint(
            namespace=NS_CONTROL, key=control_key("a1", scope, connection_id, token), scope=scope
        )
        if stored is None:
            return None
        try:
            record = ApprovalRecord.from_json(stored.value)
        except ValueError:
            return None
        if record.connection_id != connection_id:
            return None
        return LoadedApproval(version=stored.version, record=record)

    async def consume(
        self, scope: OwnershipScope, connection_id: str, token: str, expected_version: int
    ) -> ConsumeStatus:
        """CAS ``pending -> consumed`` at ``expected_version`` (the version :meth:`load` saw).

        ``invalid``: missing or the record changed since it was loaded; ``already_consumed``:
        consumed before or the CAS was lost to a concurrent consumer; ``expired``:
        ``expires_at <= now``.
        """
        loaded = await self.load(scope, connection_id, token)
        if loaded is None:
            return "invalid"
        if loaded.record.state == "consumed":
            return "already_consumed"
        if loaded.version != expected_version:
            return "invalid"
        now = self.clock.now_ms()
        if loaded.record.expires_at_ms <= now:
            return "expired"
        updated = attrs.evolve(loaded.record, state="consumed", consumed_at_ms=now)
        try:
            await self.checkpoints.save_checkpoint(
                namespace=NS_CONTROL,
                key=control_key("a1", scope, connection_id, token),
                scope=scope,
                version=loaded.version + 1,
                value=updated.to_json(),
                expected_version=loaded.version,
                category=CATEGORY_CONTROL,
                metadata={"kind": "approval", "state": "consumed"},
            )
        except CheckpointConflictError:
            return "already_consumed"
        return "consumed"


# --------------------------------------------------------------------------- pairing


@attrs.frozen
class PairingTarget:
    """What a pairing token grants once consumed (§5.6 plus the aliases a grant gets)."""

    connection_id: str
    aliases: tuple[str, ...]
    grant_revision: str
    external_conversation_id: str | None = None
    external_actor_id: str | None = None
    thread_id: str | None = None
    agent_alias: str | None = None


@attrs.frozen
class PairingIssued:
    token: str
    expires_at_ms: int
    target: PairingTarget


@attrs.frozen
class PairingConsumeResult:
    status: ConsumeStatus
    target: PairingTarget | None = None


def _pairing_to_json(
    target: PairingTarget, state: ControlState, created: int, expires: int, consumed: int | None
) -> dict[str, Any]:
    value: dict[str, Any] = {
        "connectionId": target.connection_id,
        "aliases": list(target.aliases),
        "grantRevision": target.grant_revision,
        "state": state,
        "createdAt": created,
        "expiresAt": expires,
    }
    optional = {
        "externalConversationId": target.external_conversation_id,
        "externalActorId": target.external_actor_id,
        "threadId": target.thread_id,
        "agentAlias": target.agent_alias,
        "consumedAt": consumed,
    }
    value.update({k: v for k, v in optional.items() if v is not None})
    return value


def _pairing_from_json(raw: object) -> tuple[PairingTarget, ControlState, int]:
    """(target, state, expires_at_ms); raises ``ValueError`` on a malformed record."""
    raw = _mapping(raw)
    target = PairingTarget(
        connection_id=_req_str(raw, "connectionId"),
        aliases=_aliases(raw),
        grant_revision=_req_str(raw, "grantRevision"),
        external_conversation_id=_opt_str(raw, "externalConversationId"),
        external_actor_id=_opt_str(raw, "externalActorId"),
        thread_id=_opt_str(raw, "threadId"),
        agent_alias=_opt_str(raw, "agentAlias"),
    )
    return target, _state(raw), _req_int(raw, "expiresAt")


@attrs.define(eq=False)
class PairingStore:
    """One-time pairing tokens (§10.5, SPEC difference 6), stored by hash under ``p1:`` keys.

    Guarantees: the token is never stored; a token is consumed at most once (CAS); an
    unknown token, another connection or another scope all answer ``invalid`` alike.
    """

    checkpoints: CheckpointStore
    clock: Clock = attrs.field(default=SYSTEM_CLOCK, kw_only=True)

    async def create(
        self,
        scope: OwnershipScope,
        *,
        connection_id: str,
        aliases: tuple[str, ...],
        ttl_ms: int | None = None,
        grant_revision: str = "pairing",
        external_conversation_id: str | None = None,
        actor_id: str | None = None,
        thread_id: str | None = None,
        agent_alias: str | None = None,
        now_ms: int | None = None,
    ) -> PairingIssued:
        """Issue a token valid for ``ttl_ms`` (default 5 min, clamped to [1 s, 5 min])."""
        if not connection_id:
            raise ValueError("connection_id must be non-empty")
        if isinstance(aliases, str) or not all(isinstance(a, str) and a for a in aliases):
            raise ValueError("aliases must be a tuple of non-empty strings")
        ttl = PAIRING_TTL_DEFAULT_MS if ttl_ms is None else int(ttl_ms)
        ttl = max(PAIRING_TTL_MIN_MS, min(ttl, PAIRING_TTL_MAX_MS))
        now = self.clock.now_ms() if now_ms is None else now_ms
        target = PairingTarget(
            connection_id=connection_id,
            aliases=tuple(aliases),
            grant_revision=grant_revision,
            external_conversation_id=external_conversation_id,
            external_actor_id=actor_id,
            thread_id=thread_id,
            agent_alias=agent_alias,
        )
        token = new_token()
        await self.checkpoints.save_checkpoint(
            namespace=NS_CONTROL,
            key=control_key("p1", scope, connection_id, token),
            scope=scope,
            version=1,
            value=_pairing_to_json(target, "pending", now, now + ttl, None),
            expected_version=0,
            category=CATEGORY_CONTROL,
            metadata={"kind": "pairing", "state": "pending"},
        )
        return PairingIssued(token=token, expires_at_ms=now + ttl, target=target)

    async def consume(
        self,
        scope: OwnershipScope,
        *,
        connection_id: str,
        token: str,
        now_ms: int | None = None,
    ) -> PairingConsumeResult:
        """Consume ``token`` once; expiry (``expires_at <= now``) is checked before the CAS."""
        key = control_key("p1", scope, connection_id, token)
        stored = await self.checkpoints.load_checkpoint(namespace=NS_CONTROL, key=key, scope=scope)
        if stored is None:
            return PairingConsumeResult("invalid")
        try:
            target, state, expires_at = _pairing_from_json(stored.value)
        except ValueError:
            return PairingConsumeResult("invalid")
        if target.connection_id != connection_id:
            return PairingConsumeResult("invalid")
        if state == "consumed":
            return PairingConsumeResult("already_consumed")
        now = self.clock.now_ms() if now_ms is None else now_ms
        if expires_at <= now:
            return PairingConsumeResult("expired")
        value = dict(stored.value)
        value.update(state="consumed", consumedAt=now)
        try:
            await self.checkpoints.save_checkpoint(
                namespace=NS_CONTROL,
                key=key,
                scope=scope,
                version=stored.version + 1,
                value=value,
                expected_version=stored.version,
                category=CATEGORY_CONTROL,
                metadata={"kind": "pairing", "state": "consumed"},
            )
        except CheckpointConflictError:
            return PairingConsumeResult("already_consumed")
        return PairingConsumeResult("consumed", target)


# --------------------------------------------------------------------------- grants


@attrs.frozen
class GrantRecord:
    """A durable grant recorded by pairing: ``actor_id`` may talk to ``aliases``."""

    connection_id: str
    actor_id: str
    aliases: tuple[str, ...]
    default_alias: str | None
    created_at_ms: int

    def to_json(self) -> dict[str, Any]:
        return _compact(
            {
                "connectionId": self.connection_id,
                "actorId": self.actor_id,
                "aliases": list(self.aliases),
                "createdAt": self.created_at_ms,
                "defaultAlias": self.default_alias,
            }
        )

    @classmethod
    def from_json(cls, raw: object) -> GrantRecord:
        raw = _mapping(raw)
        return cls(
            connection_id=_req_str(raw, "connectionId"),
            actor_id=_req_str(raw, "actorId"),
            aliases=_aliases(raw),
            default_alias=_opt_str(raw, "defaultAlias"),
            created_at_ms=_req_int(raw, "createdAt"),
        )


def grant_key(connection_id: str, actor_id: str) -> str:
    return f"g1:{connection_id}:{actor_id}"


@attrs.define(eq=False)
class GrantStore:
    """Grants recorded by pairing, one per (connection, actor) under ``g1:<conn>:<actor>``.

    :meth:`record` is an idempotent upsert: recording the same grant again changes nothing;
    recording different aliases replaces them (the creation time is kept).
    """

    checkpoints: CheckpointStore
    clock: Clock = attrs.field(default=SYSTEM_CLOCK, kw_only=True)

    async def record(
        self,
        scope: OwnershipScope,
        *,
        connection_id: str,
        actor_id: str,
        aliases: tuple[str, ...],
        default_alias: str | None = None,
    ) -> GrantRecord:
        if not connection_id or not actor_id:
            raise ValueError("connection_id and actor_id must be non-empty")
        if isinstance(aliases, str) or not aliases or not all(isinstance(a, str) for a in aliases):
            raise ValueError("aliases must be a non-empty tuple of strings")
        if default_alias is not None and default_alias not in aliases:
            raise ValueError("default_alias must be one of aliases")

        def change(stored: CheckpointRecord | None) -> Replace[GrantRecord] | Keep[GrantRecord]:
            created = self.clock.now_ms()
            if stored is not None:
                try:
                    existing = GrantRecord.from_json(stored.value)
                except ValueError:
                    existing = None
                if existing is not None:
                    created = existing.created_at_ms
                    if existing.aliases == tuple(aliases) and existing.default_alias == (
                        default_alias
                    ):
                        return Keep(existing)
            grant = GrantRecord(
                connection_id=connection_id,
                actor_id=actor_id,
                aliases=tuple(aliases),
                default_alias=default_alias,
                created_at_ms=created,
            )
            return Replace(grant.to_json(), grant)

        # A concurrent upsert of the same row can win the CAS: read again and retry.
        return await update_checkpoint(
            self.checkpoints,
            namespace=NS_GRANT,
            key=grant_key(connection_id, actor_id),
            scope=scope,
            change=change,
            what="the grant upsert",
            category=CATEGORY_GRANT,
            attempts=5,
        )

    async def load(
        self, scope: OwnershipScope, connection_id: str, actor_id: str
    ) -> GrantRecord | None:
        stored = await self.checkpoints.load_checkpoint(
            namespace=NS_GRANT, key=grant_key(connection_id, actor_id), scope=scope
        )
        if stored is None:
            return None
        try:
            grant = GrantRecord.from_json(stored.value)
        except ValueError:
            return None
        if grant.connection_id != connection_id or grant.actor_id != actor_id:
            return None
        return grant

    async def list(
        self, scope: OwnershipScope, connection_id: str | None = None, limit: int = 500
    ) -> list[GrantRecord]:
        """Up to ``limit`` grants matching the partial ``scope`` (and connection), newest first."""
        prefix = "g1:" if connection_id is None else f"g1:{connection_id}:"
        out: list[GrantRecord] = []
        cursor: str | None = None
        while len(out) < limit:
            page = await self.checkpoints.list_checkpoints(
                namespace=NS_GRANT,
                key_prefix=prefix,
                scope=scope,
                cursor=cursor,
                limit=min(500, limit - len(out)),
            )
            for item in page.items:
                try:
                    grant = GrantRecord.from_json(item.value)
                except ValueError:
                    continue
                if connection_id is not None and grant.connection_id != connection_id:
                    continue
                out.append(grant)
            if page.next_cursor is None or not page.items:
                break
            cursor = page.next_cursor
        return out[:limit]
