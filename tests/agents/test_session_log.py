"""The transcript log's memory of what it last wrote: appends without a load, and the
compare-and-swap that keeps that safe when anything else wrote the transcript."""

from __future__ import annotations

import json
from typing import Any

import attrs
import trio

from prismd.agents._session import (
    MAX_CACHED_BYTES,
    MAX_CACHED_SESSIONS,
    MAX_SESSION_BYTES,
    MAX_SESSION_ENTRIES,
    NS_SESSION,
    SessionEntry,
    SessionLog,
    _Transcript,
)
from stores import OwnershipScope
from stores.memory import MemoryStore

from .conftest import YieldingCheckpoints

OWNER = OwnershipScope("tenant-a", None, "user-1")


@attrs.define
class CountingLoads(YieldingCheckpoints):
    loads: int = 0

    async def load_checkpoint(self, **kw: Any) -> Any:
        self.loads += 1
        return await super().load_checkpoint(**kw)


def texts(entries: tuple[Any, ...]) -> list[str]:
    return [e.text for e in entries]


async def test_an_append_after_the_first_does_not_load_the_transcript(
    store: MemoryStore,
) -> None:
    counting = CountingLoads(store.checkpoints)
    log = SessionLog(counting, "primary")
    for i in range(5):
        await log.append("s", OWNER, (("user", f"q{i}"), ("assistant", f"a{i}")))
    assert counting.loads == 1  # the first append of this process, to learn the version
    assert counting.saves == 5 and counting.conflicts == 0
    entries = await SessionLog(store.checkpoints, "primary").entries("s", OWNER)
    assert texts(entries) == [t for i in range(5) for t in (f"q{i}", f"a{i}")]


async def test_a_transcript_written_by_another_process_is_reloaded_not_overwritten(
    store: MemoryStore,
) -> None:
    """Two logs on one store stand for two processes: each remembers its own last write,
    and the other's append makes that memory stale. Nothing either appended is lost."""
    counting = CountingLoads(store.checkpoints)
    mine = SessionLog(counting, "primary")
    theirs = SessionLog(store.checkpoints, "primary")
    await mine.append("s", OWNER, (("user", "mine-1"),))
    await theirs.append("s", OWNER, (("user", "theirs-1"),))
    leaf = await mine.append("s", OWNER, (("assistant", "mine-2"),))
    assert counting.conflicts == 1 and counting.loads == 2
    entries = await theirs.entries("s", OWNER)
    assert texts(entries) == ["mine-1", "theirs-1", "mine-2"]
    assert entries[-1].id == leaf
    # And back: the other log's memory is stale now in its turn.
    await theirs.append("s", OWNER, (("user", "theirs-2"),))
    assert texts(await mine.entries("s", OWNER)) == ["mine-1", "theirs-1", "mine-2", "theirs-2"]


async def test_a_transcript_deleted_meanwhile_starts_again(store: MemoryStore) -> None:
    """Prune deletes transcripts: the remembered version then names a row that is gone,
    the save conflicts, and the append starts a fresh transcript."""
    log = SessionLog(store.checkpoints, "primary")
    await log.append("s", OWNER, (("user", "old"),))
    deleted = await store.checkpoints.delete_checkpoint(
        namespace=NS_SESSION, key="s1:primary:s", scope=OWNER
    )
    assert deleted
    await log.append("s", OWNER, (("user", "new"),))
    row = await store.checkpoints.load_checkpoint(
        namespace=NS_SESSION, key="s1:primary:s", scope=OWNER
    )
    assert row is not None and row.version == 1
    assert texts(await log.entries("s", OWNER)) == ["new"]


async def test_concurrent_appends_in_one_process_keep_every_entry(store: MemoryStore) -> None:
    yielding = YieldingCheckpoints(store.checkpoints)
    log = SessionLog(yielding, "primary")
    await log.append("s", OWNER, (("user", "first"),))

    async with trio.open_nursery() as nursery:
        for i in range(6):
            nursery.start_soon(log.append, "s", OWNER, (("user", f"c{i}"),))
    entries = texts(await log.entries("s", OWNER))
    assert entries[0] == "first"
    assert sorted(entries[1:]) == [f"c{i}" for i in range(6)]
    # The remembered transcript is the newest one: the next append needs no retry.
    before = yielding.conflicts
    await log.append("s", OWNER, (("user", "last"),))
    assert yielding.conflicts == before
    assert texts(await log.entries("s", OWNER))[-1] == "last"


async def test_remembered_appends_keep_the_count_and_byte_bounds(store: MemoryStore) -> None:
    log = SessionLog(store.checkpoints, "primary")
    for i in range(MAX_SESSION_ENTRIES + 30):
        await log.append("s", OWNER, (("user", f"m{i}"),))
    entries = await log.entries("s", OWNER)
    assert len(entries) == MAX_SESSION_ENTRIES
    assert entries[-1].text == f"m{MAX_SESSION_ENTRIES + 29}"
    big = "x" * 30_000
    for _ in range(12):
        await log.append("b", OWNER, (("user", big),))
    row = await store.checkpoints.load_checkpoint(
        namespace=NS_SESSION, key="s1:primary:b", scope=OWNER
    )
    assert row is not None
    import json

    assert len(json.dumps(row.value)) <= MAX_SESSION_BYTES
    assert 2 <= len(row.value["entries"]) < 12


async def test_the_memory_is_bounded(store: MemoryStore) -> None:
    log = SessionLog(store.checkpoints, "primary")
    for i in range(MAX_CACHED_SESSIONS + 40):
        await log.append(f"s{i}", OWNER, (("user", "hi"),))
    assert len(log._cache) == MAX_CACHED_SESSIONS
    # The oldest were forgotten, not lost: an append to one reloads it.
    await log.append("s0", OWNER, (("assistant", "again"),))
    assert texts(await log.entries("s0", OWNER)) == ["hi", "again"]


async def test_the_memory_is_bounded_by_bytes(store: MemoryStore) -> None:
    log = SessionLog(store.checkpoints, "primary")
    big = "y" * 30_000
    for i in range(200):
        await log.append(f"b{i}", OWNER, (("user", big),))
    assert log._cached_bytes <= MAX_CACHED_BYTES
    assert log._cached_bytes == sum(t.weight for t in log._cache.values())
    assert 100 < len(log._cache) < 200


def test_an_entry_is_measured_as_its_escaped_ascii_json() -> None:
    """The byte bound counts each entry as ``json.dumps`` (escaped ASCII, spaced
    separators) would write it; the size is worked out from the compact encoding
    without encoding the entry again when that is ASCII."""
    texts_ = [
        "",
        "plain",
        'quote " and \\ slash',
        "tab\tnew\nline\x01",
        "é",
        "日本",
        "😀",
        "a" * 500,
    ]
    for text in texts_:
        transcript = _Transcript(0).extended(
            [SessionEntry("id-1", "user", text)], MAX_SESSION_ENTRIES, 1
        )
        (item,) = transcript.items
        assert transcript.sizes == (len(json.dumps(item)) + 1,), text
        assert transcript.encoded == (json.dumps(item, ensure_ascii=False, separators=(",", ":")),)
