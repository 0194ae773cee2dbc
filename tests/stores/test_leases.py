"""Conformance: LeaseStore rules (contract §1.3; behaviour 177; SPEC §8 reclaim)."""

from __future__ import annotations

from typing import Any

import pytest
import trio

from stores import (
    ANY_SCOPE,
    InvalidLeaseError,
    LeaseConflictError,
    LeaseRecord,
    OwnershipScope,
    Store,
)
from tests.support.clocks import EPOCH_MS

NS = "prism.channels.v1.binding"
KEY = "durable:tg-1"
SCOPE = OwnershipScope("tenant-1", "acct-1", "user-1")
OTHER = OwnershipScope("tenant-2", "acct-1", "user-1")


async def acquire(
    store: Store, owner: str = "worker-a", ttl_ms: int = 30_000, **kw: Any
) -> LeaseRecord | None:
    args: dict[str, Any] = {"namespace": NS, "key": KEY, "scope": SCOPE}
    args.update(kw)
    return await store.leases.try_acquire_lease(owner_id=owner, ttl_ms=ttl_ms, **args)


def _holder_args(lease: LeaseRecord, kw: dict[str, Any]) -> dict[str, Any]:
    args: dict[str, Any] = {
        "namespace": NS,
        "key": KEY,
        "scope": SCOPE,
        "owner_id": lease.owner_id,
        "token": lease.token,
    }
    args.update(kw)
    return args


async def renew(store: Store, lease: LeaseRecord, ttl_ms: int = 30_000, **kw: Any) -> Any:
    return await store.leases.renew_lease(ttl_ms=ttl_ms, **_holder_args(lease, kw))


async def release(store: Store, lease: LeaseRecord, **kw: Any) -> bool:
    return await store.leases.release_lease(**_holder_args(lease, kw))


async def get(store: Store, scope: OwnershipScope = SCOPE) -> LeaseRecord | None:
    return await store.leases.get_lease(namespace=NS, key=KEY, scope=scope)


async def test_first_acquire_excludes_others(store: Store, autojump_clock: Any) -> None:
    """Behaviour 177: worker-a acquires (ttl 30 s); worker-b gets None."""
    lease = await acquire(store)
    assert lease is not None
    now = EPOCH_MS + int(trio.current_time() * 1000)
    assert (lease.owner_id, lease.fencing_token, lease.scope) == ("worker-a", 1, SCOPE)
    assert lease.acquired_at_ms == lease.updated_at_ms == now
    assert lease.expires_at_ms == now + 30_000
    assert len(lease.token) >= 16
    assert await acquire(store, "worker-b") is None
    assert await acquire(store, "worker-a") is None  # the same owner without reclaim too
    assert await get(store) == lease


async def test_tokens_are_unique_per_acquisition(store: Store) -> None:
    tokens = set()
    for _ in range(5):
        lease = await acquire(store)
        assert lease is not None
        tokens.add(lease.token)
        assert await release(store, lease)
    assert len(tokens) == 5


@pytest.mark.slow
async def test_renew_keeps_tokens_and_moves_expiry(store: Store, autojump_clock: Any) -> None:
    lease = await acquire(store, ttl_ms=1000)
    assert lease is not None
    await trio.sleep(0.5)
    renewed = await renew(store, lease, ttl_ms=2000)
    assert renewed is not None
    assert (renewed.token, renewed.fencing_token) == (lease.token, lease.fencing_token)
    assert renewed.acquired_at_ms == lease.acquired_at_ms
    assert renewed.expires_at_ms == lease.acquired_at_ms + 500 + 2000
    assert renewed.updated_at_ms == lease.acquired_at_ms + 500
    assert await renew(store, lease, token="wrong") is None
    assert await renew(store, lease, owner_id="worker-b") is None
    await trio.sleep(1.9)
    assert await get(store) == renewed  # still inside the renewed TTL
    await trio.sleep(0.2)
    assert await get(store) is None
    assert await renew(store, lease) is None  # expired leases are not renewed


@pytest.mark.slow
async def test_expiry_then_takeover_bumps_fence(store: Store, autojump_clock: Any) -> None:
    lease = await acquire(store, ttl_ms=1000)
    assert lease is not None
    await trio.sleep(0.999)
    assert await acquire(store, "worker-b") is None
    await trio.sleep(0.001)  # expires_at is exclusive: at expiry the lease is free
    assert await get(store) is None
    taken = await acquire(store, "worker-b")
    assert taken is not None
    assert (taken.owner_id, taken.fencing_token) == ("worker-b", 2)
    assert taken.token != lease.token
    # The old holder can neither renew nor release any more.
    assert await renew(store, lease) is None
    assert not await release(store, lease)
    assert await get(store) == taken


@pytest.mark.slow
async def test_fence_counter_survives_release_and_expiry(store: Store, autojump_clock: Any) -> None:
    fences = []
    for i in range(3):
        lease = await acquire(store, owner=f"w{i}", ttl_ms=100)
        assert lease is not None
        fences.append(lease.fencing_token)
        assert await release(store, lease)
        assert not await release(store, lease)  # second release is a no-op
        assert await get(store) is None
    for i in range(3):
        lease = await acquire(store, owner=f"x{i}", ttl_ms=100)
        assert lease is not None
        fences.append(lease.fencing_token)
        await trio.sleep(0.2)
    assert fences == [1, 2, 3, 4, 5, 6]


async def test_release_needs_owner_and_token(store: Store) -> None:
    lease = await acquire(store)
    assert lease is not None
    assert not await release(store, lease, token="other")
    assert not await release(store, lease, owner_id="worker-b")
    assert await get(store) == lease
    assert await release(store, lease)


async def test_reclaim_takes_over_own_unexpired_lease(store: Store) -> None:
    lease = await acquire(store, owner="instance-1")
    assert lease is not None
    assert await acquire(store, owner="instance-2", adopt=True) is None
    assert await acquire(store, owner="instance-1") is None
    again = await acquire(store, owner="instance-1", adopt=True)
    assert again is not None
    assert again.token != lease.token and again.fencing_token == lease.fencing_token + 1
    # The predecessor's token is dead.
    assert await renew(store, lease) is None
    assert not await release(store, lease)
    assert await renew(store, again) is not None
    # Reclaim on a free row is an ordinary acquisition.
    assert await release(store, again)
    fresh = await acquire(store, owner="instance-3", adopt=True)
    assert fresh is not None and fresh.fencing_token == again.fencing_token + 1


@pytest.mark.slow
async def test_lease_scope_mismatch_is_a_conflict_both_ways(
    store: Store, autojump_clock: Any
) -> None:
    lease = await acquire(store, ttl_ms=1000)
    assert lease is not None
    for scope in (OTHER, ANY_SCOPE, OwnershipScope("tenant-1", "acct-1")):
        with pytest.raises(LeaseConflictError) as info:
            await acquire(store, owner="worker-b", scope=scope)
        assert not isinstance(info.value, InvalidLeaseError)
        with pytest.raises(LeaseConflictError):
            await renew(store, lease, scope=scope)
        with pytest.raises(LeaseConflictError):
            await release(store, lease, scope=scope)
        with pytest.raises(LeaseConflictError):
            await get(store, scope=scope)
    # Expiry does not change whose row it is.
    await trio.sleep(2)
    with pytest.raises(LeaseConflictError):
        await acquire(store, owner="worker-b", scope=OTHER)
    # And the other way round: a row owned by OTHER refuses SCOPE.
    theirs = await store.leases.try_acquire_lease(
        namespace=NS, key="k2", scope=OTHER, owner_id="w", ttl_ms=1000
    )
    assert theirs is not None
    with pytest.raises(LeaseConflictError):
        await store.leases.try_acquire_lease(
            namespace=NS, key="k2", scope=SCOPE, owner_id="w", ttl_ms=1000
        )
    with pytest.raises(LeaseConflictError):
        await store.leases.get_lease(namespace=NS, key="k2", scope=SCOPE)
    assert await get(store) is None
    again = await acquire(store, owner="worker-a")
    assert again is not None and again.fencing_token == 2


async def test_lease_keys_are_independent(store: Store) -> None:
    a = await acquire(store, key="one")
    b = await acquire(store, key="two")
    c = await acquire(store, namespace="other-ns", key="one")
    assert a and b and c
    assert {a.fencing_token, b.fencing_token, c.fencing_token} == {1}


async def test_acquire_race_has_exactly_one_winner(store: Store) -> None:
    winners: list[LeaseRecord] = []

    async def contender(i: int) -> None:
        lease = await acquire(store, owner=f"w{i}")
        if lease is not None:
            winners.append(lease)

    async with trio.open_nursery() as nursery:
        for i in range(30):
            nursery.start_soon(contender, i)
    assert len(winners) == 1 and winners[0].fencing_token == 1
    assert await get(store) == winners[0]


BAD_LEASES: list[tuple[str, dict[str, Any]]] = [
    ("empty-namespace", {"namespace": ""}),
    ("empty-key", {"key": ""}),
    ("empty-owner", {"owner": ""}),
    ("ttl-0", {"ttl_ms": 0}),
    ("ttl-negative", {"ttl_ms": -1}),
    ("ttl-float", {"ttl_ms": 1.5}),
    ("ttl-bool", {"ttl_ms": True}),
    ("scope-none", {"scope": None}),
]


@pytest.mark.parametrize("kw", [b[1] for b in BAD_LEASES], ids=[b[0] for b in BAD_LEASES])
async def test_bad_lease_input(store: Store, kw: dict[str, Any]) -> None:
    with pytest.raises(InvalidLeaseError) as info:
        await acquire(store, **kw)
    assert isinstance(info.value, LeaseConflictError)
    assert await get(store) is None


async def test_bad_renew_release_get_input(store: Store) -> None:
    lease = await acquire(store)
    assert lease is not None
    for kw in ({"token": ""}, {"owner_id": ""}, {"key": ""}, {"ttl_ms": 0}):
        with pytest.raises(InvalidLeaseError):
            await renew(store, lease, **kw)
    for kw in ({"token": ""}, {"owner_id": ""}, {"namespace": ""}):
        with pytest.raises(InvalidLeaseError):
            await release(store, lease, **kw)
    with pytest.raises(InvalidLeaseError):
        await store.leases.get_lease(namespace=NS, key="", scope=SCOPE)
    assert await get(store) == lease
