"""The transcript log's memory of what it last wrote: appends without a load, and the
compare-and-swap that keeps that safe when anything else wrote the transcript."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import attrs
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from prismd.agents._session import (
    MAX_CACHED_BYTES,
    MAX_CACHED_SESSIONS,
    MAX_SESSION_BYTES,
    MAX_SESSION_ENTRIES,
    NS_SESSION,
    SessionEntry,
    SessionLog,
    _Transcript,
    legacy_session_key,
    session_key,
)
from stores import OwnershipScope, compact_json, open_store
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
    # The first append of this process, to learn the version: the owner's key, then the
    # legacy one (both missing for a new session); none after that.
    assert counting.loads == 2
    assert counting.saves == 5 and counting.conflicts == 0
    entries = await SessionLog(store.checkpoints, "primary").entries("s", OWNER)
    assert texts(entries) == [t for i in range(5) for t in (f"q{i}", f"a{i}")]


async def test_hundreds_of_conversations_in_turn_are_appended_without_a_load(
    store: MemoryStore,
) -> None:
    """The memory holds as many conversations as a busy process has going at once,
    answered in turn (each after all the others: the worst order for a least-recently-used
    memory): 900 short ones, and 300 at their full 200 entries (about 90 KB each of short
    messages, under the byte bound together), load nothing after their first append."""
    for sessions, first_entries in ((900, 2), (300, MAX_SESSION_ENTRIES - 2)):
        assert sessions <= MAX_CACHED_SESSIONS
        counting = CountingLoads(store.checkpoints)
        log = SessionLog(counting, f"agent-{sessions}")
        for i in range(sessions):
            await log.append(
                f"s{i}", OWNER, (("user", "q"), ("assistant", "a")) * (first_entries // 2)
            )
        # The owner's key and the legacy one, each missing.
        assert counting.loads == 2 * sessions
        for turn in range(2):
            for i in range(sessions):
                await log.append(f"s{i}", OWNER, (("user", f"q{turn}"), ("assistant", "a")))
        assert counting.loads == 2 * sessions, sessions
        assert len(log._cache) == sessions and log._cached_bytes <= MAX_CACHED_BYTES
        assert all(
            len(t.items) == min(first_entries + 4, MAX_SESSION_ENTRIES) for t in log._cache.values()
        )


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
    # Two loads for the new session (the owner's key, the legacy one), one after the
    # conflict.
    assert counting.conflicts == 1 and counting.loads == 3
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
        namespace=NS_SESSION, key=session_key("primary", "s", OWNER), scope=OWNER
    )
    assert deleted
    await log.append("s", OWNER, (("user", "new"),))
    row = await store.checkpoints.load_checkpoint(
        namespace=NS_SESSION, key=session_key("primary", "s", OWNER), scope=OWNER
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
        namespace=NS_SESSION, key=session_key("primary", "b", OWNER), scope=OWNER
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
    sessions, entries = 100, 8  # 240 KB transcripts, within MAX_SESSION_BYTES
    assert entries * len(big) < MAX_SESSION_BYTES and sessions < MAX_CACHED_SESSIONS
    # Together they weigh more than the byte bound, long before the count bound.
    assert sessions * entries * 2 * len(big) > 1.2 * MAX_CACHED_BYTES
    for i in range(sessions):
        await log.append(f"b{i}", OWNER, (("user", big),) * entries)
    assert log._cached_bytes <= MAX_CACHED_BYTES
    assert log._cached_bytes == sum(t.weight for t in log._cache.values())
    assert sessions // 4 < len(log._cache) < sessions


def test_an_entry_is_measured_as_its_escaped_ascii_json() -> None:
    """The byte bound counts each entry as ``json.dumps`` (escaped ASCII, spaced
    separators) would write it; the size is worked out from the compact encoding
    without encoding the entry again when that is ASCII."""
    texts_ = [
        "",
        "plain",
        'quote " and \\ slash',
        "tab\tnew\nline\x01",
        "del \x7f\x7f",  # ASCII, but escaped as \u007f by json.dumps only
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


@settings(max_examples=400, deadline=None, database=None)
@given(
    entries=st.lists(
        st.tuples(
            st.text(min_size=1, max_size=40),
            st.sampled_from(["user", "assistant"]),
            st.text(max_size=300),
        ),
        max_size=12,
    )
)
def test_a_reloaded_transcript_is_the_one_that_was_kept(
    entries: list[tuple[str, Literal["user", "assistant"], str]],
) -> None:
    """What an append keeps of each entry (its dict, compact JSON and measured size) is
    what ``compact_json``/``json.dumps`` make of it, for any text; and a transcript read
    back from its stored JSON (the path of an append whose memory was forgotten) is the
    same, entry for entry."""
    kept = _Transcript(0).extended(
        [SessionEntry(*entry) for entry in entries], MAX_SESSION_ENTRIES, 3
    )
    for item, encoded, size in zip(kept.items, kept.encoded, kept.sizes, strict=True):
        assert encoded == compact_json(item)
        assert size == len(json.dumps(item)) + 1
    stored = json.loads(kept.value_json())
    assert stored == {"entries": list(kept.items)}
    assert _Transcript.stored(3, stored) == kept


def test_a_stored_transcript_skips_what_is_not_an_entry() -> None:
    """Read back, a damaged transcript keeps its well-formed entries only (as ``entries``
    shows them), and appends go on from those."""
    value = {
        "entries": [
            {"id": "a", "role": "user", "text": "kept"},
            {"id": "b", "role": "system", "text": "unknown role"},
            {"id": 3, "role": "user", "text": "id not a string"},
            "not an object",
            {"id": "c", "role": "assistant"},
            {"id": "d", "role": "assistant", "text": "kept too", "extra": 1},
        ]
    }
    transcript = _Transcript.stored(5, value)
    assert transcript.version == 5
    assert transcript.items == (
        {"id": "a", "role": "user", "text": "kept"},
        {"id": "d", "role": "assistant", "text": "kept too"},
    )
    assert _Transcript.stored(1, {"entries": "no list"}) == _Transcript(1)
    assert _Transcript.stored(1, ["no", "object"]) == _Transcript(1)


async def test_two_owners_with_one_session_id_keep_a_transcript_each(
    store: MemoryStore, tmp_path: Path
) -> None:
    """A host's ``resolve_binding`` may give two owners the same session id: each gets its
    own transcript (the owner is part of the row key), on every store."""
    other = OwnershipScope("tenant-b", None, "user-1")
    async with open_store(f"sqlite:///{tmp_path / 's.sqlite'}") as sqlite:
        for checkpoints in (store.checkpoints, sqlite.checkpoints):
            log = SessionLog(checkpoints, "primary")
            await log.append("main", OWNER, (("user", "from a"),))
            await log.append("main", other, (("user", "from b"),))
            await log.append("main", OWNER, (("assistant", "to a"),))
            fresh = SessionLog(checkpoints, "primary")
            assert texts(await fresh.entries("main", OWNER)) == ["from a", "to a"]
            assert texts(await fresh.entries("main", other)) == ["from b"]


async def test_a_legacy_transcript_is_read_and_moved_by_the_next_append(
    store: MemoryStore,
) -> None:
    """A transcript stored under the key without the owner (``s1:``, before it was part of
    the key) is read where the owner's row is missing, and the next append moves it:
    created under the owner's key and the legacy row deleted, together."""
    legacy = legacy_session_key("primary", "s")
    old = [{"id": "e1", "role": "user", "text": "before"}]
    await store.checkpoints.save_checkpoint(
        namespace=NS_SESSION,
        key=legacy,
        scope=OWNER,
        version=7,
        value={"entries": old},
        expected_version=None,
    )
    log = SessionLog(store.checkpoints, "primary")
    assert texts(await log.entries("s", OWNER)) == ["before"]
    # Another owner does not see it: the legacy row is scoped as it always was.
    assert await log.entries("s", OwnershipScope("tenant-b", None, "user-1")) == ()
    await log.append("s", OWNER, (("user", "after"),))
    moved = await store.checkpoints.load_checkpoint(
        namespace=NS_SESSION, key=session_key("primary", "s", OWNER), scope=OWNER
    )
    assert moved is not None and moved.version == 1
    assert [e["text"] for e in moved.value["entries"]] == ["before", "after"]
    gone = await store.checkpoints.load_checkpoint(namespace=NS_SESSION, key=legacy, scope=OWNER)
    assert gone is None
    assert texts(await SessionLog(store.checkpoints, "primary").entries("s", OWNER)) == [
        "before",
        "after",
    ]


async def test_a_legacy_transcript_moved_meanwhile_loses_nothing(store: MemoryStore) -> None:
    """Two logs (two processes) both read the legacy row; one moves it first. The other's
    move (create under the owner's key, delete the legacy row) then applies not at all, and
    its append lands on the moved transcript."""
    await store.checkpoints.save_checkpoint(
        namespace=NS_SESSION,
        key=legacy_session_key("primary", "s"),
        scope=OWNER,
        version=3,
        value={"entries": [{"id": "e1", "role": "user", "text": "before"}]},
        expected_version=None,
    )
    theirs = SessionLog(store.checkpoints, "primary")
    racing = _FirstWriteWaits(store.checkpoints)
    mine = SessionLog(racing, "primary")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(mine.append, "s", OWNER, (("user", "mine"),))
        await racing.loaded.wait()  # mine read the legacy row and is about to move it
        await theirs.append("s", OWNER, (("user", "theirs"),))
        racing.go.set()
    # The move lost: the owner's row existed, the legacy one was gone. The retry appended.
    assert racing.outcomes == [["conflict", "missing"], ["ok"]]
    entries = texts(await SessionLog(store.checkpoints, "primary").entries("s", OWNER))
    assert entries == ["before", "theirs", "mine"]


@attrs.define
class _FirstWriteWaits(YieldingCheckpoints):
    """Holds the first write until ``go``; ``loaded`` once it is about to be made."""

    loaded: trio.Event = attrs.Factory(trio.Event)
    go: trio.Event = attrs.Factory(trio.Event)
    outcomes: list[list[str]] = attrs.Factory(list)

    async def _first_waits(self) -> None:
        if not self.outcomes and not self.loaded.is_set():
            self.loaded.set()
            await self.go.wait()

    async def write_checkpoints(self, writes: Any, **kw: Any) -> Any:
        await self._first_waits()
        results = await super().write_checkpoints(writes, **kw)
        self.outcomes.append([r.status for r in results])
        return results
