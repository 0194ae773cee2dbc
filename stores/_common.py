"""Validation and encoding shared by every backend, so they refuse the same inputs the same way.

Everything here is pure: no I/O, no clock. Each function either returns a normalised value or
raises the typed error the contract names (:class:`InvalidCheckpointError` for checkpoint
input, :class:`InvalidLeaseError` for lease input). Messages name the bad field, never its
value, so a token or a payload never ends up in a log line.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeGuard

from ._types import (
    LIST_LIMIT_MAX,
    MAX_SAFE_INTEGER,
    CheckpointRecord,
    DeleteCheckpoint,
    InvalidCheckpointError,
    InvalidLeaseError,
    JournalEvent,
    JSONValue,
    OwnershipScope,
    RecordTooLargeError,
    SaveCheckpoint,
)


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


# The listing order is (updated_at DESC, key ASC, namespace ASC); a cursor is the position of
# the last row returned. Keyset paging (rather than an offset) is what makes a walk under
# concurrent writes safe: a row rewritten mid-walk moves to the front, behind the cursor, so
# it is not seen twice, and rows that stayed put keep their place after it.
SortKey = tuple[int, str, str]


class _Positioned(Protocol):
    """What a listing position is made of: a :class:`CheckpointRecord` or a stored row."""

    @property
    def updated_at_ms(self) -> int: ...
    @property
    def key(self) -> str: ...
    @property
    def namespace(self) -> str: ...


def sort_key(record: _Positioned) -> SortKey:
    """Python twin of the SQL ``ORDER BY``: ascending order of this tuple is listing order."""
    return (-record.updated_at_ms, record.key, record.namespace)


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


def encode_cursor(record: CheckpointRecord) -> str:
    return encode_position([record.updated_at_ms, record.key, record.namespace])


def decode_cursor(cursor: object) -> tuple[int, str, str] | None:
    """``(updated_at_ms, key, namespace)`` of the last row seen, or ``None`` for no cursor."""
    position = decode_position(cursor, (int, str, str), InvalidCheckpointError)
    return None if position is None else (position[0], position[1], position[2])


def after_cursor(record: _Positioned, cursor: tuple[int, str, str]) -> bool:
    """True when ``record`` sorts strictly after the cursor position."""
    updated_at_ms, key, namespace = cursor
    return sort_key(record) > (-updated_at_ms, key, namespace)


def check_event_args(after: object, limit: object, scope: object) -> tuple[int, int]:
    if not _is_int(after) or after < 0:  # type: ignore[operator]
        raise InvalidCheckpointError("after must be a non-negative integer")
    check_scope_arg(scope, InvalidCheckpointError)
    return after, clamp_limit(limit)  # type: ignore[return-value]


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


def event_from_row(row: Sequence[Any]) -> JournalEvent:
    """A journal event row of the SQL backends as an event."""
    (seq, at, action, ns, key, tenant, account, user, version, category, meta) = row
    return JournalEvent(
        seq=seq,
        at_ms=at,
        action=action,
        namespace=ns,
        key=key,
        scope=OwnershipScope(tenant, account, user),
        version=version,
        category=category,
        metadata=None if meta is None else decode_json(meta),
    )


def scope_args(scope: OwnershipScope) -> tuple[str | None, str | None, str | None]:
    """A scope as the three column values of the SQL backends."""
    return (scope.tenant_id, scope.account_id, scope.user_id)
