"""GrantAuthorizer: config grants, paired grants with a cache, pairing scopes, operators."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from prismd.grants import (
    AgentIdentity,
    AuthorizeInput,
    GrantAuthorizer,
    GrantConfig,
    Principal,
    grant_revision,
    identity_is_active,
    operator_identity,
)
from prismd.journal._access import GrantRecord, GrantStore
from stores import OwnershipScope, open_store
from tests.support.clocks import ManualClock


def Entry(**fields: Any) -> GrantConfig:
    """A grant that lets its actors use ``echo`` unless the test names other aliases."""
    return GrantConfig(**{"aliases": ("echo",), **fields})


@attrs.frozen
class Op:
    uid: int
    tenant: str = "default"
    account: str | None = None
    user: str | None = None


def _event(connection: str = "web", actor: str = "a1") -> AuthorizeInput:
    return AuthorizeInput(
        connection_id=connection,
        external_conversation_id="c1",
        external_actor_id=actor,
        event_id="e1",
        text="hello",
        action="message",
        received_at_ms=0,
    )


async def test_listed_actor_gets_identity_from_connection_and_actor() -> None:
    clock = ManualClock()
    entry = Entry(connection="tg", actors=("202", "303"), aliases=("echo", "mock"))
    auth = GrantAuthorizer([entry], clock=clock)
    grant = await auth.authorize(_event("tg", "303"))
    assert grant is not None
    assert grant.identity == AgentIdentity(
        tenant_id="default",
        account_id="tg",
        user_id="303",
        principal=Principal("user", "303"),
        scopes=("chat",),
        issued_at_ms=clock.ms,
    )
    assert identity_is_active(grant.identity, clock.ms)
    assert grant.agent_aliases == ("echo", "mock")
    assert grant.default_agent_alias is None
    assert grant.notifications is False
    assert grant.grant_revision == grant_revision(entry)


async def test_unlisted_actor_other_connection_and_empty_actor_are_refused() -> None:
    auth = GrantAuthorizer([Entry(connection="tg", actors=("202",))], clock=ManualClock())
    assert await auth.authorize(_event("tg", "999")) is None
    assert await auth.authorize(_event("other", "202")) is None
    assert await auth.authorize(_event("tg", "")) is None


async def test_wildcard_and_explicit_account_user_tenant_and_options() -> None:
    entry = Entry(
        connection="web",
        actors=("*",),
        tenant="acme",
        account="shared",
        user="team",
        aliases=("echo", "mock"),
        default_alias="mock",
        notifications=True,
    )
    auth = GrantAuthorizer([entry], clock=ManualClock())
    grant = await auth.authorize(_event("web", "browser-7"))
    assert grant is not None
    assert (grant.identity.tenant_id, grant.identity.account_id, grant.identity.user_id) == (
        "acme",
        "shared",
        "team",
    )
    assert grant.identity.principal == Principal("user", "browser-7")
    assert grant.default_agent_alias == "mock"
    assert grant.notifications is True


async def test_first_matching_entry_wins() -> None:
    specific = Entry(connection="tg", actors=("202",), aliases=("mock",))
    everyone = Entry(connection="tg", actors=("*",), aliases=("echo",))
    auth = GrantAuthorizer([specific, everyone], clock=ManualClock())
    first = await auth.authorize(_event("tg", "202"))
    other = await auth.authorize(_event("tg", "303"))
    assert first is not None and first.agent_aliases == ("mock",)
    assert other is not None and other.agent_aliases == ("echo",)
    assert first.grant_revision != other.grant_revision


def test_grant_revision_is_stable_and_changes_with_the_entry() -> None:
    entry = Entry(connection="tg", actors=("202",))
    assert grant_revision(entry) == grant_revision(Entry(connection="tg", actors=("202",)))
    assert grant_revision(entry).startswith("cfg-")
    for changed in (
        attrs.evolve(entry, actors=("203",)),
        attrs.evolve(entry, aliases=("mock",)),
        attrs.evolve(entry, tenant="t2"),
        attrs.evolve(entry, notifications=True),
        attrs.evolve(entry, default_alias="echo"),
        attrs.evolve(entry, pairing=True),
        attrs.evolve(entry, account="x"),
        attrs.evolve(entry, user="u"),
    ):
        assert grant_revision(changed) != grant_revision(entry)


def test_pairing_scope_only_for_connections_with_a_pairing_grant() -> None:
    auth = GrantAuthorizer(
        [
            Entry(connection="web", actors=("*",)),
            Entry(connection="tg", pairing=True, tenant="acme"),
            Entry(connection="tg", pairing=True, tenant="second"),
        ]
    )
    assert auth.pairing_scope("tg") == OwnershipScope(tenant_id="acme", account_id="tg")
    assert auth.pairing_scope("web") is None
    assert auth.pairing_scope("unknown") is None
    assert tuple(auth.pairing_connections()) == ("tg",)


def _record(actor: str, aliases: tuple[str, ...] = ("echo",)) -> GrantRecord:
    return GrantRecord(
        connection_id="tg",
        actor_id=actor,
        aliases=aliases,
        default_alias=None,
        created_at_ms=1,
    )


async def test_paired_grants_are_loaded_in_the_pairing_scope_and_cached() -> None:
    clock = ManualClock()
    calls: list[tuple[OwnershipScope, str, str]] = []
    paired: dict[str, GrantRecord] = {}

    async def load(scope: OwnershipScope, connection: str, actor: str) -> GrantRecord | None:
        calls.append((scope, connection, actor))
        return paired.get(actor)

    entry = Entry(connection="tg", pairing=True, tenant="acme", notifications=True)
    auth = GrantAuthorizer([entry], load_paired=load, clock=clock)
    # Not paired yet: a miss, cached briefly.
    assert await auth.authorize(_event("tg", "202")) is None
    assert await auth.authorize(_event("tg", "202")) is None
    assert calls == [(OwnershipScope("acme", "tg"), "tg", "202")]

    # Pairing recorded: on_paired makes it effective at once.
    paired["202"] = _record("202", ("echo", "mock"))
    await auth.on_paired(paired["202"])
    grant = await auth.authorize(_event("tg", "202"))
    assert grant is not None
    assert grant.identity == AgentIdentity(
        tenant_id="acme",
        account_id="tg",
        user_id="202",
        principal=Principal("user", "202"),
        scopes=("chat",),
        issued_at_ms=clock.ms,
    )
    assert grant.agent_aliases == ("echo", "mock")
    assert grant.notifications is True
    assert grant.grant_revision.startswith("paired-")
    assert len(calls) == 2
    # Cached hit.
    assert await auth.authorize(_event("tg", "202")) == grant
    assert len(calls) == 2
    # The cache expires.
    clock.ms += 60_001
    again = await auth.authorize(_event("tg", "202"))
    assert again is not None and again.grant_revision == grant.grant_revision
    assert len(calls) == 3

    # A miss expires after the short negative TTL even without on_paired.
    assert await auth.authorize(_event("tg", "303")) is None
    paired["303"] = _record("303")
    assert await auth.authorize(_event("tg", "303")) is None
    clock.ms += 5_001
    third = await auth.authorize(_event("tg", "303"))
    assert third is not None and third.identity.user_id == "303"
    assert third.grant_revision != grant.grant_revision


async def test_paired_grants_through_a_real_grant_store() -> None:
    async with open_store("memory://") as store:
        grants = GrantStore(store.checkpoints)
        entry = Entry(connection="tg", pairing=True, tenant="acme")
        auth = GrantAuthorizer([entry], load_paired=grants.load)
        scope = auth.pairing_scope("tg")
        assert scope is not None
        assert await auth.authorize(_event("tg", "202")) is None
        record = await grants.record(
            scope, connection_id="tg", actor_id="202", aliases=("echo",), default_alias="echo"
        )
        await auth.on_paired(record)
        grant = await auth.authorize(_event("tg", "202"))
        assert grant is not None
        assert grant.default_agent_alias == "echo"
        assert grant.identity.tenant_id == "acme"
        # A record on a connection without pairing grants nothing.
        assert auth.paired_grant(attrs.evolve(record, connection_id="web")) is None


async def test_no_store_lookup_without_pairing_or_loader() -> None:
    async def load(scope: OwnershipScope, connection: str, actor: str) -> GrantRecord | None:
        raise AssertionError("must not load")

    auth = GrantAuthorizer([Entry(connection="web", actors=("a1",))], load_paired=load)
    assert await auth.authorize(_event("web", "a2")) is None
    no_loader = GrantAuthorizer([Entry(connection="tg", pairing=True)])
    assert await no_loader.authorize(_event("tg", "a2")) is None


async def test_static_grant_wins_over_pairing_and_store_errors_propagate_uncached() -> None:
    calls = 0

    async def failing(scope: OwnershipScope, connection: str, actor: str) -> GrantRecord | None:
        nonlocal calls
        calls += 1
        raise RuntimeError("store down")

    auth = GrantAuthorizer(
        [Entry(connection="tg", actors=("202",)), Entry(connection="tg", pairing=True)],
        load_paired=failing,
    )
    assert await auth.authorize(_event("tg", "202")) is not None
    assert calls == 0
    for _ in range(2):
        with pytest.raises(RuntimeError):
            await auth.authorize(_event("tg", "303"))
    assert calls == 2


def test_operator_identity() -> None:
    clock = ManualClock()
    auth = GrantAuthorizer([], clock=clock)
    identity = auth.identity_for(Op(uid=1000, tenant="acme", account="tg", user="ops"))
    assert identity == AgentIdentity(
        tenant_id="acme",
        account_id="tg",
        user_id="ops",
        principal=Principal("operator", "1000"),
        scopes=("operator",),
        issued_at_ms=clock.ms,
    )
    assert identity_is_active(identity, clock.ms)
    tenant_wide = operator_identity(Op(uid=0), now_ms=5)
    assert (tenant_wide.tenant_id, tenant_wide.account_id, tenant_wide.user_id) == (
        "default",
        None,
        None,
    )


async def test_a_configured_grant_is_made_once_per_actor_and_the_memory_is_bounded() -> None:
    from prismd.grants import STATIC_MEMO_ENTRIES

    clock = ManualClock()
    auth = GrantAuthorizer([Entry(connection="tg", actors=("*",))], clock=clock)
    first = await auth.authorize(_event("tg", "303"))
    clock.ms += 5_000
    again = await auth.authorize(_event("tg", "303"))
    other = await auth.authorize(_event("tg", "404"))
    assert first is not None and again is first  # the same grant, its identity checked once
    assert other is not None and other is not first
    assert other.identity.user_id == "404" and other.identity.issued_at_ms == clock.ms
    assert identity_is_active(again.identity, clock.ms)
    for n in range(STATIC_MEMO_ENTRIES + 10):
        assert await auth.authorize(_event("tg", f"actor-{n}")) is not None
    assert len(auth._static) <= STATIC_MEMO_ENTRIES
    assert await auth.authorize(_event("web", "303")) is None  # not remembered as anything


def test_an_identity_is_checked_whole_once_and_its_times_on_every_call() -> None:
    import weakref

    from prismd import grants as identities

    identity = AgentIdentity(
        tenant_id="t",
        principal=Principal("user", "u"),
        scopes=("chat",),
        issued_at_ms=1_000,
        revoked_at_ms=5_000,
    )
    assert identity_is_active(identity, 1_000)
    assert id(identity) in identities._CHECKED
    assert not identity_is_active(identity, 5_000)  # revoked since: the time still counts
    assert not identity_is_active(identity, -70_000)  # issued over a minute in the future
    bad = attrs.evolve(identity, scopes=())
    assert not identity_is_active(bad, 1_000)
    # Not recorded as checked (an entry at its address may remain from a dead identity that
    # had it: its weak reference is dead).
    entry = identities._CHECKED.get(id(bad))
    assert entry is None or entry() is not bad
    # A new object at an address a checked identity had is checked afresh.
    identities._CHECKED[id(bad)] = weakref.ref(identity)
    assert not identity_is_active(bad, 1_000)
