"""stores.update_checkpoint and retry_compare_and_swap: the one read-modify-write loop.

On every backend: a write that lost to another writer is read again and decided again; a
``Keep`` writes nothing; a record that never settles fails with a clear error after the
given attempts, having written nothing of its own; the first write of a record is
create-only, so of two concurrent creators one wins and the other sees its value; a fence
is passed on; a refusal of ``change`` or a malformed value reaches the caller at once."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from stores import (
    LOST,
    CheckpointConflictError,
    CheckpointRecord,
    InvalidCheckpointError,
    Keep,
    Lost,
    OwnershipScope,
    Replace,
    Store,
    retry_compare_and_swap,
    update_checkpoint,
)

NS = "prismd.v1.test-update"
SCOPE = OwnershipScope("tenant-1", "acct-1", "user-1")


def counter(step: int = 1) -> Any:
    def change(stored: CheckpointRecord | None) -> Replace[int]:
        now = 0 if stored is None else int(stored.value["n"])
        return Replace({"n": now + step}, now + step)

    return change


async def test_a_first_update_creates_the_record(store: Store) -> None:
    seen: list[CheckpointRecord | None] = []

    def change(stored: CheckpointRecord | None) -> Replace[str]:
        seen.append(stored)
        return Replace({"n": 1}, "made", metadata={"kind": "test"})

    result = await update_checkpoint(
        store.checkpoints,
        namespace=NS,
        key="k",
        scope=SCOPE,
        change=change,
        what="the test record",
        category="test",
    )
    assert (result, seen) == ("made", [None])
    stored = await store.checkpoints.load_checkpoint(namespace=NS, key="k", scope=SCOPE)
    assert stored is not None
    assert (stored.version, stored.value, stored.category) == (1, {"n": 1}, "test")
    assert stored.metadata == {"kind": "test"}


async def test_keep_writes_nothing(store: Store) -> None:
    await store.checkpoints.save_checkpoint(
        namespace=NS, key="k", scope=SCOPE, version=1, value={"n": 5}
    )
    result = await update_checkpoint(
        store.checkpoints,
        namespace=NS,
        key="k",
        scope=SCOPE,
        change=lambda stored: Keep(None if stored is None else stored.value["n"]),
        what="the test record",
    )
    assert result == 5
    stored = await store.checkpoints.load_checkpoint(namespace=NS, key="k", scope=SCOPE)
    assert stored is not None and stored.version == 1
    assert await store.checkpoints.last_event_seq() == 1  # the setup's save only


async def test_a_lost_write_is_read_and_decided_again(store: Store) -> None:
    """Another writer slips in between the read and the write (inside ``change``, the
    first time only): the update loses, reads the other's value and builds on it."""
    await store.checkpoints.save_checkpoint(
        namespace=NS, key="k", scope=SCOPE, version=1, value={"n": 10}
    )
    calls: list[int] = []

    def change(stored: CheckpointRecord | None) -> Replace[int]:
        assert stored is not None
        calls.append(stored.version)
        if len(calls) == 1:
            interloper.append(stored.version)
        return Replace({"n": stored.value["n"] + 1}, stored.value["n"] + 1)

    interloper: list[int] = []

    class Racing:
        """Checkpoints that let the interloper write just before the update's write."""

        def __getattr__(self, name: str) -> Any:
            return getattr(store.checkpoints, name)

        async def save_checkpoint(self, **kw: Any) -> CheckpointRecord:
            while interloper:
                version = interloper.pop()
                await store.checkpoints.save_checkpoint(
                    namespace=NS,
                    key="k",
                    scope=SCOPE,
                    version=version + 1,
                    expected_version=version,
                    value={"n": 100},
                )
            return await store.checkpoints.save_checkpoint(**kw)

    result = await update_checkpoint(
        Racing(),
        namespace=NS,
        key="k",
        scope=SCOPE,
        change=change,
        what="the test record",
    )
    assert (result, calls) == (101, [1, 2])
    stored = await store.checkpoints.load_checkpoint(namespace=NS, key="k", scope=SCOPE)
    assert stored is not None and (stored.version, stored.value) == (3, {"n": 101})


async def test_concurrent_updates_each_apply_once(store: Store) -> None:
    """Ten tasks add one each to a record that starts absent: the first write of each is
    create-only or at the version it read, so none is lost and none applies twice."""

    async def add() -> None:
        await update_checkpoint(
            store.checkpoints,
            namespace=NS,
            key="count",
            scope=SCOPE,
            change=counter(),
            what="the counter",
            attempts=20,
        )

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for _ in range(10):
                nursery.start_soon(add)
    stored = await store.checkpoints.load_checkpoint(namespace=NS, key="count", scope=SCOPE)
    assert stored is not None and stored.value == {"n": 10} and stored.version == 10


async def test_create_only_loses_to_a_concurrent_creator(store: Store) -> None:
    """The record is absent when read and created by someone else before the write: the
    create-only write loses, and the second attempt sees the other's record."""
    seen: list[int | None] = []

    def change(stored: CheckpointRecord | None) -> Replace[str] | Keep[str]:
        seen.append(None if stored is None else stored.version)
        if stored is not None:
            return Keep(str(stored.value["by"]))
        return Replace({"by": "me"}, "me")

    class Racing:
        created = False

        def __getattr__(self, name: str) -> Any:
            return getattr(store.checkpoints, name)

        async def save_checkpoint(self, **kw: Any) -> CheckpointRecord:
            if not self.created:
                self.created = True
                await store.checkpoints.save_checkpoint(
                    namespace=NS, key="once", scope=SCOPE, version=1, value={"by": "other"}
                )
            assert kw["expected_version"] == 0  # create-only
            return await store.checkpoints.save_checkpoint(**kw)

    result = await update_checkpoint(
        Racing(),
        namespace=NS,
        key="once",
        scope=SCOPE,
        change=change,
        what="the test record",
    )
    assert (result, seen) == ("other", [None, 1])


async def test_exhausted_attempts_fail_clearly_and_write_nothing(store: Store) -> None:
    """A newer fence refuses every write: after the given attempts the caller gets a
    CheckpointConflictError naming what kept losing, and the record is as it was."""
    await store.checkpoints.save_checkpoint(
        namespace=NS, key="fenced", scope=SCOPE, version=1, value={"n": 1}, fencing_token=7
    )
    calls = 0

    def change(stored: CheckpointRecord | None) -> Replace[None]:
        nonlocal calls
        calls += 1
        return Replace({"n": 2}, None)

    with pytest.raises(CheckpointConflictError, match="the fenced record kept losing") as info:
        await update_checkpoint(
            store.checkpoints,
            namespace=NS,
            key="fenced",
            scope=SCOPE,
            change=change,
            what="the fenced record",
            fencing_token=3,  # older than the stored 7
            attempts=4,
        )
    assert "4 attempts" in str(info.value)
    assert calls == 4
    stored = await store.checkpoints.load_checkpoint(namespace=NS, key="fenced", scope=SCOPE)
    assert stored is not None and (stored.version, stored.value) == (1, {"n": 1})
    # The current fence is passed on and wins.
    await update_checkpoint(
        store.checkpoints,
        namespace=NS,
        key="fenced",
        scope=SCOPE,
        change=change,
        what="the fenced record",
        fencing_token=7,
    )
    stored = await store.checkpoints.load_checkpoint(namespace=NS, key="fenced", scope=SCOPE)
    assert stored is not None and (stored.version, stored.fencing_token) == (2, 7)


async def test_a_refusal_or_a_bad_value_reaches_the_caller_at_once(store: Store) -> None:
    calls = 0

    def refuse(stored: CheckpointRecord | None) -> Replace[None]:
        nonlocal calls
        calls += 1
        raise LookupError("no such thing")

    with pytest.raises(LookupError):
        await update_checkpoint(
            store.checkpoints, namespace=NS, key="k", scope=SCOPE, change=refuse, what="x"
        )

    def unencodable(stored: CheckpointRecord | None) -> Replace[None]:
        nonlocal calls
        calls += 1
        return Replace({"n": float("nan")}, None)

    with pytest.raises(InvalidCheckpointError):
        await update_checkpoint(
            store.checkpoints, namespace=NS, key="k", scope=SCOPE, change=unencodable, what="x"
        )
    assert calls == 2  # neither was tried again
    assert await store.checkpoints.load_checkpoint(namespace=NS, key="k", scope=SCOPE) is None


async def test_retry_compare_and_swap_counts_lost_attempts() -> None:
    outcomes: list[str | Lost] = [LOST, LOST, "won"]

    async def attempt() -> str | Lost:
        return outcomes.pop(0)

    assert await retry_compare_and_swap(attempt, what="x", attempts=3) == "won"
    outcomes[:] = [LOST, LOST, "too late"]
    with pytest.raises(CheckpointConflictError, match=r"the thing kept losing.*\(2 attempts\)"):
        await retry_compare_and_swap(attempt, what="the thing", attempts=2)
    assert outcomes == ["too late"]
    with pytest.raises(ValueError, match="attempts"):
        await retry_compare_and_swap(attempt, what="x", attempts=0)
    assert repr(LOST) == "LOST"
