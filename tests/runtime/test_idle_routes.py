"""What an idle route costs: no task left sleeping, no lock kept, and the per-actor and
per-scope memories bounded — a forgotten one is read again from the journal, never
answered wrongly."""

from __future__ import annotations

import trio
import trio.lowlevel

from prismd.grants import ownership_from_identity
from prismd.journal._journal import ChannelJournal
from prismd.limits import Limits
from tests.support.builders import event, grant, identity
from tests.support.harness import Host, StoreFactory, runtime
from tests.support.waiting import wait_until


def live_task_names() -> list[str]:
    names: list[str] = []
    root = trio.lowlevel.current_root_task()
    assert root is not None
    pending = [root]
    while pending:
        task = pending.pop()
        names.append(task.name)
        for nursery in task.child_nurseries:
            pending.extend(nursery.child_tasks)
    return names


async def test_an_idle_route_keeps_no_lease_task_and_no_lock(stores: StoreFactory) -> None:
    # Real time (SQLite works on threads, which a virtual clock would skip past), with a
    # short idle grace so the release comes soon.
    store = await stores()
    async with runtime(Host(), store, lease_idle_ms=50) as rt:
        for i in range(3):
            await rt.admit(event(str(i), chat=f"chat-{i}"))
        with trio.fail_after(30):
            await rt.drain()
        routes = list(rt._core.routes._table.values())
        assert len(routes) == 3
        # The idle lease is released after lease_idle_ms; the renewer, which would
        # otherwise sleep until a third of the TTL before noticing, goes with it.
        with trio.fail_after(10):
            await wait_until(lambda: all(r.lease is None for r in routes), step=0.01)
            await trio.sleep(0.1)  # the cancelled renewers unwind
        for route in routes:
            assert route.lease is None and route.renewer is None
            assert route._lease_lock is None and route._hydrate_lock is None
        sleeping = [n for n in live_task_names() if "_renewer" in n or "_release_later" in n]
        assert sleeping == []
        # Used again: a new lease, a new renewer, and the message runs.
        await rt.admit(event("again", chat="chat-0"))
        with trio.fail_after(30):
            await rt.drain()
        assert routes[0].lease is None or routes[0].renewer is not None
        assert await rt.list_unresolved(identity=identity()) == []


async def test_forgotten_cursors_and_selections_are_read_again(stores: StoreFactory) -> None:
    """Eight actors, each in its own scope, through memories bounded at five (the route
    table's bound here): the oldest are forgotten, and coming back reads the journal —
    the cursor counts on from where it was, the ``/agent`` choice is still the actor's."""
    store = await stores()
    actors = [f"user-{i}" for i in range(8)]
    grants = {
        a: grant(identity(user=a), aliases=("primary", "other"), default="primary") for a in actors
    }
    host = Host(grants=grants)  # type: ignore[arg-type]
    # lease_idle_ms=0: an idle route's lease goes at once, so the route may be evicted.
    async with runtime(host, store, limits=Limits(max_routes=5), lease_idle_ms=0) as rt:
        core = rt._core
        choice = await rt.admit(event("pick", "/agent other", actor="user-0", chat="c-0"))
        assert choice.status == "accepted", choice
        for n, actor in enumerate(actors):
            accepted = await rt.admit(event(f"m{n}", actor=actor, chat=f"c-{n}"))
            assert accepted.status == "accepted", accepted
            await rt.drain()
        assert len(core.cursors) <= 5 and len(core.selections) <= 5
        first = ("tg-1", ownership_from_identity(grants["user-0"].identity))
        assert first not in core.cursors
        back = await rt.admit(event("back", actor="user-0", chat="c-0"))
        assert back.status == "accepted"
        await rt.drain()
    journal = ChannelJournal(store.checkpoints)
    cursor = await journal.load_cursor(first[1], "tg-1")
    assert cursor is not None and cursor.record.admitted == 3  # /agent, m0, back
    assert cursor.record.last_event_id == "back"
    answered_by = [r.text for r in host.replies if r.in_reply_to in ("m0", "back")]
    assert len(answered_by) == 2
    resolved = [r.agent_alias for r in host.resolved if r.identity.user_id == "user-0"]
    assert resolved and set(resolved) == {"other"}
