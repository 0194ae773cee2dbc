"""A streamed artifact's ``append`` chunks joined as they were sent (issue 37).

The official servers (a2a-sdk 1.3 and 0.3, a2a-js) store the chunks of an artifact built by
``append: true`` as separate parts of that one artifact; the reply is built from the
terminal task (``GetTask``), where a single text part is the reply exactly and several are
joined by a blank line. So an artifact that prismd *saw* built by ``append`` chunks — on the
task's stream, or in a push (a2a-sdk 1.x pushes each chunk) — has its parts joined with
nothing between them; everything else keeps the blank-line rule (separate paragraphs, two
artifacts, a task followed by polling alone). The evidence is journaled with the task
record (its artifact ids, bounded; never the chunks' text), so a restart between the
chunks and the answer changes nothing.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio

from prismd.agents import AgentContext, build_agent
from prismd.agents.a2a import (
    NS_TASK,
    A2AAgent,
    Artifact,
    PushReceiver,
    Task,
    TaskRecord,
    reply_text,
)
from prismd.agents.a2a._book import MAX_APPENDED, MAX_APPENDED_ID_CHARS, appended_key
from stores import SYSTEM_CLOCK
from stores.memory import MemoryStore
from tests.fakes.a2a_agent import FakeA2A, Plan
from tests.support.a2a_peer import Peer, restarted, result, running
from tests.support.builders import event
from tests.support.harness import open_harness
from tests.support.waiting import wait_until, wait_until_async

CHUNKS = ("Rev", "enue", " grew", " by 4 %.")
WHOLE = "".join(CHUNKS)


@pytest.fixture
async def mem() -> AsyncIterator[MemoryStore]:
    async with MemoryStore(clock=SYSTEM_CLOCK) as s:
        yield s


# ---------------------------------------------------------------------- the rule


def _task(*artifacts: Artifact) -> Task:
    return Task("t-1", "ctx-1", "completed", artifacts=artifacts)


def test_only_an_artifact_seen_appended_to_is_joined_without_a_separator() -> None:
    chunked = Artifact("a1", CHUNKS)
    paragraphs = Artifact("a2", ("first", "second"))
    assert reply_text(_task(chunked), ("a1",)) == WHOLE
    assert reply_text(_task(chunked)) == "\n\n".join(CHUNKS)  # no evidence: paragraphs
    assert reply_text(_task(paragraphs), ("a1",)) == "first\n\nsecond"
    # Two artifacts stay apart, whichever were appended to.
    assert reply_text(_task(chunked, paragraphs), ("a1",)) == f"{WHOLE}\n\nfirst\n\nsecond"
    assert reply_text(_task(chunked, Artifact("a3", ("x", "y"))), ("a1", "a3")) == f"{WHOLE}\n\nxy"
    # A chunk of spaces is part of the text; an artifact of blank chunks is no text.
    assert reply_text(_task(Artifact("a1", ("two", " ", "words"))), ("a1",)) == "two words"
    blank = _task(Artifact("a1", (" ", "")), Artifact("a2", ("only",)))
    assert reply_text(blank, ("a1",)) == "only"
    # An artifact with no id is never taken for one appended to.
    assert reply_text(_task(Artifact("", ("a", "b"))), ("",)) == "a\n\nb"
    # A long id is noted by its hash, and still recognised.
    long_id = "x" * (MAX_APPENDED_ID_CHARS + 1)
    key = appended_key(long_id)
    assert len(key) <= MAX_APPENDED_ID_CHARS and key != long_id
    assert reply_text(_task(Artifact(long_id, CHUNKS)), (key,)) == WHOLE


def test_the_task_record_keeps_the_ids_bounded_and_old_records_still_read() -> None:
    record = TaskRecord("primary", "prismd-op", "following", "s-1", 1, task_id="t-1")
    # Nothing noted: the record is written as before (no new key).
    assert "appended" not in record.to_json()
    old = record.to_json()
    assert TaskRecord.from_json(old).appended == ()
    noted = TaskRecord.from_json({**old, "appended": ["a1", "#" + "0" * 32]})
    assert noted.appended == ("a1", "#" + "0" * 32)
    assert TaskRecord.from_json(noted.to_json()) == noted
    # What a record says is bounded again when read: ids, their length, their number.
    many = [f"a{n}" for n in range(MAX_APPENDED * 3)] + ["y" * 5000, 7, None]
    read = TaskRecord.from_json({**old, "appended": many}).appended
    assert len(read) == MAX_APPENDED and all(len(i) <= MAX_APPENDED_ID_CHARS for i in read)
    assert TaskRecord.from_json({**old, "appended": "a1"}).appended == ()


# ---------------------------------------------------------------------- the fake


def _agent(fake: FakeA2A, mem: MemoryStore, push_base_url: str | None = None) -> A2AAgent:
    slow = push_base_url is not None  # pushed: answered by the push, not a poll
    agent = build_agent(
        "a2a",
        AgentContext(
            alias="primary",
            options={
                "url": fake.base_url,
                "poll_interval_ms": 60_000 if slow else 20,
                "max_poll_interval_ms": 60_000 if slow else 200,
            },
            checkpoints=mem.checkpoints,
            push_base_url=push_base_url,
        ),
    )
    assert isinstance(agent, A2AAgent)
    return agent


async def _subscribed(fake: FakeA2A, method: str, count: int) -> None:
    await wait_until(lambda: sum(r["method"] == method for r in fake.requests) >= count)


@pytest.mark.parametrize("dialect", ["1.0", "0.3"])
async def test_a_streamed_answer_in_chunks_is_delivered_whole(
    dialect: str, mem: MemoryStore
) -> None:
    """Followed by its stream: the chunks (``append`` after the first) are seen, and the
    stored artifact — one part per chunk — is delivered as one text. The next answer, two
    paragraphs in one artifact with nothing appended, keeps its blank line."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect=dialect, streaming=True)  # type: ignore[arg-type]
            await nursery.start(fake.serve)
            fake.plan(Plan("work"), Plan("work"))
            agent = _agent(fake, mem)
            subscribe = "SubscribeToTask" if dialect == "1.0" else "tasks/resubscribe"
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                for n, (text, chunks) in enumerate(
                    [(WHOLE, 4), ("first paragraph\n\nsecond paragraph", 1)]
                ):
                    await h.runtime.admit(event(str(n), "go"))
                    await _subscribed(fake, subscribe, n + 1)
                    task_id = list(fake.tasks)[n]
                    await fake.move(task_id, "completed", text, chunks=chunks)
                    await h.settle()
                got = fake.tasks[next(iter(fake.tasks))].artifacts[0]["parts"]
                assert len(got) == 4  # stored as the SDKs do: one part per chunk
                assert h.texts == [WHOLE, "first paragraph\n\nsecond paragraph"]
            await agent.aclose()
            nursery.cancel_scope.cancel()


async def test_a_pushed_answer_in_chunks_is_delivered_whole(mem: MemoryStore) -> None:
    """Followed by push alone (no stream; the poll interval is a minute): a2a-sdk 1.x
    pushes each chunk, then the status. The receiver notes the artifact appended to."""
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            agents: dict[str, A2AAgent] = {}
            receiver = PushReceiver("127.0.0.1:0", agents, mem.inbox)
            await nursery.start(receiver.serve)
            nursery.start_soon(receiver.apply_pushes, "owner-1")
            assert receiver.address is not None
            agent = _agent(fake, mem, f"http://127.0.0.1:{receiver.address[1]}")
            agents["primary"] = agent
            fake.plan(Plan("work"))
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "go"))
                await wait_until(lambda: agent.following_now == 1)
                (task_id,) = fake.tasks
                await fake.move(task_id, "completed", WHOLE, chunks=4)
                await h.settle()
                assert h.texts == [WHOLE]
            assert receiver.counters["pushes_accepted"] == 5  # four chunks, one status
            await agent.aclose()
            nursery.cancel_scope.cancel()


async def test_polled_alone_the_parts_stay_paragraphs(mem: MemoryStore) -> None:
    """No stream, no push: nothing shows how the artifact was built, so its parts are
    joined by a blank line (the documented limit, ``docs/a2a.md``)."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            fake.plan(Plan("work"))
            agent = _agent(fake, mem)
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "go"))
                await wait_until(lambda: agent.following_now == 1)
                (task_id,) = fake.tasks
                await fake.move(task_id, "completed", WHOLE, chunks=4)
                await h.settle()
                pieces = [p["text"] for p in fake.tasks[task_id].artifacts[0]["parts"]]
                assert len(pieces) == 4 and "".join(pieces) == WHOLE
                assert h.texts == ["\n\n".join(pieces)]
            await agent.aclose()
            nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------- a restart between


async def _noted(mem: MemoryStore) -> tuple[str, ...]:
    page = await mem.checkpoints.list_checkpoints(namespace=NS_TASK, limit=10)
    if not page.items:
        return ()  # not sent yet
    (row,) = page.items
    text = json.dumps(row.value)
    assert "enue" not in text and "grew" not in text  # never a chunk's text
    return TaskRecord.from_json(row.value).appended


def _completed(peer: Peer) -> dict[str, Any]:
    task = peer.task("t-1", "completed")
    task["artifacts"] = [{"artifactId": "a1", "parts": [{"text": c} for c in CHUNKS]}]
    return task


def _chunk(n: int) -> dict[str, Any]:
    chunk = {"artifactId": "a1", "parts": [{"text": CHUNKS[n]}]}
    return {"artifactUpdate": {"taskId": "t-1", "artifact": chunk, "append": n > 0}}


async def test_seen_on_a_stream_then_a_restart_the_answer_is_still_whole(
    mem: MemoryStore,
) -> None:
    """The stream shows the first chunks, then prismd stops; the task completes while it is
    down, and after the restart the stream is refused (the task is over): the answer is
    read by ``GetTask`` alone, and the journaled evidence joins its parts."""
    peer = Peer(streaming=True)

    async def send(rid: Any, params: dict[str, Any]) -> httpx.Response:
        return result(rid, peer.sent(peer.task("t-1", "working")))

    async def subscribe(rid: Any, params: dict[str, Any]) -> httpx.Response:
        if peer.tasks["t-1"]["status"]["state"] == "TASK_STATE_COMPLETED":
            body = {"jsonrpc": "2.0", "id": rid, "error": {"code": -32004, "message": "no"}}
            return httpx.Response(200, json=body)
        first = {"task": peer.tasks["t-1"]}

        async def frames() -> AsyncIterator[bytes]:
            for item in (first, _chunk(0), _chunk(1)):
                frame = {"jsonrpc": "2.0", "id": rid, "result": item}
                yield f"data: {json.dumps(frame)}\n\n".encode()
            await trio.sleep_forever()
            yield b""  # pragma: no cover

        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=frames())

    peer.methods.update(send=send, subscribe=subscribe)
    with trio.fail_after(30):
        async with running(peer, mem) as (h, _):
            await h.runtime.admit(event("1", "go"))
            await wait_until_async(lambda: _has_noted(mem))
            await h.runtime.stop()
            assert h.replies == []
        _completed(peer)
        async with restarted(peer, mem) as (h2, _):
            await wait_until(lambda: bool(h2.replies))
            await h2.settle()
            assert h2.texts == [WHOLE]
        assert sum(op == "send" for op, _, _ in peer.calls) == 1


async def _has_noted(mem: MemoryStore) -> bool:
    return await _noted(mem) == ("a1",)


async def test_pushed_then_a_restart_the_answer_is_still_whole(mem: MemoryStore) -> None:
    """The chunks are pushed (a2a-sdk 1.x) and noted; prismd stops and starts again; only
    the completed status is pushed to the new process: the answer is whole."""
    peer = Peer(push=True)
    agents: dict[str, A2AAgent] = {}
    receiver = PushReceiver("127.0.0.1:0", agents, mem.inbox)
    configs: list[dict[str, Any]] = []

    async def send(rid: Any, params: dict[str, Any]) -> httpx.Response:
        configs.append(params["configuration"]["taskPushNotificationConfig"])
        return result(rid, peer.sent(peer.task("t-1", "working")))

    async def push(http: httpx.AsyncClient, body: dict[str, Any]) -> None:
        headers = {"X-A2A-Notification-Token": configs[0]["token"]}
        response = await http.post(configs[0]["url"], json=body, headers=headers)
        assert response.status_code == 200

    peer.methods["send"] = send
    slow = {"poll_interval_ms": 60_000, "max_poll_interval_ms": 60_000}
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery, httpx.AsyncClient() as http:
            await nursery.start(receiver.serve)
            nursery.start_soon(receiver.apply_pushes, "owner-1")
            assert receiver.address is not None
            base = f"http://127.0.0.1:{receiver.address[1]}"
            async with running(peer, mem, push_base_url=base, **slow) as (h, agent):
                agents["primary"] = agent
                await h.runtime.admit(event("1", "go"))
                await wait_until(lambda: agent.following_now == 1)
                for n in range(len(CHUNKS)):
                    await push(http, _chunk(n))
                await wait_until_async(lambda: _has_noted(mem))
                await h.runtime.stop()
                assert h.replies == []
            async with restarted(peer, mem, push_base_url=base, **slow) as (
                h2,
                again,
            ):
                agents["primary"] = again
                await wait_until(lambda: again.following_now == 1)
                _completed(peer)
                status = {"state": "TASK_STATE_COMPLETED"}
                await push(http, {"statusUpdate": {"taskId": "t-1", "status": status}})
                await wait_until(lambda: bool(h2.replies))
                await h2.settle()
                assert h2.texts == [WHOLE]
            nursery.cancel_scope.cancel()
