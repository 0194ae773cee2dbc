"""The calls of :class:`~stores.CheckpointStore` and :class:`~stores.LeaseStore` written
once, over each backend's few steps that touch its rows, and ``async with`` for a store.

* :class:`CheckpointStoreBase`: the reading calls and ``save_checkpoint`` /
  ``delete_checkpoint`` check the input, page the answers and write a single save or delete
  as a batch of one through the backend's own ``write_checkpoints``; a backend gives its
  ``_load``, ``_list`` and ``_events``.
* :class:`LeaseStoreBase`: the four lease calls, their checks, the clock and the fresh
  token; a backend gives the three steps that touch its rows (take a lease, move its
  expiry, read it).
* :class:`ClosesOnExit`: ``async with`` for a store that is open once made (memory,
  SQLite).
"""

from __future__ import annotations

import abc
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from types import TracebackType
from typing import Any, Self

import attrs
import trio

from . import _common
from ._types import (
    ANY_SCOPE,
    LIST_LIMIT_DEFAULT,
    CheckpointConflictError,
    CheckpointPage,
    CheckpointRecord,
    DeleteCheckpoint,
    EventPage,
    InvalidLeaseError,
    JournalEvent,
    JSONValue,
    LeaseConflictError,
    LeaseRecord,
    OwnershipScope,
    SaveCheckpoint,
    WriteResult,
)

# --------------------------------------------------------------------------- checkpoints


@attrs.frozen
class CheckpointQuery:
    """A checked :meth:`~stores.CheckpointStore.list_checkpoints`: at most ``limit`` rows,
    newest ``updated_at`` first, then key and namespace ascending, after the keyset
    position ``after`` (``(updated_at, key, namespace)`` of the last row seen)."""

    namespace: str | None
    key_prefix: str | None
    categories: tuple[str, ...] | None
    """``None``: any category (never empty here)."""
    scope: OwnershipScope
    """A partial filter."""
    after: tuple[int, str, str] | None
    limit: int


class CheckpointStoreBase(abc.ABC):
    """:class:`~stores.CheckpointStore` but for its two write methods, over the backend's
    ``_load``, ``_list``, ``_events`` and ``write_checkpoints``; ``_enter`` runs before
    anything else of every reading call."""

    __slots__ = ()

    # The backend's own; declared for the type checker.
    write_checkpoints: Callable[..., Awaitable[tuple[WriteResult, ...]]]

    async def _enter(self) -> None:
        """Before every reading call's checks (the memory store's checkpoint and open
        check); nothing by default."""
        return None

    @abc.abstractmethod
    async def _load(
        self, namespace: str, key: str, scope: OwnershipScope
    ) -> CheckpointRecord | None:
        """The row stored under exactly ``scope``, or ``None``."""

    @abc.abstractmethod
    async def _list(self, query: CheckpointQuery) -> Sequence[CheckpointRecord]:
        """The backend's own step (see the class)."""

    @abc.abstractmethod
    async def _events(
        self, after: int, limit: int, scope: OwnershipScope
    ) -> Sequence[JournalEvent]:
        """Up to ``limit`` committed events with ``seq > after`` in order, of the partial
        ``scope``."""

    async def save_checkpoint(
        self,
        *,
        namespace: str,
        key: str,
        scope: OwnershipScope,
        version: int,
        value: JSONValue,
        expected_version: int | None = None,
        fencing_token: int | None = None,
        category: str | None = None,
        metadata: Mapping[str, JSONValue] | None = None,
    ) -> CheckpointRecord:
        """Store ``value`` under the CAS and fencing rules in one transaction with its
        event (a batch of one: the same checks, transaction and event); a lost check
        raises :class:`CheckpointConflictError` and writes nothing."""
        save = SaveCheckpoint(
            namespace, key, scope, version, value, expected_version, fencing_token, category,
            metadata,
        )  # fmt: skip
        (result,) = await self.write_checkpoints((save,))
        if result.record is None:
            raise CheckpointConflictError("checkpoint version conflict")
        return result.record

    async def delete_checkpoint(self, *, namespace: str, key: str, scope: OwnershipScope) -> bool:
        """True when a row was removed (with its delete event); a foreign scope is a miss."""
        (result,) = await self.write_checkpoints((DeleteCheckpoint(namespace, key, scope),))
        return result.ok

    async def load_checkpoint(
        self, *, namespace: str, key: str, scope: OwnershipScope
    ) -> CheckpointRecord | None:
        """The row, or ``None`` when absent or stored under another exact scope."""
        await self._enter()
        _common.check_checkpoint_address(namespace, key, scope)
        return await self._load(namespace, key, scope)

    async def list_checkpoints(
        self,
        *,
        namespace: str | None = None,
        key_prefix: str | None = None,
        category: str | Sequence[str] | None = None,
        scope: OwnershipScope = ANY_SCOPE,
        cursor: str | None = None,
        limit: int = LIST_LIMIT_DEFAULT,
    ) -> CheckpointPage:
        """Newest first, then key; keyset-paged (see :meth:`CheckpointStore.list_checkpoints`)."""
        await self._enter()
        _common.check_list_filters(namespace, key_prefix, scope)
        categories = _common.check_category_filter(category)
        position = _common.decode_cursor(cursor)
        n = _common.clamp_limit(limit)
        if categories == ():
            await trio.lowlevel.checkpoint()
            return CheckpointPage(items=())
        query = CheckpointQuery(namespace, key_prefix, categories, scope, position, n + 1)
        rows = await self._list(query)
        items = tuple(rows[:n])
        next_cursor = _common.encode_cursor(items[-1]) if len(rows) > n else None
        return CheckpointPage(items=items, next_cursor=next_cursor)

    async def list_events(
        self, *, after: int = 0, limit: int = LIST_LIMIT_DEFAULT, scope: OwnershipScope = ANY_SCOPE
    ) -> EventPage:
        """Committed events with ``seq > after`` in commit order, filtered by partial scope."""
        await self._enter()
        after, n = _common.check_event_args(after, limit, scope)
        items = tuple(await self._events(after, n, scope))
        return EventPage(items=items, last_seq=items[-1].seq if items else after)


# --------------------------------------------------------------------------- leases


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


# --------------------------------------------------------------------------- closing


class ClosesOnExit(abc.ABC):
    """``async with store:`` gives the store itself and closes it (``aclose``) when the
    block ends."""

    __slots__ = ()

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Close the store (the backend's own)."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()
