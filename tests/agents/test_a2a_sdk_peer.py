"""The A2A client against the official a2a-sdk 1.3.0 server, a real remote agent in a
subprocess on loopback (tests/fakes/a2a_sdk_agent.py): both dialects, push included."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
import trio

from adapters.toolkit import Http11
from prismd.agents.a2a import A2AClient, PushConfig, Task, read_observation
from tests.agents.sdk_peer import running_sdk_agent
from tests.support.handler_server import read_request
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow


@pytest.fixture
async def sdk_url(tmp_path: Path) -> AsyncIterator[str]:
    """The SDK agent, answering each message after 1 s: long enough for a subscribe made
    right after the send to find the task still working, even on a loaded machine."""
    async with running_sdk_agent(tmp_path, 1.0) as url:
        yield url


async def _receiver(
    got: list[tuple[dict[str, str], object]], *, task_status: trio.TaskStatus[int]
) -> None:
    """A minimal push webhook that records what the SDK's push sender POSTs."""

    async def handle(stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        request = await read_request(conn, stream)
        if request is None:
            return
        head, body = request
        headers = {k.decode().lower(): v.decode() for k, v in head.headers}
        got.append((headers, json.loads(body)))
        # Connection: close, or the SDK's client may send its next push on this connection
        # just as it closes (it sends each push once, with no retry: that push is lost).
        out = conn.send(
            h11.Response(
                status_code=200, headers=[("content-length", "0"), ("connection", "close")]
            )
        )
        out = (out or b"") + (conn.send(h11.EndOfMessage()) or b"")
        await stream.send_all(out)
        await stream.aclose()

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, handle, listeners)
        task_status.started(port)


@pytest.mark.parametrize("protocol", ["1.0", "0.3"])
async def test_send_follow_and_push_against_the_sdk(sdk_url: str, protocol: str) -> None:
    got: list[tuple[dict[str, str], object]] = []
    with trio.fail_after(30):
        async with (
            httpx.AsyncClient() as http,
            contextlib.aclosing(Http11()) as rpc,
            trio.open_nursery() as nursery,
        ):
            port = await nursery.start(_receiver, got)
            client = await A2AClient.discover(http, url=sdk_url, protocol=protocol, rpc=rpc)
            assert client.card.push and client.card.streaming
            push = PushConfig(f"http://127.0.0.1:{port}/a2a/push/sdk", "tok-1", "cred-1")
            sent = await client.send(message_id="prismd-1", text="hello", push=push)
            assert isinstance(sent, Task) and not sent.terminal
            task = sent
            while not task.terminal:
                await trio.sleep(0.1)
                task = await client.get_task(sent.id)
            assert task.state == "completed"
            assert [a.texts for a in task.artifacts] == [("sdk[1]: hello",)]
            # The same context continues: a second message in it is the agent's turn 2.
            second = await client.send(
                message_id="prismd-2", text="again", context_id=task.context_id
            )
            assert isinstance(second, Task) and second.context_id == task.context_id
            seen: list[Any] = []
            await client.subscribe(second.id, lambda item: _record(seen, item))
            assert seen and seen[-1].state == "completed"
            final = await client.get_task(second.id)
            assert final.artifacts[0].texts == ("sdk[2]: again",)
            await wait_until(
                lambda: any(
                    getattr(read_observation(body), "state", None) == "completed" for _, body in got
                )
            )
            headers, _body = got[-1]
            # The SDK's sender sends the token, and Authorization from the config.
            assert headers.get("x-a2a-notification-token") == "tok-1"
            assert headers.get("authorization") == "Bearer cred-1"
            nursery.cancel_scope.cancel()


def _record(seen: list[Any], item: Any) -> bool:
    seen.append(item)
    return False


async def test_a_conversation_through_prismd_to_the_sdk_with_push(
    sdk_url: str, tmp_path: Path
) -> None:
    """Two messages of one conversation through the real runtime (SQLite journal) to the
    official SDK agent: the second continues the context (the agent counts turn 2), the
    SDK's push reaches the receiver and is committed to the inbox."""
    from prismd.agents import AgentContext, build_agent
    from prismd.agents.a2a import PUSH_SOURCE, A2AAgent, PushReceiver
    from stores import SYSTEM_CLOCK, open_store
    from tests.support.builders import event
    from tests.support.harness import open_harness

    with trio.fail_after(40):
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
                    options={"url": sdk_url, "poll_interval_ms": 100, "stream": False},
                    checkpoints=store.checkpoints,
                    push_base_url=f"http://127.0.0.1:{receiver.address[1]}",
                ),
            )
            assert isinstance(agent, A2AAgent)
            agents["primary"] = agent
            async with open_harness(store, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "hello"))
                await h.settle()
                await h.runtime.admit(event("2", "again"))
                await h.settle()
                assert h.texts == ["sdk[1]: hello", "sdk[2]: again"]
            await wait_until(lambda: receiver.counters.get("pushes_accepted", 0) >= 2)
            page = await store.inbox.list_items(source=PUSH_SOURCE)
            assert page.items
            assert receiver.counters.get("pushes_refused", 0) == 0
            await agent.aclose()
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("stream", [True, False])
async def test_an_answer_the_sdk_streams_in_chunks_is_delivered_whole(
    sdk_url: str, tmp_path: Path, stream: bool
) -> None:
    """The SDK agent answers in ``append`` chunks (``TaskUpdater.add_artifact(…,
    append=True)``), which the SDK stores as parts of one artifact: seen on the stream, or
    (``stream = false``) in the SDK's push of each chunk, they are joined as they were sent
    — not one blank line between every four characters."""
    from prismd.agents import AgentContext, build_agent
    from prismd.agents.a2a import A2AAgent, PushReceiver
    from stores import SYSTEM_CLOCK, open_store
    from tests.support.builders import event
    from tests.support.harness import open_harness

    with trio.fail_after(40):
        async with (
            open_store(f"sqlite:///{tmp_path / 'j.sqlite'}") as store,
            trio.open_nursery() as nursery,
        ):
            agents: dict[str, A2AAgent] = {}
            receiver = PushReceiver("127.0.0.1:0", agents, store.inbox)
            await nursery.start(receiver.serve)
            nursery.start_soon(receiver.apply_pushes, "owner-1")
            assert receiver.address is not None
            options = {"url": sdk_url, "poll_interval_ms": 60_000, "stream": stream}
            agent = build_agent(
                "a2a",
                AgentContext(
                    alias="primary",
                    options={**options, "max_poll_interval_ms": 60_000},
                    checkpoints=store.checkpoints,
                    push_base_url=f"http://127.0.0.1:{receiver.address[1]}",
                ),
            )
            assert isinstance(agent, A2AAgent)
            agents["primary"] = agent
            async with open_harness(store, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "chunks: revenue grew by four percent"))
                await h.settle()
                assert h.texts == ["sdk[1]: chunks: revenue grew by four percent"]
            # Pushed one by one (then the status): several chunks reached the receiver.
            assert receiver.counters.get("pushes_accepted", 0) >= 3
            await agent.aclose()
            nursery.cancel_scope.cancel()
