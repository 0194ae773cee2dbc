"""The reading calls of :class:`~stores.CheckpointStore`, and ``save_checkpoint`` /
``delete_checkpoint``, written once: :class:`CheckpointStoreBase` checks the input, pages
the answers and writes a single save or delete as a batch of one through the backend's own
``write_checkpoints``; a backend gives its ``_load``, ``_list`` and ``_events``."""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Mapping, Sequence

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
    JournalEvent,
    JSONValue,
    OwnershipScope,
    SaveCheckpoint,
    WriteResult,
)


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
