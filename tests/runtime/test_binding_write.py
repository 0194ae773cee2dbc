"""``Routes.binding_write``: a turn writes the binding only when something but its time
changed — and then whatever changed, field by field (a field added to the binding record
and forgotten by the comparison would fail here)."""

from __future__ import annotations

from typing import Any

import attrs
import pytest

from prismd.journal import BindingRecord, ChannelJournal, SuspendedRun
from prismd.limits import Limits
from prismd.runtime._routes import Routes
from stores import OwnershipScope
from stores.memory import MemoryStore

SCOPE = OwnershipScope("t", "conn", "actor")

DIFFERENT: dict[str, Any] = {
    "session_id": "another-session",
    "agent_alias": "another-alias",
    "generation": 7,
    "suspended": True,
    "leaf_id": "another-leaf",
    "suspended_run": SuspendedRun("op", "run", "s"),
    "connection_id": "another-conn",
    "external_conversation_id": "another-chat",
    "external_actor_id": "another-actor",
    "thread_id": "another-thread",
    "selected_at_ms": 99,
}


def _routes() -> Routes:
    journal = ChannelJournal(MemoryStore().checkpoints)
    return Routes(journal, Limits(), now_ms=lambda: 5_000, count=lambda _name: None)


def _route_with_stored(routes: Routes) -> Any:
    route = routes.route(
        ("conn", "chat", None, "actor", "primary", SCOPE.tenant_id, SCOPE.account_id, SCOPE.user_id)
    )
    assert route is not None
    route.session_id, route.leaf_id, route.selected_at_ms = "s-1", "e-1", 10
    stored = routes.binding_record(route, updated_at_ms=1_000)
    routes.apply_binding(route, 3, stored)
    return route, stored


def test_an_unchanged_binding_is_not_written_again() -> None:
    routes = _routes()
    route, _stored = _route_with_stored(routes)
    assert routes.binding_write(route, None) is None


@pytest.mark.parametrize(
    "field", [f.name for f in attrs.fields(BindingRecord) if f.name != "updated_at_ms"]
)
def test_any_field_that_changed_is_written(field: str) -> None:
    assert set(DIFFERENT) == {
        f.name for f in attrs.fields(BindingRecord) if f.name != "updated_at_ms"
    }, "a new binding field: give it a different value here"
    routes = _routes()
    route, stored = _route_with_stored(routes)
    # The stored copy differs in this one field from what the route would write now.
    route.binding_stored = stored.replace(**{field: DIFFERENT[field]})
    write = routes.binding_write(route, None)
    assert write is not None
    assert write.record == attrs.evolve(stored, updated_at_ms=5_000)
    assert write.expected_version == 3
