"""Three ``prismd run`` instances on one PostgreSQL database, one remote A2A agent (the
loopback fake) whose pushes reach the instances through a spreader (a balancer in front of
their ``[a2a] push_listen``): the instance following some of the conversations' long tasks
is SIGKILLed while it follows them, the tasks are finished by the remote and pushed to the
living instances. Whatever follows the tasks afterwards: every task is answered exactly
once, the remote saw one send per ``messageId``, no reply is posted twice."""

from __future__ import annotations

import signal
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio

from tests.agents.test_a2a_daemon import layout_for
from tests.daemon.helpers import _RESUME_TOKENS, chat, free_port, prismctl, running_daemon
from tests.fakes.a2a_agent import FakeA2A, Plan
from tests.support import pgserver
from tests.support.push_proxy import PushProxy

pytestmark = pytest.mark.slow
ACTORS = tuple(f"a2a-many-{n:04d}" for n in range(6))
"""Conversations; actor ``n`` writes to instance ``n % 3``, so instance 0 follows two."""


def polled(fake: FakeA2A, task_id: str) -> bool:
    return any(
        r["method"] in ("GetTask", "tasks/get") and r["params"].get("id") == task_id
        for r in fake.requests
    )


async def test_three_instances_one_killed_every_task_answered_once(tmp_path: Path) -> None:
    url = pgserver.fresh_url("a2a3")
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
                fake = FakeA2A(dialect="1.0", streaming=False)
                await nursery.start(fake.serve)
                fake.plan(*[Plan("work") for _ in ACTORS])
                push_ports = [free_port() for _ in range(3)]
                spreader = PushProxy(push_ports)
                await nursery.start(spreader.serve)
                layouts = []
                for n, port in enumerate(push_ports):
                    (tmp_path / str(n)).mkdir()
                    layouts.append(
                        layout_for(
                            tmp_path / str(n), fake, store_url=url, lease_ttl_ms=1500,
                            poll_ms=500, push_port=port, push_base_url=spreader.url,
                        )
                    )  # fmt: skip
                daemons = [
                    await stack.enter_async_context(running_daemon(layout, tag=f"i{n}"))
                    for n, layout in enumerate(layouts)
                ]
                for daemon in daemons:
                    await daemon.wait_state("READY=1")
                # Each conversation's message on its instance; the tab is closed afterwards,
                # so every answer is held in the journal until the actor comes back.
                for n, actor in enumerate(ACTORS):
                    async with chat(layouts[n % 3].port, actor) as client:
                        admission = await client.send_message("m1", f"long job {n}")
                        assert admission["status"] == "accepted"
                await fake.wait_state(lambda: len(fake.tasks) == len(ACTORS))
                task_of = {
                    sent["params"]["message"]["messageId"]: task_id
                    for sent, task_id in zip(fake.sends(), fake.tasks, strict=True)
                }
                task_of_text = {
                    sent["params"]["message"]["parts"][0]["text"]: task_id
                    for sent, task_id in zip(fake.sends(), fake.tasks, strict=True)
                }
                await fake.wait_state(lambda: all(polled(fake, t) for t in fake.tasks))
                # Instance 0 follows some of the tasks (those of actors 0 and 3, whose
                # conversations it holds): killed while it does.
                code, listed, _ = await prismctl(layouts[0], "list-remote-tasks")
                assert code == 0 and len(listed["tasks"]) == len(ACTORS)
                code, health, _ = await prismctl(layouts[0], "health")
                assert code == 0 and health["a2a"]["following"] >= 1, health["a2a"]
                daemons[0].send(signal.SIGKILL)
                assert await daemons[0].wait_exit() == -signal.SIGKILL
                pushed_before = len(spreader.served)
                # Every task is finished by the remote and pushed, half of them at once
                # (before anyone took the dead instance's over), half a moment later.
                tasks = list(fake.tasks)
                for task_id in tasks[: len(tasks) // 2]:
                    await fake.move(task_id, "completed", f"answer of {task_id}")
                await trio.sleep(1.0)
                for task_id in tasks[len(tasks) // 2 :]:
                    await fake.move(task_id, "completed", f"answer of {task_id}")
                pushes = spreader.served[pushed_before:]
                assert len(pushes) == len(tasks)
                assert 0 not in pushes  # the dead instance refused; the living took them
                # Until every operation is settled (the dead one's tasks taken over).
                while True:
                    code, listed, _ = await prismctl(layouts[1], "list-remote-tasks")
                    assert code == 0
                    if not listed["tasks"]:
                        break
                    await trio.sleep(0.2)
                # Each actor comes back (to a living instance): its one answer, once.
                for n, actor in enumerate(ACTORS):
                    home = layouts[n % 3].port
                    back = layouts[1 + n % 2]
                    token = _RESUME_TOKENS.get((home, actor))
                    if token is not None:
                        _RESUME_TOKENS[(back.port, actor)] = token
                    task_id = task_of_text[f"long job {n}"]
                    async with chat(back.port, actor) as client:
                        reply = await client.next_frame("reply", limit_s=15)
                        assert reply["text"] == f"answer of {task_id}"
                        with trio.move_on_after(1.0):
                            extra = await client.next_frame("reply", limit_s=1.0)
                            raise AssertionError(f"a reply twice: {extra}")
                # Nothing is left for an operator: no reply was staged twice or left unsent.
                code, unresolved, _ = await prismctl(layouts[2], "list-unresolved")
                assert code == 0 and unresolved == []
                accepted = 0
                for n in (1, 2):
                    code, health, _ = await prismctl(layouts[n], "health")
                    assert code == 0
                    accepted += health["a2a"].get("pushes_accepted", 0)
                    daemons[n].send(signal.SIGTERM)
                    assert await daemons[n].wait_exit() == 0
                assert accepted == len(tasks)
                assert len(fake.sends()) == len(ACTORS)
                for message_id in task_of:
                    assert fake.sends_of(message_id) == 1
                for daemon in daemons:
                    log = daemon.stderr()
                    assert "long job" not in log and "answer of" not in log
                nursery.cancel_scope.cancel()
    finally:
        pgserver.drop_schema(url)
