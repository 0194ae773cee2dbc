"""Restart and operator recovery on memory and SQLite (behaviours 6–7, 72–94).

"Restart" = a second runtime on the same store (the SQLite file reopened).
"""

from __future__ import annotations

from typing import Any

import attrs
import trio
import trio.testing

from prismd.channel import Redactor, Reply, SendResult
from prismd.grants import ownership_from_identity
from prismd.journal._journal import NS_OPERATION, NS_REPLY, ChannelJournal
from prismd.journal._records import OperationRecord, ReplyRecord
from stores import OwnershipScope, ms_to_iso
from tests.support.builders import event, grant, identity, write
from tests.support.harness import Host, StoreFactory, runtime
from tests.support.scripted import ScriptedAgent

IDENT = identity()
SCOPE = ownership_from_identity(IDENT)
TENANT2 = identity("user-1", tenant="tenant-2")


async def test_previews_redacted_and_never_journaled_b6_b7(stores: StoreFactory) -> None:
    """Behaviours 6, 7: ≥3 redacted previews, the last is the whole answer; exactly one
    final reply is delivered and journaled."""
    secret = "hunter2"
    store = await stores()
    agent = ScriptedAgent(deltas=("answer ", secret, " done"))
    host = Host(agent=agent)
    async with runtime(host, store, redactor=Redactor((secret,))) as rt:
        await rt.admit(event("1", thread="77"))
        await rt.drain()
    assert len(host.previews) >= 3
    last = host.previews[-1]
    assert (last.text, last.external_conversation_id, last.thread_id) == (
        "answer [REDACTED] done",
        "chat-1",
        "77",
    )
    assert all(secret not in p.text for p in host.previews)
    assert [(r.kind, r.text) for r in host.replies] == [("final", "answer [REDACTED] done")]
    page = await store.checkpoints.list_checkpoints(namespace=NS_REPLY)
    assert [i.value["kind"] for i in page.items] == ["final"]


async def test_restart_keeps_session_and_dedup_b72_b73(stores: StoreFactory) -> None:
    """Behaviours 72, 73: B binds to A's session; A's event is a duplicate on B."""
    host_a, host_b = Host(), Host()
    async with runtime(host_a, await stores()) as a:
        await a.admit(event("1"))
        await a.drain()
    async with runtime(host_b, await stores()) as b:
        await b.admit(event("2"))
        again = await b.admit(event("1"))
        await b.drain()
    assert host_b.scripted.calls[0].session_id == host_a.scripted.calls[0].session_id
    assert again.duplicate and again.status == "accepted"
    assert host_b.scripted.provider_calls == 1 and len(host_b.replies) == 1


async def test_new_generation_survives_restart_b74(stores: StoreFactory) -> None:
    """Behaviour 74: after ``/new`` on A, B's next turn uses the new session."""
    host_a, host_b = Host(), Host()
    async with runtime(host_a, await stores()) as a:
        await a.admit(event("1"))
        await a.drain()
        assert (await a.admit(event("2", "/new"))).status == "accepted"
        await a.drain()
    assert "Started a new conversation." in host_a.texts
    async with runtime(host_b, await stores()) as b:
        await b.admit(event("3"))
        await b.drain()
    assert host_b.scripted.calls[0].session_id != host_a.scripted.calls[0].session_id


async def test_same_event_other_tenant_is_separate_b75(stores: StoreFactory) -> None:
    """Behaviour 75: tenant-2 admitting the same connection+event id runs separately."""
    store = await stores()
    holder = [grant()]
    host = Host(grant_for=lambda _i: holder[0])
    async with runtime(host, store) as rt:
        await rt.admit(event("3"))
        await rt.drain()
        holder[0] = grant(TENANT2)
        second = await rt.admit(event("3"))
        await rt.drain()
    assert second.status == "accepted" and not second.duplicate
    assert len(host.replies) == 2


async def test_claimed_op_listed_reconciled_never_rerun_b76_to_b82(stores: StoreFactory) -> None:
    """Behaviours 76–82: an executing op is listed; B dedups it, refuses reconcile without
    the ack or with a wrong version, resolves ``execution_unknown`` with it; tenant-2 gets
    ``not_found``; the provider ran once."""
    agent = ScriptedAgent(wait_for_cancel=True)
    host_a = Host(agent=agent)
    store_a = await stores()
    async with runtime(host_a, store_a) as a:
        await a.admit(event("1"))
        await agent.wait_started(1)
        listed = await a.list_unresolved(identity=IDENT)
        assert [(e.state, e.reply_state) for e in listed] == [("executing", None)]  # b76
        version = listed[0].version
        op_id = listed[0].operation_id
        host_b = Host(agent=agent)
        async with runtime(host_b, await stores(), use_leases=False) as b:
            dup = await b.admit(event("1"))
            assert dup.duplicate and b.diagnostics().active == 0  # b77
            r = await b.reconcile(
                identity=IDENT, connection_id="tg-1", operation_id=op_id, expected_version=version
            )
            assert (r.status, r.detail) == ("conflict", "duplicate_risk")  # b78
            assert r.current_version == version  # the version to retry with, acknowledged
            r = await b.reconcile(
                identity=IDENT,
                connection_id="tg-1",
                operation_id=op_id,
                expected_version=version + 5,
                acknowledge_duplicate_risk=True,
            )
            assert r.status == "conflict"  # b79
            assert (r.state, r.detail, r.current_version) == ("executing", None, version)
            r = await b.reconcile(
                identity=IDENT,
                connection_id="tg-1",
                operation_id=op_id,
                expected_version=version,
                acknowledge_duplicate_risk=True,
            )
            assert (r.status, r.outcome) == ("resolved", "execution_unknown")  # b80
            assert await b.list_unresolved(identity=IDENT) == []
            r = await b.reconcile(
                identity=TENANT2,
                connection_id="tg-1",
                operation_id=op_id,
                expected_version=version + 1,
                acknowledge_duplicate_risk=True,
            )
            assert r.status == "not_found"  # b81
            assert r.current_version is None  # nothing about another tenant's record
        await a.stop()
    assert agent.provider_calls == 1  # b82


def _throwing_deliver(reply: Reply) -> SendResult:
    raise ConnectionError("platform accepted, then the socket died")


async def test_ambiguous_delivery_reconciled_once_b83_to_b87(stores: StoreFactory) -> None:
    """Behaviours 83–87: a thrown deliver is ambiguous; after a restart it is listed as
    ``delivery_unknown``; reconcile needs the ack, resends the stored text once, then
    reports ``none``."""
    host_a = Host(deliver_hook=_throwing_deliver)
    async with runtime(host_a, await stores()) as a:
        await a.admit(event("1"))
        await a.drain()
        diag = a.diagnostics()
        assert (diag.deliveries, diag.delivery_failures) == (0, 0)  # b83
    assert host_a.scripted.provider_calls == 1
    host_b = Host()
    async with runtime(host_b, await stores()) as b:
        listed = await b.list_unresolved(identity=IDENT)
        assert [(e.state, e.reply_state) for e in listed] == [("succeeded", "delivery_unknown")]
        entry = listed[0]
        kw = dict(identity=IDENT, connection_id="tg-1", operation_id=entry.operation_id)
        r = await b.reconcile(**kw, expected_version=entry.version)  # type: ignore[arg-type]
        assert r.status == "conflict"  # b85
        assert (r.detail, r.current_version) == ("duplicate_risk", entry.version)
        r = await b.reconcile(
            **kw,  # type: ignore[arg-type]
            expected_version=entry.version,
            acknowledge_duplicate_risk=True,
        )
        assert (r.status, r.outcome) == ("resolved", "reply_delivered")  # b86
        assert [(d.text, d.in_reply_to) for d in host_b.replies] == [("answer", None)]
        r = await b.reconcile(
            **kw,  # type: ignore[arg-type]
            expected_version=entry.version,
            acknowledge_duplicate_risk=True,
        )
        assert (r.status, r.outcome) == ("resolved", "none")  # b87
        assert len(host_b.replies) == 1
        assert await b.list_unresolved(identity=IDENT) == []
    assert host_b.scripted.provider_calls == 0


async def _write_direct(
    store_journal: ChannelJournal, state: str, reply_state: str, updated_ms: int, op_id: str
) -> None:
    await write(
        store_journal,
        NS_OPERATION,
        SCOPE,
        OperationRecord(
            operation_id=op_id,
            event_id=op_id,
            kind="message",
            connection_id="tg-1",
            external_conversation_id="chat-1",
            external_actor_id="user-1",
            agent_alias="primary",
            state=state,
            created_at_ms=updated_ms,
            updated_at_ms=updated_ms,
        ),
    )
    await write(
        store_journal,
        NS_REPLY,
        SCOPE,
        ReplyRecord(
            operation_id=op_id,
            connection_id="tg-1",
            external_conversation_id="chat-1",
            kind="final",
            text=f"staged text {op_id}",
            state=reply_state,
            created_at_ms=updated_ms,
            updated_at_ms=updated_ms,
        ),
    )


async def test_staged_reply_reconciled_by_owner_only_b88_b89(stores: StoreFactory) -> None:
    """Behaviours 88, 89: a journaled pending reply is not found by tenant-2; the owner's
    acknowledged reconcile delivers the staged text without a provider call."""
    store = await stores()
    await _write_direct(ChannelJournal(store.checkpoints), "succeeded", "pending", 1, "op-x")
    host = Host()
    async with runtime(host, store) as rt:
        r = await rt.reconcile(
            identity=TENANT2,
            connection_id="tg-1",
            operation_id="op-x",
            expected_version=1,
            acknowledge_duplicate_risk=True,
        )
        assert r.status == "not_found"
        r = await rt.reconcile(
            identity=IDENT,
            connection_id="tg-1",
            operation_id="op-x",
            expected_version=1,
            acknowledge_duplicate_risk=True,
        )
        assert (r.status, r.outcome) == ("resolved", "reply_delivered")
    assert host.texts == ["staged text op-x"] and host.scripted.provider_calls == 0


async def test_delivery_failed_resend_needs_no_ack(stores: StoreFactory) -> None:
    """§13.2: a known send failure is resent without the acknowledgment."""
    store = await stores()
    await _write_direct(ChannelJournal(store.checkpoints), "succeeded", "delivery_failed", 1, "f")
    host = Host()
    async with runtime(host, store) as rt:
        [entry] = await rt.list_unresolved(identity=IDENT)
        assert entry.reply_state == "delivery_failed"
        r = await rt.reconcile(
            identity=IDENT, connection_id="tg-1", operation_id="f", expected_version=1
        )
        assert (r.status, r.outcome) == ("resolved", "reply_delivered")
    assert host.texts == ["staged text f"]


async def test_accepted_op_reconciles_to_abandoned(stores: StoreFactory) -> None:
    """§13.2: ``accepted`` → ``abandoned`` without the acknowledgment."""
    store = await stores()
    journal = ChannelJournal(store.checkpoints)
    await _write_direct(journal, "accepted", "delivered", 1, "acc")
    async with runtime(Host(), store) as rt:
        r = await rt.reconcile(
            identity=IDENT, connection_id="tg-1", operation_id="acc", expected_version=1
        )
        assert (r.status, r.outcome) == ("resolved", "abandoned")
        missing = await rt.reconcile(
            identity=IDENT, connection_id="tg-1", operation_id="nope", expected_version=1
        )
        assert missing.status == "not_found"
    loaded = await journal.load_operation(SCOPE, "tg-1", "acc")
    assert loaded is not None and loaded.record.state == "abandoned"


async def test_prune_keeps_unresolved_b93_b94(stores: StoreFactory) -> None:
    """Behaviours 93, 94: old settled op + delivered reply are deleted; the executing op
    and its ambiguous reply stay."""
    store = await stores()
    journal = ChannelJournal(store.checkpoints)
    old = 1_577_836_800_000  # 2020-01-01
    await _write_direct(journal, "succeeded", "delivered", old, "settled")
    await _write_direct(journal, "executing", "delivery_unknown", old, "open")
    now = 1_789_516_800_000  # 2026-09-16
    async with runtime(Host(), store) as rt:
        result = await rt.prune(identity=IDENT, now_ms=now)
    assert result.deleted == 2 and result.retained >= 2
    assert await journal.load_operation(SCOPE, "tg-1", "settled") is None
    assert await journal.load_reply(SCOPE, "tg-1", "settled") is None
    kept = await journal.load_operation(SCOPE, "tg-1", "open")
    kept_reply = await journal.load_reply(SCOPE, "tg-1", "open")
    assert kept is not None and kept.record.state == "executing"
    assert kept_reply is not None and kept_reply.record.state == "delivery_unknown"
    assert ms_to_iso(now).startswith("2026-09-16")


async def test_recovery_without_journal_or_identity() -> None:
    """§13: no journal → [] / unavailable / zeros; inactive identity → denied."""
    revoked = identity(revoked_at_ms=1)
    async with runtime(Host()) as rt:
        assert await rt.list_unresolved(identity=IDENT) == []
        r = await rt.reconcile(
            identity=IDENT, connection_id="c", operation_id="o", expected_version=1
        )
        assert r.status == "unavailable"
        assert (await rt.prune(identity=IDENT)).scanned == 0
    store_host = Host()
    from stores.memory import MemoryStore

    async with MemoryStore() as store, runtime(store_host, store) as rt:
        r = await rt.reconcile(
            identity=revoked, connection_id="c", operation_id="o", expected_version=1
        )
        assert r.status == "denied"
        assert await rt.list_unresolved(identity=revoked) == []
        assert OwnershipScope() == OwnershipScope()
        bad = await rt.reconcile(
            identity=IDENT, connection_id="c", operation_id="", expected_version=1
        )
        assert bad.status == "not_found"
    await trio.testing.wait_all_tasks_blocked()


async def test_late_result_does_not_undo_an_operators_execution_unknown(
    stores: StoreFactory,
) -> None:
    """An operator files a still-running claim as ``execution_unknown`` (the run looked
    dead); when the agent finishes after all, its terminal state must not overwrite the
    operator's decision. The answer is still staged and delivered once."""
    gate = trio.Event()
    agent = ScriptedAgent(gate=gate, answer="late answer")
    host = Host(agent=agent)
    store = await stores()
    async with runtime(host, store) as rt:
        await rt.admit(event("1"))
        await agent.wait_started(1)
        (entry,) = await rt.list_unresolved(identity=IDENT)
        r = await rt.reconcile(
            identity=IDENT,
            connection_id="tg-1",
            operation_id=entry.operation_id,
            expected_version=entry.version,
            acknowledge_duplicate_risk=True,
        )
        assert (r.status, r.outcome) == ("resolved", "execution_unknown")
        gate.set()
        await rt.drain()
        journal = ChannelJournal(store.checkpoints, max_record_bytes=128 * 1024)
        loaded = await journal.load_operation(SCOPE, "tg-1", entry.operation_id)
        assert loaded is not None and loaded.record.state == "execution_unknown"
    assert [r.text for r in host.replies] == ["late answer"]
    assert agent.provider_calls == 1


@attrs.define(eq=False)
class _Overtaken:
    """A store whose first compare-and-swap on an operation loses to an identical write
    made just before it (another operator settling the same record at the same moment)."""

    inner: Any
    raced: bool = False

    @property
    def leases(self) -> Any:
        return self.inner.leases

    @property
    def checkpoints(self) -> Any:
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner.checkpoints, name)

    async def write_checkpoints(self, writes: Any, **kw: Any) -> Any:
        first = writes[0]
        if not self.raced and first.namespace == NS_OPERATION and first.expected_version:
            self.raced = True
            await self.inner.checkpoints.write_checkpoints(writes, **kw)
        return await self.inner.checkpoints.write_checkpoints(writes, **kw)

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


async def test_a_lost_race_reports_the_version_it_lost_to(stores: StoreFactory) -> None:
    """A reconcile whose CAS loses answers ``conflict`` with the version the record has
    now, so the operator can look again and retry with it (the stale one is useless)."""
    store = await stores()
    journal = ChannelJournal(store.checkpoints)
    await _write_direct(journal, "accepted", "delivered", 1, "acc")
    async with runtime(Host(), _Overtaken(store)) as rt:
        r = await rt.reconcile(
            identity=IDENT, connection_id="tg-1", operation_id="acc", expected_version=1
        )
    assert (r.status, r.state, r.current_version) == ("conflict", "accepted", 2)
    loaded = await journal.load_operation(SCOPE, "tg-1", "acc")
    assert loaded is not None and (loaded.version, loaded.record.state) == (2, "abandoned")
