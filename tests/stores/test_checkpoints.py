"""Conformance: CheckpointStore rules (contract §1.2; behaviours 95–106, 172–176)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio
import trio.testing

from stores import (
    ANY_SCOPE,
    CheckpointConflictError,
    InvalidCheckpointError,
    OwnershipScope,
    RecordTooLargeError,
    Store,
    StoreUnavailableError,
)
from tests.support.backends import Backend
from tests.support.clocks import EPOCH_MS

NS = "prism.channels.v1.binding"
SCOPE = OwnershipScope("tenant-1", "acct-1", "user-1")
OTHER = OwnershipScope("tenant-2", "acct-1", "user-1")


async def save(store: Store, key: str = "k", **kw: Any) -> Any:
    args: dict[str, Any] = {"namespace": NS, "key": key, "scope": SCOPE, "value": {"v": 1}}
    args.update(kw)
    return await store.checkpoints.save_checkpoint(**args)


async def load(store: Store, key: str = "k", scope: OwnershipScope = SCOPE) -> Any:
    return await store.checkpoints.load_checkpoint(namespace=NS, key=key, scope=scope)


# --------------------------------------------------------------------------- create / CAS


async def test_create_only_succeeds_once_and_never_overwrites(store: Store) -> None:
    """Behaviours 95, 100, 105, 172: create-only (expected_version=0) is durable dedup."""
    first = await save(store, version=1, expected_version=0, value={"sessionId": "s1"})
    assert first.version == 1
    with pytest.raises(CheckpointConflictError) as info:
        await save(store, version=1, expected_version=0, value={"sessionId": "s2"})
    assert not isinstance(info.value, InvalidCheckpointError)
    loaded = await load(store)
    assert loaded.value == {"sessionId": "s1"} and loaded.version == 1


async def test_cas_on_version(store: Store) -> None:
    """Behaviours 96, 101, 173, 175: wrong expected version refused, right one applied."""
    await save(store, version=1, expected_version=0, value={"state": "accepted"})
    with pytest.raises(CheckpointConflictError):
        await save(store, version=2, expected_version=0, value={"state": "x"})
    saved = await save(store, version=2, expected_version=1, value={"state": "executing"})
    assert saved.version == 2 and saved.value == {"state": "executing"}
    with pytest.raises(CheckpointConflictError):
        await save(store, version=3, expected_version=1, value={"state": "succeeded"})
    loaded = await load(store)
    assert (loaded.version, loaded.value) == (2, {"state": "executing"})


async def test_new_version_must_be_strictly_greater(store: Store) -> None:
    await save(store, version=5)
    for bad in (5, 4, 1):
        with pytest.raises(CheckpointConflictError):
            await save(store, version=bad, value={"bad": bad})
        with pytest.raises(CheckpointConflictError):
            await save(store, version=bad, expected_version=5, value={"bad": bad})
    assert (await save(store, version=9, expected_version=5)).version == 9
    assert (await load(store)).version == 9


async def test_positive_expected_version_on_missing_row_conflicts(store: Store) -> None:
    with pytest.raises(CheckpointConflictError):
        await save(store, version=2, expected_version=1)
    assert await load(store) is None
    assert (await store.checkpoints.list_events()).items == ()


async def test_unconditional_save_creates_then_follows_version_rule(store: Store) -> None:
    assert (await save(store, version=3)).version == 3
    assert (await save(store, version=4)).version == 4


async def test_created_at_preserved_updated_at_moves(store: Store, autojump_clock: Any) -> None:
    first = await save(store, version=1, expected_version=0)
    assert first.created_at_ms == first.updated_at_ms == EPOCH_MS + int(trio.current_time() * 1000)
    await trio.sleep(5)
    second = await save(store, version=2, expected_version=1)
    assert second.created_at_ms == first.created_at_ms
    assert second.updated_at_ms == first.updated_at_ms + 5000
    assert second.updated_at.timestamp() * 1000 == second.updated_at_ms
    loaded = await load(store)
    assert (loaded.created_at_ms, loaded.updated_at_ms) == (
        first.created_at_ms,
        second.updated_at_ms,
    )


async def test_category_and_metadata_round_trip(store: Store) -> None:
    rec = await save(
        store, version=1, category="channel-binding", metadata={"state": "accepted", "n": [1, 2]}
    )
    assert rec.category == "channel-binding"
    assert rec.metadata == {"state": "accepted", "n": [1, 2]}
    loaded = await load(store)
    assert loaded == rec


async def test_value_is_deep_copied_through_json(store: Store) -> None:
    value: dict[str, Any] = {
        "text": "héllo ✓ \U0001f600",
        "nested": {"list": [1, 2.5, True, None, "x"]},
        "big": 2**53 - 1,
        "neg": -7,
    }
    await save(store, version=1, value=value)
    value["nested"]["list"].append("mutated")
    loaded = await load(store)
    assert loaded.value["nested"]["list"] == [1, 2.5, True, None, "x"]
    loaded.value["nested"]["list"].clear()
    again = await load(store)
    assert again.value["text"] == "héllo ✓ \U0001f600"
    assert again.value["nested"]["list"] == [1, 2.5, True, None, "x"]
    assert again.value["big"] == 2**53 - 1


async def test_tuple_value_comes_back_as_list(store: Store) -> None:
    rec = await save(store, version=1, value={"t": (1, 2)})
    assert rec.value == {"t": [1, 2]}


# --------------------------------------------------------------------------- fencing


async def test_fenced_row_refuses_stale_and_missing_tokens(store: Store) -> None:
    await save(store, version=1, expected_version=0)
    # First fenced write on an unfenced row is accepted.
    assert (await save(store, version=2, expected_version=1, fencing_token=3)).fencing_token == 3
    with pytest.raises(CheckpointConflictError):
        await save(store, version=3, expected_version=2, fencing_token=2)
    with pytest.raises(CheckpointConflictError):
        await save(store, version=3, expected_version=2)  # missing token on a fenced row
    # Equal and higher tokens pass; the stored token follows the write.
    assert (await save(store, version=3, expected_version=2, fencing_token=3)).fencing_token == 3
    assert (await save(store, version=4, expected_version=3, fencing_token=7)).fencing_token == 7
    with pytest.raises(CheckpointConflictError):
        await save(store, version=5, expected_version=4, fencing_token=3)
    loaded = await load(store)
    assert (loaded.version, loaded.fencing_token) == (4, 7)


async def test_unfenced_row_accepts_unfenced_writes(store: Store) -> None:
    await save(store, version=1)
    rec = await save(store, version=2, expected_version=1)
    assert rec.fencing_token is None


async def test_create_with_fencing_token_stores_it(store: Store) -> None:
    rec = await save(store, version=1, expected_version=0, fencing_token=2)
    assert rec.fencing_token == 2
    with pytest.raises(CheckpointConflictError):
        await save(store, version=2, expected_version=1)


# --------------------------------------------------------------------------- scope


async def test_foreign_scope_is_a_miss_for_load_and_delete(store: Store) -> None:
    """Behaviours 98, 99, 174: another scope loads None and deletes nothing."""
    await save(store, version=1, value={"sessionId": "s"})
    assert await load(store, scope=OTHER) is None
    assert await load(store, scope=OwnershipScope("tenant-1")) is None  # partial scope misses
    assert await load(store, scope=ANY_SCOPE) is None
    assert not await store.checkpoints.delete_checkpoint(namespace=NS, key="k", scope=OTHER)
    assert (await load(store)).value == {"sessionId": "s"}


async def test_foreign_scope_save_is_an_ordinary_conflict(store: Store) -> None:
    await save(store, version=1)
    with pytest.raises(CheckpointConflictError) as foreign:
        await save(store, version=2, expected_version=1, scope=OTHER)
    with pytest.raises(CheckpointConflictError) as stale:
        await save(store, version=2, expected_version=9)
    # No ownership-shaped oracle: the two failures look the same.
    assert type(foreign.value) is type(stale.value)
    assert str(foreign.value) == str(stale.value)
    assert (await load(store)).scope == SCOPE


async def test_none_scope_fields_differ_from_empty_strings(store: Store) -> None:
    empty = OwnershipScope("", "", "")
    await save(store, key="a", version=1, scope=ANY_SCOPE)
    await save(store, key="b", version=1, scope=empty)
    assert await load(store, key="a", scope=empty) is None
    assert await load(store, key="b", scope=ANY_SCOPE) is None
    assert (await load(store, key="a", scope=ANY_SCOPE)).scope == ANY_SCOPE
    assert (await load(store, key="b", scope=empty)).scope == empty
    with pytest.raises(CheckpointConflictError):
        await save(store, key="a", version=2, scope=empty)


async def test_scope_isolation_both_ways(store: Store) -> None:
    await save(store, key="mine", version=1, scope=SCOPE)
    await save(store, key="theirs", version=1, scope=OTHER)
    assert await load(store, key="theirs", scope=SCOPE) is None
    assert await load(store, key="mine", scope=OTHER) is None
    with pytest.raises(CheckpointConflictError):
        await save(store, key="theirs", version=2, scope=SCOPE)
    with pytest.raises(CheckpointConflictError):
        await save(store, key="mine", version=2, scope=OTHER)


# --------------------------------------------------------------------------- delete


async def test_delete_then_fresh_create(store: Store) -> None:
    """Behaviour 102: remove → True, load → None, a fresh create succeeds."""
    await save(store, version=1, expected_version=0)
    await save(store, version=2, expected_version=1, fencing_token=4)
    assert await store.checkpoints.delete_checkpoint(namespace=NS, key="k", scope=SCOPE)
    assert await load(store) is None
    assert not await store.checkpoints.delete_checkpoint(namespace=NS, key="k", scope=SCOPE)
    fresh = await save(store, version=1, expected_version=0)
    assert (fresh.version, fresh.fencing_token) == (1, None)


# --------------------------------------------------------------------------- races


async def test_cas_race_has_exactly_one_winner(store: Store) -> None:
    await save(store, version=1, expected_version=0, value={"winner": None})
    winners: list[int] = []
    conflicts = 0

    async def contender(i: int) -> None:
        nonlocal conflicts
        try:
            await save(store, version=2, expected_version=1, value={"winner": i})
        except CheckpointConflictError:
            conflicts += 1
        else:
            winners.append(i)

    async with trio.open_nursery() as nursery:
        for i in range(40):
            nursery.start_soon(contender, i)
    assert len(winners) == 1 and conflicts == 39
    assert (await load(store)).value == {"winner": winners[0]}
    events = (await store.checkpoints.list_events()).items
    assert [e.version for e in events] == [1, 2]


async def test_create_race_has_exactly_one_winner(store: Store) -> None:
    results = []

    async def contender(i: int) -> None:
        try:
            await save(store, key="new", version=1, expected_version=0, value=i)
            results.append(i)
        except CheckpointConflictError:
            pass

    async with trio.open_nursery() as nursery:
        for i in range(40):
            nursery.start_soon(contender, i)
    assert len(results) == 1
    assert (await load(store, key="new")).value == results[0]


# --------------------------------------------------------------------------- size limit


async def test_record_size_limit_default_one_mib(store: Store) -> None:
    limit = 1024 * 1024
    fits = "x" * (limit - 2)  # the JSON encoding adds two quotes
    assert (await save(store, key="fits", version=1, value=fits)).value == fits
    with pytest.raises(RecordTooLargeError) as info:
        await save(store, key="big", version=1, value=fits + "x")
    assert "max_value_bytes" in str(info.value)
    assert await load(store, key="big") is None
    # Bytes, not characters: a 3-byte character counts three times.
    with pytest.raises(RecordTooLargeError):
        await save(store, key="big", version=1, value="€" * (limit // 3 + 1))


async def test_record_size_limit_is_configurable(backend: Backend) -> None:
    """Behaviour 104: a 4 KiB value is refused by a store limited to 1024 bytes."""
    async with backend.open(max_value_bytes=1024) as store:
        with pytest.raises(RecordTooLargeError):
            await save(store, version=1, value={"leafId": "x" * 4096})
        assert await load(store) is None
        assert (await store.checkpoints.list_events()).items == ()
        assert (await save(store, version=1, value={"leafId": "x" * 900})).version == 1


# --------------------------------------------------------------------------- bad input


class Unserialisable:
    pass


BAD_SAVES: list[tuple[str, dict[str, Any]]] = [
    ("empty-namespace", {"namespace": ""}),
    ("empty-key", {"key": ""}),
    ("namespace-not-str", {"namespace": 5}),
    ("version-0", {"version": 0}),
    ("version-negative", {"version": -1}),
    ("version-unsafe", {"version": 2**53}),
    ("version-bool", {"version": True}),
    ("version-float", {"version": 1.0}),
    ("expected-negative", {"expected_version": -1}),
    ("expected-float", {"expected_version": 0.0}),
    ("fence-negative", {"fencing_token": -1}),
    ("fence-str", {"fencing_token": "1"}),
    ("value-set", {"value": {1, 2}}),
    ("value-nan", {"value": {"x": math.nan}}),
    ("value-inf", {"value": [math.inf]}),
    ("value-object", {"value": Unserialisable()}),
    ("value-bytes", {"value": b"raw"}),
    ("value-int-key", {"value": {1: "a"}}),
    ("metadata-not-mapping", {"metadata": ["a"]}),
    ("metadata-nan", {"metadata": {"x": math.nan}}),
    ("category-not-str", {"category": 3}),
    ("key-lone-surrogate", {"key": "k\ud800"}),
    ("value-lone-surrogate", {"value": {"t": "\udfff"}}),
    ("category-lone-surrogate", {"category": "\ud800"}),
    ("scope-lone-surrogate", {"scope": OwnershipScope("\ud800")}),
    ("scope-not-scope", {"scope": ("t", "a", "u")}),
    ("scope-field-not-str", {"scope": OwnershipScope(1, None, None)}),  # type: ignore[arg-type]
]


@pytest.mark.parametrize("override", [b[1] for b in BAD_SAVES], ids=[b[0] for b in BAD_SAVES])
async def test_bad_save_input_is_typed_and_writes_nothing(
    store: Store, override: dict[str, Any]
) -> None:
    args: dict[str, Any] = {"version": 1, "expected_version": 0}
    args.update(override)
    with pytest.raises(InvalidCheckpointError) as info:
        await save(store, **args)
    assert isinstance(info.value, CheckpointConflictError) and isinstance(info.value, ValueError)
    assert (await store.checkpoints.list_checkpoints()).items == ()
    assert (await store.checkpoints.list_events()).items == ()


@pytest.mark.parametrize(
    "kw", [{"namespace": ""}, {"key": ""}, {"scope": None}], ids=["namespace", "key", "scope"]
)
async def test_bad_load_and_delete_input(store: Store, kw: dict[str, Any]) -> None:
    args: dict[str, Any] = {"namespace": NS, "key": "k", "scope": SCOPE}
    args.update(kw)
    with pytest.raises(InvalidCheckpointError):
        await store.checkpoints.load_checkpoint(**args)
    with pytest.raises(InvalidCheckpointError):
        await store.checkpoints.delete_checkpoint(**args)


async def test_closed_store_is_unavailable(backend: Backend) -> None:
    async with backend.open() as store:
        await save(store, version=1)
        await store.aclose()  # early, inside the block
        await store.aclose()  # idempotent
        with pytest.raises(StoreUnavailableError):
            await load(store)
        with pytest.raises(StoreUnavailableError):
            await save(store, version=2)
        with pytest.raises(StoreUnavailableError):
            await store.leases.get_lease(namespace=NS, key="k", scope=SCOPE)


async def test_store_is_closed_when_its_block_ends(backend: Backend) -> None:
    async with backend.open() as store:
        await save(store, version=1)
    with pytest.raises(StoreUnavailableError):
        await load(store)
    with pytest.raises(StoreUnavailableError):
        await store.leases.get_lease(namespace=NS, key="k", scope=SCOPE)


async def test_open_store_is_no_longer_awaitable(backend: Backend) -> None:
    """Only ``async with open_store(...)``: the old ``await open_store(...)`` form is gone."""
    opener = backend.open()
    with pytest.raises(TypeError):
        await opener  # type: ignore[misc]


# --------------------------------------------------------------------------- cancellation


async def test_cancelled_save_writes_nothing(store: Store) -> None:
    with trio.CancelScope() as scope:
        scope.cancel()
        await save(store, version=1, expected_version=0)
    assert scope.cancelled_caught
    assert await load(store) is None
    assert (await store.checkpoints.list_events()).items == ()


async def test_save_cancelled_in_flight_is_all_or_nothing(store: Store) -> None:
    """A cancel that lands while saves are in flight never leaves a row without its event,
    and every save that returned is stored."""
    returned: list[str] = []

    async def writer(i: int) -> None:
        await save(store, key=f"k{i}", version=1, expected_version=0)
        returned.append(f"k{i}")

    with trio.CancelScope() as cancel_scope:
        async with trio.open_nursery() as nursery:
            for i in range(20):
                nursery.start_soon(writer, i)
            # Cancel once every writer is parked (on the SQLite worker thread or its limiter).
            await trio.testing.wait_all_tasks_blocked()
            cancel_scope.cancel()
    rows = {r.key for r in (await store.checkpoints.list_checkpoints(limit=500)).items}
    events = {e.key for e in (await store.checkpoints.list_events(limit=500)).items}
    assert set(returned) <= rows
    assert rows == events
