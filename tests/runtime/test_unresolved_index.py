"""Unresolved work never becomes invisible (issue 10): listing reads the journal's open
categories (an index the store keeps with each record), so an ``executing`` record behind
thousands of newer settled operations is still listed, and paging walks every one."""

from __future__ import annotations

from pathlib import Path

import pytest

from prismd.journal import (
    NS_OPERATION,
    NS_REPLY,
    ChannelJournal,
    OperationRecord,
    ReplyRecord,
    Write,
)
from stores import OwnershipScope, Store, open_store
from tests.support.builders import identity
from tests.support.harness import Host, runtime

SCOPE = OwnershipScope("tenant-1", None, "user-1")


def op(i: int, state: str, *, at: int) -> OperationRecord:
    return OperationRecord(
        operation_id=f"op-{i:05d}",
        event_id=f"ev-{i}",
        kind="message",
        connection_id="tg-1",
        external_conversation_id="chat-1",
        external_actor_id="user-1",
        agent_alias="primary",
        state=state,
        created_at_ms=at,
        updated_at_ms=at,
        run_id="run" if state != "accepted" else None,
        reply_staged=state == "succeeded",
    )


def reply(i: int, state: str, *, at: int) -> ReplyRecord:
    return ReplyRecord(
        operation_id=f"op-{i:05d}",
        connection_id="tg-1",
        external_conversation_id="chat-1",
        kind="final",
        text="answer",
        state=state,
        created_at_ms=at,
        updated_at_ms=at,
    )


async def fill(store: Store, settled: int) -> None:
    await fill_scope(store, SCOPE, settled)


async def fill_scope(store: Store, scope: OwnershipScope, settled: int) -> None:
    """One ``executing`` record first, then ``settled`` newer ``succeeded`` ones, each with
    its delivered reply, written in batches of 500."""
    journal = ChannelJournal(store.checkpoints)
    await journal.commit([Write(NS_OPERATION, scope, op(0, "executing", at=1), 0)])
    writes: list[Write] = []
    for i in range(1, settled + 1):
        writes.append(Write(NS_OPERATION, scope, op(i, "succeeded", at=10 + i), 0))
        writes.append(Write(NS_REPLY, scope, reply(i, "delivered", at=10 + i), 0))
        if len(writes) >= 500:
            assert (await journal.commit(writes)).ok
            writes = []
    if writes:
        assert (await journal.commit(writes)).ok


@pytest.mark.parametrize("kind", ["memory", "sqlite"])
@pytest.mark.slow
async def test_an_old_executing_record_behind_5000_settled_ones_is_listed(
    tmp_path: Path, kind: str
) -> None:
    url = "memory://" if kind == "memory" else f"sqlite:///{tmp_path}/journal.sqlite"
    async with open_store(url) as store:
        await fill(store, 5_000)
        async with runtime(Host(), store) as rt:
            entries = await rt.list_unresolved(identity=identity(user=None))
            assert [(e.operation_id, e.state) for e in entries] == [("op-00000", "executing")]
            page = await rt.list_unresolved_page(identity=identity(user=None), limit=10_000)
            assert page.capped and page.limit == 100 and page.next_cursor is None
            assert len(page.entries) == 1


async def test_paging_walks_every_unresolved_record_once(tmp_path: Path) -> None:
    async with open_store(f"sqlite:///{tmp_path}/journal.sqlite") as store:
        journal = ChannelJournal(store.checkpoints)
        writes = [Write(NS_OPERATION, SCOPE, op(i, "accepted", at=100 + i), 0) for i in range(7)]
        # Settled operations whose reply is not: listed with the reply's state.
        writes += [
            Write(NS_OPERATION, SCOPE, op(i, "succeeded", at=200 + i), 0) for i in range(7, 12)
        ]
        writes += [
            Write(NS_REPLY, SCOPE, reply(i, "delivery_unknown", at=300 + i), 0)
            for i in range(7, 12)
        ]
        # Noise: settled and delivered, and another tenant's unresolved record.
        writes += [
            Write(NS_OPERATION, SCOPE, op(i, "succeeded", at=400 + i), 0) for i in range(12, 40)
        ]
        other = OwnershipScope("tenant-2", None, "user-1")
        writes.append(Write(NS_OPERATION, other, op(99, "executing", at=500), 0))
        assert (await journal.commit(writes)).ok
        async with runtime(Host(), store) as rt:
            seen: list[str] = []
            after = None
            pages = 0
            while True:
                page = await rt.list_unresolved_page(
                    identity=identity(user=None), limit=3, after=after
                )
                pages += 1
                assert len(page.entries) <= 3 and not page.capped
                seen += [e.operation_id for e in page.entries]
                after = page.next_cursor
                if after is None:
                    break
            assert sorted(seen) == [f"op-{i:05d}" for i in range(12)]
            assert len(seen) == len(set(seen)) and pages >= 4
            states = {
                e.operation_id: e.reply_state
                for e in await rt.list_unresolved(identity=identity(user=None), limit=100)
            }
            assert states["op-00008"] == "delivery_unknown" and states["op-00001"] is None
            # A cursor that was not issued by the listing is answered with nothing.
            bogus = await rt.list_unresolved_page(identity=identity(user=None), after="x")
            assert bogus.entries == () and bogus.next_cursor is None


async def test_a_record_leaves_the_index_when_it_is_settled(tmp_path: Path) -> None:
    async with open_store(f"sqlite:///{tmp_path}/journal.sqlite") as store:
        journal = ChannelJournal(store.checkpoints)
        await journal.commit([Write(NS_OPERATION, SCOPE, op(1, "executing", at=1), 0)])
        async with runtime(Host(), store) as rt:
            (entry,) = await rt.list_unresolved(identity=identity(user=None))
            result = await rt.reconcile(
                identity=identity(user=None),
                connection_id="tg-1",
                operation_id=entry.operation_id,
                expected_version=entry.version,
                acknowledge_duplicate_risk=True,
            )
            assert result.status == "resolved"
            assert await rt.list_unresolved(identity=identity(user=None)) == []
        page = await store.checkpoints.list_checkpoints(
            namespace=NS_OPERATION, category="channel-operation-open"
        )
        assert page.items == ()
