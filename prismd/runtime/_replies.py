"""The reply path's small parts: records that always fit the journal (contract §5 record cap,
§9.2 persist before send), the held mark, and one send at a time per conversation."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import attrs
import trio

from ..journal import ReplyRecord
from ..redact import truncate_utf8, utf8_len


def scrub_surrogates(text: str) -> str:
    """``text`` with lone surrogates replaced by U+FFFD (a surrogate pair held as two
    code points becomes its character): the journal stores UTF-8, which has no encoding
    for a lone surrogate, and a reply that cannot be staged would be lost."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def _record_size(record: ReplyRecord, text: str) -> int:
    value = attrs.evolve(record, text=text).to_json()
    dumped = json.dumps(value, separators=(",", ":"), ensure_ascii=False)
    return utf8_len(dumped)


def fit_record(record: ReplyRecord, max_journal_record_bytes: int) -> ReplyRecord:
    """``record``, its text cut further (with the truncation marker) when its JSON would
    not fit ``max_journal_record_bytes`` with room left for marking it (message id and a
    reason of up to 512 bytes, escaped). JSON escaping can grow a text six-fold, and a
    record that cannot be staged would lose the answer. Returns ``record`` itself when
    it already fits.
    """
    limit = max(1024, max_journal_record_bytes)
    budget = limit - min(4096, limit // 4)
    if _record_size(record, record.text) <= budget:
        return record
    lo, hi = 0, utf8_len(record.text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _record_size(record, truncate_utf8(record.text, mid)[0]) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return attrs.evolve(record, text=truncate_utf8(record.text, lo)[0])


HELD_REASON = "held"
"""The ``reason`` of a ``pending`` reply whose channel answered ``SendResult.hold()``: proven
not sent (no live connection took it), so it may be re-driven automatically when its
conversation reconnects (:mod:`prismd.runtime._delivery`). Every other ``pending`` reply
may have been sent (staged, then the daemon died) and waits for an operator."""


def is_held(record: ReplyRecord) -> bool:
    """``record`` is ``pending`` because its channel held it (see :data:`HELD_REASON`)."""
    return record.state == "pending" and record.reason == HELD_REASON


@attrs.define(eq=False)
class _Turn:
    lock: trio.Lock = attrs.field(factory=trio.Lock)
    users: int = 0


@attrs.define(eq=False)
class DeliveryTurns:
    """One send (deliver + mark) at a time per conversation, within this process.

    A channel may hold a reply (no live connection) and ask for its held replies when the
    conversation reconnects. Without this a reconnect's re-drive could read the journal
    after ``deliver`` said "hold" but before that mark was written, and the reply would
    wait for the next reconnect. Sends hold the turn across deliver and mark, and the
    re-drive takes it too, so it sees every hold. Entries are dropped when unused: the
    table is bounded by the sends in flight.
    """

    _turns: dict[tuple[str, str], _Turn] = attrs.field(factory=dict)

    @asynccontextmanager
    async def hold(self, connection_id: str, conversation_id: str) -> AsyncIterator[None]:
        key = (connection_id, conversation_id)
        turn = self._turns.get(key)
        if turn is None:
            turn = self._turns[key] = _Turn()
        turn.users += 1
        try:
            async with turn.lock:
                yield
        finally:
            turn.users -= 1
            if turn.users == 0:
                del self._turns[key]

    def __len__(self) -> int:
        return len(self._turns)
