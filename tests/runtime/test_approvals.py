"""Suspension and approval controls against the runtime (behaviours 38-48), SPEC differences 4
and 6 (no raw tokens in reply records, fresh controls on resend; pairing end to end).

The agent is the ``mock`` agent with ``suspend_for_tool = "write"``: its run state is durable
in the runtime's own checkpoint store, so a second runtime (a "restart") on the same store
can resume it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import attrs
import pytest
import trio

from prismd.agents import NS_RUN, AgentContext, MockAgent, RunResult, build_agent
from prismd.channel import Reply, SendResult
from prismd.grants import AgentIdentity, Principal, ownership_from_identity
from prismd.journal._access import GrantStore, token_hash
from stores import OwnershipScope
from stores.memory import MemoryStore
from tests.support.builders import IDENTITY, event, grant, identity
from tests.support.clocks import ManualClock
from tests.support.harness import SECRET, ExactRedactor, Host, open_harness
from tests.support.scripted import RecordingAgent

OWNER = ownership_from_identity(IDENTITY)
DENIED_TEXT = "Approval denied. The request will not continue."


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def store(clock: ManualClock) -> AsyncIterator[MemoryStore]:
    async with MemoryStore(clock=clock) as s:
        yield s


def suspending_mock(store: Any, clock: ManualClock, **options: Any) -> MockAgent:
    agent = build_agent(
        "mock",
        AgentContext(
            alias="primary",
            options={"suspend_for_tool": "write", **options},
            checkpoints=store.checkpoints,
            clock=clock,
        ),
    )
    assert isinstance(agent, MockAgent)
    return agent


def tokens_of(reply: Reply) -> tuple[str, str]:
    values = {c.label: c.value for c in reply.buttons}
    assert values["Allow once"].startswith("p:a:") and values["Deny"].startswith("p:d:")
    return values["Allow once"][4:], values["Deny"][4:]


async def suspend(h: Host, event_id: str = "1") -> tuple[str, str]:
    """Behaviour 38's GIVEN: a message whose run suspends; returns (allow, deny) tokens."""
    admission = await h.runtime.admit(event(event_id, "hello"))
    assert admission.status == "accepted", admission
    await h.settle()
    notice = h.last()
    assert notice.kind == "notice"
    assert notice.text.startswith("Approval required for tool write")
    return tokens_of(notice)


async def all_rows(store: MemoryStore) -> list[Any]:
    rows: list[Any] = []
    cursor = None
    while True:
        page = await store.checkpoints.list_checkpoints(cursor=cursor, limit=500)
        rows.extend(page.items)
        if page.next_cursor is None:
            return rows
        cursor = page.next_cursor


async def test_suspension_notice_carries_allow_once_control(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviour 38."""
    agent = suspending_mock(store, clock)
    async with open_harness(store, clock, {"primary": agent}) as h:
        allow, deny = await suspend(h)
        assert allow != deny and len(allow) == 43
        assert [c.label for c in h.last().buttons] == ["Allow once", "Deny"]
        assert h.runtime.diagnostics().suspended == 1


async def test_approval_from_a_revoked_identity_is_denied(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviour 39."""
    agent = suspending_mock(store, clock)
    async with open_harness(store, clock, {"primary": agent}) as h:
        allow, _ = await suspend(h)
        h.default_grant = grant(identity(revoked_at_ms=1))
        admission = await h.runtime.admit(event("2", "", approval=(allow, "allow_once")))
        assert (admission.status, admission.reason) == ("denied", "revoked")
        await h.settle()
        run_id, _ = await suspended_run(store)
        assert await agent.tool_runs(run_id, OWNER) == 0
        assert agent.resume_calls == 0


async def test_approval_from_another_actor_is_rejected(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviour 40."""
    agent = suspending_mock(store, clock)
    async with open_harness(store, clock, {"primary": agent}) as h:
        allow, _ = await suspend(h)
        admission = await h.runtime.admit(
            event("2", "", actor="user-2", approval=(allow, "allow_once"))
        )
        assert (admission.status, admission.reason) == ("denied", "rejected")
        await h.settle()
        assert agent.resume_calls == 0


async def test_suspension_survives_restart_and_resumes_exactly_once(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviours 41, 42 and 43 (the suspended run is resumed by a second runtime)."""
    first_agent = suspending_mock(store, clock)
    async with open_harness(store, clock, {"primary": first_agent}) as h1:
        allow, _ = await suspend(h1)
        run_id, _ = await suspended_run(store)
        await h1.runtime.stop()

    second_agent = suspending_mock(store, clock)
    async with open_harness(store, clock, {"primary": second_agent}) as h2:
        # 41: /status in the new runtime reports the durable suspension.
        assert (await h2.runtime.admit(event("10", "/status"))).status == "accepted"
        await h2.settle()
        assert "awaiting decision" in h2.last().text
        # 42: the approval is accepted once; the same token under a new event id is rejected.
        first = await h2.runtime.admit(event("11", "", approval=(allow, "allow_once")))
        assert first.status == "accepted", first
        await h2.settle()
        replay = await h2.runtime.admit(event("12", "", approval=(allow, "allow_once")))
        assert (replay.status, replay.reason) == ("denied", "rejected")
        await h2.settle()
        # 43: the tool ran once, the agent ran twice (run + resume), the answer was delivered
        # and previewed during the resume.
        assert await second_agent.tool_runs(run_id, OWNER) == 1
        assert first_agent.run_calls + second_agent.run_calls == 1
        assert first_agent.resume_calls + second_agent.resume_calls == 1
        assert h2.last().text == "mock: hello"
        assert h2.last().kind == "final"
        assert any("mock: hello" in p.text for p in h2.previews)
        assert "awaiting decision" not in "".join(h2.texts[-1:])


async def suspended_run(store: MemoryStore) -> tuple[str, str]:
    """(run id, session id) of the only mock run in the store."""
    page = await store.checkpoints.list_checkpoints(namespace=NS_RUN, limit=10)
    assert len(page.items) == 1
    row = page.items[0]
    return str(row.key).rsplit(":", 1)[-1], str(row.value["sessionId"])


async def test_cancel_while_suspended_denies_without_running_the_tool(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviour 44."""
    agent = suspending_mock(store, clock)
    async with open_harness(store, clock, {"primary": agent}) as h:
        await suspend(h)
        run_id, session_id = await suspended_run(store)
        admission = await h.runtime.admit(event("2", "/cancel"))
        assert admission.status == "accepted"
        await h.settle()
        assert await agent.tool_runs(run_id, OWNER) == 0
        assert agent.run_calls == 1
        assert h.last().text == DENIED_TEXT
        state = await agent.status(run_id=run_id, session_id=session_id, scope=OWNER)
        assert state is not None and state.status == "denied"
        # The route is no longer suspended: a new message runs (and suspends) again.
        assert (await h.runtime.admit(event("3", "again"))).status == "accepted"
        await h.settle()
        assert agent.run_calls == 2


async def test_cancel_during_resume_aborts_the_agent(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviour 45: the resumed turn waits (delay); ``/cancel`` aborts it."""
    agent = suspending_mock(store, clock, delay_ms=30_000)
    async with open_harness(store, clock, {"primary": agent}) as h:
        with trio.fail_after(3600):
            allow, _ = await suspend(h)
        run_id, session_id = await suspended_run(store)
        assert (await h.runtime.admit(event("2", "", approval=(allow, "allow_once")))).status == (
            "accepted"
        )
        await trio.sleep(1)
        status = await h.runtime.admit(event("3", "/status"))
        assert status.status == "accepted"
        await trio.sleep(1)
        assert "resuming" in h.last().text
        cancel = await h.runtime.admit(event("4", "/cancel"))
        assert cancel.status == "accepted"
        await h.settle()
        assert agent.run_calls == 1 and agent.resume_calls == 1
        # The tool had been dispatched (not rolled back); the agent saw the abort before
        # its answer, so its durable run state never reached `succeeded`.
        assert await agent.tool_runs(run_id, OWNER) == 1
        state = await agent.status(run_id=run_id, session_id=session_id, scope=OWNER)
        assert state is not None and state.status == "running"
        assert "mock: hello" not in h.texts
        assert h.last().text == "Request cancelled."


# --------------------------------------------------------------------------- leases 46-48


@attrs.define(eq=False)
class FlakyLeases:
    """A lease store whose first ``release_lease`` raises; records every call."""

    inner: Any
    releases: list[str] = attrs.field(factory=list)
    acquisitions: list[str] = attrs.field(factory=list)
    fail_first_release: bool = True

    async def try_acquire_lease(self, **kw: Any) -> Any:
        lease = await self.inner.try_acquire_lease(**kw)
        if lease is not None:
            self.acquisitions.append(lease.token)
        return lease

    async def renew_lease(self, **kw: Any) -> Any:
        return await self.inner.renew_lease(**kw)

    async def release_lease(self, **kw: Any) -> Any:
        self.releases.append(kw["token"])
        if self.fail_first_release and len(self.releases) == 1:
            raise OSError("lease store unavailable")
        return await self.inner.release_lease(**kw)

    async def get_lease(self, **kw: Any) -> Any:
        return await self.inner.get_lease(**kw)


@attrs.define(eq=False)
class StoreWithLeases:
    inner: MemoryStore
    leases: FlakyLeases

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def checkpoints(self) -> Any:
        return self.inner.checkpoints

    async def aclose(self) -> None:
        pass


async def test_failed_lease_release_is_counted_retried_and_recovered(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviours 46, 47 and 48."""
    echo = build_agent(
        "echo",
        AgentContext(alias="primary", options={}, checkpoints=store.checkpoints, clock=clock),
    )
    flaky = FlakyLeases(store.leases)
    wrapped = StoreWithLeases(store, flaky)
    async with open_harness(wrapped, clock, {"primary": echo}, use_leases=True) as h:  # type: ignore[arg-type]
        assert (await h.runtime.admit(event("1", "hello"))).status == "accepted"
        await h.settle()
        assert h.last().text == "hello"
        # The idle route gives its lease back after lease_idle_ms (virtual time here).
        await trio.sleep(2)
        assert h.runtime.diagnostics().storage_failures == 1  # 46
        await h.runtime.stop()
        # 47: the failed release was retried at stop with the same token.
        assert len(flaky.releases) == 2 and flaky.releases[0] == flaky.releases[1]
    second = FlakyLeases(store.leases, fail_first_release=False)
    async with open_harness(
        StoreWithLeases(store, second),  # type: ignore[arg-type]
        clock,
        {"primary": echo},
        use_leases=True,
    ) as h2:
        assert (await h2.runtime.admit(event("2", "again"))).status == "accepted"
        await h2.settle()
        assert h2.last().text == "again"
        # 48: a fresh acquisition with a new token; nothing failed.
        assert len(flaky.acquisitions) + len(second.acquisitions) == 2
        assert second.acquisitions[0] != flaky.acquisitions[0]
        assert h2.runtime.diagnostics().storage_failures == 0


# --------------------------------------------------------------------------- SPEC difference 4


async def test_reply_records_never_hold_approval_tokens(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """SPEC difference 4: the journal keeps controls without tokens (neither raw nor hashed
    inside a reply), and the control records hold only hashes in their keys."""
    agent = suspending_mock(store, clock)
    async with open_harness(store, clock, {"primary": agent}) as h:
        allow, deny = await suspend(h)
        rows = await all_rows(store)
        dump = json.dumps([[r.namespace, r.key, r.value, r.metadata] for r in rows])
        assert allow not in dump and deny not in dump
        reply_rows = [r for r in rows if r.namespace == "prism.channels.v1.reply"]
        assert reply_rows
        notice = next(r for r in reply_rows if r.value.get("controls"))
        assert [c["label"] for c in notice.value["controls"]] == ["Allow once", "Deny"]
        assert "p:a:" not in json.dumps(notice.value)
        control_keys = {r.key for r in rows if r.namespace == "prism.channels.v1.control"}
        assert any(k.endswith(token_hash(allow)) for k in control_keys)
        events = await store.checkpoints.list_events(limit=500)
        assert allow not in json.dumps([[e.key, e.metadata] for e in events.items])


async def test_resend_of_an_approval_notice_issues_fresh_controls(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """SPEC difference 4: a reconcile resend cannot replay stored tokens; it issues new ones,
    and the new allow token resumes the run."""
    agent = suspending_mock(store, clock)
    fail_next = [True]

    def fail_first_controls(reply: Reply) -> SendResult | None:
        if reply.buttons and fail_next[0]:
            fail_next[0] = False
            return SendResult(False, reason="telegram_api_error")
        return None

    async with open_harness(store, clock, {"primary": agent}) as h:
        h.deliver_hook = fail_first_controls
        allow, _ = await suspend(h)
        entries = await h.runtime.list_unresolved(identity=IDENTITY)
        target = [e for e in entries if e.reply_state == "delivery_failed"]
        assert len(target) == 1, entries
        result = await h.runtime.reconcile(
            identity=IDENTITY,
            connection_id="tg-1",
            operation_id=target[0].operation_id,
            expected_version=target[0].version,
        )
        assert result.outcome == "reply_delivered", result
        resent = h.last()
        new_allow, new_deny = tokens_of(resent)
        assert {new_allow, new_deny}.isdisjoint({allow})
        assert resent.text.startswith("Approval required for tool write")
        admission = await h.runtime.admit(event("5", "", approval=(new_allow, "allow_once")))
        assert admission.status == "accepted", admission
        await h.settle()
        assert h.last().text == "mock: hello"


# --------------------------------------------------------------------------- SPEC difference 6


async def test_pairing_flow_records_a_durable_grant(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """SPEC difference 6: ``pair`` issues a one-time token (hashed, TTL <= 5 min); the user
    sends ``/pair TOKEN``; a grant is recorded durably; the token cannot be reused."""
    echo = build_agent(
        "echo",
        AgentContext(alias="primary", options={}, checkpoints=store.checkpoints, clock=clock),
    )
    paired: list[Any] = []
    pair_scope = OwnershipScope("default", "tg-1", None)

    async def on_paired(grant: Any) -> None:
        paired.append(grant)

    async with open_harness(
        store,
        clock,
        {"primary": echo},
        grants={"stranger": None, "other": None},
        pairing_scope=lambda conn: pair_scope if conn == "tg-1" else None,
        on_paired=on_paired,
    ) as h:
        operator = AgentIdentity(
            tenant_id="default",
            principal=Principal("operator", "root"),
            scopes=("operator",),
            issued_at_ms=0,
        )
        ticket = await h.runtime.create_pairing(
            identity=operator, connection_id="tg-1", aliases=("primary",), ttl_ms=60_000
        )
        assert len(ticket.token) == 43 and ticket.connection_id == "tg-1"
        rows = await all_rows(store)
        assert ticket.token not in json.dumps([[r.key, r.value] for r in rows])
        before = len(h.replies)
        admission = await h.runtime.admit(event("p1", f"/pair {ticket.token}", actor="stranger"))
        assert admission.status == "accepted", admission
        await h.settle()
        assert len(h.replies) == before + 1 and ticket.token not in h.last().text
        assert paired and paired[0].actor_id == "stranger"
        assert paired[0].aliases == ("primary",)
        grants = await GrantStore(store.checkpoints, clock=clock).list(OwnershipScope("default"))
        assert [(g.connection_id, g.actor_id) for g in grants] == [("tg-1", "stranger")]
        # One-time: another actor cannot reuse it.
        reuse = await h.runtime.admit(event("p2", f"/pair {ticket.token}", actor="other"))
        assert (reuse.status, reuse.reason) == ("denied", "rejected")
        await h.settle()
        assert h.last().text == "That pairing code is not valid."
        assert len(paired) == 1
        grants = await GrantStore(store.checkpoints, clock=clock).list(OwnershipScope("default"))
        assert [g.actor_id for g in grants] == ["stranger"]


# --------------------------------------------------------------------------- §10.3 checks


async def test_text_approve_resumes_and_text_deny_denies(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """``/approve TOKEN`` and ``/deny TOKEN`` map to allow_once / reject_once (§8)."""
    agent = suspending_mock(store, clock)
    async with open_harness(store, clock, {"primary": agent}) as h:
        allow, _ = await suspend(h)
        run_id, _ = await suspended_run(store)
        admission = await h.runtime.admit(event("2", f"  /APPROVE {allow} "))
        assert admission.status == "accepted", admission
        await h.settle()
        assert h.last().text == "mock: hello"
        assert await agent.tool_runs(run_id, OWNER) == 1

    other_store = MemoryStore(clock=clock)
    agent2 = suspending_mock(other_store, clock)
    async with open_harness(other_store, clock, {"primary": agent2}) as h2:
        _, deny = await suspend(h2)
        run_id2, _ = await suspended_run(other_store)
        admission = await h2.runtime.admit(event("2", f"/deny {deny}"))
        assert admission.status == "accepted", admission
        await h2.settle()
        assert h2.last().text == DENIED_TEXT
        assert await agent2.tool_runs(run_id2, OWNER) == 0
        assert h2.runtime.diagnostics().suspended == 1


async def test_a_message_while_suspended_is_refused_and_new_cannot_bypass(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    agent = suspending_mock(store, clock)
    async with open_harness(store, clock, {"primary": agent}) as h:
        await suspend(h)
        refused = await h.runtime.admit(event("2", "another"))
        assert (refused.status, refused.reason) == ("denied", "awaiting_decision")
        await h.settle()
        assert h.last().text == "A previous request is awaiting an operator decision."
        new = await h.runtime.admit(event("3", "/new"))
        assert new.status == "accepted"
        await h.settle()
        assert h.last().text == (
            "Resolve or cancel the suspended request before starting a new conversation."
        )
        assert agent.run_calls == 1


@pytest.mark.parametrize(
    "change",
    ["wrong_outcome", "expired", "grant_revision", "alias_removed", "other_principal"],
)
async def test_approval_checks_reject_without_consuming(
    store: MemoryStore,
    clock: ManualClock,
    autojump_clock: trio.testing.MockClock,
    change: str,
) -> None:
    """§10.3: every binding of the control is re-checked; a failed check rejects and the
    token stays usable once the cause is gone (it was not consumed)."""
    agent = suspending_mock(store, clock)
    async with open_harness(store, clock, {"primary": agent}) as h:
        allow, _ = await suspend(h)
        outcome = "allow_once"
        good_grant = h.default_grant
        if change == "wrong_outcome":
            outcome = "reject_once"
        elif change == "expired":
            clock.advance(5 * 60 * 1000)
        elif change == "grant_revision":
            h.default_grant = grant(revision="rev-2")
        elif change == "alias_removed":
            h.default_grant = grant(aliases=("secondary",))
        elif change == "other_principal":
            h.default_grant = grant(
                attrs.evolve(IDENTITY, principal=Principal("user", "someone-else"))
            )
        admission = await h.runtime.admit(event("2", "", approval=(allow, outcome)))
        assert (admission.status, admission.reason) == ("denied", "rejected")
        await h.settle()
        assert agent.resume_calls == 0
        if change != "expired":
            h.default_grant = good_grant
            retry = await h.runtime.admit(event("3", "", approval=(allow, "allow_once")))
            assert retry.status == "accepted", retry
            await h.settle()
            assert h.last().text == "mock: hello"


async def test_changed_agent_definition_rejects_old_controls(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """§10.3: the control names the agent definition revision it was issued for."""
    async with open_harness(store, clock, {"primary": suspending_mock(store, clock)}) as h1:
        allow, _ = await suspend(h1)
        await h1.runtime.stop()
    changed = suspending_mock(store, clock, reply_prefix="changed: ")
    async with open_harness(store, clock, {"primary": changed}) as h2:
        admission = await h2.runtime.admit(event("2", "", approval=(allow, "allow_once")))
        assert (admission.status, admission.reason) == ("denied", "rejected")
        await h2.settle()
        assert changed.resume_calls == 0


async def test_restart_resume_on_sqlite(tmp_path: Any) -> None:
    """Behaviours 41-43 on a real SQLite file: the suspended run, its controls and the
    binding all come back from disk in a fresh store and runtime."""
    from stores import open_store

    url = f"sqlite:///{tmp_path}/journal.sqlite"
    clock = ManualClock()
    with trio.fail_after(60):
        async with (
            open_store(url, clock=clock) as first_store,
            open_harness(
                first_store,
                clock,
                {"primary": suspending_mock(first_store, clock)},
            ) as h1,
        ):
            allow, _ = await suspend(h1)
            await h1.runtime.stop()
        async with open_store(url, clock=clock) as second_store:
            agent = suspending_mock(second_store, clock)
            async with open_harness(second_store, clock, {"primary": agent}) as h2:
                await h2.runtime.admit(event("10", "/status"))
                await h2.settle()
                assert "awaiting decision" in h2.last().text
                ok = await h2.runtime.admit(event("11", "", approval=(allow, "allow_once")))
                assert ok.status == "accepted", ok
                await h2.settle()
                assert h2.last().text == "mock: hello"
                replay = await h2.runtime.admit(event("12", "", approval=(allow, "allow_once")))
                assert (replay.status, replay.reason) == ("denied", "rejected")
                page = await second_store.checkpoints.list_checkpoints(namespace=NS_RUN)
                (row,) = page.items
                assert row.value["toolRuns"] == 1 and row.value["status"] == "succeeded"


async def test_pairing_by_start_deep_link_and_expiry(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """SPEC difference 6: Telegram's ``/start TOKEN`` pairs too; an expired token does not."""
    echo = build_agent(
        "echo",
        AgentContext(alias="primary", options={}, checkpoints=store.checkpoints, clock=clock),
    )
    pair_scope = OwnershipScope("default", "tg-1", None)
    operator = AgentIdentity(
        tenant_id="default", principal=Principal("operator", "root"), scopes=("operator",),
        issued_at_ms=0,
    )  # fmt: skip
    async with open_harness(
        store,
        clock,
        {"primary": echo},
        grants={"a": None, "b": None},
        pairing_scope=lambda conn: pair_scope,
    ) as h:
        first = await h.runtime.create_pairing(
            identity=operator, connection_id="tg-1", aliases=("primary",)
        )
        second = await h.runtime.create_pairing(
            identity=operator, connection_id="tg-1", aliases=("primary",), ttl_ms=10**9
        )
        assert second.expires_at == first.expires_at  # clamped to the 5 min maximum
        ok = await h.runtime.admit(event("1", f"/start {first.token}", actor="a"))
        assert ok.status == "accepted", ok
        clock.advance(5 * 60 * 1000)
        late = await h.runtime.admit(event("2", f"/pair {second.token}", actor="b"))
        assert (late.status, late.reason) == ("denied", "rejected")
        await h.settle()
        grants = await GrantStore(store.checkpoints, clock=clock).list(OwnershipScope("default"))
        assert [g.actor_id for g in grants] == ["a"]
        # A foreign tenant's operator cannot issue tokens into this scope.
        with pytest.raises(Exception, match="outside"):
            await h.runtime.create_pairing(
                identity=attrs.evolve(operator, tenant_id="other"),
                connection_id="tg-1",
                aliases=("primary",),
            )


async def test_approval_notice_is_redacted(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Every outbound text is redacted, the approval notice's reason and tool name too."""
    agent = suspending_mock(store, clock, suspend_for_tool=SECRET)
    async with open_harness(store, clock, {"primary": agent}, redactor=ExactRedactor(SECRET)) as h:
        assert (await h.runtime.admit(event("1", "hello"))).status == "accepted"
        await h.settle()
        notice = h.last()
        assert notice.text.startswith("Approval required for tool ")
        assert SECRET not in notice.text and "[REDACTED]" in notice.text
        assert len(notice.buttons) == 2
        rows = await all_rows(store)
        replies = [r for r in rows if r.namespace == "prism.channels.v1.reply"]
        assert replies and all(SECRET not in json.dumps(r.value) for r in replies)


class SuspendsWithoutApprovals(RecordingAgent):
    async def run(self, request: Any, *, on_event: Any = None) -> RunResult:
        self.inputs.append(request.input)
        return RunResult("suspended", "", "run-x", request.session_id)


async def test_approvals_need_a_journal_and_a_capable_agent(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """§10.1: without a journal an approval event is ``unavailable``; an agent that suspends
    without durable approvals gets the generic notice and no controls."""
    async with open_harness(
        store, clock, {"primary": suspending_mock(store, clock)}, use_journal=False
    ) as h:
        token = "A" * 43
        admission = await h.runtime.admit(event("1", "", approval=(token, "allow_once")))
        assert (admission.status, admission.reason) == ("denied", "unavailable")

    agent = SuspendsWithoutApprovals(supports_approvals=False)
    async with open_harness(store, clock, {"primary": agent}) as h2:
        assert (await h2.runtime.admit(event("2", "hello"))).status == "accepted"
        await h2.settle()
        assert h2.last().text == "This request requires an authenticated host decision."
        assert h2.last().buttons == ()


class _GatedStatus:
    """Delegates to a real agent; ``status`` waits for ``release`` once armed."""

    def __init__(self, inner: MockAgent) -> None:
        self.inner = inner
        self.armed = False
        self.entered = trio.Event()
        self.release = trio.Event()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def status(self, **kw: Any) -> Any:
        if self.armed:
            self.entered.set()
            await self.release.wait()
        return await self.inner.status(**kw)


async def test_approval_racing_stop_is_retryable_and_keeps_its_token(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """An approval whose checks are still awaiting when ``stop()`` begins is answered
    ``stopped`` (retryable) without consuming the token or starting a resume; the same
    token then works on the next runtime."""
    agent = suspending_mock(store, clock)
    gated = _GatedStatus(agent)
    async with open_harness(store, clock, {"primary": gated}) as h:
        allow, _ = await suspend(h)
        gated.armed = True
        result: list[Any] = []

        async def approve() -> None:
            result.append(await h.runtime.admit(event("2", "", approval=(allow, "allow_once"))))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(approve)
            await gated.entered.wait()
            nursery.start_soon(h.runtime.stop)
            await trio.testing.wait_all_tasks_blocked()
            gated.release.set()
        assert (result[0].status, result[0].reason) == ("denied", "stopped")
        assert agent.resume_calls == 0
    async with open_harness(store, clock, {"primary": agent}) as h2:
        again = await h2.runtime.admit(event("3", "", approval=(allow, "allow_once")))
        assert again.status == "accepted", again
        await h2.settle()
        assert h2.last().text == "mock: hello" and agent.resume_calls == 1


@attrs.define(eq=False)
class SlowMarkStore:
    """The store, with the write that marks a reply ``delivered`` taking 5 s: the turn that
    sent an approval notice is still finishing when the user presses its button."""

    inner: MemoryStore

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def leases(self) -> Any:
        return self.inner.leases

    @property
    def checkpoints(self) -> Any:
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner.checkpoints, name)

    async def write_checkpoints(self, writes: Any, **kw: Any) -> Any:
        if any(json.loads(w.value_json).get("state") == "delivered" for w in writes):
            await trio.sleep(5)
        return await self.inner.checkpoints.write_checkpoints(writes, **kw)

    async def aclose(self) -> None:
        pass


async def test_an_approval_pressed_while_its_turn_still_finishes_is_not_refused(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """The notice reached the user before its turn wrote its last record; a valid decision
    made in that moment waits for the route instead of being refused."""
    agent = suspending_mock(store, clock)
    slow = SlowMarkStore(store)
    notice_seen = trio.Event()
    async with open_harness(slow, clock, {"primary": agent}) as h:
        h.deliver_hook = lambda reply: notice_seen.set() if reply.buttons else None
        assert (await h.runtime.admit(event("1", "hello"))).status == "accepted"
        with trio.fail_after(30):
            await notice_seen.wait()
        allow, _ = tokens_of(h.last())
        run_id, _ = await suspended_run(store)
        admission = await h.runtime.admit(event("2", f"/approve {allow}"))
        assert admission.status == "accepted", admission
        await h.settle()
        assert h.last().text == "mock: hello"
        assert await agent.tool_runs(run_id, OWNER) == 1
