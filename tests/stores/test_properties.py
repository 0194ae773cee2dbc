"""Hypothesis: random sequences of saves/deletes and lease calls against a tiny model.

Each example opens a fresh store on every backend and checks each call's outcome and the
resulting state against the rules of ``stores._contracts`` written out as plain Python.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stores import CheckpointConflictError, OwnershipScope, Store, open_store
from tests.support import pgserver
from tests.support.backends import BACKENDS, Backend
from tests.support.clocks import ManualClock

SCOPES = [OwnershipScope("t1", "a1", "u1"), OwnershipScope("t1", "a1", "u2"), OwnershipScope()]
KEYS = ["a", "b"]

PROPERTY_SETTINGS = settings(
    deadline=None,
    database=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@attrs.define
class Scratch:
    """Where each example of one test keeps its store: a fresh directory per example, or,
    for PostgreSQL, one schema per test emptied between examples (migrating a new schema for
    every example would be most of the run)."""

    schemas: dict[str, Backend] = attrs.Factory(dict)

    @contextmanager
    def url(self, name: str) -> Iterator[str]:
        if name == "postgres":
            backend = self.schemas.get(name)
            if backend is None:
                backend = self.schemas[name] = BACKENDS[name](Path("."))
            else:
                pgserver.empty_schema(backend.url)
            yield backend.url
            return
        with tempfile.TemporaryDirectory() as directory:
            yield BACKENDS[name](Path(directory)).url

    def discard(self) -> None:
        for backend in self.schemas.values():
            backend.discard()


@pytest.fixture
def scratch() -> Iterator[Scratch]:
    """Shared by every example of a test (Hypothesis runs them all in one call)."""
    kept = Scratch()
    yield kept
    kept.discard()


# Mostly the first scope, so rows are rewritten often enough to hit the version/fence rules.
scope_index = st.sampled_from([0, 0, 0, 0, 1, 2])
save_op = st.tuples(
    st.just("save"),
    st.sampled_from(KEYS),
    scope_index,
    # "next"/"current" follow the model, so most saves are ones that could succeed.
    st.one_of(st.just("next"), st.just("next"), st.integers(1, 6)),
    st.one_of(st.none(), st.just("current"), st.just("current"), st.integers(0, 6)),
    st.one_of(st.none(), st.integers(0, 4)),
)
delete_op = st.tuples(st.just("delete"), st.sampled_from(KEYS), scope_index)
checkpoint_ops = st.lists(st.one_of(save_op, save_op, delete_op), min_size=1, max_size=25)


def model_save(
    row: tuple[int, int, int | None] | None,
    scope: int,
    version: int,
    expected: int | None,
    fence: int | None,
) -> bool:
    """The save rules of the contract, written as directly as possible."""
    if row is None:
        return expected in (None, 0)
    stored_scope, stored_version, stored_fence = row
    if stored_scope != scope:
        return False
    if expected is not None and expected != stored_version:
        return False
    if version <= stored_version:
        return False
    return stored_fence is None or (fence is not None and fence >= stored_fence)


async def run_checkpoint_ops(store: Store, ops: list[tuple[Any, ...]]) -> None:
    model: dict[str, tuple[int, int, int | None]] = {}
    events = 0
    cp = store.checkpoints
    for op in ops:
        if op[0] == "save":
            _, key, scope, version, expected, fence = op
            row = model.get(key)
            if version == "next":
                version = 1 if row is None else row[1] + 1
            if expected == "current":
                expected = 0 if row is None else row[1]
            ok = model_save(model.get(key), scope, version, expected, fence)
            try:
                rec = await cp.save_checkpoint(
                    namespace="n", key=key, scope=SCOPES[scope], version=version,
                    value={"v": version}, expected_version=expected, fencing_token=fence,
                )  # fmt: skip
            except CheckpointConflictError:
                assert not ok, op
            else:
                assert ok, op
                assert (rec.version, rec.fencing_token) == (version, fence)
                model[key] = (scope, version, fence)
                events += 1
        else:
            _, key, scope = op
            removed = await cp.delete_checkpoint(namespace="n", key=key, scope=SCOPES[scope])
            row = model.get(key)
            assert removed == (row is not None and row[0] == scope), op
            if removed:
                del model[key]
                events += 1
        for k in KEYS:
            for s, sc in enumerate(SCOPES):
                loaded = await cp.load_checkpoint(namespace="n", key=k, scope=sc)
                row = model.get(k)
                if row is None or row[0] != s:
                    assert loaded is None
                else:
                    assert loaded is not None
                    assert (loaded.version, loaded.fencing_token) == (row[1], row[2])
                    assert loaded.value == {"v": row[1]}
    page = await cp.list_events(limit=500)
    assert len(page.items) == events


@pytest.mark.parametrize("backend_name", list(BACKENDS))
@PROPERTY_SETTINGS
@given(ops=checkpoint_ops)
@pytest.mark.slow
def test_checkpoint_rules_match_model(
    scratch: Scratch, backend_name: str, ops: list[tuple[Any, ...]]
) -> None:
    with scratch.url(backend_name) as url:

        async def main() -> None:
            async with open_store(url, clock=ManualClock()) as store:
                await run_checkpoint_ops(store, ops)

        trio.run(main)


lease_ops = st.lists(
    st.one_of(
        st.tuples(st.just("acquire"), st.sampled_from(["x", "y"]), st.booleans()),
        st.tuples(st.just("renew"), st.sampled_from(["x", "y"]), st.booleans()),
        st.tuples(st.just("release"), st.sampled_from(["x", "y"]), st.booleans()),
        st.tuples(st.just("advance"), st.integers(0, 1500)),
    ),
    min_size=1,
    max_size=30,
)


async def run_lease_ops(store: Store, clock: ManualClock, ops: list[tuple[Any, ...]]) -> None:
    ttl = 1000
    holder: str | None = None
    expires = 0
    fence = 0
    # The latest token each owner was given (possibly stale by now).
    tokens: dict[str, str] = {}
    current_token: str | None = None
    lk: dict[str, Any] = {"namespace": "n", "key": "k", "scope": SCOPES[0]}
    for op in ops:
        now = clock.ms
        live = holder is not None and expires > now
        if op[0] == "advance":
            clock.ms += op[1]
        elif op[0] == "acquire":
            _, owner, adopt = op
            lease = await store.leases.try_acquire_lease(
                owner_id=owner, ttl_ms=ttl, adopt=adopt, **lk
            )
            if live and not (adopt and holder == owner):
                assert lease is None, op
            else:
                assert lease is not None, op
                fence += 1
                assert lease.fencing_token == fence
                assert lease.expires_at_ms == now + ttl
                holder, expires, current_token = owner, now + ttl, lease.token
                tokens[owner] = lease.token
        elif op[0] in ("renew", "release"):
            _, owner, use_current = op
            token = current_token if use_current else tokens.get(owner)
            if token is None:
                continue
            valid = live and holder == owner and token == current_token
            if op[0] == "renew":
                got = await store.leases.renew_lease(owner_id=owner, token=token, ttl_ms=ttl, **lk)
                assert (got is not None) == valid, op
                if got is not None:
                    assert got.fencing_token == fence and got.token == token
                    expires = now + ttl
            else:
                released = await store.leases.release_lease(owner_id=owner, token=token, **lk)
                assert released == valid, op
                if released:
                    expires = now
        current = await store.leases.get_lease(**lk)
        if holder is not None and expires > clock.ms:
            assert current is not None and current.owner_id == holder
            assert (current.fencing_token, current.expires_at_ms) == (fence, expires)
        else:
            assert current is None


@pytest.mark.parametrize("backend_name", list(BACKENDS))
@PROPERTY_SETTINGS
@given(ops=lease_ops)
@pytest.mark.slow
def test_lease_rules_match_model(
    scratch: Scratch, backend_name: str, ops: list[tuple[Any, ...]]
) -> None:
    with scratch.url(backend_name) as url:

        async def main() -> None:
            clock = ManualClock()
            async with open_store(url, clock=clock) as store:
                await run_lease_ops(store, clock, ops)

        trio.run(main)
