"""Validation and encoding of the durable inbox's input, shared by every backend (as
:mod:`stores._bases` is for checkpoints and leases): pure, raising
:class:`InvalidInboxError` naming the bad field, never its value."""

from __future__ import annotations

import os
from collections.abc import Sequence

import attrs

from ._bases import check_name
from ._types import (
    INBOX_STATES,
    LIST_LIMIT_MAX,
    MAX_INBOX_ERROR_CHARS,
    InboxItem,
    InboxReservation,
    InboxState,
    InvalidCheckpointError,
    InvalidInboxError,
    JSONValue,
    _is_int,
    _is_safe_int,
    decode_position,
    encode_json,
    encode_position,
)


@attrs.frozen
class InboxPut:
    """A validated :meth:`~stores.InboxStore.put` with its payload encoded."""

    source: str
    key: str
    partition: str
    order: int
    payload_json: str


def check_inbox_put(
    *,
    source: object,
    key: object,
    partition: object,
    order: object,
    payload: JSONValue,
    max_value_bytes: int,
) -> InboxPut:
    """Validate a put; raises :class:`InvalidInboxError` naming the bad field."""
    check_name(source, "source", InvalidInboxError)
    check_name(key, "key", InvalidInboxError)
    check_name(partition, "partition", InvalidInboxError)
    if not _is_safe_int(order, 0):
        raise InvalidInboxError("order must be a non-negative safe integer")
    try:
        payload_json = encode_json(payload, "payload")
    except InvalidCheckpointError:
        raise InvalidInboxError("payload is not JSON-serialisable") from None
    if len(payload_json.encode("utf-8")) > max_value_bytes:
        raise InvalidInboxError(f"payload is larger than max_value_bytes ({max_value_bytes} bytes)")
    assert isinstance(source, str) and isinstance(key, str) and isinstance(partition, str)
    return InboxPut(source, key, partition, order, payload_json)  # type: ignore[arg-type]


def check_inbox_ms(value: object, what: str, *, minimum: int) -> int:
    """A duration or a moment in milliseconds: a safe integer of at least ``minimum``."""
    if not _is_safe_int(value, minimum):
        raise InvalidInboxError(f"{what} must be a safe integer of at least {minimum}")
    return value  # type: ignore[return-value]


def check_inbox_reservation(reservation: object) -> InboxReservation:
    if not isinstance(reservation, InboxReservation):
        raise InvalidInboxError("reservation must be an InboxReservation from reserve()")
    return reservation


def check_inbox_sources(sources: object) -> tuple[str, ...] | None:
    """``None`` (any source) or a sequence of source names (an empty one matches nothing)."""
    if sources is None:
        return None
    if isinstance(sources, str | bytes) or not isinstance(sources, Sequence):
        raise InvalidInboxError("sources must be a sequence of strings")
    return tuple(check_name(s, "sources", InvalidInboxError) for s in sources)


def check_inbox_reserve_args(
    owner_id: object, ttl_ms: object, limit: object, max_attempts: object, sources: object
) -> tuple[str, int, int, int, tuple[str, ...] | None]:
    owner = check_name(owner_id, "owner_id", InvalidInboxError)
    ttl = check_inbox_ms(ttl_ms, "ttl_ms", minimum=1)
    if not _is_int(limit):
        raise InvalidInboxError("limit must be an integer")
    n = max(1, min(LIST_LIMIT_MAX, limit))  # type: ignore[call-overload]
    if not _is_safe_int(max_attempts, 1):
        raise InvalidInboxError("max_attempts must be a positive safe integer")
    return owner, ttl, n, max_attempts, check_inbox_sources(sources)  # type: ignore[return-value]


def bound_inbox_error(error: object) -> str:
    """A failure code for the item: a non-empty string, cut to a bounded length."""
    text = check_name(error, "error", InvalidInboxError)
    return text[:MAX_INBOX_ERROR_CHARS]


def check_inbox_state(state: object) -> InboxState | None:
    if state is None:
        return None
    if state not in INBOX_STATES:
        raise InvalidInboxError(f"state must be one of {', '.join(INBOX_STATES)}")
    return state


def encode_inbox_cursor(item: InboxItem) -> str:
    return encode_position([item.source, item.order, item.key])


def decode_inbox_cursor(cursor: object) -> tuple[str, int, str] | None:
    """``(source, order, key)`` of the last item seen, or ``None`` for no cursor."""
    position = decode_position(cursor, (str, int, str), InvalidInboxError)
    return None if position is None else (position[0], position[1], position[2])


def new_reservation_token() -> str:
    """A reservation's token: unguessable and unique (a fencing identity, never logged)."""
    return os.urandom(16).hex()
