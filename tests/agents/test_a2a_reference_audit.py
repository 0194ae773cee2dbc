"""The ``a2a`` agent against peers that are not our fake: hand-written A2A servers that do
what ``reference/a2a-protocol.md`` says other implementations do (issue 37's audit) — the
send, its recovery and the client's reading. Following, pushes and continuations are in
``test_a2a_reference_audit_follow.py``; the peer is :mod:`tests.support.a2a_peer`.

Each test names the reference fact (or the SDK source) its peer follows, and what prismd
did wrong before.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio

from adapters.toolkit import Http11
from prismd.agents import AgentContext, AgentOptionError
from prismd.agents.a2a import (
    NOTICES,
    A2AAgent,
    A2AClient,
    Refused,
    Task,
    read_observation,
    retry_after_s,
    validate_a2a_options,
)
from stores import SYSTEM_CLOCK
from stores.memory import MemoryStore
from tests.support.a2a_peer import Peer, client_of, error, result, running
from tests.support.builders import event
from tests.support.handler_server import serve_handler
from tests.support.harness import open_harness


@pytest.fixture
async def mem() -> AsyncIterator[MemoryStore]:
    async with MemoryStore(clock=SYSTEM_CLOCK) as s:
        yield s


# ---------------------------------------------------------------------- Retry-After: 0


async def test_a_retry_after_of_zero_or_in_the_past_is_not_a_busy_loop(mem: MemoryStore) -> None:
    """§5 "rate limiting often arrives as a bare HTTP 429 … and Retry-After", which may be
    ``0`` or an HTTP date already past. Before: the send was made again at once, as often
    as the peer answered (a busy loop against a rate-limited peer); now the backoff still
    applies, the peer's value a floor."""
    peer = Peer()
    refusals = iter(["0", "Wed, 21 Oct 2015 07:28:00 GMT", "0", "0"])

    async def send(rid: Any, params: dict[str, Any]) -> httpx.Response:
        value = next(refusals, None)
        if value is not None:
            return httpx.Response(429, headers={"retry-after": value})
        return result(rid, peer.sent(peer.task("t-1", "completed", "at last")))

    peer.methods["send"] = send
    with trio.fail_after(20):
        async with running(peer, mem, poll_interval_ms=100, max_poll_interval_ms=400) as (h, _):
            await h.runtime.admit(event("1", "go"))
            await h.settle()
            assert h.texts == ["at last"]
    times = [at for op, _, at in peer.calls if op == "send"]
    assert len(times) == 5
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert min(gaps) >= 0.07, gaps  # the backoff (100 ms, -20 % jitter) at least


async def test_backoff_keeps_its_floor_under_a_zero_retry_after(mem: MemoryStore) -> None:
    agent = A2AAgent.from_context(
        AgentContext(alias="a", options={"url": "http://127.0.0.1:1/"}, checkpoints=mem.checkpoints)
    )
    assert agent.backoff(0.0, 2.0) >= 1.6
    assert agent.backoff(7.0, 2.0) == 7.0  # a longer Retry-After is honoured as said
    assert agent.backoff(1e9, 2.0) == 3600.0  # within the bound


# ---------------------------------------------------------------------- a blocking peer


@pytest.mark.parametrize("dialect", ["1.0", "0.3"])
async def test_a_peer_that_ignores_immediate_acceptance_is_waited_for(
    dialect: str, mem: MemoryStore
) -> None:
    """§2 "Not every server honours it. LangGraph's ``message/send`` waits for the final
    Task result". Before: the send's answer was awaited as long as any call's (the client's
    ``timeout_s``), then the outcome was unknown, never sent again and never found (v0.3
    has no ListTasks): the remote did the work and the user got "may have received it".
    Now a send waits for its answer as long as the task may take (``task_timeout_ms``)."""
    peer = Peer(dialect)

    async def send(rid: Any, params: dict[str, Any]) -> httpx.Response:
        await trio.sleep(1.5)  # works on it before answering, whatever was asked
        return result(rid, peer.sent(peer.task("t-1", "completed", "worth the wait")))

    peer.methods["send"] = send
    with trio.fail_after(20):
        async with running(peer, mem) as (h, agent):
            agent.client = await A2AClient.discover(
                agent.http, url=peer.url, rpc=agent.rpc, timeout_s=0.5
            )
            await h.runtime.admit(event("1", "go"))
            await h.settle()
            assert h.texts == ["worth the wait"]
    assert len(peer.sends()) == 1


# ---------------------------------------------------------------------- push refused


@pytest.mark.parametrize("code", [-32003, -32602])
async def test_a_send_whose_push_is_refused_is_made_again_without_it(
    code: int, mem: MemoryStore
) -> None:
    """§4/§5: -32003 PushNotificationNotSupportedError means "fall back to polling"; and §4
    "a prismd test webhook on loopback may be refused by strict servers": a2a-sdk 1.3.0
    with ``push_url_validator=validate_push_notification_url`` (loopback, private and
    link-local hosts refused, as §13.2 says it SHOULD) answers **-32602** "Invalid push
    notification URL" before it creates any task
    (``default_request_handler_v2.py::_reject_unsafe_push_url``). Before: every message
    was refused with a notice. Now the same message (same ``messageId``) is sent once more
    without push and the task is followed by polling."""
    peer = Peer(push=True)

    async def send(rid: Any, params: dict[str, Any]) -> httpx.Response:
        if "taskPushNotificationConfig" in params["configuration"]:
            return error(rid, code)
        return result(rid, peer.sent(peer.task("t-1", "completed", "polled, not pushed")))

    peer.methods["send"] = send
    with trio.fail_after(20):
        async with running(peer, mem, push_base_url="http://127.0.0.1:9") as (h, _):
            await h.runtime.admit(event("1", "go"))
            await h.settle()
            assert h.texts == ["polled, not pushed"]
    with_push, without = peer.sends()
    assert with_push["message"]["messageId"] == without["message"]["messageId"]
    assert "taskPushNotificationConfig" not in without["configuration"]


# ---------------------------------------------------------------------- ListTasks


@pytest.mark.parametrize("where", ["history", "page"])
async def test_an_unknown_send_is_found_beyond_ten_messages_and_the_first_page(
    where: str, mem: MemoryStore
) -> None:
    """A send cut after the peer processed it is looked for with v1.0 ``ListTasks`` by its
    ``messageId`` in the task's history (§6). The peer follows §3.2.4 and the a2a-sdk 1.3
    store: ``historyLength`` n is the *last* n messages, pages of ``pageSize`` (default 50)
    newest first with a ``nextPageToken``. Before: the search asked for the last 10 messages
    only (the user's message is the first: gone from a task with more progress messages)
    and read one page (a busy peer lists 50 other tasks first): not found, the user told
    "may have received it" while the peer worked on it. Now the history is the server's
    default (the whole, in the SDK) and the pages are followed."""
    peer = Peer()
    ours: list[dict[str, Any]] = []

    async def send(rid: Any, params: dict[str, Any]) -> httpx.Response:
        count = 12 if where == "history" else 1
        progress = [
            {"messageId": f"p-{n}", "role": "ROLE_AGENT", "parts": [{"text": "…"}]}
            for n in range(count)
        ]
        history = (params["message"], *progress)
        ours.append(peer.task("t-9", "completed", "found again", history=history))
        raise ConnectionError("processed, then the connection is cut before the answer")

    async def list_tasks(rid: Any, params: dict[str, Any]) -> httpx.Response:
        others = 60 if where == "page" else 0
        tasks = [peer.task(f"o-{n}", "working", context_id=f"c-{n}") for n in range(others)]
        tasks += ours
        size = int(params.get("pageSize") or 50)
        start = int(params.get("pageToken") or 0)
        page = [dict(t) for t in tasks[start : start + size]]
        if "historyLength" in params:
            n = int(params["historyLength"])
            for task in page:
                task["history"] = task["history"][-n:] if n else []
        more = start + size < len(tasks)
        return result(rid, {"tasks": page, "nextPageToken": str(start + size) if more else ""})

    peer.methods.update(send=send, list=list_tasks)
    with trio.fail_after(20):
        async with running(peer, mem) as (h, _):
            await h.runtime.admit(event("1", "go"))
            await h.settle()
            assert h.texts == ["found again"]
    assert len(peer.sends()) == 1


# ---------------------------------------------------------------------- the client alone


async def test_a_redirect_to_a_malformed_location_is_a_refusal() -> None:
    """§5: "A 307 on POST usually means a missing trailing slash"; the client follows one
    to the same origin. Before: a ``Location`` httpx cannot parse (``http://[::1``) raised
    httpx's ``InvalidURL`` out of the client — not one of its errors, so the run crashed,
    with the peer's text in the exception. Now it is a refusal like any other redirect the
    client does not follow (nothing was processed)."""
    peer = Peer()

    async def send(rid: Any, params: dict[str, Any]) -> httpx.Response:
        return httpx.Response(307, headers={"location": "http://[::1"})

    peer.methods["send"] = send
    with trio.fail_after(10):
        async with client_of(peer) as client:
            with pytest.raises(Refused) as refused:
                await client.send(message_id="m-1", text="x")
            assert refused.value.reason == "redirect"
            assert "::1" not in str(refused.value)


async def test_a_task_read_wrapped_like_a_send_result_is_read() -> None:
    """§2: ``GetTask``'s result "is a bare Task, not wrapped" — but a send's is
    ``{"task": …}``, and a hand-written peer that answers both alike is easy to meet.
    Before: every poll of such a peer was unreadable (an unknown outcome, polled again), so
    the task was followed until ``task_timeout_ms`` and reported "did not finish in time".
    Now the wrapper is read too (unknown fields are ignored anyway)."""
    peer = Peer()

    async def get(rid: Any, params: dict[str, Any]) -> httpx.Response:
        return result(rid, {"task": peer.task(str(params["id"]), "completed", "wrapped")})

    peer.methods["get"] = get
    with trio.fail_after(10):
        async with client_of(peer) as client:
            task = await client.get_task("t-1")
            assert task.id == "t-1" and task.state == "completed"
            assert task.artifacts[0].texts == ("wrapped",)


def test_a_03_file_part_without_kind_is_read() -> None:
    """v0.3 parts carry ``kind`` (required by the JSON schema), but the a2a-sdk server
    tolerates a part without it (reference, "What changed in a2a-sdk 1.3.0"), and so do
    the peers built on it. A text part without ``kind`` was read already; a file part
    (``{"file": {"uri"|"bytes", …}}``) was skipped: the answer's file was lost and the
    reply said there was no text answer."""
    raw = {
        "kind": "task",
        "id": "t-1",
        "contextId": "c",
        "status": {"state": "completed"},
        "artifacts": [
            {
                "artifactId": "a",
                "parts": [
                    {
                        "file": {
                            "name": "r.pdf",
                            "mimeType": "application/pdf",
                            "uri": "https://x/r",
                        }
                    },
                    {"file": {"name": "s.txt", "bytes": "aGk="}},
                ],
            }
        ],
    }
    task = read_observation(raw)
    assert isinstance(task, Task)
    (artifact,) = task.artifacts
    assert [(f.name, f.media_type, f.uri, f.data_b64) for f in artifact.files] == [
        ("r.pdf", "application/pdf", "https://x/r", None),
        ("s.txt", None, None, "aGk="),
    ]


async def test_a_card_url_with_a_query_is_accepted_and_fetched_as_is() -> None:
    """§1: "LangGraph Agent Server serves ``GET /.well-known/agent-card.json?assistant_id=…``".
    Before: ``card_url`` refused any query ("must not carry a query or a fragment"), so
    such an agent could not be configured at all. Now ``card_url`` may carry a query (it is
    fetched as written); ``url``, to which the card's path is appended, still may not."""
    card_url = "https://agents.example/.well-known/agent-card.json?assistant_id=a-1"
    assert validate_a2a_options({"card_url": card_url}).card_url == card_url
    with pytest.raises(AgentOptionError) as bad:
        validate_a2a_options({"url": "https://agents.example/a2a/?assistant_id=a-1"})
    assert bad.value.key == "url"
    with pytest.raises(AgentOptionError):
        validate_a2a_options({"card_url": "https://agents.example/card.json#frag"})
    peer = Peer()
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery, httpx.AsyncClient() as http:
            peer.origin = await serve_handler(nursery, peer.handle)
            rpc = Http11()
            card = f"{peer.origin}/.well-known/agent-card.json?assistant_id=a-1"
            client = await A2AClient.discover(http, rpc=rpc, card_url=card)
            assert client.url == peer.url
            await rpc.aclose()
            nursery.cancel_scope.cancel()
    assert peer.card_queries == ["assistant_id=a-1"]


async def test_a_retry_after_of_non_ascii_digits_is_no_crash() -> None:
    """A ``Retry-After`` is ASCII delta-seconds or an HTTP date. Before: ``"²"`` passed
    ``str.isdigit`` and ``float`` raised ``ValueError`` out of the client — not one of its
    errors: a card fetch (or a stream) answered 429 by a broken proxy crashed the run. Now
    it is a refusal without a usable ``retry_after``."""

    async def card(request: httpx.Request) -> httpx.Response:
        return httpx.Response(429, headers=[(b"retry-after", "²".encode("latin-1"))])

    assert retry_after_s("²") is None and retry_after_s(" 7 ") == 7.0
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery, httpx.AsyncClient() as http:
            origin = await serve_handler(nursery, card)
            with pytest.raises(Refused) as refused:
                await A2AClient.discover(http, url=origin)
            assert refused.value.retry_after is None
            nursery.cancel_scope.cancel()


async def test_a_peer_that_checks_input_modes_takes_the_text(mem: MemoryStore) -> None:
    """a2a-sdk 1.3.0 with ``validate_input_modes=True`` refuses a part whose ``mediaType``
    its card declares nowhere (-32005, ``utils/input_mode_validator.py``); "a part that
    omits it … is not checked". Cards commonly declare ``"text"`` (the SDK's own samples),
    not ``"text/plain"``. Before: every text part said ``text/plain`` and every message to
    such a peer was refused. Now a text part carries no media type (it is text)."""
    peer = Peer()
    declared = {"text"}

    async def send(rid: Any, params: dict[str, Any]) -> httpx.Response:
        for part in params["message"]["parts"]:
            if part.get("mediaType") and part["mediaType"] not in declared:
                return error(rid, -32005)
        return result(rid, peer.sent(peer.task("t-1", "completed", "read as text")))

    peer.methods["send"] = send
    with trio.fail_after(20):
        async with running(peer, mem) as (h, _):
            await h.runtime.admit(event("1", "go"))
            await h.settle()
            assert h.texts == ["read as text"]
    (sent,) = peer.sends()
    assert sent["message"]["parts"] == [{"text": "go"}]


def test_a_v1_state_given_as_its_enum_number_is_read() -> None:
    """v1.0 is ProtoJSON (§2), whose parsers accept an enum's number as well as its name
    — and a server printing with ``use_integers_for_enums`` (or Go's ``UseEnumNumbers``)
    sends the number. Numbers from ``a2a.proto`` ``TaskState`` (checked against a2a-sdk
    1.3.0's ``a2a_pb2``). Before: ``"state": 3`` read as unknown, the completed task
    polled until ``task_timeout_ms`` and reported "did not finish in time"."""
    states = {0: "unknown", 1: "submitted", 2: "working", 3: "completed", 4: "failed"}
    states |= {5: "canceled", 6: "input-required", 7: "rejected", 8: "auth-required"}
    for number, state in states.items():
        task = read_observation({"task": {"id": "t", "status": {"state": number}}})
        assert isinstance(task, Task) and task.state == state, number
    for odd in (9, -1, True, 3.0):
        task = read_observation({"task": {"id": "t", "status": {"state": odd}}})
        assert isinstance(task, Task) and task.state == "unknown", odd


# ---------------------------------------------------------------------- refused for ever


async def test_a_send_refused_past_the_task_timeout_is_told_and_settled(mem: MemoryStore) -> None:
    """A definite refusal (503, 429, connection refused) is retried with backoff — but a
    peer may refuse for ever (a 503 maintenance page, a proxy in front of a removed agent).
    Before: the send was retried for ever, the user never told, and every later message in
    the conversation waited behind it. Now a send still refused when ``task_timeout_ms``
    (the time the task was given) has passed is settled with the fixed "could not be
    reached" notice, and the conversation goes on."""
    peer = Peer()
    answers = {"go": 0}

    async def send(rid: Any, params: dict[str, Any]) -> httpx.Response:
        text = params["message"]["parts"][0]["text"]
        answers[text] = answers.get(text, 0) + 1
        if text == "go":
            return httpx.Response(503)
        return result(rid, peer.sent(peer.task("t-2", "completed", "the next one")))

    peer.methods["send"] = send
    with trio.fail_after(20):
        async with running(peer, mem, task_timeout_ms=1000) as (h, _):
            await h.runtime.admit(event("1", "go"))
            await h.runtime.admit(event("2", "next"))
            await h.settle()
            assert h.texts == [f"Request failed: {NOTICES['unreachable']}", "the next one"]
    assert answers["go"] >= 2 and answers["next"] == 1


async def test_a_card_refused_past_the_task_timeout_is_told(mem: MemoryStore) -> None:
    """The same for the card: before, a message to a peer whose card answered 503 for ever
    was never settled (the card fetched again and again, the user never told), and an
    operator's ``--cancel-remote`` or a reply's file fetch after a restart waited on it
    for ever too. Now a fresh message gives up after ``task_timeout_ms`` (nothing was sent)
    and the other callers after their own short budget."""
    cards = 0

    async def handle(request: httpx.Request) -> httpx.Response:
        nonlocal cards
        cards += 1
        return httpx.Response(503)

    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            origin = await serve_handler(nursery, handle)
            options = {"url": f"{origin}/a2a/", "poll_interval_ms": 50, "task_timeout_ms": 1000}
            context = AgentContext(alias="primary", options=options, checkpoints=mem.checkpoints)
            agent = A2AAgent.from_context(context)
            async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
                await h.runtime.admit(event("1", "go"))
                await h.settle()
                assert h.texts == [f"Request failed: {NOTICES['unreachable']}"]
            assert cards >= 2
            started = trio.current_time()
            assert await agent.connect(patience_s=0.3) is None
            assert trio.current_time() - started < 1.0
            await agent.aclose()
            nursery.cancel_scope.cancel()
