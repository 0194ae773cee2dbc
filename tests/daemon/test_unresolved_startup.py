"""A real `prismd run` on a journal with one ``executing`` record behind 5,000 newer
settled operations: startup says 1 unresolved (not "none"), ``STATUS=`` says so too, and
`prismctl list-unresolved` shows it (issue 10)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from prismd.journal import NS_OPERATION, ChannelJournal, Write, operation_key
from stores import OwnershipScope, SaveCheckpoint, open_store
from tests.runtime.test_unresolved_index import fill_scope, op

from .helpers import prismctl, running_daemon, write_config

pytestmark = pytest.mark.slow


async def test_startup_counts_an_executing_record_behind_5000_settled_ones(
    tmp_path: Path,
) -> None:
    layout = write_config(tmp_path)
    layout.db.parent.mkdir(parents=True, exist_ok=True)
    async with open_store(f"sqlite:///{layout.db}") as store:
        # The web chat grant's scope: tenant "default", account = the connection id.
        await fill_scope(store, OwnershipScope("default", "web", "old-user"), 5_000)
    async with running_daemon(layout) as daemon:
        await daemon.wait_state("READY=1")
        log = daemon.stderr()
        assert "1 unresolved operation(s)" in log, log
        assert "no unresolved operations" not in log
        assert any(s.startswith("STATUS=ready") and "1 unresolved" in s for s in daemon.states)
        code, entries, err = await prismctl(layout, "list-unresolved")
        assert code == 0, err
        assert [(e["operationId"], e["state"]) for e in entries] == [("op-00000", "executing")]
        daemon.send(signal.SIGTERM)
        assert await daemon.wait_exit() == 0


async def test_a_journal_written_before_the_index_is_upgraded_once(tmp_path: Path) -> None:
    """A journal whose records were all filed under the plain category (written before the
    open index existed): the first start re-files the unresolved ones, so they are
    listed, and records the format so later starts do not walk the journal again."""
    layout = write_config(tmp_path)
    layout.db.parent.mkdir(parents=True, exist_ok=True)
    scope = OwnershipScope("default", "web", "old-user")
    async with open_store(f"sqlite:///{layout.db}") as store:
        writes = [
            SaveCheckpoint(
                namespace=NS_OPERATION,
                key=operation_key("web", scope, record.operation_id),
                scope=scope,
                version=1,
                value=record.to_json(),
                expected_version=0,
                category="channel-operation",  # the only category before format 2
            )
            for record in (op(0, "executing", at=1), op(1, "succeeded", at=2))
        ]
        assert all(r.ok for r in await store.checkpoints.write_checkpoints(writes))
    for tag in ("first", "second"):
        async with running_daemon(layout, tag=tag) as daemon:
            await daemon.wait_state("READY=1")
            log = daemon.stderr()
            assert "1 unresolved operation(s)" in log, log
            assert ("journal upgraded: 1 unresolved record(s) indexed" in log) == (tag == "first")
            code, entries, err = await prismctl(layout, "list-unresolved")
            assert code == 0, err
            assert [e["operationId"] for e in entries] == ["op-00000"]
            daemon.send(signal.SIGTERM)
            assert await daemon.wait_exit() == 0


async def test_prismctl_pages_through_every_unresolved_record(tmp_path: Path) -> None:
    """250 ``executing`` records: a page is capped at ``max_journal_page`` (100) and says
    how to get the next, ``--after`` walks on, ``--all`` returns all 250 once each."""
    layout = write_config(tmp_path)
    layout.db.parent.mkdir(parents=True, exist_ok=True)
    scope = OwnershipScope("default", "web", "old-user")
    async with open_store(f"sqlite:///{layout.db}") as store:
        journal = ChannelJournal(store.checkpoints)
        writes = [Write(NS_OPERATION, scope, op(i, "executing", at=10 + i), 0) for i in range(250)]
        assert (await journal.commit(writes)).ok
    async with running_daemon(layout) as daemon:
        await daemon.wait_state("READY=1")
        assert "250 unresolved operation(s)" in daemon.stderr()
        code, first, err = await prismctl(layout, "list-unresolved", "--limit", "1000")
        assert code == 0, err
        assert len(first) == 100
        assert "above the daemon's page cap: 100 entries per page" in err
        cursor = err.split("--after ", 1)[1].split()[0]
        code, second, err = await prismctl(layout, "list-unresolved", "--after", cursor)
        assert code == 0 and len(second) == 100, err
        code, every, err = await prismctl(layout, "list-unresolved", "--all")
        assert code == 0, err
        ids = [e["operationId"] for e in every]
        assert len(ids) == 250 == len(set(ids))
        assert {e["operationId"] for e in first + second} <= set(ids)
        assert "more:" not in err
        daemon.send(signal.SIGTERM)
        assert await daemon.wait_exit() == 0
