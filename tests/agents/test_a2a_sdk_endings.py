"""Every way the official a2a-sdk 1.3.0 server (a subprocess, ``tests/fakes/a2a_sdk_agent.py``)
may end a task, through the real runtime on a SQLite journal with the push receiver: each
message is sent once, answered once, in the words ``docs/a2a.md`` promises, and the peer's
own text in a failure reaches neither the chat nor the logs. In both dialects
(``protocol = "1.0"`` and ``"0.3"``, the SDK serving both on one endpoint)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from prismd.agents import AgentContext, build_agent
from prismd.agents.a2a import (
    NOTICES,
    NS_CONTEXT,
    A2AAgent,
    A2AClient,
    PushReceiver,
    list_remote_tasks,
)
from prismd.channel import TRUNCATION_MARKER
from prismd.journal import FOLLOWING_STATE, NS_OPERATION
from stores import ANY_SCOPE, SYSTEM_CLOCK, Store, open_store
from tests.agents.sdk_peer import running_sdk_agent
from tests.fakes.a2a_sdk_agent import QUESTION, SIGN_IN
from tests.support.builders import event
from tests.support.harness import Host, open_harness
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow
SECRET = "the peer's own words 7f3a"


@attrs.define
class Peer:
    """prismd's side of one test: the store, the agent, its push receiver, the host."""

    store: Store
    agent: A2AAgent
    receiver: PushReceiver
    host: Host

    async def say(self, event_id: str, text: str) -> None:
        await self.host.runtime.admit(event(event_id, text))
        await self.host.settle()

    async def sends(self) -> list[str]:
        """The ``messageId`` of every user message the peer's tasks hold (ListTasks: the
        SDK keeps them in each task's history) — one per message sent."""
        client = await self.agent.connect()
        assert client is not None
        probe = A2AClient(client.http, attrs.evolve(client.card, dialect="1.0"), rpc=client.rpc)
        tasks, _ = await probe.list_tasks(page_size=100)
        return sorted(m for t in tasks for m in t.message_ids if m.startswith("prismd-"))


@asynccontextmanager
async def prismd_against(
    tmp_path: Path, url: str, protocol: str, **options: Any
) -> AsyncIterator[Peer]:
    async with (
        open_store(f"sqlite:///{tmp_path / 'j.sqlite'}") as store,
        trio.open_nursery() as nursery,
    ):
        agents: dict[str, A2AAgent] = {}
        receiver = PushReceiver("127.0.0.1:0", agents, store.inbox)
        await nursery.start(receiver.serve)
        nursery.start_soon(receiver.apply_pushes, "owner-1")
        assert receiver.address is not None
        agent = build_agent(
            "a2a",
            AgentContext(
                alias="primary",
                options={
                    "url": url,
                    "protocol": protocol,
                    "poll_interval_ms": 100,
                    "max_poll_interval_ms": 1000,
                    **options,
                },
                checkpoints=store.checkpoints,
                push_base_url=f"http://127.0.0.1:{receiver.address[1]}",
            ),
        )
        assert isinstance(agent, A2AAgent)
        agents["primary"] = agent
        try:
            async with open_harness(store, SYSTEM_CLOCK, {"primary": agent}) as host:
                yield Peer(store, agent, receiver, host)
        finally:
            await agent.aclose()
            nursery.cancel_scope.cancel()


@pytest.fixture
async def sdk_url(tmp_path: Path) -> AsyncIterator[str]:
    async with running_sdk_agent(tmp_path, 0.3) as url:
        yield url


def failed(code: str) -> str:
    return f"Request failed: {NOTICES[code]}"


@pytest.mark.parametrize("protocol", ["1.0", "0.3"])
@pytest.mark.parametrize(
    ("said", "answer"),
    [
        (f"reject:{SECRET}", failed("rejected")),
        (f"fail:{SECRET}", failed("failed")),
        # Completed without an artifact: the final status message is the answer.
        ("status:all done", "status: all done"),
        ("data:", "The remote agent finished without a text answer."),
        ("many:", "part 0\n\npart 1\n\npart 2"),
    ],
)
async def test_each_ending_is_answered_once_in_its_words(
    sdk_url: str,
    tmp_path: Path,
    protocol: str,
    said: str,
    answer: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    with trio.fail_after(40):
        async with prismd_against(tmp_path, sdk_url, protocol) as peer:
            await peer.say("1", said)
            assert peer.host.texts == [answer]
            assert await peer.sends() == [f"prismd-{peer.host.replies[0].operation_id}"]
    assert SECRET not in caplog.text


@pytest.mark.parametrize("protocol", ["1.0", "0.3"])
async def test_a_question_is_the_reply_and_the_next_message_continues_the_task(
    sdk_url: str, tmp_path: Path, protocol: str
) -> None:
    with trio.fail_after(40):
        async with prismd_against(tmp_path, sdk_url, protocol) as peer:
            await peer.say("1", "ask: the report")
            await peer.say("2", "2025")
            # The answer to the question continues the task (the SDK agent says
            # "(continued)" only there), in the same context (its turn 2).
            assert peer.host.texts == [QUESTION, "sdk[2]: 2025 (continued)"]
            assert len(await peer.sends()) == 2


@pytest.mark.parametrize("protocol", ["1.0", "0.3"])
async def test_auth_required_is_relayed_once_and_the_task_followed_to_its_answer(
    sdk_url: str, tmp_path: Path, protocol: str
) -> None:
    with trio.fail_after(40):
        async with prismd_against(tmp_path, sdk_url, protocol) as peer:
            await peer.say("1", "auth:2")
            assert peer.host.texts == [SIGN_IN, "sdk[1]: auth:2"]
            assert len(await peer.sends()) == 1


async def test_an_answer_larger_than_a_push_is_read_by_polling(
    sdk_url: str, tmp_path: Path
) -> None:
    """1.2 MB of text: the SDK's push of it is refused (413, over 1 MiB) and nothing is
    lost: the task is read by ``GetTask`` and answered once."""
    with trio.fail_after(40):
        async with prismd_against(tmp_path, sdk_url, "1.0", stream=False) as peer:
            await peer.say("1", "big:1200000")
            (reply,) = peer.host.texts  # capped by the runtime as any long reply
            assert reply.endswith(TRUNCATION_MARKER)
            assert set(reply.removesuffix(TRUNCATION_MARKER)) == {"x"}
            assert peer.receiver.counters.get("pushes_refused", 0) >= 1


@pytest.mark.parametrize("stream", [False, True])
async def test_a_peer_that_restarts_and_forgets_its_tasks_is_told_once(
    tmp_path: Path, stream: bool
) -> None:
    """The SDK's in-memory task store forgets a task when the agent restarts: the next
    ``GetTask`` is -32001, and the user is told once that the agent lost it. Followed by
    its stream, the stream breaks with the agent and the task is read instead."""
    with trio.fail_after(50):
        async with contextlib.AsyncExitStack() as first:
            url = await first.enter_async_context(running_sdk_agent(tmp_path, 30.0))
            port = int(url.rsplit(":", 1)[1].strip("/"))
            async with prismd_against(tmp_path, url, "1.0", stream=stream) as peer:
                await peer.host.runtime.admit(event("1", "a long job"))
                await wait_until(lambda: peer.agent.following_now == 1)
                await first.aclose()  # the agent stops, its tasks with it
                async with running_sdk_agent(tmp_path, 30.0, port):
                    await peer.host.settle()
                assert peer.host.texts == [failed("lost")]


async def test_cancel_while_the_send_waits_for_its_answer_settles_the_message(
    sdk_url: str, tmp_path: Path
) -> None:
    """``/cancel`` while a slow peer has not answered the send yet (the operation is
    ``following`` from before the request): the run is cut, the message settled and
    nothing is left followed; the message queued behind it runs."""
    with trio.fail_after(40):
        async with prismd_against(tmp_path, sdk_url, "1.0") as peer:
            await peer.host.runtime.admit(event("1", "late:3 a slow start"))
            await trio.sleep(0.5)  # the send is out, its answer 3 s away
            await peer.host.runtime.admit(event("2", "/cancel"))
            await peer.host.runtime.admit(event("3", "and then this"))
            await peer.host.settle()
            assert peer.host.texts == [
                "Cancelling the current request.",
                "Request cancelled.",
                "sdk[1]: and then this",
            ]
            assert peer.agent.following_now == 0
            listed, _ = await list_remote_tasks(peer.store.checkpoints, ANY_SCOPE)
            assert listed == []
            page = await peer.store.checkpoints.list_checkpoints(namespace=NS_OPERATION)
            states = sorted(str(r.value["state"]) for r in page.items if isinstance(r.value, dict))
            assert FOLLOWING_STATE not in states and "executing" not in states, states


@pytest.mark.parametrize("protocol", ["1.0", "0.3"])
async def test_an_answer_to_a_question_whose_task_ended_meanwhile_starts_a_new_task(
    sdk_url: str, tmp_path: Path, protocol: str
) -> None:
    """The task that asked was cancelled at the peer before the user answered: the SDK
    refuses the continuation (-32004), and the answer goes to a new task in the same
    context — sent once, answered once."""
    with trio.fail_after(40):
        async with prismd_against(tmp_path, sdk_url, protocol) as peer:
            await peer.say("1", "ask: the report")
            client = await peer.agent.connect()
            assert client is not None
            page = await peer.store.checkpoints.list_checkpoints(namespace=NS_CONTEXT)
            (asked,) = page.items
            task_id = asked.value["taskId"]
            assert task_id is not None
            assert (await client.cancel_task(task_id)) is not None
            await peer.say("2", "2025")
            assert peer.host.texts == [QUESTION, "sdk[2]: 2025"]
            assert len(await peer.sends()) == 2


@pytest.mark.parametrize("protocol", ["1.0", "0.3"])
async def test_a_bare_message_answer_is_the_reply_and_its_context_continues(
    sdk_url: str, tmp_path: Path, protocol: str
) -> None:
    """A message-only answer (no task): replied at once, nothing left followed, and the
    next message continues its context (the agent's turn 2)."""
    with trio.fail_after(40):
        async with prismd_against(tmp_path, sdk_url, protocol) as peer:
            await peer.say("1", "reply: hello")
            await peer.say("2", "reply: again")
            assert peer.host.texts == ["sdk[1]: hello", "sdk[2]: again"]
            assert peer.agent.following_now == 0
            listed, _ = await list_remote_tasks(peer.store.checkpoints, ANY_SCOPE)
            assert listed == []
