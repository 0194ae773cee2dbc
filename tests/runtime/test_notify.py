"""Host notices against the runtime (behaviours 61-70) and SPEC difference 3 (notify after a
restart, from the durable binding). ``[NOJ]`` behaviours run without a journal."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from prismd.grants import ownership_from_identity
from prismd.journal._journal import NS_OPERATION, operation_key
from stores.memory import MemoryStore
from tests.support.builders import IDENTITY, event, grant, identity
from tests.support.clocks import ManualClock
from tests.support.harness import SECRET, ExactRedactor, Host, open_harness
from tests.support.scripted import RecordingAgent

OWNER = ownership_from_identity(IDENTITY)


def unbound(conversation: str = "chat-1", thread: str | None = None) -> str:
    """The hint for a conversation without a binding the caller can see."""
    where = f"conversation {conversation!r}" + ("" if thread is None else f" thread {thread!r}")
    return (
        f"no {where} on connection 'tg-1' is bound to an agent in your scope "
        "(a conversation is bound once its user has written to the agent)"
    )


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def store(clock: ManualClock) -> AsyncIterator[MemoryStore]:
    async with MemoryStore(clock=clock) as s:
        yield s


async def bind(h: Host, event_id: str = "1", **kw: Any) -> None:
    """Send one ordinary message so the actor has a binding, and let it finish."""
    admission = await h.runtime.admit(event(event_id, "hello", **kw))
    assert admission.status == "accepted", admission
    await h.settle()


async def notify(h: Host, notify_id: str = "job-1", **kw: Any) -> Any:
    args: dict[str, Any] = dict(
        identity=IDENTITY,
        connection_id="tg-1",
        external_conversation_id="chat-1",
        notify_id=notify_id,
        text=f"build finished, key {SECRET}",
    )
    args.update(kw)
    result = await h.runtime.notify(**args)
    await h.settle()
    return result


async def load_operation(store: MemoryStore, operation_id: str, owner: Any = OWNER) -> Any:
    row = await store.checkpoints.load_checkpoint(
        namespace=NS_OPERATION, key=operation_key("tg-1", owner, operation_id), scope=owner
    )
    assert row is not None
    return row.value


async def test_notify_without_notifications_grant_is_rejected(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviour 61 [NOJ]."""
    agent = RecordingAgent()
    async with open_harness(store, clock, {"primary": agent}, use_journal=False) as h:
        await bind(h)
        delivered = len(h.replies)
        result = await notify(h)
        assert (result.status, result.reason) == ("denied", "rejected")
        assert result.hint == (
            "no [[grants]] entry for connection 'tg-1' with notifications = true for actor 'user-1'"
        )
        assert SECRET not in result.hint
        assert len(h.replies) == delivered and len(agent.inputs) == 1
        assert h.actions == ["message", "notify"]


async def test_notify_is_deduplicated_redacted_and_journaled(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviours 62, 63 and 64."""
    agent = RecordingAgent()
    async with open_harness(
        store,
        clock,
        {"primary": agent},
        grant=grant(notifications=True),
        redactor=ExactRedactor(SECRET),
    ) as h:
        await bind(h)
        delivered = len(h.replies)
        first = await notify(h)
        second = await notify(h)
        assert first.status == "accepted" and first.operation_id and not first.duplicate
        assert second.status == "accepted" and second.duplicate is True
        assert second.operation_id == first.operation_id
        notices = h.replies[delivered:]
        assert len(notices) == 1  # 62
        notice = notices[0]
        assert notice.kind == "notice"  # 63
        assert (notice.connection_id, notice.external_conversation_id) == ("tg-1", "chat-1")
        assert SECRET not in notice.text and "[REDACTED]" in notice.text
        assert notice.in_reply_to == "notify-job-1"
        assert len(agent.inputs) == 1
        assert h.runtime.diagnostics().queued == 0
        record = await load_operation(store, first.operation_id)  # 64
        assert record["kind"] == "notify" and record["state"] == "succeeded"
        assert SECRET not in str(record)


async def test_notify_from_another_user_or_tenant_is_rejected(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviour 65 [NOJ]."""
    async with open_harness(
        store,
        clock,
        {"primary": RecordingAgent()},
        grant=grant(notifications=True),
        use_journal=False,
    ) as h:
        await bind(h)
        delivered = len(h.replies)
        other_user = await notify(h, identity=identity("user-2"))
        assert (other_user.status, other_user.reason) == ("denied", "rejected")
        other_tenant = await notify(h, identity=identity("user-1", "tenant-9"))
        assert (other_tenant.status, other_tenant.reason) == ("denied", "rejected")
        # Told the same as for a conversation that does not exist: nothing leaks.
        assert other_user.hint == other_tenant.hint == unbound()
        assert len(h.replies) == delivered


async def test_notify_without_a_binding_is_rejected(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviour 66 [NOJ]."""
    async with open_harness(
        store,
        clock,
        {"primary": RecordingAgent()},
        grant=grant(notifications=True),
        use_journal=False,
    ) as h:
        await bind(h)
        result = await notify(h, external_conversation_id="chat-unbound")
        assert (result.status, result.reason) == ("denied", "rejected")
        assert result.hint == unbound("chat-unbound")
        threaded = await notify(h, thread_id="t-9")
        assert threaded.hint == unbound("chat-1", "t-9")
        assert all(r.external_conversation_id != "chat-unbound" for r in h.replies)


@pytest.mark.parametrize("use_journal", [False, True])
async def test_notify_from_a_revoked_identity(
    store: MemoryStore,
    clock: ManualClock,
    autojump_clock: trio.testing.MockClock,
    use_journal: bool,
) -> None:
    """Behaviour 67: revoked before and after the binding exists."""
    revoked = identity(revoked_at_ms=1)
    async with open_harness(
        store,
        clock,
        {"primary": RecordingAgent()},
        grant=grant(notifications=True),
        use_journal=use_journal,
    ) as h:
        before = await notify(h, identity=revoked)
        assert (before.status, before.reason) == ("denied", "revoked")
        await bind(h)
        delivered = len(h.replies)
        after = await notify(h, identity=revoked)
        assert (after.status, after.reason) == ("denied", "revoked")
        assert len(h.replies) == delivered


async def test_notify_by_a_user_who_is_not_the_bound_actor(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviour 68 [NOJ]: each grant's identity is the actor; only user-1 is bound."""
    grants = {actor: grant(identity(actor), notifications=True) for actor in ("user-1", "user-2")}
    async with open_harness(
        store, clock, {"primary": RecordingAgent()}, grants=grants, use_journal=False
    ) as h:
        await bind(h)
        delivered = len(h.replies)
        result = await notify(h, identity=identity("user-2"))
        assert (result.status, result.reason) == ("denied", "rejected")
        assert len(h.replies) == delivered


async def test_notify_follows_the_grant_to_the_new_alias(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviour 69."""
    agents = {"primary": RecordingAgent(), "secondary": RecordingAgent(answer="second")}
    async with open_harness(
        store, clock, agents, grant=grant(aliases=("primary",), notifications=True)
    ) as h:
        await bind(h, "1")
        h.default_grant = grant(aliases=("secondary",), notifications=True)
        await bind(h, "2")
        assert h.last().text == "second"
        delivered = len(h.replies)
        result = await notify(h, "job-2")
        assert result.status == "accepted", result
        assert len(h.replies) == delivered + 1
        record = await load_operation(store, result.operation_id)
        assert record["agentAlias"] == "secondary"


async def test_notify_in_a_group_thread_targets_the_callers_actor(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviour 70: two actors bound in chat-g / thread 77."""
    grants = {actor: grant(identity(actor), notifications=True) for actor in ("user-1", "user-2")}
    async with open_harness(store, clock, {"primary": RecordingAgent()}, grants=grants) as h:
        await bind(h, "1", actor="user-1", chat="chat-g", thread="77")
        await bind(h, "2", actor="user-2", chat="chat-g", thread="77")
        delivered = len(h.replies)
        result = await notify(h, "job-3", external_conversation_id="chat-g", thread_id="77")
        assert result.status == "accepted", result
        notices = h.replies[delivered:]
        assert len(notices) == 1
        assert (notices[0].external_conversation_id, notices[0].thread_id) == ("chat-g", "77")
        record = await load_operation(store, result.operation_id)
        assert record["externalActorId"] == "user-1"


async def test_notify_after_restart_uses_the_durable_binding(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """SPEC difference 3: the reference only finds routes in memory, so after a restart a
    bound actor could not be notified until they wrote again. Ours reads the binding."""
    notifying = grant(notifications=True)
    async with open_harness(store, clock, {"primary": RecordingAgent()}, grant=notifying) as h1:
        await bind(h1)
        await h1.runtime.stop()
    agent = RecordingAgent()
    async with open_harness(store, clock, {"primary": agent}, grant=notifying) as h2:
        result = await notify(h2, "after-restart")
        assert result.status == "accepted", result
        assert len(h2.replies) == 1
        assert h2.replies[0].in_reply_to == "notify-after-restart"
        assert h2.replies[0].kind == "notice" and agent.inputs == []
        # Still no binding is created for a conversation nobody wrote in.
        unbound = await notify(h2, "x", external_conversation_id="chat-none")
        assert (unbound.status, unbound.reason) == ("denied", "rejected")


async def test_notify_input_validation_and_stop(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """§9.5 step 1: blank text, empty or oversized ids are ``malformed``; after ``stop()``
    every notify is ``stopped``; none of them delivers anything."""
    async with open_harness(
        store, clock, {"primary": RecordingAgent()}, grant=grant(notifications=True)
    ) as h:
        await bind(h)
        delivered = len(h.replies)
        for kw in (
            {"text": "   "},
            {"notify_id": ""},
            {"notify_id": "n" * 249},
            {"external_conversation_id": ""},
            {"thread_id": ""},
        ):
            result = await notify(h, **kw)
            assert (result.status, result.reason) == ("denied", "malformed"), kw
        ok = await notify(h, "n" * 248)
        assert ok.status == "accepted", ok
        assert len(h.replies) == delivered + 1
        await h.runtime.stop()
        stopped = await h.runtime.notify(
            identity=IDENTITY,
            connection_id="tg-1",
            external_conversation_id="chat-1",
            notify_id="late",
            text="x",
        )
        assert (stopped.status, stopped.reason) == ("denied", "stopped")
        assert len(h.replies) == delivered + 1


def operator_identity(tenant: str = "tenant-1") -> Any:
    from prismd.grants import AgentIdentity, Principal

    return AgentIdentity(
        tenant_id=tenant, principal=Principal("operator", "0"), scopes=("operator",), issued_at_ms=0
    )


async def test_operator_notifies_a_bound_actor_inside_its_tenant(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """SPEC difference 7 for ``notify``: a tenant-scoped operator (the control socket's
    ``notify``) reaches a bound actor of its tenant; the notice is journaled under the
    actor's own scope. The reference would refuse it (principal mismatch)."""
    agent = RecordingAgent()
    async with open_harness(store, clock, {"primary": agent}, grant=grant(notifications=True)) as h:
        await bind(h)
        delivered = len(h.replies)
        result = await notify(h, identity=operator_identity())
        assert result.status == "accepted" and not result.duplicate, result
        assert [r.text for r in h.replies[delivered:]] == [f"build finished, key {SECRET}"]
        record = await load_operation(store, result.operation_id)
        assert record["kind"] == "notify" and record["externalActorId"] == "user-1"
        again = await notify(h, identity=operator_identity())
        assert again.duplicate is True and len(h.replies) == delivered + 1
        # Another tenant's operator sees no binding at all.
        foreign = await notify(h, notify_id="job-2", identity=operator_identity("tenant-9"))
        assert (foreign.status, foreign.reason) == ("denied", "rejected")
        assert foreign.hint == unbound()


async def test_operator_notify_needs_the_actors_notifications_grant(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """An operator cannot push notices to an actor whose grant has no notifications."""
    async with open_harness(store, clock, {"primary": RecordingAgent()}) as h:
        await bind(h)
        result = await notify(h, identity=operator_identity())
        assert (result.status, result.reason) == ("denied", "rejected")
        assert result.hint == (
            "no [[grants]] entry for connection 'tg-1' with notifications = true for actor 'user-1'"
        )


async def test_operator_notify_into_a_shared_thread_names_the_ambiguity(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Two actors bound in one group thread: an operator's notify cannot pick one and
    says so (a user's own notify reaches its own actor, behaviour 70)."""
    grants = {actor: grant(identity(actor), notifications=True) for actor in ("user-1", "user-2")}
    async with open_harness(store, clock, {"primary": RecordingAgent()}, grants=grants) as h:
        await bind(h, "1", actor="user-1", chat="chat-g", thread="77")
        await bind(h, "2", actor="user-2", chat="chat-g", thread="77")
        delivered = len(h.replies)
        result = await notify(
            h, identity=operator_identity(), external_conversation_id="chat-g", thread_id="77"
        )
        assert (result.status, result.reason) == ("denied", "rejected")
        assert result.hint == (
            "conversation 'chat-g' thread '77' on connection 'tg-1' has 2 bound actors in"
            " your scope; notify needs exactly one"
        )
        assert len(h.replies) == delivered


async def test_notify_refusal_hints_for_grant_problems(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """The grant of the bound actor went away, or no longer lists the bound agent: the
    operator is told which, naming the actor (inside its own scope)."""
    notifying = grant(notifications=True)
    async with open_harness(store, clock, {"primary": RecordingAgent()}, grant=notifying) as h:
        await bind(h)
        h.default_grant = None
        gone = await notify(h, "job-a", identity=operator_identity())
        assert gone.hint == (
            "no [[grants]] entry or pairing for connection 'tg-1' covers actor 'user-1'"
        )
        h.default_grant = grant(aliases=("other",), notifications=True)
        moved = await notify(h, "job-b", identity=operator_identity())
        assert moved.hint == (
            "the agent bound to the conversation 'chat-1' on connection 'tg-1' is not among"
            " the aliases granted to 'user-1'"
        )
        assert (gone.status, gone.reason) == (moved.status, moved.reason) == ("denied", "rejected")
