"""Resume tokens: which browser owns a web chat actor id.

One record per (connection, actor) holds only the SHA-256 prefix of a random token issued at
the actor's first hello; the page keeps the token and presents it on every later hello.
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping

import attrs

from prismd.journal import new_token, token_hash
from stores import CheckpointConflictError, CheckpointStore, Clock, OwnershipScope

__all__ = ["DAY_MS", "RESUME_NAMESPACE", "ResumeTokens", "Resumed"]

DAY_MS = 24 * 60 * 60 * 1000
SWEEP_PAGES = 20
SWEEP_PAGE_SIZE = 500
RESUME_NAMESPACE = "prismd.v1.webchat-resume"
RESUME_CATEGORY = "prismd-webchat-resume"
SERVICE_TENANT = "prismd-service"
"""Adapter state lives outside every user tenant (like the Telegram cursor)."""


@attrs.frozen
class Resumed:
    issued: str | None = None
    """The token just issued for a fresh actor (sent once in ``ready``), else ``None``."""


@attrs.define(eq=False)
class ResumeTokens:
    """Which browser owns an actor id: one record per (connection, actor) holding only the
    SHA-256 prefix of a random token issued at the actor's first hello.

    Records are written create-only or by CAS, so of two browsers claiming a fresh actor at
    once exactly one gets the token. ``last_seen`` is refreshed at most daily; a record
    unused for ``ttl_ms`` no longer protects its actor and is deleted by :meth:`sweep`.
    """

    checkpoints: CheckpointStore
    connection_id: str
    clock: Clock
    ttl_ms: int
    _sweep_cursor: str | None = attrs.field(default=None, init=False)

    def _scope(self, actor: str | None) -> OwnershipScope:
        return OwnershipScope(
            tenant_id=SERVICE_TENANT, account_id=self.connection_id, user_id=actor
        )

    def _key(self, actor: str) -> str:
        return f"w1:{self.connection_id}:{actor}"

    async def redeem(self, actor: str, presented: str | None) -> Resumed | None:
        """``Resumed`` when ``presented`` owns ``actor`` (or the actor was free and now
        belongs to a new token), ``None`` when another browser owns it. Store errors
        propagate."""
        scope, key = self._scope(actor), self._key(actor)
        row = await self.checkpoints.load_checkpoint(
            namespace=RESUME_NAMESPACE, key=key, scope=scope
        )
        now = self.clock.now_ms()
        stored = None if row is None else _resume_record(row.value)
        if row is not None and stored is not None and now - stored[1] <= self.ttl_ms:
            if presented is None or not hmac.compare_digest(token_hash(presented), stored[0]):
                return None
            if now - stored[1] >= DAY_MS:
                await self._write(key, scope, stored[0], now, row.version)
            return Resumed()
        token = new_token()
        if not await self._write(
            key, scope, token_hash(token), now, 0 if row is None else row.version
        ):
            return None  # another browser claimed it a moment ago
        return Resumed(issued=token)

    async def _write(
        self, key: str, scope: OwnershipScope, digest: str, now: int, expected: int
    ) -> bool:
        try:
            await self.checkpoints.save_checkpoint(
                namespace=RESUME_NAMESPACE,
                key=key,
                scope=scope,
                version=expected + 1,
                expected_version=expected,
                value={"tokenHash": digest, "lastSeenAtMs": now},
                category=RESUME_CATEGORY,
            )
        except CheckpointConflictError:
            return False
        return True

    async def sweep(self) -> int:
        """Delete records unused for longer than the TTL; returns how many.

        Bounded: at most ``SWEEP_PAGES`` pages per call. The listing is newest first, so
        the oldest records are at its end: a call that stops early leaves its cursor for
        the next call, which goes on from there (and starts over once it reached the end).
        """
        cutoff = self.clock.now_ms() - self.ttl_ms
        deleted = 0
        cursor = self._sweep_cursor
        for _page in range(SWEEP_PAGES):
            page = await self.checkpoints.list_checkpoints(
                namespace=RESUME_NAMESPACE,
                key_prefix=f"w1:{self.connection_id}:",
                category=RESUME_CATEGORY,
                scope=self._scope(None),
                cursor=cursor,
                limit=SWEEP_PAGE_SIZE,
            )
            for item in page.items:
                stored = _resume_record(item.value)
                if stored is None or stored[1] < cutoff:
                    removed = await self.checkpoints.delete_checkpoint(
                        namespace=RESUME_NAMESPACE, key=item.key, scope=item.scope
                    )
                    deleted += int(removed)
            cursor = page.next_cursor
            if cursor is None or not page.items:
                cursor = None
                break
        self._sweep_cursor = cursor
        return deleted


def _resume_record(value: object) -> tuple[str, int] | None:
    """``(token hash, last seen ms)`` of a stored record, ``None`` when it does not parse."""
    if not isinstance(value, Mapping):
        return None
    digest, seen = value.get("tokenHash"), value.get("lastSeenAtMs")
    if not isinstance(digest, str) or isinstance(seen, bool) or not isinstance(seen, int):
        return None
    return digest, seen
