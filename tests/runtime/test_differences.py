"""SPEC "Deliberate differences" 1, 2, 3, 5, 7, 8 — each test fails on the reference
behaviour (differences 4 and 6 are covered in ``test_approvals.py``, 3 for notify in
``test_notify.py``). Also behaviours 90–92, replaced by difference 8."""

from __future__ import annotations

from typing import Any

import attrs
import trio
import trio.testing

from prismd.grants import ownership_from_identity
from prismd.journal import operation_id_for
from prismd.journal._journal import NS_BINDING, ChannelJournal, binding_key, operation_key
from prismd.limits import Limits
from stores.memory import MemoryStore
from tests.support.builders import event, grant, identity
from tests.support.clocks import TrioClock
from tests.support.harness import Host, StoreFactory, runtime
from tests.support.scripted import ScriptedAgent

IDENT = identity()
SCOPE = ownership_from_identity(IDENT)
KEY = binding_key("tg-1", SCOPE, "chat-1", None, "user-1", "primary")


async def test_d1_new_on_idle_leased_route_succeeds(stores: StoreFactory) -> None:
    """Difference 1: the binding was written under a lease fence and the lease released;
    ``/new`` re-acquires the lease instead of failing ("Could not start…" in the
    reference)."""
    store = await stores()
    host = Host()
    # lease_idle_ms=0: the lease is released as soon as the turn ends (an idle route).
    async with runtime(host, store, lease_idle_ms=0) as rt:
        await rt.admit(event("1"))
        await rt.drain()
        raw = await store.checkpoints.load_checkpoint(namespace=NS_BINDING, key=KEY, scope=SCOPE)
        assert raw is not None and raw.fencing_token is not None
        assert await store.leases.get_lease(namespace=NS_BINDING, key=KEY, scope=SCOPE) is None
        result = await rt.admit(event("2", "/new"))
        await rt.drain()
        assert result.status == "accepted"
        assert rt.diagnostics().storage_failures == 0
    assert "Started a new conversation." in host.texts
    binding = await ChannelJournal(store.checkpoints).load_binding(SCOPE, KEY)
    assert binding is not None and binding.record.generation == 1
    assert await store.leases.get_lease(namespace=NS_BINDING, key=KEY, scope=SCOPE) is None


async def test_d2_lease_key_includes_thread_and_scope(stores: StoreFactory) -> None:
    """Difference 2: two topics of one chat hold separate leases, so a never-ending run in
    topic 77 does not hold up topic 88 (the reference's key has no thread)."""
    store = await stores()
    gate = trio.Event()
    agent = ScriptedAgent(gate=gate, gate_first_only=True)
    host = Host(agent=agent)
    async with runtime(host, store) as rt:
        await rt.admit(event("1", thread="77"))
        await agent.wait_started(1)
        await rt.admit(event("2", thread="88"))
        with trio.fail_after(5):
            await agent.wait_started(2)
            await host.delivered.wait()
        key77 = binding_key("tg-1", SCOPE, "chat-1", "77", "user-1", "primary")
        lease = await store.leases.get_lease(namespace=NS_BINDING, key=key77, scope=SCOPE)
        assert lease is not None  # held by the running topic-77 turn
        assert [r.thread_id for r in host.replies] == ["88"]
        gate.set()
        await rt.drain()


async def test_d3_agent_selection_survives_restart(stores: StoreFactory) -> None:
    """Difference 3: ``/agent research`` is stored on the binding; after a restart the
    next message still goes to ``research`` (in-memory only in the reference)."""
    host_a = Host(grant_for=lambda _i: grant(aliases=("primary", "research")))
    async with runtime(host_a, await stores()) as a:
        await a.admit(event("1", "/agent research"))
        await a.drain()
    assert host_a.texts == ["Agent set to research."]
    host_b = Host(grant_for=lambda _i: grant(aliases=("primary", "research")))
    async with runtime(host_b, await stores()) as b:
        await b.admit(event("2", "hello"))
        await b.drain()
    assert [r.agent_alias for r in host_b.resolved] == ["research"]


async def test_d5_attempts_counted_at_claim(stores: StoreFactory) -> None:
    """Difference 5: the claim increments ``attempts`` (always 0 in the reference)."""
    store = await stores()
    async with runtime(Host(), store) as rt:
        result = await rt.admit(event("1"))
        await rt.drain()
    assert result.operation_id is not None
    loaded = await ChannelJournal(store.checkpoints).load_operation(
        SCOPE, "tg-1", result.operation_id
    )
    assert loaded is not None
    assert (loaded.record.state, loaded.record.attempts) == ("succeeded", 1)


async def test_d7_tenant_operator_lists_and_settles_users_records(stores: StoreFactory) -> None:
    """Difference 7: a tenant-scoped operator lists *and* reconciles and prunes a user's
    record (the reference lists it and then fails with exact-scope loads); another
    tenant's operator sees nothing."""
    store = await stores()
    agent = ScriptedAgent(wait_for_cancel=True)
    operator = identity(user=None)
    stranger = identity(user=None, tenant="tenant-2")
    async with runtime(Host(agent=agent), store) as rt:
        await rt.admit(event("1"))
        await agent.wait_started(1)
        assert await rt.list_unresolved(identity=stranger) == []
        [entry] = await rt.list_unresolved(identity=operator)
        assert entry.state == "executing"
        foreign = await rt.reconcile(
            identity=stranger,
            connection_id="tg-1",
            operation_id=entry.operation_id,
            expected_version=entry.version,
            acknowledge_duplicate_risk=True,
        )
        assert foreign.status == "not_found"
        settled = await rt.reconcile(
            identity=operator,
            connection_id="tg-1",
            operation_id=entry.operation_id,
            expected_version=entry.version,
            acknowledge_duplicate_risk=True,
        )
        assert (settled.status, settled.outcome) == ("resolved", "execution_unknown")
        assert await rt.list_unresolved(identity=operator) == []
        far_future = 4_000_000_000_000
        assert (await rt.prune(identity=stranger, now_ms=far_future)).deleted == 0
        pruned = await rt.prune(identity=operator, now_ms=far_future)
        assert pruned.deleted >= 1
        await rt.stop()
    op_key = operation_key("tg-1", SCOPE, entry.operation_id)
    from prismd.journal._journal import NS_OPERATION

    assert (
        await store.checkpoints.load_checkpoint(namespace=NS_OPERATION, key=op_key, scope=SCOPE)
        is None
    )


async def test_d8_lease_held_elsewhere_keeps_record_and_runs_later_b90_b91_b92(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Difference 8 (replaces behaviours 90–92): B cannot get the binding lease while A
    runs; B's record stays ``accepted`` and listed (the reference deletes it), and B runs
    it exactly once after A releases the lease."""
    clock = TrioClock()
    store = MemoryStore(clock=clock)
    gate = trio.Event()
    agent_a = ScriptedAgent(gate=gate, answer="from A")
    agent_b = ScriptedAgent(answer="from B")
    host_a, host_b = Host(agent=agent_a), Host(agent=agent_b)
    async with runtime(host_a, store, clock=clock) as a, runtime(host_b, store, clock=clock) as b:
        await a.admit(event("1"))
        await agent_a.wait_started(1)
        second = await b.admit(event("2"))
        assert second.status == "accepted" and not second.retryable
        await trio.sleep(5)
        diag = b.diagnostics()
        assert diag.lease_losses >= 1 and diag.completed == 0  # b90
        assert host_b.replies == []
        loaded = await ChannelJournal(store.checkpoints).load_operation(
            SCOPE, "tg-1", operation_id_for("tg-1", "2")
        )
        assert loaded is not None and loaded.record.state == "accepted"  # replaces b91
        listed = await b.list_unresolved(identity=IDENT)
        assert ("accepted", second.operation_id) in [(e.state, e.operation_id) for e in listed]
        gate.set()
        await a.drain()
        with trio.fail_after(30):
            await b.drain()
    assert agent_a.provider_calls == 1 and agent_b.provider_calls == 1  # b92
    assert host_a.texts == ["from A"] and host_b.texts == ["from B"]


async def test_d8_restart_adopts_own_lease_at_once(autojump_clock: trio.abc.Clock) -> None:
    """Difference 8: a restarted daemon with the same instance id takes over its dead
    predecessor's binding lease at once (new fencing token) instead of waiting the TTL."""
    clock = TrioClock()
    store = MemoryStore(clock=clock)
    dead = await store.leases.try_acquire_lease(
        namespace=NS_BINDING, key=KEY, scope=SCOPE, owner_id="inst-1", ttl_ms=300_000
    )
    assert dead is not None
    host = Host()
    async with runtime(host, store, clock=clock, owner_id="inst-1", adopt_own_leases=True) as rt:
        start = trio.current_time()
        await rt.admit(event("1"))
        await rt.drain()
        assert trio.current_time() - start < 1
        assert rt.diagnostics().lease_losses == 0
    assert host.texts == ["answer"]
    raw = await store.checkpoints.load_checkpoint(namespace=NS_BINDING, key=KEY, scope=SCOPE)
    assert raw is not None and raw.fencing_token is not None
    assert raw.fencing_token > dead.fencing_token


async def test_d8_expired_foreign_lease_is_taken_over_after_ttl(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A dead foreign holder blocks only until its lease expires (bounded backoff)."""
    clock = TrioClock()
    store = MemoryStore(clock=clock)
    await store.leases.try_acquire_lease(
        namespace=NS_BINDING, key=KEY, scope=SCOPE, owner_id="dead-peer", ttl_ms=30_000
    )
    host = Host()
    async with runtime(host, store, clock=clock, limits=Limits(lease_ttl_ms=30_000)) as rt:
        start = trio.current_time()
        await rt.admit(event("1"))
        await rt.drain()
        waited = trio.current_time() - start
    assert 30 <= waited < 35
    assert host.texts == ["answer"]


async def test_lease_renewed_during_long_run(autojump_clock: trio.abc.Clock) -> None:
    """§9.1: the route lease is renewed while the turn runs (below ttl/3), so a run longer
    than the TTL keeps its fence and completes."""
    clock = TrioClock()
    store = MemoryStore(clock=clock)
    gate = trio.Event()
    host = Host(agent=ScriptedAgent(gate=gate))
    async with runtime(host, store, clock=clock, limits=Limits(lease_ttl_ms=30_000)) as rt:
        await rt.admit(event("1"))
        await host.scripted.wait_started(1)
        await trio.sleep(100)
        lease = await store.leases.get_lease(namespace=NS_BINDING, key=KEY, scope=SCOPE)
        assert lease is not None and lease.expires_at_ms > clock.now_ms()
        gate.set()
        await rt.drain()
        assert rt.diagnostics().lease_losses == 0
    assert host.texts == ["answer"]


@attrs.define
class _NoRenewLeases:
    """A lease store whose renewals always fail (as if the lease had been lost)."""

    inner: Any
    renewals: int = 0

    async def try_acquire_lease(self, **kw: Any) -> Any:
        return await self.inner.try_acquire_lease(**kw)

    async def renew_lease(self, **kw: Any) -> Any:
        self.renewals += 1
        return None

    async def release_lease(self, **kw: Any) -> Any:
        return await self.inner.release_lease(**kw)

    async def get_lease(self, **kw: Any) -> Any:
        return await self.inner.get_lease(**kw)


@attrs.define
class _Store:
    checkpoints: Any
    leases: Any
    url: str = "memory://"

    async def aclose(self) -> None:
        return None


async def test_lost_lease_before_claim_requeues_not_drops(autojump_clock: trio.abc.Clock) -> None:
    """A turn whose lease was lost while it waited for a slot is not claimed unfenced and
    not dropped: it stays ``accepted``, waits for the lease, then runs once."""
    clock = TrioClock()
    inner = MemoryStore(clock=clock)
    leases = _NoRenewLeases(inner.leases)
    store = _Store(inner.checkpoints, leases)
    gate = trio.Event()
    blocker = ScriptedAgent(gate=gate, answer="other")
    agent = ScriptedAgent(answer="mine")
    host = Host(agent=agent, agents={"other": blocker})
    host.grant_for = lambda inp: grant(
        aliases=("other",) if inp.external_actor_id == "user-b" else ("primary",)
    )
    limits = Limits(max_active_sessions=1, lease_ttl_ms=30_000)
    async with runtime(host, store, clock=clock, limits=limits) as rt:  # type: ignore[arg-type]
        await rt.admit(event("b", actor="user-b"))
        await blocker.wait_started(1)
        await rt.admit(event("1"))
        await trio.sleep(60)  # our lease (30 s) lapses while we wait for the slot
        assert agent.provider_calls == 0
        gate.set()
        with trio.fail_after(120):
            await rt.drain()
        assert rt.diagnostics().lease_losses >= 1
    assert agent.provider_calls == 1 and "mine" in host.texts
    assert leases.renewals >= 1
    from prismd.journal._journal import NS_OPERATION

    raw = await inner.checkpoints.load_checkpoint(
        namespace=NS_OPERATION,
        key=operation_key("tg-1", SCOPE, operation_id_for("tg-1", "1")),
        scope=SCOPE,
    )
    assert raw is not None and raw.fencing_token is not None  # claimed under a fence
