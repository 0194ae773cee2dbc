"""What every backend builds on: the calls of :class:`~stores.CheckpointStore` and
:class:`~stores.LeaseStore` written once, over each backend's few steps that touch its rows,
the checks that make every backend refuse the same input the same way (the first part of
the module), and ``async with`` for a store.

* :class:`CheckpointStoreBase`: the reading calls and ``save_checkpoint`` /
  ``delete_checkpoint`` check the input, page the answers and write a single save or delete
  as a batch of one through the backend's own ``write_checkpoints``; a backend gives its
  ``_load``, ``_list`` and ``_events`` (an SQL backend's ``_list`` runs
  :func:`listing_query`).
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

from ._types import (
    ANY_SCOPE,
    LIST_LIMIT_DEFAULT,
    LIST_LIMIT_MAX,
    MAX_SAFE_INTEGER,
    CheckpointConflictError,
    CheckpointPage,
    CheckpointRecord,
    Condition,
    DeleteCheckpoint,
    EventPage,
    InvalidCheckpointError,
    InvalidLeaseError,
    JournalEvent,
    JSONValue,
    LeaseConflictError,
    LeaseRecord,
    OwnershipScope,
    RecordTooLargeError,
    SaveCheckpoint,
    Where,
    WriteResult,
    _is_int,
    _is_safe_int,
    _is_text,
    decode_json,
    decode_position,
    encode_json,
    encode_position,
    utf8_size,
)

# --------------------------------------------------------------------------- checks
# Every backend refuses the same inputs the same way: each check returns the value as the
# backend uses it or raises the error the contract names (InvalidCheckpointError,
# InvalidLeaseError), naming the bad field, never its value. Pure: no I/O, no clock.


def check_scope_arg(scope: object, error: type[Exception]) -> OwnershipScope:
    """``scope`` must be an :class:`OwnershipScope` whose fields are ``str`` or ``None``."""
    if not isinstance(scope, OwnershipScope):
        raise error("scope must be an OwnershipScope")
    for field in (scope.tenant_id, scope.account_id, scope.user_id):
        if field is not None and not _is_text(field):
            raise error("scope fields must be strings or None")
    return scope


def check_name(value: object, what: str, error: type[Exception]) -> str:
    """A namespace, key, owner id or token: a non-empty, UTF-8 encodable ``str``."""
    if not _is_text(value) or not value:
        raise error(f"{what} must be a non-empty string")
    return value


def _check_address(namespace: object, key: object, scope: object, error: type[Exception]) -> None:
    check_name(namespace, "namespace", error)
    check_name(key, "key", error)
    check_scope_arg(scope, error)


def check_checkpoint_address(namespace: object, key: object, scope: object) -> None:
    """Validate the ``(namespace, key, scope)`` of a checkpoint call."""
    _check_address(namespace, key, scope, InvalidCheckpointError)


def check_lease_address(namespace: object, key: object, scope: object) -> None:
    """Validate the ``(namespace, key, scope)`` of a lease call."""
    _check_address(namespace, key, scope, InvalidLeaseError)


def check_ttl(ttl_ms: object) -> int:
    """A lease TTL: a positive safe integer of milliseconds."""
    if not _is_safe_int(ttl_ms, 1):
        raise InvalidLeaseError("ttl_ms must be a positive safe integer")
    return ttl_ms  # type: ignore[return-value]


def _plain_save(
    namespace: object,
    key: object,
    scope: object,
    version: object,
    expected_version: object,
    fencing_token: object,
    category: object,
) -> bool:
    """The common save, recognised in one expression: non-empty ASCII names, an exact
    :class:`OwnershipScope` of ASCII strings or ``None``, exact ints in range, an ASCII
    category or none. Everything it accepts, the full checks of :func:`check_save` accept
    too; anything else takes those checks (and their error messages)."""
    if type(scope) is not OwnershipScope:
        return False
    t, a, u = scope.tenant_id, scope.account_id, scope.user_id
    return (
        type(namespace) is str
        and type(key) is str
        and namespace != ""
        and key != ""
        and namespace.isascii()
        and key.isascii()
        and (t is None or (type(t) is str and t.isascii()))
        and (a is None or (type(a) is str and a.isascii()))
        and (u is None or (type(u) is str and u.isascii()))
        and type(version) is int
        and 1 <= version <= MAX_SAFE_INTEGER
        and (
            expected_version is None
            or (type(expected_version) is int and 0 <= expected_version <= MAX_SAFE_INTEGER)
        )
        and (
            fencing_token is None
            or (type(fencing_token) is int and 0 <= fencing_token <= MAX_SAFE_INTEGER)
        )
        and (category is None or (type(category) is str and category.isascii()))
    )


_METADATA_JSON: dict[tuple[tuple[str, str], ...], str] = {}
"""Encoded metadata of the small flat ``str → str`` shapes seen (the journal's
``kind``/``state`` pairs: a small closed set), so the common ones are not encoded on every
write. Bounded in entries and in each entry's size: a host's own metadata (any text) is
encoded every time instead."""
_METADATA_JSON_MAX = 256
_METADATA_MEMO_CHARS = 128


def _metadata_json(metadata: Mapping[Any, Any]) -> str:
    items = tuple(metadata.items())
    if (
        len(items) <= 4
        and all(type(k) is str and type(v) is str for k, v in items)
        and sum(len(k) + len(v) for k, v in items) <= _METADATA_MEMO_CHARS
    ):
        cached = _METADATA_JSON.get(items)
        if cached is None:
            cached = encode_json(dict(items), "metadata")
            if len(_METADATA_JSON) < _METADATA_JSON_MAX:
                _METADATA_JSON[items] = cached
        return cached
    return encode_json(dict(metadata), "metadata")


def _check_save_fields(save: SaveCheckpoint) -> None:
    """Everything of a save but its value and metadata (one expression for the common
    save, :func:`_plain_save`; the full checks and their messages otherwise)."""
    namespace, key, scope, version, _value, expected_version, fencing_token, category = save[:8]
    if not _plain_save(namespace, key, scope, version, expected_version, fencing_token, category):
        check_checkpoint_address(namespace, key, scope)
        if not _is_safe_int(version, 1):
            raise InvalidCheckpointError("version must be a positive safe integer")
        if expected_version is not None and not _is_safe_int(expected_version, 0):
            raise InvalidCheckpointError("expected_version must be a non-negative safe integer")
        if fencing_token is not None and not _is_safe_int(fencing_token, 0):
            raise InvalidCheckpointError("fencing_token must be a non-negative safe integer")
        if category is not None and not _is_text(category):
            raise InvalidCheckpointError("category must be a string")


def _check_value_json(value_json: object, max_value_bytes: int) -> str:
    if not _is_text(value_json):
        raise InvalidCheckpointError("value_json must be a string")
    if utf8_size(value_json) > max_value_bytes:
        raise RecordTooLargeError(
            f"checkpoint value is larger than max_value_bytes ({max_value_bytes} bytes)"
        )
    return value_json


def _check_metadata_size(metadata_json: str, max_value_bytes: int) -> None:
    if utf8_size(metadata_json) > max_value_bytes:
        raise RecordTooLargeError("checkpoint metadata is larger than max_value_bytes")


def check_save(save: SaveCheckpoint, max_value_bytes: int) -> SaveCheckpoint:
    """Validate a save and encode its value and metadata; every backend calls this (through
    :func:`check_writes`) before touching data. The save as the backend stores it: the
    one given when the caller encoded both (``value_json``, ``metadata_json`` or none), a
    copy with them filled in otherwise.

    Raises :class:`InvalidCheckpointError` (or :class:`RecordTooLargeError` when the UTF-8
    JSON encoding of the value or the metadata exceeds ``max_value_bytes``).
    """
    _check_save_fields(save)
    value_json = save.value_json
    if value_json is None:
        value_json = encode_json(save.value, "value")
    elif save.value is not None:
        raise InvalidCheckpointError("give value or value_json, not both")
    _check_value_json(value_json, max_value_bytes)
    metadata, metadata_json = save.metadata, save.metadata_json
    if metadata_json is not None:
        if metadata is not None:
            raise InvalidCheckpointError("give metadata or metadata_json, not both")
        _check_metadata_json(metadata_json, max_value_bytes)
    elif metadata is not None:
        if not isinstance(metadata, Mapping):
            raise InvalidCheckpointError("metadata must be a mapping")
        metadata_json = _metadata_json(metadata)
        _check_metadata_size(metadata_json, max_value_bytes)
    if value_json is save.value_json and metadata_json is save.metadata_json:
        return save
    return save._replace(value_json=value_json, metadata_json=metadata_json)


MAX_BATCH_WRITES = 1000
"""At most this many writes in one ``write_checkpoints`` call (bounded transactions)."""


def _check_batch(writes: object, atomic: object, not_a_sequence: str) -> None:
    # A tuple or a list (the common two) is not put through the ABC check.
    if (
        type(writes) is not tuple
        and type(writes) is not list
        and (not isinstance(writes, Sequence) or isinstance(writes, str | bytes))
    ):
        raise InvalidCheckpointError(not_a_sequence)
    if len(writes) > MAX_BATCH_WRITES:
        raise InvalidCheckpointError(f"at most {MAX_BATCH_WRITES} writes per batch")
    if not isinstance(atomic, bool):
        raise InvalidCheckpointError("atomic must be a bool")


def check_writes(
    writes: object, atomic: object, max_value_bytes: int
) -> Sequence[SaveCheckpoint | DeleteCheckpoint]:
    """Validate a ``write_checkpoints`` batch before anything is written (raises
    :class:`InvalidCheckpointError` at the first bad write); the writes as the backend
    applies them, each save with its value and metadata encoded (:func:`check_save`)."""
    _check_batch(writes, atomic, "writes must be a sequence of SaveCheckpoint/DeleteCheckpoint")
    assert isinstance(writes, Sequence)
    checked: list[SaveCheckpoint | DeleteCheckpoint] | None = None
    for n, write in enumerate(writes):
        if type(write) is SaveCheckpoint:
            save = check_save(write, max_value_bytes)
            if save is not write:
                # A copy of the batch only once a save needed its value encoded.
                if checked is None:
                    checked = list(writes)
                checked[n] = save
        elif type(write) is DeleteCheckpoint:
            check_checkpoint_address(write.namespace, write.key, write.scope)
        else:
            raise InvalidCheckpointError("writes must be SaveCheckpoint or DeleteCheckpoint")
    return writes if checked is None else checked


_METADATA_OBJECTS: set[str] = set()
"""Encoded metadata already checked to be a JSON object (bounded like
:data:`_METADATA_JSON`): the journal's few ``kind``/``state`` pairs."""


def _check_metadata_json(metadata_json: object, max_value_bytes: int) -> None:
    if metadata_json is None:
        return
    if not _is_text(metadata_json):
        raise InvalidCheckpointError("metadata_json must be a string")
    if metadata_json in _METADATA_OBJECTS:
        return
    _check_metadata_size(metadata_json, max_value_bytes)
    try:
        decoded = decode_json(metadata_json)
    except ValueError:
        decoded = None
    if not isinstance(decoded, dict):
        raise InvalidCheckpointError("metadata_json must be a JSON object")
    if len(metadata_json) <= _METADATA_MEMO_CHARS and len(_METADATA_OBJECTS) < _METADATA_JSON_MAX:
        _METADATA_OBJECTS.add(metadata_json)


def check_max_value_bytes(max_value_bytes: object) -> int:
    if not _is_int(max_value_bytes) or max_value_bytes < 1:  # type: ignore[operator]
        raise ValueError("max_value_bytes must be a positive integer")
    return max_value_bytes  # type: ignore[return-value]


# --------------------------------------------------------------------------- listing


def clamp_limit(limit: object) -> int:
    """``limit`` clamped to ``1..500``; anything but an int is bad input."""
    if not _is_int(limit):
        raise InvalidCheckpointError("limit must be an integer")
    return max(1, min(LIST_LIMIT_MAX, limit))  # type: ignore[call-overload, no-any-return]


def check_category_filter(category: object) -> tuple[str, ...] | None:
    """``None`` (any), one category, or a sequence of them (an empty one matches nothing)."""
    if category is None:
        return None
    if _is_text(category):
        return (category,)
    if isinstance(category, Sequence) and all(_is_text(c) for c in category):
        return tuple(category)
    raise InvalidCheckpointError("category must be a string or a sequence of strings")


def check_list_filters(namespace: object, key_prefix: object, scope: object) -> None:
    if namespace is not None and not _is_text(namespace):
        raise InvalidCheckpointError("namespace must be a string")
    if key_prefix is not None and not _is_text(key_prefix):
        raise InvalidCheckpointError("key_prefix must be a string")
    check_scope_arg(scope, InvalidCheckpointError)


def prefix_bounds(prefix: str) -> tuple[str, str | None]:
    """``(low, high)``: every key that starts with ``prefix`` is ``>= low`` and, unless
    ``high`` is ``None``, ``< high``, in code point order, which is the order of their UTF-8
    bytes (SQLite's ``BINARY``, PostgreSQL's ``"C"``). A listing by prefix adds them beside
    its exact test so that the primary key ``(namespace, key)`` finds the range instead of
    reading the whole namespace: one new route's bindings among 10,000 took 0.92 ms, and
    0.027 ms with the range (SQLite)."""
    chars = list(prefix)
    while chars and chars[-1] == "\U0010ffff":
        chars.pop()
    if not chars:
        return prefix, None
    following = ord(chars[-1]) + 1
    chars[-1] = chr(0xE000 if following == 0xD800 else following)  # no surrogates in UTF-8
    return prefix, "".join(chars)


# The listing order is (updated_at DESC, key ASC, namespace ASC): the SQL backends' ORDER BY,
# the memory store's sort key. A cursor is the position of the last row returned. Keyset
# paging (rather than an offset) is what makes a walk under concurrent writes safe: a row
# rewritten mid-walk moves to the front, behind the cursor, so it is not seen twice, and
# rows that stayed put keep their place after it.


def encode_cursor(record: CheckpointRecord) -> str:
    return encode_position([record.updated_at_ms, record.key, record.namespace])


def decode_cursor(cursor: object) -> tuple[int, str, str] | None:
    """``(updated_at_ms, key, namespace)`` of the last row seen, or ``None`` for no cursor."""
    position = decode_position(cursor, (int, str, str), InvalidCheckpointError)
    return None if position is None else (position[0], position[1], position[2])


def check_event_args(after: object, limit: object, scope: object) -> tuple[int, int]:
    if not _is_int(after) or after < 0:  # type: ignore[operator]
        raise InvalidCheckpointError("after must be a non-negative integer")
    check_scope_arg(scope, InvalidCheckpointError)
    return after, clamp_limit(limit)  # type: ignore[return-value]


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


_AFTER = "(updated_at < ? OR (updated_at = ? AND (key > ? OR (key = ? AND namespace > ?))))"
_ORDER = " ORDER BY updated_at DESC, key ASC, namespace ASC LIMIT ?"


def listing_query(
    table: str,
    columns: str,
    query: CheckpointQuery,
    *,
    starts_with: Callable[[str], Condition],
    one_of: Callable[[tuple[str, ...]], Condition],
) -> tuple[str, list[Any]]:
    """The SQL backends' checkpoint listing of ``table``, in ``?`` parameters, and its
    arguments; the backend's SQL tests that ``key`` starts with a prefix (beside the
    :func:`prefix_bounds` range) and that ``category`` is one of some names."""
    where = Where()
    where.equals("namespace", query.namespace)
    if query.key_prefix:
        low, high = prefix_bounds(query.key_prefix)
        where.add("key >= ?", low)
        if high is not None:
            where.add("key < ?", high)
        condition, args = starts_with(query.key_prefix)
        where.add(condition, *args)
    if query.categories is not None:
        condition, args = one_of(query.categories)
        where.add(condition, *args)
    where.scope(query.scope)
    if query.after is not None:
        at, key, namespace = query.after
        where.add(_AFTER, at, at, key, key, namespace)
    return f"SELECT {columns} FROM {table}{where.sql()}{_ORDER}", [*where.args, query.limit]


class CheckpointStoreBase(abc.ABC):
    """:class:`~stores.CheckpointStore` but for its two write methods, over the backend's
    ``_load``, ``_list``, ``_events`` and ``write_checkpoints``; ``_enter`` runs before
    anything else of every reading call."""

    __slots__ = ()

    # The backend's own; declared for the type checker.
    write_checkpoints: Callable[..., Awaitable[tuple[WriteResult, ...]]]
    _count: Callable[[CheckpointQuery], Awaitable[int]]  # the rows matched, up to its limit

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
            namespace,
            key,
            scope,
            version,
            value,
            expected_version,
            fencing_token,
            category,
            metadata,
        )
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
        check_checkpoint_address(namespace, key, scope)
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
        check_list_filters(namespace, key_prefix, scope)
        categories = check_category_filter(category)
        position = decode_cursor(cursor)
        n = clamp_limit(limit)
        if categories == ():
            await trio.lowlevel.checkpoint()
            return CheckpointPage(items=())
        query = CheckpointQuery(namespace, key_prefix, categories, scope, position, n + 1)
        rows = await self._list(query)
        items = tuple(rows[:n])
        next_cursor = encode_cursor(items[-1]) if len(rows) > n else None
        return CheckpointPage(items=items, next_cursor=next_cursor)

    async def count_checkpoints(
        self, *, namespace: str, category: str, scope: OwnershipScope, limit: int
    ) -> int:
        """Rows counted up to ``limit`` (see :meth:`CheckpointStore.count_checkpoints`)."""
        await self._enter()
        check_list_filters(namespace, None, scope)
        if not _is_text(namespace) or not _is_text(category) or not _is_int(limit) or limit < 1:
            raise InvalidCheckpointError("a count needs a namespace, a category and a limit >= 1")
        return await self._count(CheckpointQuery(namespace, None, (category,), scope, None, limit))

    async def list_events(
        self, *, after: int = 0, limit: int = LIST_LIMIT_DEFAULT, scope: OwnershipScope = ANY_SCOPE
    ) -> EventPage:
        """Committed events with ``seq > after`` in commit order, filtered by partial scope."""
        await self._enter()
        after, n = check_event_args(after, limit, scope)
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
        check_lease_address(namespace, key, scope)
        check_name(owner_id, "owner_id", InvalidLeaseError)
        if token is None:
            token = os.urandom(16).hex()
        else:
            check_name(token, "token", InvalidLeaseError)
        ttl = 0 if ttl_ms is None else check_ttl(ttl_ms)
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
        check_lease_address(namespace, key, scope)
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
