"""Conformance: list_checkpoints filters, order, limits, keyset paging; list_events."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import trio

from stores import (
    ANY_SCOPE,
    CheckpointConflictError,
    InvalidCheckpointError,
    JournalEvent,
    OwnershipScope,
    SaveCheckpoint,
    Store,
    _bases,
)
from stores.sqlite import open_sqlite_store

A = OwnershipScope("t1", "a1", "u1")
B = OwnershipScope("t1", "a1", "u2")
C = OwnershipScope("t1", "a2", "u1")
D = OwnershipScope("t2", "a1", "u1")


async def put(
    store: Store, ns: str, key: str, scope: OwnershipScope = A, version: int = 1, **kw: Any
) -> Any:
    return await store.checkpoints.save_checkpoint(
        namespace=ns, key=key, scope=scope, version=version, value={"k": key}, **kw
    )


def keys(page: Any) -> list[str]:
    return [r.key for r in page.items]


async def walk(store: Store, limit: int, **filters: Any) -> list[tuple[str, str]]:
    seen: list[tuple[str, str]] = []
    cursor = None
    while True:
        page = await store.checkpoints.list_checkpoints(cursor=cursor, limit=limit, **filters)
        seen += [(r.namespace, r.key) for r in page.items]
        if page.next_cursor is None:
            return seen
        assert len(page.items) == limit
        cursor = page.next_cursor


@pytest.mark.slow
async def test_order_is_newest_first_then_key(store: Store, autojump_clock: Any) -> None:
    await put(store, "n", "b")
    await put(store, "n", "a")
    await trio.sleep(1)
    await put(store, "n", "d")
    await put(store, "n", "c")
    await trio.sleep(1)
    await put(store, "n", "b", version=2)
    page = await store.checkpoints.list_checkpoints()
    assert keys(page) == ["b", "c", "d", "a"]
    assert page.next_cursor is None
    stamps = [r.updated_at_ms for r in page.items]
    assert stamps == sorted(stamps, reverse=True)


async def test_filters(store: Store) -> None:
    await put(store, "ns1", "o1:x", A, category="op")
    await put(store, "ns1", "o1:y", B, category="op")
    await put(store, "ns1", "r1:x", C, category="reply")
    await put(store, "ns2", "o1:z", D, category="op")
    await put(store, "ns2", "b1:w", A)
    lc = store.checkpoints.list_checkpoints
    assert sorted(keys(await lc(namespace="ns1"))) == ["o1:x", "o1:y", "r1:x"]
    assert sorted(keys(await lc(key_prefix="o1:"))) == ["o1:x", "o1:y", "o1:z"]
    assert sorted(keys(await lc(namespace="ns2", key_prefix="o1:"))) == ["o1:z"]
    assert keys(await lc(key_prefix="o1:x")) == ["o1:x"]
    assert keys(await lc(key_prefix="nothing")) == []
    assert sorted(keys(await lc(category="op"))) == ["o1:x", "o1:y", "o1:z"]
    assert sorted(keys(await lc(category=["op", "reply"]))) == ["o1:x", "o1:y", "o1:z", "r1:x"]
    assert sorted(keys(await lc(category=("reply",)))) == ["r1:x"]
    assert keys(await lc(category=[])) == []
    # Partial scope: every given field must match, omitted ones match anything.
    assert sorted(keys(await lc(scope=OwnershipScope("t1")))) == [
        "b1:w",
        "o1:x",
        "o1:y",
        "r1:x",
    ]
    assert sorted(keys(await lc(scope=OwnershipScope("t1", "a1")))) == ["b1:w", "o1:x", "o1:y"]
    assert sorted(keys(await lc(scope=OwnershipScope(user_id="u1")))) == [
        "b1:w",
        "o1:x",
        "o1:z",
        "r1:x",
    ]
    assert sorted(keys(await lc(scope=B))) == ["o1:y"]
    assert keys(await lc(scope=OwnershipScope("t3"))) == []
    assert len((await lc(scope=ANY_SCOPE)).items) == 5
    assert sorted(keys(await lc(namespace="ns1", category="op", scope=OwnershipScope("t1")))) == [
        "o1:x",
        "o1:y",
    ]


async def test_count_is_the_listing_counted_up_to_limit(store: Store) -> None:
    """``count_checkpoints`` counts what ``list_checkpoints`` walks with the same namespace,
    category and partial scope, up to ``limit`` (not clamped to a page: 501 of 501)."""
    await put(store, "ns1", "o1:x", A, category="op")
    await put(store, "ns1", "o1:y", B, category="op")
    await put(store, "ns1", "r1:x", C, category="reply")
    await put(store, "ns2", "o1:z", D, category="op")
    await put(store, "ns2", "b1:w", A)
    count = store.checkpoints.count_checkpoints
    for namespace, category, scope in [
        ("ns1", "op", ANY_SCOPE),
        ("ns1", "op", OwnershipScope("t1")),
        ("ns1", "op", OwnershipScope("t1", "a1")),
        ("ns1", "op", OwnershipScope(user_id="u1")),
        ("ns1", "op", B),
        ("ns1", "reply", ANY_SCOPE),
        ("ns2", "op", ANY_SCOPE),
        ("ns2", "op", OwnershipScope("t1")),
        ("ns1", "nothing", ANY_SCOPE),
        ("nothing", "op", ANY_SCOPE),
    ]:
        given: dict[str, Any] = {"namespace": namespace, "category": category, "scope": scope}
        listed = len(await walk(store, 500, **given))
        assert await count(limit=1000, **given) == listed, given
        assert await count(limit=1, **given) == min(listed, 1), given
    assert await count(namespace="ns1", category="op", scope=ANY_SCOPE, limit=1000) == 2
    saves = [
        SaveCheckpoint("many", f"k{i:04d}", A, 1, {"i": i}, category="open") for i in range(501)
    ]
    await store.checkpoints.write_checkpoints(saves)
    assert await count(namespace="many", category="open", scope=ANY_SCOPE, limit=10_000) == 501
    assert (
        await count(namespace="many", category="open", scope=OwnershipScope("t1"), limit=501) == 501
    )
    assert await count(namespace="many", category="open", scope=A, limit=500) == 500


async def test_count_bad_input(store: Store) -> None:
    async def count(**given: Any) -> int:
        args: dict[str, Any] = {"namespace": "n", "category": "c", "scope": ANY_SCOPE, "limit": 1}
        return await store.checkpoints.count_checkpoints(**(args | given))

    assert await count() == 0
    bad_input: list[dict[str, Any]] = [
        {"limit": 0},
        {"limit": -1},
        {"limit": 1.5},
        {"limit": "3"},
        {"limit": None},
        {"limit": True},
        {"namespace": None},
        {"namespace": 3},
        {"category": None},
        {"category": ["c"]},
        {"category": 1},
        {"scope": "t1"},
    ]
    for bad in bad_input:
        with pytest.raises(InvalidCheckpointError):
            await count(**bad)


async def test_key_prefix_is_literal(store: Store) -> None:
    await put(store, "n", "a%b")
    await put(store, "n", "axb")
    await put(store, "n", "a_c")
    await put(store, "n", "a*c")
    lc = store.checkpoints.list_checkpoints
    assert keys(await lc(key_prefix="a%")) == ["a%b"]
    assert keys(await lc(key_prefix="a_")) == ["a_c"]
    assert keys(await lc(key_prefix="a*")) == ["a*c"]


async def test_key_prefix_at_the_edges_of_its_range(store: Store) -> None:
    # A prefix listing narrows by the range [prefix, prefix with its last code point + 1)
    # before the exact test; the keys here sit on and just past both ends of those ranges.
    for key in [
        "ab",
        "ab\x01",
        "abz",
        "ac",
        "a\U0010ffff",
        "a\U0010ffffx",
        "b",
        "\ud7ff!",
        "\ue000",
        "é",
        "éa",
        "ê",
        "\U0010ffff",
        "\U0010ffff\U0010ffff",
    ]:
        await put(store, "n", key)
    lc = store.checkpoints.list_checkpoints

    async def prefixed(prefix: str) -> list[str]:
        return sorted(keys(await lc(key_prefix=prefix)))

    assert await prefixed("ab") == ["ab", "ab\x01", "abz"]
    assert await prefixed("a\U0010ffff") == ["a\U0010ffff", "a\U0010ffffx"]
    assert await prefixed("a") == ["ab", "ab\x01", "abz", "ac", "a\U0010ffff", "a\U0010ffffx"]
    assert await prefixed("\ud7ff") == ["\ud7ff!"]
    assert await prefixed("é") == ["é", "éa"]
    assert await prefixed("\U0010ffff") == ["\U0010ffff", "\U0010ffff\U0010ffff"]
    assert await prefixed("\U0010ffff\U0010ffff") == ["\U0010ffff\U0010ffff"]


async def test_sqlite_prefix_listing_reads_a_range_of_the_primary_key(tmp_path: Path) -> None:
    # The plan, not a time: a prefix listing finds its keys through the primary key's range
    # (namespace = ? AND key > ? AND key < ?), not by reading every key of the namespace.
    store = await open_sqlite_store(f"sqlite:///{tmp_path}/plan.sqlite")
    try:
        for route in range(20):
            await put(store, "bindings", f"route:{route}:binding", category="binding")
        statements: list[tuple[str, Any]] = []

        def trace(_cursor: Any, sql: str, bindings: Any) -> bool:
            statements.append((sql, bindings))
            return True

        # Either reader may run it (see _Database.run).
        readers = (store._db.loop_reader, store._db.reader)
        for reader in readers:
            reader.exec_trace = trace
        page = await store.checkpoints.list_checkpoints(
            namespace="bindings", key_prefix="route:7:", category=["binding", "other"]
        )
        for reader in readers:
            reader.exec_trace = None
        assert keys(page) == ["route:7:binding"]
        ((sql, bindings),) = statements
        plan = " | ".join(
            row[3] for row in store._db.reader.execute("EXPLAIN QUERY PLAN " + sql, bindings)
        )
        assert "namespace=? AND key>? AND key<?" in plan, plan
    finally:
        await store.aclose()


@pytest.mark.parametrize(
    ("prefix", "bounds"),
    [
        ("ab", ("ab", "ac")),
        ("a\U0010ffff", ("a\U0010ffff", "b")),
        ("\ud7ff", ("\ud7ff", "\ue000")),
        ("\U0010ffff\U0010ffff", ("\U0010ffff\U0010ffff", None)),
    ],
)
def test_prefix_bounds(prefix: str, bounds: tuple[str, str | None]) -> None:
    assert _bases.prefix_bounds(prefix) == bounds


async def test_limit_is_clamped(store: Store) -> None:
    for i in range(501):
        await put(store, "n", f"k{i:04d}")
    lc = store.checkpoints.list_checkpoints
    assert len((await lc()).items) == 100  # default
    for low in (0, -5):
        page = await lc(limit=low)
        assert len(page.items) == 1 and page.next_cursor is not None
    page = await lc(limit=10_000)
    assert len(page.items) == 500 and page.next_cursor is not None
    rest = await lc(limit=10_000, cursor=page.next_cursor)
    assert len(rest.items) == 1 and rest.next_cursor is None
    with pytest.raises(InvalidCheckpointError):
        await lc(limit=1.5)  # type: ignore[arg-type]


@pytest.mark.slow
async def test_paging_walks_every_row_once(store: Store, autojump_clock: Any) -> None:
    expected = []
    for i in range(23):
        # Several rows share a millisecond, so the key tie-break is exercised too.
        if i % 4 == 0:
            await trio.sleep(0.001)
        ns = "n1" if i % 2 else "n2"
        key = f"k{i % 7}"  # the same key in two namespaces
        if (ns, key) in expected:
            key += f"-{i}"
        await put(store, ns, key)
        expected.append((ns, key))
    full = await store.checkpoints.list_checkpoints(limit=500)
    assert [(r.namespace, r.key) for r in full.items] == await walk(store, 1)
    for limit in (1, 2, 5, 22, 23, 24):
        seen = await walk(store, limit)
        assert sorted(seen) == sorted(expected)
        assert seen == [(r.namespace, r.key) for r in full.items]


@pytest.mark.slow
async def test_paging_under_concurrent_writes(store: Store, autojump_clock: Any) -> None:
    """No row twice, and every row that stayed unchanged for the whole walk is seen."""
    rng = random.Random(7)
    versions: dict[str, int] = {}
    for i in range(60):
        if i % 5 == 0:
            await trio.sleep(0.001)
        await put(store, "n", f"k{i:03d}")
        versions[f"k{i:03d}"] = 1
    touched: set[str] = set()
    seen: list[str] = []
    cursor = None
    new = 0
    while True:
        page = await store.checkpoints.list_checkpoints(namespace="n", cursor=cursor, limit=7)
        seen += keys(page)
        # Between pages: rewrite some rows (seen and unseen), delete some, add new ones.
        await trio.sleep(0.001)
        for key in rng.sample(sorted(versions), 3):
            versions[key] += 1
            await put(store, "n", key, version=versions[key])
            touched.add(key)
        victim = rng.choice(sorted(versions))
        assert await store.checkpoints.delete_checkpoint(namespace="n", key=victim, scope=A)
        del versions[victim]
        touched.add(victim)
        await put(store, "n", f"new{new}")
        versions[f"new{new}"] = 1
        touched.add(f"new{new}")
        new += 1
        if page.next_cursor is None:
            break
        cursor = page.next_cursor
    assert len(seen) == len(set(seen)), "a row was returned twice"
    untouched = {f"k{i:03d}" for i in range(60)} - touched
    assert untouched, "the walk should leave some rows alone"
    assert untouched <= set(seen)


async def test_bad_cursor_and_filters(store: Store) -> None:
    lc = store.checkpoints.list_checkpoints
    for cursor in ("", "not a cursor!", "W10", "eyJhIjoxfQ"):
        with pytest.raises(InvalidCheckpointError):
            await lc(cursor=cursor)
    with pytest.raises(InvalidCheckpointError):
        await lc(category=[1])  # type: ignore[list-item]
    with pytest.raises(InvalidCheckpointError):
        await lc(scope=None)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- events


@pytest.mark.slow
async def test_events_follow_commit_order(store: Store, autojump_clock: Any) -> None:
    cp = store.checkpoints
    await put(store, "n", "a", A, category="op", metadata={"state": "accepted"})
    await trio.sleep(1)
    await put(store, "n", "a", A, version=2, expected_version=1, metadata={"state": "executing"})
    with pytest.raises(CheckpointConflictError):
        await put(store, "n", "a", A, version=2, expected_version=1)
    await put(store, "n", "b", B, category="reply")
    assert await cp.delete_checkpoint(namespace="n", key="a", scope=A)
    assert not await cp.delete_checkpoint(namespace="n", key="a", scope=A)
    page = await cp.list_events()
    assert [(e.action, e.key, e.version) for e in page.items] == [
        ("save", "a", 1),
        ("save", "a", 2),
        ("save", "b", 1),
        ("delete", "a", 2),
    ]
    seqs = [e.seq for e in page.items]
    assert seqs == sorted(seqs) and len(set(seqs)) == 4
    assert page.last_seq == seqs[-1]
    first, second, third, deleted = page.items
    assert isinstance(first, JournalEvent)
    assert first.metadata == {"state": "accepted"} and first.category == "op"
    assert second.metadata == {"state": "executing"} and second.category is None
    assert second.at_ms - first.at_ms == 1000
    assert third.scope == B and third.category == "reply"
    assert deleted.scope == A
    # Paging by `after`.
    tail = await cp.list_events(after=seqs[1])
    assert [e.seq for e in tail.items] == seqs[2:]
    one = await cp.list_events(after=seqs[0], limit=1)
    assert [e.seq for e in one.items] == [seqs[1]] and one.last_seq == seqs[1]
    empty = await cp.list_events(after=seqs[-1])
    assert empty.items == () and empty.last_seq == seqs[-1]


async def test_events_scope_filter(store: Store) -> None:
    await put(store, "n", "a", A)
    await put(store, "n", "b", B)
    await put(store, "n", "c", C)
    await put(store, "n", "d", D)
    ev = store.checkpoints.list_events
    assert [e.key for e in (await ev(scope=OwnershipScope("t1"))).items] == ["a", "b", "c"]
    assert [e.key for e in (await ev(scope=OwnershipScope("t1", "a1"))).items] == ["a", "b"]
    assert [e.key for e in (await ev(scope=OwnershipScope(user_id="u1"))).items] == [
        "a",
        "c",
        "d",
    ]
    assert [e.key for e in (await ev(scope=D)).items] == ["d"]
    assert (await ev(scope=OwnershipScope("zz"))).items == ()


async def test_events_bad_input(store: Store) -> None:
    with pytest.raises(InvalidCheckpointError):
        await store.checkpoints.list_events(after=-1)
    with pytest.raises(InvalidCheckpointError):
        await store.checkpoints.list_events(limit="3")  # type: ignore[arg-type]
