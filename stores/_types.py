"""The values of the store contracts (:mod:`._contracts`): records, the errors a call
raises, the clock, and the encodings every backend shares (JSON, page positions); at the
end, what the two SQL backends share of their rows (a scope's columns, a ``WHERE`` clause
in ``?`` parameters, checkpoint and lease rows as records).
"""

from __future__ import annotations

import base64
import binascii
import datetime as _dt
import functools
import json
import math
import time
from collections.abc import Mapping, Sequence
from typing import Any, Generic, Literal, NamedTuple, Protocol, TypeAlias, TypeGuard, TypeVar

import attrs

JSONValue: TypeAlias = Any
"""A value that survives ``json.dumps``/``json.loads`` unchanged."""

MAX_SAFE_INTEGER = 2**53 - 1
DEFAULT_MAX_VALUE_BYTES = 1024 * 1024
LIST_LIMIT_DEFAULT = 100
LIST_LIMIT_MAX = 500


# --------------------------------------------------------------------------- errors


class StoreError(Exception):
    """Base class of every error a store raises on purpose."""


class CheckpointConflictError(StoreError):
    """A save lost its compare-and-swap: version, create-only, fence or scope mismatch.

    The message never says which of these it was (no ownership-shaped oracle).
    """

    code = "ERR_PRISM_CHECKPOINT_CONFLICT"


class InvalidCheckpointError(CheckpointConflictError, ValueError):
    """The save itself is malformed: empty namespace/key, bad version, non-JSON value.

    Still a :class:`CheckpointConflictError` (the contract treats bad input as a
    conflict) but also a :class:`ValueError` so callers can tell it apart.
    """


class RecordTooLargeError(InvalidCheckpointError):
    """The JSON encoding of the value is larger than the store accepts."""


class LeaseConflictError(StoreError):
    """A lease call touched a row owned by another scope, or its input was invalid."""

    code = "ERR_PRISM_LEASE_CONFLICT"


class InvalidLeaseError(LeaseConflictError, ValueError):
    """Empty namespace/key/owner/token or a non-positive TTL."""


class InvalidInboxError(StoreError, ValueError):
    """An inbox call's input was invalid (an empty name, a bad number, a payload that is not
    JSON or too large); nothing was written."""


class StoreUnavailableError(StoreError):
    """The backend cannot be reached or its data cannot be trusted (I/O, corruption)."""


class StoreUnreachableError(StoreUnavailableError):
    """A network backend's server could not be reached (refused, timed out, starting up,
    no free connection slot): trying again later may succeed, unlike a refused login, a
    missing database or a schema newer than this build."""


class InvalidStoreURLError(StoreError, ValueError):
    """``open_store`` was given a URL it does not understand."""


# --------------------------------------------------------------------------- clock


class Clock(Protocol):
    """Wall-clock time in integer milliseconds since the Unix epoch."""

    def now_ms(self) -> int: ...


@attrs.frozen
class SystemClock:
    """The real wall clock."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


SYSTEM_CLOCK: Clock = SystemClock()


def ms_to_datetime(ms: int) -> _dt.datetime:
    return _dt.datetime.fromtimestamp(ms / 1000, tz=_dt.UTC)


@functools.lru_cache(maxsize=256)
def _iso_second(second: int) -> str:
    return ms_to_datetime(second * 1000).isoformat(timespec="seconds").replace("+00:00", "")


_ISO_MEMO: dict[int, str] = {}
_ISO_MEMO_MAX = 1024
"""The texts of the milliseconds met lately: every record carries its two times in this
form, and the records of one moment share them (emptied when full)."""


def ms_to_iso(ms: int) -> str:
    """ISO 8601 UTC with millisecond precision and a ``Z`` suffix (``…T14:13:20.123Z``)."""
    text = _ISO_MEMO.get(ms)
    if text is None:
        second, milli = divmod(ms, 1000)
        text = f"{_iso_second(second)}.{milli:03d}Z"
        if len(_ISO_MEMO) >= _ISO_MEMO_MAX:
            _ISO_MEMO.clear()
        _ISO_MEMO[ms] = text
    return text


# --------------------------------------------------------------------------- records


@attrs.frozen
class OwnershipScope:
    """Who owns a record: tenant, account and user, each optional.

    ``None`` is distinct from every string, including ``""``. In list and event
    filters a ``None`` field matches any value; in load, save, delete and every lease
    call the whole scope must match exactly.
    """

    tenant_id: str | None = None
    account_id: str | None = None
    user_id: str | None = None

    def matches_filter(self, stored: OwnershipScope) -> bool:
        """True when every field set on ``self`` equals the same field of ``stored``."""
        return (
            (self.tenant_id is None or self.tenant_id == stored.tenant_id)
            and (self.account_id is None or self.account_id == stored.account_id)
            and (self.user_id is None or self.user_id == stored.user_id)
        )


ANY_SCOPE = OwnershipScope()


@attrs.frozen
class CheckpointRecord:
    namespace: str
    key: str
    version: int
    value: JSONValue
    scope: OwnershipScope
    created_at_ms: int
    updated_at_ms: int
    fencing_token: int | None = None
    category: str | None = None
    metadata: Mapping[str, JSONValue] | None = None

    @property
    def created_at(self) -> _dt.datetime:
        return ms_to_datetime(self.created_at_ms)

    @property
    def updated_at(self) -> _dt.datetime:
        return ms_to_datetime(self.updated_at_ms)


_Item = TypeVar("_Item")


@attrs.frozen
class Page(Generic[_Item]):
    """One page of a listing: its items and the cursor of the next (``None``: the last)."""

    items: tuple[_Item, ...]
    next_cursor: str | None = None


CheckpointPage: TypeAlias = Page[CheckpointRecord]


@attrs.frozen
class LeaseRecord:
    namespace: str
    key: str
    scope: OwnershipScope
    owner_id: str
    token: str
    fencing_token: int
    acquired_at_ms: int
    expires_at_ms: int
    updated_at_ms: int


EventAction: TypeAlias = Literal["save", "delete"]


@attrs.frozen
class JournalEvent:
    """One committed mutation of the checkpoint table, in commit order.

    Carries no value: only where, which version, and the caller's ``metadata`` (which
    the journal keeps free of message text and tokens).
    """

    seq: int
    at_ms: int
    action: EventAction
    namespace: str
    key: str
    scope: OwnershipScope
    version: int | None
    category: str | None = None
    metadata: Mapping[str, JSONValue] | None = None


class SaveCheckpoint(NamedTuple):
    """One save of :meth:`CheckpointStore.write_checkpoints`; the fields mean what the
    keyword arguments of :meth:`CheckpointStore.save_checkpoint` mean. A named tuple, not
    an attrs class: the journal makes several for every message, and a tuple is built in
    one step.

    ``value_json`` / ``metadata_json``: the value (and the metadata, a JSON object) already
    encoded as compact JSON, as :func:`stores.compact_json` makes it, by a caller that built
    them (the journal, an agent's transcript): stored as given, so they are encoded once;
    their size is still checked. Give ``value`` (``None`` is JSON ``null``) or
    ``value_json``, ``metadata`` or ``metadata_json``: not both."""

    namespace: str
    key: str
    scope: OwnershipScope
    version: int
    value: JSONValue = None
    expected_version: int | None = None
    fencing_token: int | None = None
    category: str | None = None
    metadata: Mapping[str, JSONValue] | None = None
    value_json: str | None = None
    metadata_json: str | None = None


class DeleteCheckpoint(NamedTuple):
    """One delete of :meth:`CheckpointStore.write_checkpoints`: a row stored under another
    exact scope is a miss, as for :meth:`CheckpointStore.delete_checkpoint`."""

    namespace: str
    key: str
    scope: OwnershipScope


WriteStatus: TypeAlias = Literal["ok", "conflict", "missing", "aborted"]


class WriteResult(NamedTuple):
    """What became of one write of a batch.

    ``ok``: saved or deleted. ``conflict``: a save lost its compare-and-swap (version,
    create-only, fence or scope). ``missing``: a delete found no row in that scope.
    ``aborted``: the write would have applied, but another write of the same ``atomic``
    batch did not, so none of them was written.

    A written save carries the save as stored (``saved``, its value and metadata encoded)
    and the row's times; :attr:`record` builds the stored row from them when asked (the
    journal reads only ``updated_at_ms``, and builds no record per write).
    """

    status: WriteStatus
    saved: SaveCheckpoint | None = None
    created_at_ms: int | None = None
    updated_at_ms: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def record(self) -> CheckpointRecord | None:
        """The stored row of a written save (built anew on each access), else ``None``."""
        if self.saved is None or self.created_at_ms is None or self.updated_at_ms is None:
            return None
        return stored_record(self.saved, self.created_at_ms, self.updated_at_ms)


def stored_record(save: SaveCheckpoint, created_at_ms: int, updated_at_ms: int) -> CheckpointRecord:
    """The row a checked save (its value and metadata encoded) stored at these times."""
    assert save.value_json is not None
    return CheckpointRecord(
        namespace=save.namespace,
        key=save.key,
        version=save.version,
        value=json.loads(save.value_json),
        scope=save.scope,
        created_at_ms=created_at_ms,
        updated_at_ms=updated_at_ms,
        fencing_token=save.fencing_token,
        category=save.category,
        metadata=None if save.metadata_json is None else json.loads(save.metadata_json),
    )


@attrs.frozen
class SchemaStatus:
    """Where a durable store's schema stands against this build (``prismd migrate``)."""

    schema: str
    """Which schema: a PostgreSQL schema name, or the SQLite file."""
    current: int
    """The highest version applied (0: none yet)."""
    latest: int
    """The highest version this build knows."""
    applied: tuple[int, ...] = ()
    """The versions this call applied."""

    @property
    def pending(self) -> tuple[int, ...]:
        return tuple(range(self.current + 1, self.latest + 1))

    @property
    def up_to_date(self) -> bool:
        return self.current == self.latest


@attrs.frozen
class EventPage:
    items: tuple[JournalEvent, ...]
    last_seq: int
    """The highest sequence number read, or ``after`` when nothing was read."""


InboxState: TypeAlias = Literal["pending", "claimed", "done", "dead", "discarded"]
INBOX_STATES: tuple[InboxState, ...] = ("pending", "claimed", "done", "dead", "discarded")
MAX_INBOX_ERROR_CHARS = 200


@attrs.frozen
class InboxItem:
    """One row of the durable inbox (see :class:`InboxStore`)."""

    source: str
    """Who handed it in: a connection id."""
    key: str
    """Unique within ``source`` (Telegram: the ``update_id``): the dedup key."""
    partition: str
    """Items of one ``(source, partition)`` are handed out one at a time, in ``order``."""
    order: int
    state: InboxState
    attempts: int
    """Reservations so far (each counts one attempt)."""
    available_at_ms: int
    """A ``pending`` item is not reserved before this (retry backoff)."""
    created_at_ms: int
    updated_at_ms: int
    payload: JSONValue = None
    """What was handed in; ``None`` once ``done`` or ``discarded`` (the inbox keeps a payload
    only while it may still be needed) and in listings."""
    error: str | None = None
    """The code the last failed attempt gave (a short fixed text, never payload text)."""
    owner_id: str | None = None
    """The owner of the current or last reservation."""
    claim_expires_at_ms: int = 0
    """Until when that reservation holds the item (and, for a ``done`` item, its partition).
    (The state ``claimed`` and this field keep the names they have on disk and on the wire.)"""


@attrs.frozen
class InboxReservation:
    """An item handed to one worker: valid while its ``token`` is the item's."""

    item: InboxItem
    token: str
    expires_at_ms: int

    @property
    def source(self) -> str:
        return self.item.source

    @property
    def key(self) -> str:
        return self.item.key


InboxPage: TypeAlias = Page[InboxItem]


@attrs.frozen
class InboxDepth:
    """How many items wait, are in a worker's hands, or are dead letters."""

    pending: int = 0
    claimed: int = 0
    dead: int = 0


# --------------------------------------------------------------------------- values
# How every backend checks, writes and reads a value the same way: JSON (strict, compact),
# UTF-8 strings, page positions, a scope as three column values.


def _is_int(value: object) -> bool:
    # bool is an int subclass; True as a version is a caller bug, not version 1.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_safe_int(value: object, minimum: int) -> bool:
    """An int (not a bool) in ``minimum..MAX_SAFE_INTEGER``."""
    return _is_int(value) and minimum <= value <= MAX_SAFE_INTEGER  # type: ignore[operator]


def _is_text(value: object) -> TypeGuard[str]:
    # Lone surrogates cannot be stored as UTF-8 by SQLite or PostgreSQL; refusing them here
    # keeps every backend (memory included) accepting exactly the same strings.
    if not isinstance(value, str):
        return False
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_COMPACT = json.JSONEncoder(allow_nan=False, ensure_ascii=False, separators=(",", ":"))
"""``json.dumps`` with these options builds an encoder per call; this one is shared (it
keeps no state between calls)."""


def compact_json(value: JSONValue) -> str:
    """``value`` as the stores keep JSON: compact, UTF-8 unescaped, no NaN/Infinity (no
    shape checks: for values their caller built, such as the journal's records)."""
    return _COMPACT.encode(value)


def utf8_size(text: str) -> int:
    """``len(text.encode("utf-8"))`` without the copy for ASCII text."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def encode_json(value: JSONValue, what: str) -> str:
    """Strict compact JSON: no NaN/Infinity, string keys only, no ``default`` hook.

    Raises :class:`InvalidCheckpointError` naming ``what`` when the value is not JSON.
    """
    try:
        _check_json_shape(value, 0)
        text = _COMPACT.encode(value)
        if not text.isascii():
            text.encode("utf-8")  # lone surrogates: see _is_text
        return text
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidCheckpointError(f"{what} is not JSON-serialisable") from exc


def _check_json_shape(value: object, depth: int) -> None:
    # json.dumps silently turns int dict keys into strings and tuples into lists; the first
    # would change the value on the way back, so refuse it instead of storing something else.
    if depth > 200:
        raise ValueError("nested too deeply")
    if value is None or isinstance(value, str | bool | int):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError("non-finite float")
        return
    if isinstance(value, list | tuple):
        for item in value:
            _check_json_shape(item, depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise TypeError("non-string key")
            _check_json_shape(v, depth + 1)
        return
    raise TypeError(f"{type(value).__name__} is not JSON")


def decode_json(text: str) -> JSONValue:
    return json.loads(text)


_CURSOR_ERROR = "cursor must be a next_cursor from a previous page"


def encode_position(values: Sequence[int | str]) -> str:
    """A page cursor: the last row's position (its sort key's values) as unpadded
    base64url JSON, read back by :func:`decode_position`."""
    raw = json.dumps(list(values), ensure_ascii=False)
    return base64.urlsafe_b64encode(raw.encode("utf-8")).decode("ascii").rstrip("=")


def decode_position(
    cursor: object, kinds: tuple[type[int] | type[str], ...], error: type[ValueError]
) -> tuple[Any, ...] | None:
    """The values of a cursor :func:`encode_position` wrote, one of each of ``kinds`` (an
    ``int`` never a bool), or ``None`` for no cursor. Anything else raises ``error``, with
    one message whatever is wrong."""
    if cursor is None:
        return None
    if not isinstance(cursor, str) or not cursor:
        raise error(_CURSOR_ERROR)
    try:
        padded = cursor + "=" * (-len(cursor) % 4)
        decoded = json.loads(base64.urlsafe_b64decode(padded.encode("ascii")).decode("utf-8"))
    except (ValueError, UnicodeError, binascii.Error) as exc:
        raise error(_CURSOR_ERROR) from exc
    if (
        not isinstance(decoded, list)
        or len(decoded) != len(kinds)
        or not all(
            _is_int(value) if kind is int else isinstance(value, kind)
            for value, kind in zip(decoded, kinds, strict=True)
        )
    ):
        raise error(_CURSOR_ERROR)
    return tuple(decoded)


def scope_args(scope: OwnershipScope) -> tuple[str | None, str | None, str | None]:
    """A scope as the three column values of the SQL backends."""
    return (scope.tenant_id, scope.account_id, scope.user_id)


SCOPE_COLUMNS = ("tenant_id", "account_id", "user_id")


@attrs.define
class Where:
    """The conditions of an SQL backend's ``WHERE`` clause (all must hold) and their
    arguments, in order, in the ``?`` parameters both speak (PostgreSQL numbers them)."""

    conditions: list[str] = attrs.field(factory=list)
    args: list[Any] = attrs.field(factory=list)

    def add(self, condition: str, *args: Any) -> None:
        self.conditions.append(condition)
        self.args.extend(args)

    def equals(self, column: str, value: object) -> None:
        """``column = value``; no condition when ``value`` is ``None``."""
        if value is not None:
            self.add(f"{column} = ?", value)

    def scope(self, scope: OwnershipScope) -> None:
        """The partial-scope filter: each field that is set must match exactly."""
        for column, value in zip(SCOPE_COLUMNS, scope_args(scope)):
            self.equals(column, value)

    def sql(self) -> str:
        """`` WHERE …`` (with its leading space), or ``""`` when there is no condition."""
        return " WHERE " + " AND ".join(self.conditions) if self.conditions else ""


Condition: TypeAlias = tuple[str, tuple[Any, ...]]
"""A condition in ``?`` parameters (see :class:`Where`) and its arguments."""


def checkpoint_from_row(row: Sequence[Any]) -> CheckpointRecord:
    """A checkpoint row of the SQL backends (their shared column order) as a record."""
    (ns, key, version, fence, category, tenant, account, user, value, meta, created, updated) = row
    return CheckpointRecord(
        namespace=ns,
        key=key,
        version=version,
        value=decode_json(value),
        scope=OwnershipScope(tenant, account, user),
        created_at_ms=created,
        updated_at_ms=updated,
        fencing_token=fence,
        category=category,
        metadata=None if meta is None else decode_json(meta),
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
