"""The ``a2a`` agent against peers that are not our fake (issue 37's audit): following a
task — streams, pushes, ``auth-required`` and continuations after ``input-required`` — with
hand-written A2A servers (:mod:`tests.support.a2a_peer`). Each test names the reference fact
(or the SDK source) its peer follows, and what prismd did wrong before.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio

from prismd.agents.a2a import (
    A2AAgent,
    PushReceiver,
)
from stores import SYSTEM_CLOCK
from stores.memory import MemoryStore
from tests.support.a2a_peer import Peer, client_of, error, gets, result, running
from tests.support.builders import event
from tests.support.waiting import wait_until


@pytest.fixture
async def mem() -> AsyncIterator[MemoryStore]:
    async with MemoryStore(clock=SYSTEM_CLOCK) as s:
        yield s


# ---------------------------------------------------------------------- SSE keep-alives


@pytest.mark.parametrize("event_id", ["id: 1\n", ""])
async def test_a_stream_of_keep_alives_alone_ends_at_the_idle_time(
    event_id: str, mem: MemoryStore
) -> None:
    """SSE comments (``: keep-alive``) carry no event. A peer whose stream lost the task's
    events (§8: a2a-python#832, "events are lost across resubscribe") but keeps the
    connection alive with comments: before, each comment restarted the idle timeout, so
    the task was followed by that stream alone (pushes and polls held off) until
    ``task_timeout_ms`` — then cancelled and reported "did not finish in time" although it
    had completed. Now ``idle_s`` counts from the last event: the stream ends, the task is
    read, the answer delivered. (Once the peer sent an ``id:``, httpx-sse yields each
    comment's blank line as an event without data: those are not events either.)"""
    peer = Peer(streaming=True)
    subscribed = trio.Event()

    async def send(rid: Any, params: dict[str, Any]) -> httpx.Response:
        return result(rid, peer.sent(peer.task("t-1", "working")))

    async def subscribe(rid: Any, params: dict[str, Any]) -> httpx.Response:
        first = {"jsonrpc": "2.0", "id": rid, "result": {"task": peer.task("t-1", "working")}}
        peer.task("t-1", "completed", "done meanwhile")  # its events never reach this stream

        async def frames() -> AsyncIterator[bytes]:
            yield f"{event_id}data: {json.dumps(first)}\n\n".encode()
            subscribed.set()
            for _ in range(400):
                await trio.sleep(0.05)
                yield b": keep-alive\n\n"

        headers = {"content-type": "text/event-stream"}
        return httpx.Response(200, headers=headers, content=frames())

    peer.methods.update(send=send, subscribe=subscribe)
    with trio.fail_after(15):
        async with running(peer, mem, task_timeout_ms=12_000) as (h, _):
            await h.runtime.admit(event("1", "go"))
            await subscribed.wait()
            with trio.fail_after(5):
                await h.settle()
            assert h.texts == ["done meanwhile"]


# ---------------------------------------------------------------------- a2a-sdk 0.3


async def test_a_continuation_a_03_sdk_refuses_as_invalid_starts_a_new_task(
    mem: MemoryStore,
) -> None:
    """The next message after ``input-required`` goes to the same task (§6); if that task
    ended meanwhile, a2a-sdk 0.3.26 answers **-32602** (``InvalidParamsError("Task … is in
    terminal state")``, ``server/request_handlers/default_request_handler.py:220-225``),
    not the -32004 of v1.0. Before: the message was refused with a notice, and the
    conversation kept the task id, so every later message was refused the same way until
    ``/new``. Now it is sent again as a new task in the same context, as after -32004."""
    peer = Peer("0.3")

    async def send(rid: Any, params: dict[str, Any]) -> httpx.Response:
        message = params["message"]
        if message.get("taskId") == "t-1":
            return error(rid, -32602)
        if not peer.tasks:
            task = peer.task("t-1", "input-required")
            question = {"kind": "text", "text": "Which year?"}
            task["status"]["message"] = {
                "kind": "message", "messageId": "q", "role": "agent", "parts": [question]
            }  # fmt: skip
            return result(rid, task)
        return result(rid, peer.task("t-2", "completed", "fresh answer"))

    peer.methods["send"] = send
    with trio.fail_after(20):
        async with running(peer, mem) as (h, _):
            await h.runtime.admit(event("1", "report please"))
            await h.settle()
            await h.runtime.admit(event("2", "2026"))
            await h.settle()
            assert h.texts == ["Which year?", "fresh answer"]
    first, refused, fresh = (s["message"] for s in peer.sends())
    assert refused["taskId"] == "t-1" and "taskId" not in fresh
    assert refused["messageId"] == fresh["messageId"] != first["messageId"]
    assert fresh["contextId"] == "ctx-1"


# ---------------------------------------------------------------------- push before answer


async def test_a_task_a_push_named_before_the_cut_answer_is_followed(mem: MemoryStore) -> None:
    """§4/§6: a peer may push for a task before the send's answer arrives, and the answer
    may then be lost (a cut connection). The push carried this send's own random
    credential, so the receiver journaled the task id it names. Before: that task was
    accepted only if ``GetTask``'s history showed the message — and the history is the
    server's default, which may be none (§3.2.4) — so the user was told "may have received
    it" while the peer worked on a task prismd knew. Now a task id a push proved with this
    send's credential is followed (a continued task still needs the history)."""
    peer = Peer(push=True)
    agents: dict[str, A2AAgent] = {}
    receiver = PushReceiver("127.0.0.1:0", agents, mem.inbox)

    async def send(rid: Any, params: dict[str, Any]) -> httpx.Response:
        config = params["configuration"]["taskPushNotificationConfig"]
        peer.task("t-1", "working")
        status = {"state": "TASK_STATE_WORKING"}
        body = {"statusUpdate": {"taskId": "t-1", "contextId": "ctx-1", "status": status}}
        headers = {"X-A2A-Notification-Token": config["token"]}
        async with httpx.AsyncClient() as http:
            pushed = await http.post(config["url"], json=body, headers=headers)
        assert pushed.status_code == 200
        peer.task("t-1", "completed", "followed after all")  # GetTask shows no history
        raise ConnectionError("the answer is lost")

    peer.methods["send"] = send
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(receiver.serve)
            nursery.start_soon(receiver.apply_pushes, "owner-1")
            assert receiver.address is not None
            base = f"http://127.0.0.1:{receiver.address[1]}"
            async with running(peer, mem, push_base_url=base) as (h, agent):
                agents["primary"] = agent
                await h.runtime.admit(event("1", "go"))
                await h.settle()
                assert h.texts == ["followed after all"]
            nursery.cancel_scope.cancel()
    assert len(peer.sends()) == 1


# ---------------------------------------------------------------------- auth-required


async def test_an_auth_required_status_stamped_at_each_read_is_relayed_once(
    mem: MemoryStore,
) -> None:
    """§3: ``auth-required`` is relayed, then followed on. A hand-written peer that stamps
    ``status.timestamp`` when it *answers* (not when the status was recorded) shows one
    episode with a new timestamp at every read. Before: the relay key held the timestamp,
    so every poll relayed the same sign-in request again (the chat spammed at each poll).
    Now a task that stays ``auth-required`` from one read to the next is one episode."""
    peer = Peer()
    reads = itertools.count()
    finished = False
    sign_in = "Please sign in at the portal."

    async def send(rid: Any, params: dict[str, Any]) -> httpx.Response:
        return result(rid, peer.sent(peer.task("t-1", "working")))

    async def get(rid: Any, params: dict[str, Any]) -> httpx.Response:
        if finished:
            return result(rid, peer.task("t-1", "completed", "signed in and done"))
        task = peer.task("t-1", "auth-required")
        task["status"]["timestamp"] = f"2026-12-06T00:00:{next(reads) % 60:02d}.000Z"
        task["status"]["message"] = {"messageId": "s", "role": "ROLE_AGENT", "parts": []}
        task["status"]["message"]["parts"].append({"text": sign_in})
        return result(rid, task)

    peer.methods.update(send=send, get=get)
    with trio.fail_after(20):
        async with running(peer, mem, max_poll_interval_ms=100) as (h, _):
            await h.runtime.admit(event("1", "fetch my invoices"))
            await wait_until(lambda: len(h.replies) >= 1)
            seen = gets(peer)
            await wait_until(lambda: gets(peer) >= seen + 6)
            assert h.texts == [sign_in]
            finished = True
            await h.settle()
            assert h.texts == [sign_in, "signed in and done"]


# ---------------------------------------------------------------------- a push per chunk


async def test_pushed_artifact_chunks_do_not_each_cost_a_poll(mem: MemoryStore) -> None:
    """§4: a2a-sdk 1.x pushes ``MessageToDict(to_stream_response(event))`` for **every**
    event — each ``artifactUpdate`` chunk of an answer streamed in pieces included — and
    "a statusUpdate carries no artifacts, so call GetTask". An artifact chunk says nothing
    about the task's state. Before: each pushed chunk woke the task's follower, which read
    the whole task again (``GetTask`` after ``GetTask`` while the agent streamed: the
    growing task fetched once per chunk). Now only a push that reports a state wakes it;
    the final status push still answers at once."""
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
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery, httpx.AsyncClient() as http:
            await nursery.start(receiver.serve)
            nursery.start_soon(receiver.apply_pushes, "owner-1")
            assert receiver.address is not None
            base = f"http://127.0.0.1:{receiver.address[1]}"
            slow = {"poll_interval_ms": 60_000, "max_poll_interval_ms": 60_000}
            async with running(peer, mem, push_base_url=base, **slow) as (h, agent):
                agents["primary"] = agent
                await h.runtime.admit(event("1", "go"))
                await wait_until(lambda: gets(peer) >= 1 and agent.following_now == 1)
                before = gets(peer)
                for n in range(30):
                    chunk = {"artifactId": "a", "parts": [{"text": f"piece {n} "}]}
                    update = {"taskId": "t-1", "artifact": chunk, "append": n > 0}
                    await push(http, {"artifactUpdate": update})
                    await trio.sleep(0.01)
                await trio.sleep(0.5)
                assert gets(peer) - before <= 2
                peer.task("t-1", "completed", "all pieces")
                status = {"state": "TASK_STATE_COMPLETED"}
                await push(http, {"statusUpdate": {"taskId": "t-1", "status": status}})
                await h.settle()
                assert h.texts == ["all pieces"]
            nursery.cancel_scope.cancel()


# ---------------------------------------------------------------------- a stale question


@pytest.mark.parametrize("streaming", [False, True])
async def test_a_continuation_answered_with_the_question_still_showing_is_followed(
    streaming: bool, mem: MemoryStore
) -> None:
    """The next message after ``input-required`` goes to the same task (§6) asking for
    immediate acceptance; the official a2a-js server (@a2a-js/sdk 1.3.0, checked by hand)
    answers it with the task *as it was*: still ``input-required``, the same status
    timestamp and question, before its agent has read the answer. Before: prismd took that
    for the agent's reply — the chat got the old question again, and the real answer,
    arriving later, was lost. Now the status that asked (its timestamp, state and text,
    journaled with the conversation's context) is not news: the task is followed on."""
    peer = Peer(streaming=streaming)
    asked = "2026-12-06T00:03:25.747Z"
    answered = trio.Event()

    def question(task: dict[str, Any]) -> dict[str, Any]:
        task["status"]["timestamp"] = asked
        message = {"messageId": "q", "role": "ROLE_AGENT", "parts": [{"text": "Which year?"}]}
        task["status"]["message"] = message
        return task

    async def send(rid: Any, params: dict[str, Any]) -> httpx.Response:
        if params["message"].get("taskId") == "t-1":
            answered.set()  # answered as it was: the question still showing
        return result(rid, peer.sent(question(peer.task("t-1", "input-required"))))

    async def subscribe(rid: Any, params: dict[str, Any]) -> httpx.Response:
        frame = {"jsonrpc": "2.0", "id": rid, "result": {"task": peer.tasks["t-1"]}}
        body = f"data: {json.dumps(frame)}\n\n".encode()
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, content=body)

    peer.methods.update(send=send, subscribe=subscribe)
    with trio.fail_after(20):
        async with running(peer, mem) as (h, _):
            await h.runtime.admit(event("1", "report please"))
            await h.settle()
            assert h.texts == ["Which year?"]
            await h.runtime.admit(event("2", "2026"))
            await answered.wait()
            await trio.sleep(0.5)  # the agent reads the answer meanwhile (polls see the question)
            assert h.texts == ["Which year?"]
            peer.task("t-1", "completed", "2026 it is")
            await h.settle()
            assert h.texts == ["Which year?", "2026 it is"]


async def test_a_push_for_a_continued_task_before_its_answer_is_accepted(
    mem: MemoryStore,
) -> None:
    """The message after ``input-required`` registers a new push config (new random
    secrets) for the same task, and the official servers push at once — a2a-sdk 0.3.26 and
    @a2a-js/sdk 1.3.0 both did, by hand — before the send's answer has reindexed the task.
    Before: that push was checked against the last turn's credentials and refused 401 (an
    error in the peer's log at every continuation). Now the credential journaled with this
    send identifies it, as for a new task's early push; a credential of another task is
    still refused."""
    peer = Peer(push=True)
    agents: dict[str, A2AAgent] = {}
    receiver = PushReceiver("127.0.0.1:0", agents, mem.inbox)
    codes: list[int] = []

    async def send(rid: Any, params: dict[str, Any]) -> httpx.Response:
        config = params["configuration"]["taskPushNotificationConfig"]
        if params["message"].get("taskId") != "t-1":
            task = peer.task("t-1", "input-required")
            task["status"]["message"] = {"messageId": "q", "role": "ROLE_AGENT", "parts": []}
            task["status"]["message"]["parts"].append({"text": "Which year?"})
            return result(rid, peer.sent(task))
        status = {"state": "TASK_STATE_WORKING"}
        body = {"statusUpdate": {"taskId": "t-1", "contextId": "ctx-1", "status": status}}
        async with httpx.AsyncClient() as http:
            for token in (config["token"], "another task's token"):
                headers = {"X-A2A-Notification-Token": token}
                codes.append(
                    (await http.post(config["url"], json=body, headers=headers)).status_code
                )
        return result(rid, peer.sent(peer.task("t-1", "completed", "2026 it is")))

    peer.methods["send"] = send
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(receiver.serve)
            nursery.start_soon(receiver.apply_pushes, "owner-1")
            assert receiver.address is not None
            base = f"http://127.0.0.1:{receiver.address[1]}"
            async with running(peer, mem, push_base_url=base) as (h, agent):
                agents["primary"] = agent
                await h.runtime.admit(event("1", "report please"))
                await h.settle()
                await h.runtime.admit(event("2", "2026"))
                await h.settle()
                assert h.texts == ["Which year?", "2026 it is"]
            nursery.cancel_scope.cancel()
    assert codes == [200, 401]


# ---------------------------------------------------------------------- SSE framing


async def test_sse_framing_of_other_servers_is_read() -> None:
    """SSE as servers write it (the WHATWG format the spec's streams use): CRLF line ends,
    ``event:``/``id:``/``retry:`` fields, comments, and one JSON-RPC frame split over
    several ``data:`` lines (joined by newlines: still JSON). Every observation arrives, in
    order, and the terminal one ends the stream."""
    peer = Peer(streaming=True)
    seen: list[tuple[str, str]] = []

    async def subscribe(rid: Any, params: dict[str, Any]) -> httpx.Response:
        def frame(result: dict[str, Any]) -> str:
            text = json.dumps({"jsonrpc": "2.0", "id": rid, "result": result}, indent=1)
            return "".join(f"data: {line}\r\n" for line in text.split("\n"))

        working = {"statusUpdate": {"taskId": "t-1", "status": {"state": "TASK_STATE_WORKING"}}}
        done = {"statusUpdate": {"taskId": "t-1", "status": {"state": "TASK_STATE_COMPLETED"}}}
        body = (
            ": hello\r\nretry: 1000\r\n\r\n"
            f"event: message\r\nid: 1\r\n{frame({'task': peer.task('t-1', 'submitted')})}\r\n"
            f": keep-alive\r\n\r\nid: 2\r\n{frame(working)}\r\n"
            f"event: message\r\n{frame(done)}\r\n"
        )
        headers = {"content-type": "text/event-stream; charset=utf-8"}
        return httpx.Response(200, headers=headers, content=body.encode())

    peer.methods["subscribe"] = subscribe

    def on_item(item: Any) -> bool:
        seen.append((type(item).__name__, item.state))
        return bool(item.state == "completed")

    with trio.fail_after(10):
        async with client_of(peer) as client:
            await client.subscribe("t-1", on_item, idle_s=5)
    assert seen == [
        ("Task", "submitted"),
        ("StatusUpdate", "working"),
        ("StatusUpdate", "completed"),
    ]


async def test_a_context_the_peer_names_otherwise_is_the_one_continued(mem: MemoryStore) -> None:
    """§6: the server mints the ``contextId`` and MUST return it; a peer may answer with
    another than the one sent (its own mapping). The next message continues the context the
    peer named, not the one prismd sent."""
    peer = Peer()
    contexts = iter(["ctx-a", "ctx-b"])

    async def send(rid: Any, params: dict[str, Any]) -> httpx.Response:
        context = next(contexts)
        task = peer.task(f"t-{context}", "completed", f"in {context}", context_id=context)
        return result(rid, peer.sent(task))

    peer.methods["send"] = send
    with trio.fail_after(20):
        async with running(peer, mem) as (h, _):
            await h.runtime.admit(event("1", "first"))
            await h.settle()
            await h.runtime.admit(event("2", "second"))
            await h.settle()
            assert h.texts == ["in ctx-a", "in ctx-b"]
    first, second = (s["message"] for s in peer.sends())
    assert "contextId" not in first and second["contextId"] == "ctx-a"
