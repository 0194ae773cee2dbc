"""Approval controls, pairing tokens and grants (contract §5.5, §5.6, §10; behaviours 107-110)."""

from __future__ import annotations

import json
import re

import pytest
import trio

from prismd.journal._access import (
    CATEGORY_CONTROL,
    NS_CONTROL,
    NS_GRANT,
    ApprovalStore,
    ApprovalTarget,
    ControlRecordTooLargeError,
    GrantStore,
    PairingStore,
    new_token,
    token_hash,
)
from stores import OwnershipScope
from stores.memory import MemoryStore
from tests.support.clocks import ManualClock

from .conftest import YieldingCheckpoints

SCOPE = OwnershipScope("tenant-1", None, "user-1")
TOKEN_RE = re.compile(r"^[A-Za-z0-9_-]{32,64}$")


def target(**changes: object) -> ApprovalTarget:
    base: dict[str, object] = dict(
        connection_id="tg-1",
        external_conversation_id="chat-1",
        external_actor_id="user-1",
        thread_id=None,
        principal_kind="user",
        principal_id="user-1",
        grant_revision="rev-1",
        agent_alias="primary",
        definition_revision="def-1",
        session_id="chan-s",
        run_id="run-1",
        approval_id="approval-1",
        expected_version=1,
    )
    base.update(changes)
    return ApprovalTarget(**base)  # type: ignore[arg-type]


async def all_control_rows(store: MemoryStore) -> list[tuple[str, str]]:
    page = await store.checkpoints.list_checkpoints(namespace=NS_CONTROL, limit=500)
    return [(r.key, json.dumps(r.value)) for r in page.items]


def test_tokens_are_43_char_base64url_and_hashes_40_hex() -> None:
    tokens = {new_token() for _ in range(50)}
    assert len(tokens) == 50
    for token in tokens:
        assert len(token) == 43 and TOKEN_RE.match(token)
    h = token_hash("abc")
    assert h == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"[:40]


async def test_issue_creates_two_records_without_tokens(
    store: MemoryStore, clock: ManualClock
) -> None:
    approvals = ApprovalStore(store.checkpoints, clock=clock)
    issued = await approvals.issue(SCOPE, target(thread_id="77"), ttl_ms=300_000)
    allow, deny = issued.buttons
    assert allow.label == "Allow once" and allow.value.startswith("p:a:")
    assert deny.label == "Deny" and deny.value.startswith("p:d:")
    t_allow, t_deny = allow.value[4:], deny.value[4:]
    assert t_allow != t_deny and TOKEN_RE.match(t_allow) and TOKEN_RE.match(t_deny)
    assert issued.expires_at_ms == clock.ms + 300_000
    rows = await all_control_rows(store)
    assert sorted(k for k, _ in rows) == sorted(
        f"a1:tg-1:tenant-1:-:user-1:{token_hash(t)}" for t in (t_allow, t_deny)
    )
    for key, value in rows:
        assert t_allow not in key + value and t_deny not in key + value
    record = await store.checkpoints.load_checkpoint(
        namespace=NS_CONTROL, key=f"a1:tg-1:tenant-1:-:user-1:{token_hash(t_allow)}", scope=SCOPE
    )
    assert record is not None and record.category == CATEGORY_CONTROL
    assert record.value["outcome"] == "allow_once" and record.value["threadId"] == "77"
    assert record.value["state"] == "pending" and record.value["expectedVersion"] == 1
    loaded = await approvals.load(SCOPE, "tg-1", t_deny)
    assert loaded is not None and loaded.version == 1
    assert loaded.record.outcome == "reject_once"
    assert loaded.record.target == target(thread_id="77")


async def test_ttl_is_clamped_to_five_minutes(store: MemoryStore, clock: ManualClock) -> None:
    approvals = ApprovalStore(store.checkpoints, clock=clock)
    issued = await approvals.issue(SCOPE, target(), ttl_ms=3_600_000)
    assert issued.expires_at_ms == clock.ms + 300_000


async def test_load_misses_other_connection_scope_and_unknown_token(
    store: MemoryStore, clock: ManualClock
) -> None:
    approvals = ApprovalStore(store.checkpoints, clock=clock)
    issued = await approvals.issue(SCOPE, target(), ttl_ms=60_000)
    token = issued.buttons[0].value[4:]
    assert await approvals.load(SCOPE, "tg-2", token) is None
    assert await approvals.load(OwnershipScope("tenant-1", None, "user-2"), "tg-1", token) is None
    assert await approvals.load(SCOPE, "tg-1", new_token()) is None
    assert await approvals.consume(SCOPE, "tg-2", token, 1) == "invalid"


async def test_load_rejects_a_record_whose_connection_differs(
    store: MemoryStore, clock: ManualClock
) -> None:
    """The key carries the connection, but the record must agree too (§10.3)."""
    approvals = ApprovalStore(store.checkpoints, clock=clock)
    issued = await approvals.issue(SCOPE, target(connection_id="tg-9"), ttl_ms=60_000)
    token = issued.buttons[0].value[4:]
    # Issued with target connection tg-9 -> key is a1:tg-9:..., so tg-9 loads, tg-1 misses.
    assert await approvals.load(SCOPE, "tg-9", token) is not None
    key = f"a1:tg-9:tenant-1:-:user-1:{token_hash(token)}"
    row = await store.checkpoints.load_checkpoint(namespace=NS_CONTROL, key=key, scope=SCOPE)
    assert row is not None
    forged = dict(row.value, connectionId="tg-1")
    await store.checkpoints.save_checkpoint(
        namespace=NS_CONTROL, key=key, scope=SCOPE, version=2, value=forged, expected_version=1
    )
    assert await approvals.load(SCOPE, "tg-9", token) is None
    await store.checkpoints.save_checkpoint(
        namespace=NS_CONTROL, key=key, scope=SCOPE, version=3, value={"x": 1}, expected_version=2
    )
    assert await approvals.load(SCOPE, "tg-9", token) is None


async def test_consume_once_then_already_consumed(store: MemoryStore, clock: ManualClock) -> None:
    approvals = ApprovalStore(store.checkpoints, clock=clock)
    issued = await approvals.issue(SCOPE, target(), ttl_ms=60_000)
    token = issued.buttons[0].value[4:]
    assert await approvals.consume(SCOPE, "tg-1", token, 1) == "consumed"
    loaded = await approvals.load(SCOPE, "tg-1", token)
    assert loaded is not None and loaded.version == 2
    assert loaded.record.state == "consumed" and loaded.record.consumed_at_ms == clock.ms
    assert await approvals.consume(SCOPE, "tg-1", token, 1) == "already_consumed"
    assert await approvals.consume(SCOPE, "tg-1", token, 2) == "already_consumed"
    # The other control of the pair is independent.
    other = issued.buttons[1].value[4:]
    assert await approvals.consume(SCOPE, "tg-1", other, 1) == "consumed"


async def test_consume_with_a_stale_version_is_invalid(
    store: MemoryStore, clock: ManualClock
) -> None:
    approvals = ApprovalStore(store.checkpoints, clock=clock)
    issued = await approvals.issue(SCOPE, target(), ttl_ms=60_000)
    token = issued.buttons[0].value[4:]
    assert await approvals.consume(SCOPE, "tg-1", token, 7) == "invalid"
    assert await approvals.consume(SCOPE, "tg-1", new_token(), 1) == "invalid"


async def test_consume_expires_at_the_boundary(store: MemoryStore, clock: ManualClock) -> None:
    approvals = ApprovalStore(store.checkpoints, clock=clock)
    issued = await approvals.issue(SCOPE, target(), ttl_ms=1_000)
    token = issued.buttons[0].value[4:]
    clock.advance(999)
    loaded = await approvals.load(SCOPE, "tg-1", token)
    assert loaded is not None and loaded.record.expires_at_ms > clock.ms
    clock.advance(1)
    assert await approvals.consume(SCOPE, "tg-1", token, 1) == "expired"
    loaded = await approvals.load(SCOPE, "tg-1", token)
    assert loaded is not None and loaded.record.state == "pending"


async def test_exactly_one_concurrent_consumer_wins(store: MemoryStore, clock: ManualClock) -> None:
    checkpoints = YieldingCheckpoints(store.checkpoints)
    approvals = ApprovalStore(checkpoints, clock=clock)
    issued = await approvals.issue(SCOPE, target(), ttl_ms=60_000)
    token = issued.buttons[0].value[4:]
    loaded = await approvals.load(SCOPE, "tg-1", token)
    assert loaded is not None
    results: list[str] = []

    async def consumer() -> None:
        results.append(await approvals.consume(SCOPE, "tg-1", token, loaded.version))

    async with trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(consumer)
    assert sorted(results) == ["already_consumed"] * 9 + ["consumed"]
    # Every consumer loaded before any saved: the losers lost the CAS itself.
    assert checkpoints.conflicts == 9


async def test_issue_rejects_bad_version_and_oversized_records(
    store: MemoryStore, clock: ManualClock
) -> None:
    approvals = ApprovalStore(store.checkpoints, clock=clock, max_record_bytes=1024)
    with pytest.raises(ValueError, match="expected_version"):
        await approvals.issue(SCOPE, target(expected_version=0), ttl_ms=1000)
    with pytest.raises(ControlRecordTooLargeError, match="max_journal_record_bytes"):
        await approvals.issue(SCOPE, target(approval_id="x" * 2000), ttl_ms=1000)
    assert await all_control_rows(store) == []


# --------------------------------------------------------------------------- pairing


async def test_pairing_record_never_contains_the_token(
    store: MemoryStore, clock: ManualClock
) -> None:
    """Behaviour 107."""
    pairings = PairingStore(store.checkpoints, clock=clock)
    issued = await pairings.create(
        SCOPE,
        connection_id="tg-1",
        aliases=("primary",),
        external_conversation_id="chat-1",
        actor_id="user-1",
        agent_alias="primary",
        grant_revision="rev-1",
    )
    assert len(issued.token) > 20 and TOKEN_RE.match(issued.token)
    rows = await all_control_rows(store)
    assert len(rows) == 1
    key, value = rows[0]
    assert key == f"p1:tg-1:tenant-1:-:user-1:{token_hash(issued.token)}"
    assert issued.token not in key and issued.token not in value
    assert issued.expires_at_ms == clock.ms + 300_000


async def test_pairing_consume_lifecycle(store: MemoryStore, clock: ManualClock) -> None:
    """Behaviours 108 and 109."""
    pairings = PairingStore(store.checkpoints, clock=clock)
    issued = await pairings.create(
        SCOPE,
        connection_id="tg-1",
        aliases=("primary",),
        external_conversation_id="chat-1",
        actor_id="user-1",
        agent_alias="primary",
        grant_revision="rev-1",
    )
    wrong_conn = await pairings.consume(SCOPE, connection_id="tg-2", token=issued.token)
    assert wrong_conn.status == "invalid" and wrong_conn.target is None
    other_scope = OwnershipScope("tenant-1", None, "user-2")
    assert (
        await pairings.consume(other_scope, connection_id="tg-1", token=issued.token)
    ).status == "invalid"
    first = await pairings.consume(SCOPE, connection_id="tg-1", token=issued.token)
    assert first.status == "consumed"
    assert first.target is not None and first.target.grant_revision == "rev-1"
    assert first.target == issued.target
    assert first.target.aliases == ("primary",) and first.target.external_actor_id == "user-1"
    again = await pairings.consume(SCOPE, connection_id="tg-1", token=issued.token)
    assert again.status == "already_consumed"
    unknown = await pairings.consume(SCOPE, connection_id="tg-1", token=new_token())
    assert unknown.status == "invalid"
    # After consumption, the wrong connection is still just invalid (no oracle).
    after = await pairings.consume(SCOPE, connection_id="tg-2", token=issued.token)
    assert after.status == "invalid"


async def test_pairing_expiry_uses_now(store: MemoryStore, clock: ManualClock) -> None:
    """Behaviour 110: expired when now = expiresAt + 1 ms (and already at expiresAt)."""
    pairings = PairingStore(store.checkpoints, clock=clock)
    issued = await pairings.create(
        SCOPE, connection_id="tg-1", aliases=("primary",), ttl_ms=1000, grant_revision="rev-1"
    )
    assert issued.expires_at_ms == clock.ms + 1000
    late = await pairings.consume(
        SCOPE, connection_id="tg-1", token=issued.token, now_ms=issued.expires_at_ms + 1
    )
    assert late.status == "expired" and late.target is None
    at = await pairings.consume(
        SCOPE, connection_id="tg-1", token=issued.token, now_ms=issued.expires_at_ms
    )
    assert at.status == "expired"
    clock.advance(999)
    ok = await pairings.consume(SCOPE, connection_id="tg-1", token=issued.token)
    assert ok.status == "consumed"


async def test_pairing_ttl_clamped(store: MemoryStore, clock: ManualClock) -> None:
    pairings = PairingStore(store.checkpoints, clock=clock)
    short = await pairings.create(SCOPE, connection_id="tg-1", aliases=("a",), ttl_ms=5)
    long = await pairings.create(SCOPE, connection_id="tg-1", aliases=("a",), ttl_ms=10**9)
    default = await pairings.create(
        SCOPE, connection_id="tg-1", aliases=("a",), now_ms=clock.ms + 50
    )
    assert short.expires_at_ms == clock.ms + 1000
    assert long.expires_at_ms == clock.ms + 300_000
    assert default.expires_at_ms == clock.ms + 50 + 300_000
    assert default.target.grant_revision == "pairing" and default.target.external_actor_id is None


async def test_pairing_exactly_one_concurrent_consumer(
    store: MemoryStore, clock: ManualClock
) -> None:
    checkpoints = YieldingCheckpoints(store.checkpoints)
    pairings = PairingStore(checkpoints, clock=clock)
    issued = await pairings.create(SCOPE, connection_id="tg-1", aliases=("primary",))
    results: list[str] = []

    async def consumer() -> None:
        r = await pairings.consume(SCOPE, connection_id="tg-1", token=issued.token)
        results.append(r.status)

    async with trio.open_nursery() as nursery:
        for _ in range(8):
            nursery.start_soon(consumer)
    assert sorted(results) == ["already_consumed"] * 7 + ["consumed"]
    assert checkpoints.conflicts == 7


# --------------------------------------------------------------------------- grants


async def test_grant_record_is_an_idempotent_upsert(store: MemoryStore, clock: ManualClock) -> None:
    grants = GrantStore(store.checkpoints, clock=clock)
    scope = OwnershipScope("default", "tg-1", "202")
    first = await grants.record(scope, connection_id="tg-1", actor_id="202", aliases=("primary",))
    assert first.created_at_ms == clock.ms and first.default_alias is None
    clock.advance(10)
    again = await grants.record(scope, connection_id="tg-1", actor_id="202", aliases=("primary",))
    assert again == first
    row = await store.checkpoints.load_checkpoint(
        namespace=NS_GRANT, key="g1:tg-1:202", scope=scope
    )
    assert row is not None and row.version == 1
    changed = await grants.record(
        scope,
        connection_id="tg-1",
        actor_id="202",
        aliases=("primary", "secondary"),
        default_alias="secondary",
    )
    assert changed.created_at_ms == first.created_at_ms
    assert changed.aliases == ("primary", "secondary") and changed.default_alias == "secondary"
    assert await grants.load(scope, "tg-1", "202") == changed
    assert await grants.load(scope, "tg-1", "203") is None
    assert await grants.load(OwnershipScope("other", "tg-1", "202"), "tg-1", "202") is None


async def test_grant_list_filters_by_connection_and_scope(
    store: MemoryStore, clock: ManualClock
) -> None:
    grants = GrantStore(store.checkpoints, clock=clock)
    for conn, actor in (("tg-1", "1"), ("tg-1", "2"), ("sig", "1")):
        await grants.record(
            OwnershipScope("default", conn, actor),
            connection_id=conn,
            actor_id=actor,
            aliases=("a",),
        )
        clock.advance(1)
    everything = await grants.list(OwnershipScope("default"))
    assert len(everything) == 3
    tg = await grants.list(OwnershipScope("default"), connection_id="tg-1")
    assert sorted(g.actor_id for g in tg) == ["1", "2"]
    assert await grants.list(OwnershipScope("nobody")) == []
    assert len(await grants.list(OwnershipScope("default"), limit=2)) == 2


async def test_grant_validation(store: MemoryStore, clock: ManualClock) -> None:
    grants = GrantStore(store.checkpoints, clock=clock)
    with pytest.raises(ValueError, match="default_alias"):
        await grants.record(
            SCOPE, connection_id="tg-1", actor_id="1", aliases=("a",), default_alias="b"
        )
    with pytest.raises(ValueError, match="aliases"):
        await grants.record(SCOPE, connection_id="tg-1", actor_id="1", aliases=())
