"""A turn whose route lease expired under it writes and sends nothing more.

The store's fence check refuses a write only to rows a newer lease holder wrote; a process
that was stopped (SIGSTOP, a long pause) past its lease's expiry and wakes up in the middle
of a turn must not settle the operation, stage or send the reply under the old lease either
— the conversation has moved on to another instance. These tests jump the clock past the
expiry while the agent runs (what a stopped process sees when it wakes).
"""

from __future__ import annotations

import attrs
import pytest
import trio

from prismd.grants import ownership_from_identity
from prismd.journal._journal import ChannelJournal
from prismd.limits import Limits
from stores.memory import MemoryStore
from tests.support.builders import event, identity
from tests.support.clocks import EPOCH_MS
from tests.support.harness import FirstSendHeld, Host, runtime
from tests.support.scripted import ScriptedAgent
from tests.support.waiting import wait_until_async

SCOPE = ownership_from_identity(identity())
TTL_MS = 6_000


@attrs.define
class JumpClock:
    """Trio's clock plus a jump the test makes (a process that slept through time)."""

    jumped_ms: int = 0

    def now_ms(self) -> int:
        return EPOCH_MS + int(trio.current_time() * 1000) + self.jumped_ms


async def test_a_turn_woken_after_its_lease_expired_writes_and_sends_nothing() -> None:
    clock = JumpClock()
    store = MemoryStore(clock=clock)
    gate = trio.Event()
    agent_a = ScriptedAgent(gate=gate, answer="late answer")
    host_a, host_b = Host(agent=agent_a), Host(agent=ScriptedAgent(answer="from b"))
    limits = Limits(lease_ttl_ms=TTL_MS)
    with trio.fail_after(30):
        async with (
            runtime(host_a, store, limits=limits, clock=clock, owner_id="a") as a,
            runtime(host_b, store, limits=limits, clock=clock, owner_id="b") as b,
        ):
            first = await a.admit(event("1"))
            await agent_a.wait_started(1)
            # A "sleeps" past its lease: B takes the conversation over and answers.
            clock.jumped_ms += TTL_MS + 1_000
            second = await b.admit(event("2"))
            with trio.fail_after(10):
                await host_b.delivered.wait()
            assert host_b.texts == ["from b"]
            # A wakes up: its agent returns, and nothing of it reaches the journal or chat.
            gate.set()
            await a.drain()
            assert host_a.replies == []
            assert a.diagnostics().lease_losses >= 1
            journal = ChannelJournal(store.checkpoints)
            assert first.operation_id is not None and second.operation_id is not None
            stuck = await journal.load_operation(SCOPE, "tg-1", first.operation_id)
            assert stuck is not None and stuck.record.state == "executing"  # listed for reconcile
            [entry] = await a.list_unresolved(identity=identity(user=None))
            assert entry.operation_id == first.operation_id
            done = await journal.load_operation(SCOPE, "tg-1", second.operation_id)
            assert done is not None and done.record.state == "succeeded"
            await b.drain()


async def test_a_lease_renewed_while_the_agent_runs_still_answers(autojump_clock: object) -> None:
    """The guard refuses only a lease no longer held: a long run kept alive by renewals
    (well past the TTL) settles and answers as usual."""
    store = MemoryStore(clock=JumpClock())
    agent = ScriptedAgent(gate=trio.Event(), answer="slow answer")
    host = Host(agent=agent)
    async with runtime(host, store, limits=Limits(lease_ttl_ms=TTL_MS), clock=JumpClock()) as rt:
        await rt.admit(event("1"))
        await agent.wait_started(1)
        await trio.sleep(5 * TTL_MS / 1000)  # renewed all along
        assert agent.gate is not None
        agent.gate.set()
        await rt.drain()
        assert host.texts == ["slow answer"]
        assert rt.diagnostics().lease_losses == 0


async def test_a_takeover_that_wrote_nothing_yet_still_fences_the_old_turn() -> None:
    """The new holder took the lease but has not written a row of the conversation yet, so
    the store's row fences would let the old turn's writes through: the lease check does
    not, and the reply is not sent under the old lease."""
    from prismd.journal._journal import NS_BINDING, binding_key

    clock = JumpClock()
    store = MemoryStore(clock=clock)
    gate = trio.Event()
    agent = ScriptedAgent(gate=gate, answer="late answer")
    host = Host(agent=agent)
    with trio.fail_after(30):
        async with runtime(host, store, limits=Limits(lease_ttl_ms=TTL_MS), clock=clock) as a:
            first = await a.admit(event("1"))
            await agent.wait_started(1)
            clock.jumped_ms += TTL_MS + 1_000
            key = binding_key("tg-1", SCOPE, "chat-1", None, "user-1", "primary")
            taken = await store.leases.try_acquire_lease(
                namespace=NS_BINDING, key=key, scope=SCOPE, owner_id="other", ttl_ms=TTL_MS
            )
            assert taken is not None
            gate.set()
            await a.drain()
            assert host.replies == []
            assert a.diagnostics().lease_losses >= 1
            assert first.operation_id is not None
            loaded = await ChannelJournal(store.checkpoints).load_operation(
                SCOPE, "tg-1", first.operation_id
            )
            assert loaded is not None and loaded.record.state == "executing"


@pytest.mark.parametrize("idempotent", [True, False])
async def test_a_reply_waiting_in_the_outbox_when_the_lease_ran_out(idempotent: bool) -> None:
    """A reply staged behind a slow send while the process stalled past its lease (a VM
    paused, SIGSTOP): never sent under the lost lease. On a channel whose sends are
    idempotent (Discord) it is re-driven as after a takeover — reopened by CAS — and
    delivered once; elsewhere it stays ``pending``, listed for ``reconcile``."""
    clock = JumpClock()
    store = MemoryStore(clock=clock)
    host = Host(agent=ScriptedAgent(answer=lambda text, _n: f"re: {text}"))
    held = FirstSendHeld()
    sent = held.sent

    with trio.fail_after(30):
        async with runtime(
            host,
            store,
            deliver=held.deliver,
            limits=Limits(lease_ttl_ms=TTL_MS),
            clock=clock,
            owner_id="a",
            idempotent_send=lambda _connection: idempotent,
        ) as rt:
            await rt.admit(event("1", "m1"))
            await held.first_send.wait()
            await rt.admit(event("2", "m2"))

            async def both_pending() -> bool:
                unresolved = await rt.list_unresolved(identity=identity())
                return [e.reply_state for e in unresolved] == ["pending", "pending"]

            await wait_until_async(both_pending, step=0.01)
            clock.jumped_ms += TTL_MS + 1_000  # the process "slept" past its lease
            held.release.set()
            assert (await rt.drain(deadline_ms=20_000)).settled
            unresolved = await rt.list_unresolved(identity=identity())
            assert rt.diagnostics().lease_losses == 1
    if idempotent:
        assert sent == ["re: m1", "re: m2"]
        assert unresolved == []
    else:
        assert sent == ["re: m1"]
        assert [e.reply_state for e in unresolved] == ["pending"]
