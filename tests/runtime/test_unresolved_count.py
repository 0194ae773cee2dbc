"""``count_unresolved`` (the daemon's ``STATUS=`` every 10 s) is the length of the listing
``prismctl list-unresolved`` walks, and what it costs does not follow the replies waiting to
be sent: a reply's operation is not loaded again at every count."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import pytest
import trio

from prismd.grants import AgentIdentity
from prismd.journal import (
    NS_OPERATION,
    NS_REPLY,
    ChannelJournal,
    OperationRecord,
    ReplyRecord,
    Write,
)
from prismd.limits import Limits
from prismd.runtime import Runtime
from stores import ANY_SCOPE, CheckpointPage, CheckpointStore, OwnershipScope, Store
from tests.support.builders import identity
from tests.support.harness import Host, runtime, store_factory

A = OwnershipScope("tenant-1", None, "user-1")
B = OwnershipScope("tenant-2", None, "user-2")
ELSEWHERE = OwnershipScope("tenant-3", None, "user-3")
TENANTS = [identity(user=None), identity(user=None, tenant="tenant-2")]


def op(name: str, state: str, *, at: int = 1, answered: bool = True) -> OperationRecord:
    return OperationRecord(
        operation_id=name,
        event_id=f"ev-{name}",
        kind="message",
        connection_id="tg-1",
        external_conversation_id="chat-1",
        external_actor_id="user-1",
        agent_alias="primary",
        state=state,
        created_at_ms=at,
        updated_at_ms=at,
        run_id=None if state == "accepted" else "run",
        reply_staged=answered and state in ("succeeded", "failed"),
    )


def reply(name: str, state: str, *, at: int = 2) -> ReplyRecord:
    return ReplyRecord(
        operation_id=name,
        connection_id="tg-1",
        external_conversation_id="chat-1",
        kind="final",
        text="answer",
        state=state,
        created_at_ms=at,
        updated_at_ms=at,
    )


async def listed(rt: Runtime, identities: Sequence[AgentIdentity]) -> list[str]:
    """Every entry ``list-unresolved`` shows for each identity (every page)."""
    ids: list[str] = []
    for who in identities:
        after = None
        while True:
            page = await rt.list_unresolved_page(identity=who, limit=3, after=after)
            ids += [e.operation_id for e in page.entries]
            after = page.next_cursor
            if after is None:
                break
    return ids


async def counted(rt: Runtime, identities: Sequence[AgentIdentity] = TENANTS) -> int:
    total, capped = await rt.count_unresolved(identities=identities, limit=100_000)
    assert not capped
    return total


async def same(rt: Runtime, expected: set[str]) -> None:
    ids = await listed(rt, TENANTS)
    assert sorted(ids) == sorted(expected)  # each once
    assert await counted(rt) == len(ids)


@pytest.mark.parametrize(
    "kind", ["memory", "sqlite", pytest.param("postgres", marks=pytest.mark.slow)]
)
async def test_the_count_is_the_listing_in_mixed_cases(tmp_path: Path, kind: str) -> None:
    async with store_factory(kind, tmp_path) as stores:
        store = await stores()
        journal = ChannelJournal(store.checkpoints)
        writes = [
            Write(NS_OPERATION, A, op("executing", "executing"), 0),
            Write(NS_OPERATION, A, op("accepted", "accepted"), 0),
            # Settled, its reply not: listed by the reply.
            Write(NS_OPERATION, A, op("sent", "succeeded"), 0),
            Write(NS_REPLY, A, reply("sent", "pending"), 0),
            Write(NS_OPERATION, A, op("refused", "failed"), 0),
            Write(NS_REPLY, A, reply("refused", "delivery_failed"), 0),
            # Unresolved with an unsettled reply: listed once, as the operation.
            Write(NS_OPERATION, A, op("both", "executing"), 0),
            Write(NS_REPLY, A, reply("both", "pending"), 0),
            # Followed (open, not unresolved): its reply is listed.
            Write(NS_OPERATION, A, op("followed", "following"), 0),
            Write(NS_REPLY, A, reply("followed", "delivery_unknown"), 0),
            # Waiting for a decision, its approval notice unsent: listed by the notice.
            Write(NS_OPERATION, A, op("suspended", "suspended"), 0),
            Write(NS_REPLY, A, reply("suspended", "pending"), 0),
            # An answer without its reply (killed between two writes): listed.
            Write(NS_OPERATION, A, op("answerless", "succeeded", answered=False), 0),
            # The same with a delivered reply, and a settled pair: not listed.
            Write(NS_OPERATION, A, op("delivered-late", "succeeded", answered=False), 0),
            Write(NS_REPLY, A, reply("delivered-late", "delivered"), 0),
            Write(NS_OPERATION, A, op("done", "succeeded"), 0),
            Write(NS_REPLY, A, reply("done", "delivered"), 0),
            # A notice whose operation is gone (a refused command): nothing to reconcile.
            Write(NS_REPLY, A, reply("orphan", "pending"), 0),
            # A relay (no operation of its own): listed by its own id.
            Write(NS_REPLY, A, reply("sent~relay-1", "pending"), 0),
            # The second tenant: an unresolved operation and a pending reply.
            Write(NS_OPERATION, B, op("b-executing", "executing"), 0),
            Write(NS_OPERATION, B, op("b-sent", "succeeded"), 0),
            Write(NS_REPLY, B, reply("b-sent", "pending"), 0),
            # A tenant not asked about.
            Write(NS_OPERATION, ELSEWHERE, op("elsewhere", "executing"), 0),
            Write(NS_REPLY, ELSEWHERE, reply("elsewhere", "pending"), 0),
        ]
        assert (await journal.commit(writes)).ok
        expected = {
            "executing",
            "accepted",
            "sent",
            "refused",
            "both",
            "followed",
            "suspended",
            "answerless",
            "sent~relay-1",
            "b-executing",
            "b-sent",
        }
        async with runtime(Host(), store, resume_accepted=False) as rt:
            await same(rt, expected)
            # Changes between counts, each moving a reply's verdict without touching it:
            # a settled operation pruned (its reply is orphaned), an orphan's operation
            # admitted again and settled, an operation settled by an operator, a decision
            # resumed (its notice is now listed with it), a reply delivered.
            await journal.remove_operation(A, "tg-1", "sent")
            assert (await journal.commit([Write(NS_OPERATION, A, op("orphan", "accepted"), 0)])).ok
            loaded = await journal.load_operation(A, "tg-1", "orphan")
            assert loaded is not None
            assert (
                await journal.commit(
                    [Write(NS_OPERATION, A, op("orphan", "succeeded"), loaded.version)]
                )
            ).ok
            for name, state in (("both", "execution_unknown"), ("suspended", "executing")):
                loaded = await journal.load_operation(A, "tg-1", name)
                assert loaded is not None
                assert (
                    await journal.commit([Write(NS_OPERATION, A, op(name, state), loaded.version)])
                ).ok
            refused = await journal.load_reply(A, "tg-1", "refused")
            assert refused is not None
            assert (
                await journal.commit(
                    [Write(NS_REPLY, A, reply("refused", "delivered"), refused.version)]
                )
            ).ok
            # A delivered reply sent again (an operator's resend reopens it): its
            # operation, untouched since the first count, is looked up.
            done = await journal.load_reply(A, "tg-1", "done")
            assert done is not None
            assert (
                await journal.commit([Write(NS_REPLY, A, reply("done", "pending"), done.version)])
            ).ok
            expected -= {"sent", "refused"}
            expected |= {"orphan", "done"}
            await same(rt, expected)
            # The relay's base operation is gone: still listed; the orphan's operation
            # pruned again: not.
            await journal.remove_operation(A, "tg-1", "orphan")
            await same(rt, expected - {"orphan"})
            # Counted per identity asked about; a narrower one sees its own.
            assert await counted(rt, [TENANTS[1]]) == 2


class CountingCheckpoints:
    """A checkpoint store that counts the reads the test's own task makes, by method."""

    READS = (
        "load_checkpoint",
        "list_checkpoints",
        "count_checkpoints",
        "list_events",
        "last_event_seq",
    )

    def __init__(self, inner: CheckpointStore) -> None:
        self.inner = inner
        self.reads: Counter[str] = Counter()
        self.task: object = None
        self.hide_newest_replies = False
        """The newest open replies of every scope are not found (as if out of order)."""

    def __getattr__(self, name: str) -> Any:
        method = getattr(self.inner, name)
        if name not in self.READS:
            return method

        async def counted(*args: Any, **kwargs: Any) -> Any:
            if trio.lowlevel.current_task() is self.task:
                self.reads[name] += 1
            if (
                self.hide_newest_replies
                and kwargs.get("namespace") == NS_REPLY
                and kwargs.get("scope") == ANY_SCOPE
            ):
                return CheckpointPage(items=())
            return await method(*args, **kwargs)

        return counted


class CountingStore:
    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.checkpoints = CountingCheckpoints(inner.checkpoints)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@asynccontextmanager
async def backlog(kind: str, tmp_path: Path, pending: int) -> AsyncIterator[Any]:
    """A runtime over ``pending`` settled operations whose replies wait to be sent, and
    one unresolved operation; yields ``(runtime, store, journal)``."""
    (tmp_path / f"{pending}").mkdir()
    async with store_factory(kind, tmp_path / f"{pending}") as stores:
        store = CountingStore(await stores())
        journal = ChannelJournal(store.inner.checkpoints)
        writes = [Write(NS_OPERATION, A, op("executing", "executing"), 0)]
        for i in range(pending):
            writes.append(Write(NS_OPERATION, A, op(f"op-{i}", "succeeded", at=10 + i), 0))
            writes.append(Write(NS_REPLY, A, reply(f"op-{i}", "pending", at=10 + i), 0))
            if len(writes) >= 500:
                assert (await journal.commit(writes)).ok
                writes = []
        assert (await journal.commit(writes)).ok
        limits = Limits(max_journal_page=500)
        async with runtime(Host(), cast(Store, store), limits=limits) as rt:
            store.checkpoints.task = trio.lowlevel.current_task()
            yield rt, store, journal


async def refresh_reads(rt: Runtime, store: CountingStore, expected: int) -> Counter[str]:
    store.checkpoints.reads.clear()
    assert await counted(rt, TENANTS[:1]) == expected
    return Counter(store.checkpoints.reads)


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
async def test_a_refresh_costs_no_read_per_pending_reply(tmp_path: Path, kind: str) -> None:
    reads: dict[int, Counter[str]] = {}
    for pending in (10, 1_000):
        async with backlog(kind, tmp_path, pending) as (rt, store, journal):
            first = await refresh_reads(rt, store, pending + 1)
            # The first count reads what the listing reads: every open reply, and each
            # one's operation.
            assert first["load_checkpoint"] == pending
            assert first["list_checkpoints"] == 1 + -(-pending // 500)
            reads[pending] = await refresh_reads(rt, store, pending + 1)
            # A backlog in motion: answers staged (operation and reply in one write, as a
            # turn ends) and replies sent between two counts cost no load either.
            for i in range(pending, pending + 50):
                settle = [
                    Write(NS_OPERATION, A, op(f"op-{i}", "succeeded", at=10 + i), 0),
                    Write(NS_REPLY, A, reply(f"op-{i}", "pending", at=10 + i), 0),
                ]
                assert (await journal.commit(settle, atomic=True)).ok
            for i in range(20):
                sent = await journal.load_reply(A, "tg-1", f"op-{i}")
                assert sent is not None
                delivered = reply(f"op-{i}", "delivered")
                assert (await journal.commit([Write(NS_REPLY, A, delivered, sent.version)])).ok
            moving = await refresh_reads(rt, store, pending + 1 + 50 - 20)
            if pending > 500:
                # The events (one page), the open operations, the new replies (a page).
                assert moving == {"last_event_seq": 1, "list_events": 1, "list_checkpoints": 2}
            else:
                # More events than 4 a reply: read again (2 pages), each operation loaded.
                assert moving == {
                    "last_event_seq": 1,
                    "list_checkpoints": 2,
                    "load_checkpoint": pending + 50 - 20,
                }, moving
            # What the listing reads for the same answer: a load per pending reply.
            store.checkpoints.reads.clear()
            assert len(await listed(rt, TENANTS[:1])) == pending + 1 + 50 - 20
            assert store.checkpoints.reads["load_checkpoint"] >= pending
            if pending > 500:
                # Counting stops at the limit, a page at a time: "at least" what it read.
                limit = 300
                assert await rt.count_unresolved(identities=TENANTS, limit=limit) == (500, True)
                # What was not read is read by the next count.
                assert await counted(rt) == pending + 1 + 50 - 20
    # 100 times the replies waiting, the same two reads: the open operations (a page)
    # and the last event's number (none since the last count).
    assert reads[10] == reads[1_000] == {"list_checkpoints": 1, "last_event_seq": 1}, reads


async def test_a_new_reply_not_among_the_newest_open_rows_is_loaded(tmp_path: Path) -> None:
    async with backlog("sqlite", tmp_path, 10) as (rt, store, journal):
        await refresh_reads(rt, store, 11)
        store.checkpoints.hide_newest_replies = True
        staged = [
            Write(NS_OPERATION, A, op("late", "succeeded", at=5), 0),
            Write(NS_REPLY, A, reply("late", "pending", at=5), 0),
        ]
        assert (await journal.commit(staged, atomic=True)).ok
        reads = await refresh_reads(rt, store, 12)
        # Looked for among the newest open rows, then loaded; its operation is known
        # from the events.
        assert reads["load_checkpoint"] == 1, reads
        store.checkpoints.hide_newest_replies = False
        assert len(await listed(rt, TENANTS[:1])) == 12
