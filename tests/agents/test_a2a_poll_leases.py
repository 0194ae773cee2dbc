"""Several instances on one PostgreSQL database follow the same remote A2A tasks (each one
took up the others' ``following`` operations, as it does when an instance dies), and each
due poll of a task is made by one of them: the task's poll row in ``prism_polls`` is
reserved ``FOR UPDATE SKIP LOCKED`` with a lease held while the ``GetTask`` is in flight
(``prismd/agents/a2a/_follower.py``). An instance whose runtime is cancelled while its polls
are in flight keeps the others off those tasks until its leases expire; then they poll them,
and every task is answered once."""

from __future__ import annotations

import itertools
from collections import defaultdict
from contextlib import AsyncExitStack
from typing import Any

import pytest
import trio

from prismd.agents import AgentContext, build_agent
from prismd.agents.a2a import A2AAgent
from prismd.journal import NS_OPERATION
from prismd.limits import Limits
from stores import SYSTEM_CLOCK, Store, open_store
from tests.fakes.a2a_agent import FakeA2A, Plan
from tests.support import pgserver
from tests.support.builders import event
from tests.support.harness import Host, open_harness
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

TASKS = 9
INTERVAL_MS = 1000
LEASE_MS = 1500


def instance_agent(fake: FakeA2A, store: Store) -> A2AAgent:
    """An instance's agent: polled every second (±20 % jitter), poll leases of 1.5 s."""
    agent = build_agent(
        "a2a",
        AgentContext(
            alias="primary",
            options={
                "url": fake.base_url,
                "poll_interval_ms": INTERVAL_MS,
                "max_poll_interval_ms": INTERVAL_MS,
                "stream": False,
            },
            checkpoints=store.checkpoints,
            polls=store.polls,
        ),
    )
    assert isinstance(agent, A2AAgent)
    assert agent.polls is not None
    agent.poll_lease_ms = LEASE_MS
    return agent


def reader(agents: list[A2AAgent], request: dict[str, Any]) -> str:
    """Which instance made ``request``: its JSON-RPC id is ``prismd-<tag>-<n>``, ``tag``
    random per client (the fake records what the product sends, nothing added for it)."""
    for n, agent in enumerate(agents):
        if agent.client is not None and str(request["id"]).startswith(
            f"prismd-{agent.client.tag}-"
        ):
            return str(n)
    raise AssertionError(f"a request of no instance: {request['id']}")


def gets(fake: FakeA2A, since: int = 0) -> list[dict[str, Any]]:
    return [r for r in fake.requests[since:] if r["method"] == "GetTask"]


async def test_each_due_poll_is_made_once_and_a_dead_instances_polls_are_taken_over() -> None:
    url = pgserver.fresh_url("a2apoll")
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
                fake = FakeA2A(dialect="1.0", streaming=False)
                await nursery.start(fake.serve)
                fake.plan(*(Plan("work") for _ in range(TASKS)))
                stores = [await stack.enter_async_context(open_store(url)) for _ in range(3)]
                agents = [instance_agent(fake, s) for s in stores]
                hosts: list[Host] = []
                scopes: list[trio.CancelScope] = []

                async def instance(n: int, task_status: trio.TaskStatus[None]) -> None:
                    with trio.CancelScope() as scope:
                        scopes.append(scope)
                        async with open_harness(
                            stores[n], SYSTEM_CLOCK, {"primary": agents[n]},
                            resume_accepted=True, limits=Limits(lease_ttl_ms=1000),
                            owner_id=f"instance-{n}",
                        ) as host:  # fmt: skip
                            hosts.append(host)
                            task_status.started()
                            await trio.sleep_forever()

                for n in range(3):
                    await nursery.start(instance, n)
                for i in range(TASKS):
                    admitted = await hosts[i % 3].runtime.admit(event(f"e{i}", "go", chat=f"c{i}"))
                    assert admitted.status == "accepted"
                # Every instance takes up the others' followed operations (as after a death):
                # each has every task parked.
                await wait_until(lambda: all(a.following_now == TASKS for a in agents))

                # 1. Five seconds of following: each task read about once a second in all,
                # never twice within a due time, whoever reads it.
                start = len(fake.requests)
                began = trio.current_time()
                await trio.sleep(5)
                window = gets(fake, start)
                by_task: dict[str, list[dict[str, Any]]] = defaultdict(list)
                for r in window:
                    by_task[r["params"]["id"]].append(r)
                assert set(by_task) == set(fake.tasks)
                for task_id, reads in by_task.items():
                    # 5 s at 1 s ± 20 %: at most 7 (not 3 × as many), at least 3.
                    assert 3 <= len(reads) <= 7, (task_id, [r["at"] - began for r in reads])
                    times = [r["at"] for r in reads]
                    gaps = [b - a for a, b in itertools.pairwise(times)]
                    assert min(gaps) >= 0.6, (task_id, gaps)
                readers = {reader(agents, r) for r in window}
                assert len(readers) >= 2, readers  # the instances share the polling

                # 2. Every read now hangs at the peer: one read in flight per task, never two.
                fake.stall = trio.Event()
                stalled_from = len(fake.requests)
                await wait_until(
                    lambda: {r["params"]["id"] for r in gets(fake, stalled_from)} == set(fake.tasks)
                )
                await trio.sleep(LEASE_MS / 1000 * 2)  # leases renewed meanwhile
                in_flight = gets(fake, stalled_from)
                assert len(in_flight) == TASKS, [(r["params"]["id"]) for r in in_flight]
                holder = {r["params"]["id"]: reader(agents, r) for r in in_flight}
                counts = {n: list(holder.values()).count(str(n)) for n in range(3)}
                victim = max(counts, key=lambda n: counts[n])
                orphaned = {t for t, who in holder.items() if who == str(victim)}
                assert orphaned
                # The instance with the most reads in flight dies (its runtime cancelled):
                # its leases are left held, and expire.
                scopes[victim].cancel()
                killed = trio.current_time()
                await wait_until(lambda: agents[victim].following_now == 0)
                stall, fake.stall = fake.stall, None
                stall.set()
                for task_id in list(fake.tasks):
                    await fake.move(task_id, "completed", f"answer {task_id}", push=False)
                survivors = [h for n, h in enumerate(hosts) if n != victim]
                await wait_until(lambda: sum(len(h.replies) for h in survivors) == TASKS)
                after = gets(fake, stalled_from + len(in_flight))
                for task_id in orphaned:
                    taken = [r["at"] for r in after if r["params"]["id"] == task_id]
                    assert taken, task_id
                    # Not before the dead instance's lease expired (renewed every 0.5 s
                    # until the kill, so it ran at least 1 s beyond it).
                    assert min(taken) >= killed + 0.9, (task_id, min(taken) - killed)
                    assert all(reader(agents, r) != str(victim) for r in after)
                for host in survivors:
                    await host.settle()
                texts = sorted(t for h in survivors for t in h.texts)
                assert texts == sorted(f"answer {t}" for t in fake.tasks)
                assert all(fake.sends_of(s["params"]["message"]["messageId"]) == 1
                           for s in fake.sends())  # fmt: skip
                assert len(fake.sends()) == TASKS
                page = await stores[0].checkpoints.list_checkpoints(
                    namespace=NS_OPERATION, limit=500
                )
                states = {str(r.value["state"]) for r in page.items if isinstance(r.value, dict)}
                assert states == {"succeeded"}
                # The answered tasks' poll rows are gone.
                rows = await pgserver.query(
                    url, f"SELECT count(*) FROM {pgserver.schema_of(url)}.prism_polls"
                )
                assert rows[0][0] == 0
                for agent in agents:
                    await agent.aclose()
                nursery.cancel_scope.cancel()
    finally:
        pgserver.drop_schema(url)
