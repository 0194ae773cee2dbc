"""Records a route writes within one millisecond keep their order: ``created_at_ms`` ties
and the operation id is a hash, so admissions and staged replies carry a microsecond
stamp, strictly increasing within the process, that orders them (the resume of accepted
messages after a restart is in ``test_resume_accepted``)."""

from __future__ import annotations

import itertools

from prismd.journal import Loaded
from prismd.journal._records import OperationInput, ReplyRecord
from prismd.runtime._core import stamp_us
from prismd.runtime._delivery import _oldest_first


def _reply(operation_id: str, created_us: int | None, created_at_ms: int = 5_000) -> ReplyRecord:
    return ReplyRecord(
        operation_id=operation_id,
        connection_id="tg-1",
        external_conversation_id="chat-1",
        kind="answer",
        text="t",
        state="pending",
        created_at_ms=created_at_ms,
        updated_at_ms=created_at_ms,
        created_us=created_us,
    )


def test_stamps_strictly_increase_even_within_one_microsecond() -> None:
    stamps = [stamp_us() for _ in range(5_000)]
    assert all(a < b for a, b in itertools.pairwise(stamps))
    assert stamps[-1] < 2**53  # a JSON-safe integer


def test_held_replies_of_one_millisecond_are_sent_in_the_order_they_were_staged() -> None:
    # The ids sort the other way round: by id alone "c" would be sent before "a".
    staged = [_reply("chan-op-c", 5_000_001), _reply("chan-op-b", 5_000_002)]
    staged.append(_reply("chan-op-a", 5_000_003))
    older = _reply("chan-op-z", 4_999_000, created_at_ms=4_999)
    legacy = _reply("chan-op-y", None)  # staged before replies carried a stamp
    loaded = [Loaded(version=1, record=r) for r in (*reversed(staged), legacy, older)]
    order = [item.record.operation_id for item in _oldest_first(loaded)]
    assert order == ["chan-op-z", "chan-op-y", "chan-op-c", "chan-op-b", "chan-op-a"]


def test_the_stamps_survive_the_journal_and_older_records_still_read() -> None:
    reply = _reply("chan-op-a", 1_764_000_000_123_456)
    assert reply.to_json()["createdUs"] == 1_764_000_000_123_456
    assert ReplyRecord.from_json(reply.to_json()) == reply
    without = {k: v for k, v in reply.to_json().items() if k != "createdUs"}
    assert ReplyRecord.from_json(without).created_us is None
    accepted = OperationInput(text="hi", admitted_us=1_764_000_000_123_457)
    assert accepted.to_json()["admittedUs"] == 1_764_000_000_123_457
    assert OperationInput.from_json(accepted.to_json()) == accepted
    assert OperationInput.from_json({"text": "hi"}).admitted_us is None
