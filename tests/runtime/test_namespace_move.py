"""The journal's format 3: prismd's own namespaces take one scheme (``prismd.v1.<name>``),
and a journal written before keeps its agents' transcripts and suspended runs.

"Before" is today's agents writing through a store that files their records where they
were kept until now (``prismd.agents.v1.session`` / ``.run``, :data:`MOVED_NAMESPACES`),
into a real SQLite file whose identity record says format 2. Opening it as the daemon
does (:func:`ensure_format`) moves every record, key, scope, version and all; a new agent
then finds the transcript and resumes the suspended run, once, at the version it had."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from prismd.agents import (
    MOVED_NAMESPACES,
    NS_RUN,
    NS_SESSION,
    AgentContext,
    Decision,
    MockAgent,
    RunRequest,
    build_agent,
)
from prismd.grants import AgentIdentity, Principal, ownership_from_identity
from prismd.journal import FORMAT, ChannelJournal, ensure_format
from stores import CheckpointStore, OwnershipScope, open_store
from tests.support.clocks import ManualClock

IDENTITY = AgentIdentity(
    tenant_id="tenant-1", principal=Principal("user", "user-1"), scopes=("chat",),
    issued_at_ms=0, user_id="user-1",
)  # fmt: skip
OWNER = ownership_from_identity(IDENTITY)
OLD = {new: old for old, new in MOVED_NAMESPACES.items()}
JOURNAL_ID = "0123456789abcdef0123456789abcdef"


@attrs.define
class BeforeTheMove:
    """Today's records where they were filed before format 3: every namespace the agents
    name is replaced by the one it had."""

    inner: CheckpointStore

    async def save_checkpoint(self, **kw: Any) -> Any:
        return await self.inner.save_checkpoint(**{**kw, "namespace": OLD[kw["namespace"]]})

    async def load_checkpoint(self, **kw: Any) -> Any:
        return await self.inner.load_checkpoint(**{**kw, "namespace": OLD[kw["namespace"]]})

    async def write_checkpoints(self, writes: Any, **kw: Any) -> Any:
        moved = [w._replace(namespace=OLD[w.namespace]) for w in writes]
        return await self.inner.write_checkpoints(moved, **kw)


def mock(checkpoints: Any, clock: ManualClock) -> MockAgent:
    context = AgentContext(
        alias="primary",
        options={"suspend_for_tool": "write"},
        checkpoints=checkpoints,
        clock=clock,
    )
    agent = build_agent("mock", context)
    assert isinstance(agent, MockAgent)
    return agent


async def test_a_format_2_journal_keeps_its_agent_records(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.sqlite'}"
    clock = ManualClock()
    async with open_store(url) as store:
        await store.checkpoints.save_checkpoint(
            namespace="prism.channels.v1.meta",
            key="journal",
            scope=OwnershipScope(),
            version=1,
            value={"journalId": JOURNAL_ID, "format": 2},
            category="channel-meta",
        )
        before = mock(BeforeTheMove(store.checkpoints), clock)
        request = RunRequest(
            session_id="sess-1", input="do it", identity=IDENTITY, idempotency_key="op-1"
        )
        suspended = await before.run(request)
        assert suspended.status == "suspended"
        state = await before.status(run_id=suspended.run_id, session_id="sess-1", scope=OWNER)
        assert state is not None and state.pending
        for old in MOVED_NAMESPACES:
            assert len((await store.checkpoints.list_checkpoints(namespace=old)).items) == 1
        old_run = await store.checkpoints.load_checkpoint(
            namespace=OLD[NS_RUN], key=f"r1:primary:{suspended.run_id}", scope=OWNER
        )
        assert old_run is not None

    async with open_store(url) as store:
        info = await ensure_format(ChannelJournal(store.checkpoints))
        assert (info.journal_id, info.created, info.moved) == (JOURNAL_ID, False, 2)
        for old in MOVED_NAMESPACES:
            assert (await store.checkpoints.list_checkpoints(namespace=old)).items == ()
        run = await store.checkpoints.load_checkpoint(
            namespace=NS_RUN, key=f"r1:primary:{suspended.run_id}", scope=OWNER
        )
        assert run is not None
        assert (run.version, run.value, run.category, run.metadata) == (
            old_run.version,
            old_run.value,
            old_run.category,
            old_run.metadata,
        )
        assert len((await store.checkpoints.list_checkpoints(namespace=NS_SESSION)).items) == 1

        after = mock(store.checkpoints, clock)
        again = await after.status(run_id=suspended.run_id, session_id="sess-1", scope=OWNER)
        assert again is not None and (again.status, again.version) == ("suspended", state.version)
        result = await after.resume(
            run_id=suspended.run_id,
            session_id="sess-1",
            scope=OWNER,
            identity=IDENTITY,
            expected_version=state.version,
            decisions=(Decision(state.pending[0].approval_id, "allow_once"),),
        )
        assert (result.status, result.text) == ("succeeded", "mock: do it")
        assert await after.tool_runs(suspended.run_id, OWNER) == 1
        entries = await after.session_entries("sess-1", OWNER)
        assert [(e.role, e.text) for e in entries] == [
            ("user", "do it"),
            ("assistant", "mock: do it"),
        ]

        meta = await store.checkpoints.load_checkpoint(
            namespace="prism.channels.v1.meta", key="journal", scope=OwnershipScope()
        )
        assert meta is not None and meta.value == {"journalId": JOURNAL_ID, "format": FORMAT}
        assert FORMAT == 3
        second = await ensure_format(ChannelJournal(store.checkpoints))
        assert (second.journal_id, second.moved) == (JOURNAL_ID, 0)


@attrs.define
class Interleaved:
    """Rewrites run-1 (as another instance of the old code would) just before each of the
    first ``times`` batches of writes."""

    inner: CheckpointStore
    times: int
    version: int = 1

    async def write_checkpoints(self, writes: Any, **kw: Any) -> Any:
        if self.times:
            self.times -= 1
            await self.inner.save_checkpoint(
                namespace=OLD[NS_RUN],
                key="r1:primary:run-1",
                scope=OWNER,
                version=self.version + 1,
                expected_version=self.version,
                value={"status": "succeeded", "n": 1},
                category="agent-run",
            )
            self.version += 1
        return await self.inner.write_checkpoints(writes, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def three_old_runs(url: str) -> None:
    async with open_store(url) as store:
        for n in range(3):
            await store.checkpoints.save_checkpoint(
                namespace=OLD[NS_RUN],
                key=f"r1:primary:run-{n}",
                scope=OWNER,
                version=1,
                value={"status": "suspended", "n": n},
                category="agent-run",
            )


async def test_a_record_changed_while_it_is_moved_is_moved_at_its_new_version(
    tmp_path: Path,
) -> None:
    """The move checks each old row is still as listed: a run rewritten between the listing
    and the move (another instance of the old code) is not moved stale: it is moved at its
    newer version in the next pass."""
    url = f"sqlite:///{tmp_path / 'journal.sqlite'}"
    await three_old_runs(url)
    async with open_store(url) as store:
        info = await ensure_format(ChannelJournal(Interleaved(store.checkpoints, times=1)))
        assert info.moved == 3
        assert (await store.checkpoints.list_checkpoints(namespace=OLD[NS_RUN])).items == ()
        moved = (await store.checkpoints.list_checkpoints(namespace=NS_RUN)).items
        assert sorted((r.key, r.version, r.value["status"]) for r in moved) == [
            ("r1:primary:run-0", 1, "suspended"),
            ("r1:primary:run-1", 2, "succeeded"),
            ("r1:primary:run-2", 1, "suspended"),
        ]
        meta = await store.checkpoints.load_checkpoint(
            namespace="prism.channels.v1.meta", key="journal", scope=OwnershipScope()
        )
        assert meta is not None and meta.value["format"] == 3


async def test_a_record_that_keeps_changing_is_left_for_the_next_start(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'journal.sqlite'}"
    await three_old_runs(url)
    async with open_store(url) as store:
        first = await ensure_format(ChannelJournal(Interleaved(store.checkpoints, times=100)))
        assert first.moved == 2
        left = (await store.checkpoints.list_checkpoints(namespace=OLD[NS_RUN])).items
        assert [r.key for r in left] == ["r1:primary:run-1"]
        meta = await store.checkpoints.load_checkpoint(
            namespace="prism.channels.v1.meta", key="journal", scope=OwnershipScope()
        )
        assert meta is not None and meta.value["format"] == 2  # not done: tried again
        second = await ensure_format(ChannelJournal(store.checkpoints))
        assert (second.journal_id, second.created, second.moved) == (first.journal_id, False, 1)
        assert (await store.checkpoints.list_checkpoints(namespace=OLD[NS_RUN])).items == ()
        meta = await store.checkpoints.load_checkpoint(
            namespace="prism.channels.v1.meta", key="journal", scope=OwnershipScope()
        )
        assert meta is not None and meta.value["format"] == 3
