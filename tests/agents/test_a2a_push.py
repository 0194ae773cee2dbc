"""The push receiver ``[a2a] push_listen`` over real loopback sockets: a push committed to
the store's inbox before the 200 wakes the follower (the poll interval is a minute), bad
pushes get a 4xx and change nothing, duplicates and late pushes answer nothing twice."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio

from prismd.agents import AgentContext, build_agent
from prismd.agents.a2a import PUSH_SOURCE, A2AAgent, PushReceiver, moves_forward
from stores import SYSTEM_CLOCK, StoreUnavailableError
from stores.memory import MemoryStore
from tests.fakes.a2a_agent import FakeA2A, Plan
from tests.support.builders import event
from tests.support.harness import open_harness
from tests.support.waiting import wait_until


@pytest.fixture
async def mem() -> AsyncIterator[MemoryStore]:
    async with MemoryStore(clock=SYSTEM_CLOCK) as s:
        yield s


@pytest.mark.parametrize("dialect", ["1.0", "0.3"])
async def test_push_answers_a_long_task_and_bad_pushes_change_nothing(
    dialect: str, mem: MemoryStore
) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery, httpx.AsyncClient() as http:
            fake = FakeA2A(dialect=dialect, streaming=False)  # type: ignore[arg-type]
            await nursery.start(fake.serve)
            agents: dict[str, A2AAgent] = {}
            receiver = PushReceiver("127.0.0.1:0", agents, mem.inbox)
            await nursery.start(receiver.serve)
            nursery.start_soon(receiver.apply_pushes, "owner-1")
            assert receiver.address is not None
            base = f"http://127.0.0.1:{receiver.address[1]}"
            agent = build_agent(
                "a2a",
                AgentContext(
                    alias="primary",
                    options={
                        "url": fake.base_url,
                        "poll_interval_ms": 60_000,
                        "max_poll_interval_ms": 60_000,
                    },
                    checkpoints=mem.checkpoints,
                    push_base_url=base,
                ),
            )
            assert isinstance(agent, A2AAgent)
            agents["primary"] = agent
            fake.plan(Plan("work"))
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "long job"))
                await wait_until(lambda: len(fake.tasks) == 1)
                (task_id,) = fake.tasks
                task = fake.tasks[task_id]
                assert task.push is not None
                assert task.push["url"] == f"{base}/a2a/push/primary"
                url = task.push["url"]
                good_body = {"kind": "task", "id": task_id, "status": {"state": "working"}}
                # Bad pushes: 4xx, nothing committed.
                bad = [
                    (url, {"X-A2A-Notification-Token": "wrong"}, good_body, 401),
                    (url, {"Authorization": "Bearer wrong"}, good_body, 401),
                    (url, {}, good_body, 401),
                    (
                        url,
                        {"X-A2A-Notification-Token": task.push["token"]},
                        {"id": "nope", "status": {}},
                        404,
                    ),
                    (url, {"X-A2A-Notification-Token": task.push["token"]}, {"x": 1}, 400),
                    (f"{base}/a2a/push/other", {}, good_body, 404),
                ]
                for target, headers, body, status in bad:
                    response = await http.post(target, json=body, headers=headers)
                    assert response.status_code == status, (target, headers, body)
                malformed = await http.post(url, content=b"{not json", headers={})
                assert malformed.status_code == 400
                assert await _declared_too_big(receiver.address[1]) == 413
                assert (await http.get(url)).status_code == 405
                page = await mem.inbox.list_items(source=PUSH_SOURCE)
                assert page.items == ()
                assert h.replies == []
                # The real push (sent once by the fake) answers the task long before a poll.
                await fake.move(task_id, "completed", "pushed answer")
                await wait_until(lambda: bool(h.replies))
                assert h.texts == ["pushed answer"]
                # Duplicate and late pushes: accepted, deduplicated, nothing answered again.
                assert await fake.push_again(task_id) == 200
                assert await fake.push_again(task_id, "working") == 200
                await trio.sleep(0.3)
                await h.settle()
                assert h.texts == ["pushed answer"]
                page = await mem.inbox.list_items(source=PUSH_SOURCE)
                assert len(page.items) == 2  # the push and the late one; the duplicate deduped
                assert receiver.counters["pushes_accepted"] == 3
                figures = receiver.statistics()
                assert figures["pushes_accepted"] == 3
                assert figures["pushes_refused"] >= 7
                assert figures["sent"] == 1 and figures["following"] == 0
                assert receiver.health() == {"listener": "listening"}
            await agent.aclose()
            nursery.cancel_scope.cancel()


async def _declared_too_big(port: int) -> int:
    """POST a head declaring 2 MiB and send nothing more: refused before the body."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        head = (
            "POST /a2a/push/primary HTTP/1.1\r\nHost: x\r\n"
            f"Content-Type: application/json\r\nContent-Length: {2 * 1024 * 1024}\r\n\r\n"
        )
        await stream.send_all(head.encode())
        answer = b""
        while b"\r\n" not in answer:
            chunk = await stream.receive_some(4096)
            if not chunk:
                break
            answer += chunk
    return int(answer.split(b" ")[1])


class _DownInbox:
    """An inbox whose store cannot commit."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    async def put(self, **kw: Any) -> bool:
        raise StoreUnavailableError("down")

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def test_a_store_that_cannot_commit_gets_503(mem: MemoryStore) -> None:
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery, httpx.AsyncClient() as http:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            agents: dict[str, A2AAgent] = {}
            receiver = PushReceiver("127.0.0.1:0", agents, _DownInbox(mem.inbox))
            await nursery.start(receiver.serve)
            assert receiver.address is not None
            agent = build_agent(
                "a2a",
                AgentContext(
                    alias="primary",
                    options={"url": fake.base_url, "poll_interval_ms": 50},
                    checkpoints=mem.checkpoints,
                    push_base_url=f"http://127.0.0.1:{receiver.address[1]}",
                ),
            )
            assert isinstance(agent, A2AAgent)
            agents["primary"] = agent
            fake.plan(Plan("work"))
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "go"))
                await wait_until(lambda: len(fake.tasks) == 1)
                (task_id,) = fake.tasks
                push = fake.tasks[task_id].push
                assert push is not None
                response = await http.post(
                    push["url"],
                    json={"statusUpdate": {"taskId": task_id, "status": {"state": "x"}}},
                    headers={"Authorization": f"Bearer {push['authentication']['credentials']}"},
                )
                assert response.status_code == 503
                # Polling still answers it.
                await fake.move(task_id, "completed", "polled", push=False)
                await h.settle()
                assert h.texts == ["polled"]
            await agent.aclose()
            nursery.cancel_scope.cancel()


def test_states_only_move_forward() -> None:
    assert moves_forward("working", "completed")
    assert not moves_forward("completed", "working")
    assert not moves_forward("working", "working")
    assert not moves_forward("working", None)
    assert moves_forward(None, "submitted")


async def test_a_push_finds_the_task_of_a_cut_v03_send(mem: MemoryStore) -> None:
    """v0.3 has no ListTasks: after a send cut once the request went out, the push that
    carries the task's credential (journaled with the send intent) names the task, which is
    then followed and answered — never sent again."""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="0.3", streaming=False)
            await nursery.start(fake.serve)
            agents: dict[str, A2AAgent] = {}
            receiver = PushReceiver("127.0.0.1:0", agents, mem.inbox)
            await nursery.start(receiver.serve)
            nursery.start_soon(receiver.apply_pushes, "owner-1")
            assert receiver.address is not None
            agent = build_agent(
                "a2a",
                AgentContext(
                    alias="primary",
                    options={"url": fake.base_url, "poll_interval_ms": 50},
                    checkpoints=mem.checkpoints,
                    push_base_url=f"http://127.0.0.1:{receiver.address[1]}",
                ),
            )
            assert isinstance(agent, A2AAgent)
            agents["primary"] = agent
            fake.plan(Plan("work"))
            fake.friction("cut")
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "go"))
                await wait_until(lambda: len(fake.tasks) == 1)
                (task_id,) = fake.tasks
                await trio.sleep(0.2)  # the cut answer arrives; the agent waits for news
                await fake.move(task_id, "completed", "found by its push")
                await h.settle()
                assert h.texts == ["found by its push"]
            (sent,) = fake.sends()
            assert fake.sends_of(sent["params"]["message"]["messageId"]) == 1
            await agent.aclose()
            nursery.cancel_scope.cancel()


def test_metrics_expose_the_a2a_counters() -> None:
    from prismd.daemon._metrics import DaemonMetrics
    from prismd.runtime import Diagnostics

    metrics = DaemonMetrics()
    metrics.watch(
        diagnostics=Diagnostics,
        health=dict,
        restarts=dict,
        leases=dict,
        a2a=lambda: {"following": 3, "polls": 7, "pushes_accepted": 2},
    )
    body, _ = metrics.exposition()
    assert b"prismd_a2a_following 3.0" in body
    assert b"prismd_a2a_polls_total 7.0" in body
    assert b"prismd_a2a_pushes_accepted_total 2.0" in body
