"""Journal primitives on memory and SQLite (contract behaviours 95–106, §5 key formats)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prismd.channel import AttachmentRef
from prismd.journal import NS_REPLY
from prismd.journal._journal import (
    NS_BINDING,
    NS_OPERATION,
    ChannelJournal,
    binding_key,
    cursor_key,
    operation_key,
    reply_key,
)
from prismd.journal._records import (
    BindingRecord,
    JournalRecordTooLargeError,
    OperationInput,
    OperationRecord,
    ReplyRecord,
    StoredButton,
    StoredFile,
)
from stores import OwnershipScope, compact_json
from tests.support.builders import write
from tests.support.harness import StoreFactory

SCOPE = OwnershipScope("tenant-1", "acct-1", "user-1")


def op(state: str = "accepted") -> OperationRecord:
    return OperationRecord(
        operation_id="chan-op-1",
        event_id="1",
        kind="message",
        connection_id="tg-1",
        external_conversation_id="chat-1",
        external_actor_id="user-1",
        agent_alias="primary",
        state=state,
        created_at_ms=1,
        updated_at_ms=1,
    )


def reply(state: str = "pending") -> ReplyRecord:
    return ReplyRecord(
        operation_id="chan-op-1",
        connection_id="tg-1",
        external_conversation_id="chat-1",
        kind="final",
        text="the answer",
        state=state,
        created_at_ms=1,
        updated_at_ms=1,
        buttons=(StoredButton("Allow once", "allow_once"),),
    )


def test_key_formats_exactly_as_section_5() -> None:
    """§5: scope parts ``-`` when absent; other parts ``-`` when absent or empty."""
    scope = OwnershipScope("t", None, "")
    assert binding_key("c", scope, "conv", None, "a", "al") == "b1:c:t:-::conv:-:a:al"
    assert operation_key("", scope, "op") == "o1:-:t:-::op"
    assert cursor_key("c", OwnershipScope()) == "c1:c:-:-:-"
    assert reply_key("", scope, "op") == "r1:-:t:-::op"
    assert reply_key("c:x", scope, "") == "r1:c:x:t:-::"


async def test_binding_create_save_reload_scope_b95_b96_b97_b98_b99(stores: StoreFactory) -> None:
    """Behaviours 95–99: create-only, CAS save, reload by a new journal, scoped miss."""
    store = await stores()
    journal = ChannelJournal(store.checkpoints)
    key = binding_key("tg-1", SCOPE, "chat-1", None, "user-1", "primary")
    created = await journal.create_binding(SCOPE, key, BindingRecord("s-1", "primary"))
    assert created is not None and created.version == 1
    assert await journal.create_binding(SCOPE, key, BindingRecord("s-2", "primary")) is None
    updated = BindingRecord("s-1", "primary", leaf_id="leaf-2", generation=1)
    assert await journal.save(NS_BINDING, SCOPE, key, updated, expected_version=0) is None
    saved = await journal.save(NS_BINDING, SCOPE, key, updated, expected_version=1)
    assert saved is not None and saved.version == 2
    again = await ChannelJournal(store.checkpoints).load_binding(SCOPE, key)
    assert again is not None and again.version == 2
    assert (again.record.session_id, again.record.leaf_id, again.record.generation) == (
        "s-1",
        "leaf-2",
        1,
    )
    assert await journal.load_binding(OwnershipScope("tenant-2"), key) is None
    raw = await store.checkpoints.load_checkpoint(
        namespace=NS_BINDING, key=key, scope=OwnershipScope("tenant-2")
    )
    assert raw is None


async def test_operation_dedup_cas_remove_b100_b101_b102(stores: StoreFactory) -> None:
    """Behaviours 100–102: create-only dedup, CAS with stale version, remove + recreate."""
    store = await stores()
    journal = ChannelJournal(store.checkpoints)
    assert (await write(journal, NS_OPERATION, SCOPE, op())) is not None
    assert await write(journal, NS_OPERATION, SCOPE, op()) is None
    executing = await write(journal, NS_OPERATION, SCOPE, op("executing"), 1)
    assert executing is not None and executing.version == 2
    loaded = await journal.load_operation(SCOPE, "tg-1", "chan-op-1")
    assert loaded is not None and loaded.record.state == "executing"
    assert await write(journal, NS_OPERATION, SCOPE, op("succeeded"), 1) is None
    assert await journal.remove_operation(SCOPE, "tg-1", "chan-op-1") is True
    assert await journal.load_operation(SCOPE, "tg-1", "chan-op-1") is None
    assert await write(journal, NS_OPERATION, SCOPE, op()) is not None


async def test_fenced_record_refuses_unfenced_write(stores: StoreFactory) -> None:
    """A record written with a fence refuses a later write without one (None, not raise)."""
    store = await stores()
    journal = ChannelJournal(store.checkpoints)
    await write(journal, NS_OPERATION, SCOPE, op())
    assert await write(journal, NS_OPERATION, SCOPE, op("executing"), 1, fence=3) is not None
    assert await write(journal, NS_OPERATION, SCOPE, op("succeeded"), 2) is None
    assert await write(journal, NS_OPERATION, SCOPE, op("succeeded"), 2, fence=2) is None
    assert await write(journal, NS_OPERATION, SCOPE, op("succeeded"), 2, fence=3) is not None


async def test_cursor_advances_b103(stores: StoreFactory) -> None:
    """Behaviour 103: two advances → admitted 2, lastEventId "11"."""
    store = await stores()
    journal = ChannelJournal(store.checkpoints)
    await journal.advance_cursor(SCOPE, "tg-1", "10", 1)
    await journal.advance_cursor(SCOPE, "tg-1", "11", 2)
    loaded = await journal.load_cursor(SCOPE, "tg-1")
    assert loaded is not None
    assert (loaded.record.admitted, loaded.record.last_event_id) == (2, "11")


async def test_record_size_checked_before_saving_b104(stores: StoreFactory) -> None:
    """Behaviour 104: a 4 KiB leaf with max 1024 bytes is refused, mentioning the limit."""
    store = await stores()
    journal = ChannelJournal(store.checkpoints, max_record_bytes=1024)
    key = binding_key("tg-1", SCOPE, "chat-1", None, "user-1", "primary")
    with pytest.raises(JournalRecordTooLargeError, match="max_journal_record_bytes"):
        await journal.create_binding(SCOPE, key, BindingRecord("s", "primary", leaf_id="x" * 4096))
    assert await journal.load_binding(SCOPE, key) is None


async def test_reply_stage_and_mark_b105_b106(stores: StoreFactory) -> None:
    """Behaviours 105, 106: stage is create-only; mark keeps the text; no raw tokens."""
    store = await stores()
    journal = ChannelJournal(store.checkpoints)
    staged = await write(journal, NS_REPLY, SCOPE, reply())
    assert staged is not None and staged.version == 1
    assert await write(journal, NS_REPLY, SCOPE, reply()) is None
    marked = await write(journal, NS_REPLY, SCOPE, reply("delivered"), staged.version)
    assert marked is not None
    loaded = await journal.load_reply(SCOPE, "tg-1", "chan-op-1")
    assert loaded is not None
    assert (loaded.record.state, loaded.record.text) == ("delivered", "the answer")
    assert loaded.record.buttons == (StoredButton("Allow once", "allow_once"),)


async def test_saves_carry_state_metadata_without_text(stores: StoreFactory) -> None:
    """The store's event stream shows kind/state transitions and never the reply text."""
    store = await stores()
    journal = ChannelJournal(store.checkpoints)
    await write(journal, NS_OPERATION, SCOPE, op())
    await write(journal, NS_OPERATION, SCOPE, op("executing"), 1)
    await write(journal, NS_REPLY, SCOPE, reply())
    page = await store.checkpoints.list_events(after=0, limit=100)
    metas = [(e.namespace, dict(e.metadata or {})) for e in page.items]
    assert (NS_OPERATION, {"kind": "message", "state": "accepted"}) in metas
    assert (NS_OPERATION, {"kind": "message", "state": "executing"}) in metas
    assert "the answer" not in json.dumps([m for _n, m in metas])


@pytest.mark.parametrize(
    "record",
    [
        op(),
        reply(),
        BindingRecord(session_id="s-1", agent_alias="primary", leaf_id="e-1"),
    ],
)
def test_replace_is_evolve(record: OperationRecord | ReplyRecord | BindingRecord) -> None:
    """``record.replace`` answers what ``attrs.evolve`` would, field by field, and refuses
    a field the record does not have (as ``evolve`` does)."""
    import attrs

    values: dict[str, Any] = {
        "state": "delivered",
        "updated_at_ms": 99,
        "thread_id": "th",
        "session_id": "s-2",
        "generation": 4,
        "suspended": True,
        "attempts": 2,
        "text": "changed",
    }
    fields = {f.name for f in attrs.fields(type(record))}
    changes = {name: value for name, value in values.items() if name in fields}
    assert len(changes) >= 2
    replaced = record.replace(**changes)
    assert replaced == attrs.evolve(record, **changes)
    assert type(replaced) is type(record) and replaced is not record
    assert record.replace() == record
    with pytest.raises(TypeError, match="no field 'nope'"):
        record.replace(nope=1)


def test_stored_json_leaves_out_absent_fields_and_keeps_its_key_order() -> None:
    """The records' JSON as the journal stores it: what is absent is left out (not
    ``null``), every field present comes in the contract's order."""
    minimal = op().to_json()
    assert list(minimal) == [
        "operationId", "eventId", "kind", "connectionId", "externalConversationId",
        "externalActorId", "agentAlias", "state", "replyStaged", "attempts", "createdAt",
        "updatedAt", "createdAtMs", "updatedAtMs",
    ]  # fmt: skip
    full = (
        op("failed")
        .replace(thread_id="t", session_id="s", run_id="r", error_code="run_failed")
        .to_json()
    )
    assert [k for k in full if k not in minimal] == ["threadId", "sessionId", "runId", "errorCode"]
    assert list(full).index("threadId") == list(full).index("externalActorId") + 1
    assert full["createdAt"] == "1970-01-01T00:00:00.001Z"
    held = reply().replace(
        thread_id="t", buttons=(StoredButton("Allow", "allow_once"),), message_id="m",
        reason="held", approval={"runId": "r"}, created_us=5,
    ).to_json()  # fmt: skip
    assert list(held) == [
        "operationId", "connectionId", "externalConversationId", "threadId", "kind", "text",
        "controls", "state", "attempts", "messageId", "reason", "approval", "createdAt",
        "updatedAt", "createdAtMs", "updatedAtMs", "createdUs",
    ]  # fmt: skip
    bare = reply().replace(buttons=()).to_json()
    assert "controls" not in bare and "createdUs" not in bare and "threadId" not in bare
    assert OperationRecord.from_json(json.loads(json.dumps(full))) == op("failed").replace(
        thread_id="t", session_id="s", run_id="r", error_code="run_failed"
    )


_TEXT = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["", "é", 'a"b\\c', "\n\t\x00\x1f\x7f", "\u2028", "\ud800", "😀"]),
)
_OPT = st.none() | _TEXT
_INT = st.integers(min_value=0, max_value=2**53 - 1)
_MS = st.integers(min_value=0, max_value=253_402_300_799_999)  # the ISO form ends at 9999
_INPUTS = st.none() | st.builds(
    OperationInput,
    text=_TEXT,
    attachments=st.lists(st.builds(AttachmentRef, _TEXT, _TEXT, _INT, _OPT, _OPT), max_size=2).map(
        tuple
    ),
    thread_id=_OPT,
    received_at_ms=st.none() | _INT,
    claims=st.dictionaries(st.sampled_from(["platform", "chatType", "isForum"]), _TEXT),
    admitted_us=st.none() | _INT,
)
_FIELDS: dict[type, dict[str, Any]] = {
    OperationRecord: {
        "operation_id": _TEXT, "event_id": _TEXT, "kind": _TEXT, "connection_id": _TEXT,
        "external_conversation_id": _TEXT, "external_actor_id": _TEXT, "agent_alias": _TEXT,
        "state": _TEXT, "created_at_ms": _MS, "updated_at_ms": _MS, "thread_id": _OPT,
        "session_id": _OPT, "run_id": _OPT, "reply_staged": st.booleans(), "attempts": _INT,
        "error_code": _OPT, "input": _INPUTS,
    },
    ReplyRecord: {
        "operation_id": _TEXT, "connection_id": _TEXT, "external_conversation_id": _TEXT,
        "kind": _TEXT, "text": _TEXT, "state": _TEXT, "created_at_ms": _MS,
        "updated_at_ms": _MS, "thread_id": _OPT,
        "buttons": st.lists(st.builds(StoredButton, _TEXT, _TEXT), max_size=2).map(tuple),
        "attempts": _INT, "message_id": _OPT, "reason": _OPT,
        "approval": st.none() | st.dictionaries(_TEXT, _TEXT | _INT, max_size=3),
        "created_us": st.none() | _INT,
        "files": st.lists(
            st.builds(StoredFile, _TEXT, _TEXT, _TEXT, _OPT, st.none() | _INT), max_size=2
        ).map(tuple),
    },
}  # fmt: skip
"""Every field of the two records that write their own JSON: a field added to a record
must be added here too (see the test below), so its text is checked."""


def test_every_field_of_the_written_out_records_is_generated() -> None:
    import attrs

    for cls, fields in _FIELDS.items():
        assert set(fields) == {f.name for f in attrs.fields(cls)}, cls.__name__


@settings(max_examples=300, deadline=None)
@given(
    record=st.builds(OperationRecord, **_FIELDS[OperationRecord])
    | st.builds(ReplyRecord, **_FIELDS[ReplyRecord])
)
def test_written_out_json_is_the_encoders(record: OperationRecord | ReplyRecord) -> None:
    """``to_json_text`` (what the journal stores for operations and replies) is exactly
    ``compact_json(to_json())``: the same keys, order, escaping and numbers, for any text
    (quotes, control characters, U+2028, lone surrogates, astral characters)."""
    assert record.to_json_text() == compact_json(record.to_json())
