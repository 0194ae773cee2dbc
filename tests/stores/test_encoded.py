"""Conformance: ``write_checkpoints`` of saves the caller encoded (``value_json``,
``metadata_json``), each answered with its row's time.

Every backend: the same checks, transaction and events as a save given its value (a lost
compare-and-swap is a result without a time, not an exception), ``atomic``
all-or-nothing, a stored row that loads as any other, and bad input refused before
anything is written.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from stores import (
    InvalidCheckpointError,
    OwnershipScope,
    RecordTooLargeError,
    SaveCheckpoint,
    Store,
    compact_json,
)

NS = "prism.channels.v1.operation"
SCOPE = OwnershipScope("tenant-1", "acct-1", "user-1")
OTHER = OwnershipScope("tenant-2", "acct-1", "user-1")
META = compact_json({"kind": "message", "state": "accepted"})


def enc(key: str, version: int = 1, **kw: Any) -> SaveCheckpoint:
    args: dict[str, Any] = {
        "namespace": NS,
        "key": key,
        "scope": SCOPE,
        "version": version,
        "expected_version": version - 1,
        "fencing_token": None,
        "category": "channel-operation",
        "value_json": compact_json({"key": key, "v": version, "text": "é ✓"}),
        "metadata_json": META,
    }
    args.update(kw)
    return SaveCheckpoint(**args)


async def versions(store: Store) -> dict[str, int]:
    page = await store.checkpoints.list_checkpoints(namespace=NS, limit=500)
    return {r.key: r.version for r in page.items}


async def test_each_save_is_answered_with_its_time_or_none(store: Store) -> None:
    await store.checkpoints.save_checkpoint(
        namespace=NS, key="old", scope=SCOPE, version=1, value={}, expected_version=0
    )
    results = await store.checkpoints.write_checkpoints(
        [
            enc("a"),
            enc("old"),  # create-only over an existing row: lost
            enc("b", fencing_token=3),
            enc("old", 2, scope=OTHER),  # another scope: lost
            enc("a", 2),  # sees the save of "a" above
            enc("c", 5, expected_version=None),  # any version
        ]
    )
    stored = [r.updated_at_ms for r in results]
    assert [at is None for at in stored] == [False, True, False, True, False, False]
    assert all(isinstance(at, int) for at in stored if at is not None)
    assert [r.status for r in results] == ["ok", "conflict", "ok", "conflict", "ok", "ok"]
    assert await versions(store) == {"old": 1, "a": 2, "b": 1, "c": 5}
    page = await store.checkpoints.list_events(limit=500)
    assert [(e.action, e.key, e.version) for e in page.items] == [
        ("save", "old", 1),
        ("save", "a", 1),
        ("save", "b", 1),
        ("save", "a", 2),
        ("save", "c", 5),
    ]
    assert page.items[1].metadata == {"kind": "message", "state": "accepted"}
    assert page.items[1].category == "channel-operation"


async def test_a_stored_save_loads_as_any_other(store: Store) -> None:
    (written,) = await store.checkpoints.write_checkpoints([enc("k", fencing_token=7)])
    at = written.updated_at_ms
    record = written.record
    assert record is not None and record.value == {"key": "k", "v": 1, "text": "é ✓"}
    assert record.metadata == {"kind": "message", "state": "accepted"}
    loaded = await store.checkpoints.load_checkpoint(namespace=NS, key="k", scope=SCOPE)
    assert loaded is not None
    assert loaded.value == {"key": "k", "v": 1, "text": "é ✓"}
    assert (loaded.version, loaded.fencing_token, loaded.scope) == (1, 7, SCOPE)
    assert loaded.metadata == {"kind": "message", "state": "accepted"}
    assert loaded.category == "channel-operation"
    assert loaded.updated_at_ms == at
    # And a save given its value takes it from there: one row, one path.
    (result,) = await store.checkpoints.write_checkpoints(
        [SaveCheckpoint(NS, "k", SCOPE, 2, {"v": 2}, expected_version=1, fencing_token=7)]
    )
    assert result.ok
    # A fence below the stored one loses, as for a save given its value.
    (lost,) = await store.checkpoints.write_checkpoints([enc("k", 3, fencing_token=6)])
    assert (lost.status, lost.updated_at_ms, lost.record) == ("conflict", None, None)


async def test_an_atomic_batch_is_all_or_nothing(store: Store) -> None:
    await store.checkpoints.write_checkpoints([enc("op")])
    lost = await store.checkpoints.write_checkpoints(
        [enc("reply"), enc("op", 2), enc("binding", 2)],  # binding does not exist yet
        atomic=True,
    )
    assert [r.status for r in lost] == ["aborted", "aborted", "conflict"]
    assert [r.updated_at_ms for r in lost] == [None, None, None]
    assert await versions(store) == {"op": 1}
    won = await store.checkpoints.write_checkpoints(
        [enc("reply"), enc("op", 2), enc("binding")], atomic=True
    )
    assert None not in [r.updated_at_ms for r in won]
    assert await versions(store) == {"op": 2, "reply": 1, "binding": 1}
    page = await store.checkpoints.list_events(limit=500)
    assert [e.key for e in page.items] == ["op", "reply", "op", "binding"]


async def test_an_empty_batch_writes_nothing(store: Store) -> None:
    assert await store.checkpoints.write_checkpoints([]) == ()
    assert await store.checkpoints.last_event_seq() == 0


@pytest.mark.parametrize(
    ("bad", "error", "names"),
    [
        ({"version": 0}, InvalidCheckpointError, "version"),
        ({"version": True}, InvalidCheckpointError, "version"),
        ({"expected_version": -1}, InvalidCheckpointError, "expected_version"),
        ({"fencing_token": "3"}, InvalidCheckpointError, "fencing_token"),
        ({"namespace": ""}, InvalidCheckpointError, "namespace"),
        ({"key": "\ud800"}, InvalidCheckpointError, "key"),
        ({"scope": ("t", "a", "u")}, InvalidCheckpointError, "scope"),
        ({"category": 5}, InvalidCheckpointError, "category"),
        ({"value_json": {"v": 1}}, InvalidCheckpointError, "value_json"),
        ({"value_json": "x" * 2_000_000}, RecordTooLargeError, "max_value_bytes"),
        ({"metadata_json": "[1, 2]"}, InvalidCheckpointError, "metadata_json"),
        ({"metadata_json": "{not json"}, InvalidCheckpointError, "metadata_json"),
        ({"metadata_json": {"kind": "x"}}, InvalidCheckpointError, "metadata_json"),
        # one value and one metadata: given or encoded, not both
        ({"value": {"v": 1}}, InvalidCheckpointError, "value or value_json"),
        ({"metadata": {"kind": "x"}}, InvalidCheckpointError, "metadata or metadata_json"),
    ],
)
async def test_bad_input_is_refused_before_anything_is_written(
    store: Store, bad: dict[str, Any], error: type[Exception], names: str
) -> None:
    with pytest.raises(error, match=names):
        await store.checkpoints.write_checkpoints([enc("first"), enc("bad")._replace(**bad)])
    assert await versions(store) == {}
    assert await store.checkpoints.last_event_seq() == 0


async def test_what_is_not_a_batch_of_encoded_saves_is_refused(store: Store) -> None:
    checkpoints: Any = store.checkpoints
    with pytest.raises(InvalidCheckpointError, match="SaveCheckpoint"):
        await checkpoints.write_checkpoints("not a batch")
    with pytest.raises(InvalidCheckpointError, match="SaveCheckpoint"):
        await checkpoints.write_checkpoints([tuple(enc("k"))])  # a plain tuple of the fields
    with pytest.raises(InvalidCheckpointError, match="atomic"):
        await checkpoints.write_checkpoints([enc("k")], atomic="yes")
    assert await versions(store) == {}


async def test_metadata_is_stored_as_the_object_it_encodes(store: Store) -> None:
    meta = json.dumps({"kind": "reply", "state": "pending", "n": [1, {"x": None}]})
    await store.checkpoints.write_checkpoints(
        [enc("k", metadata_json=meta), enc("m", metadata_json=None)]
    )
    page = await store.checkpoints.list_events(limit=10)
    assert [e.metadata for e in page.items] == [json.loads(meta), None]
