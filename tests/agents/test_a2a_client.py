"""The A2A client (prismd.agents.a2a) against the loopback fake in both dialects."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio

from adapters.toolkit import Http11
from prismd.agents.a2a import (
    A2AClient,
    CardError,
    Message,
    OutcomeUnknown,
    PushConfig,
    Refused,
    RemoteError,
    StatusUpdate,
    Task,
    read_observation,
    retry_after_s,
)
from tests.fakes.a2a_agent import FakeA2A, Plan
from tests.support.waiting import wait_until

DIALECTS = ["1.0", "0.3"]


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient() as client:
        yield client


@pytest.fixture
async def rpc() -> AsyncIterator[Http11]:
    """The unary calls' connections, closed after the test."""
    client = Http11()
    try:
        yield client
    finally:
        await client.aclose()


async def _serve(nursery: trio.Nursery, **kw: Any) -> FakeA2A:
    fake = FakeA2A(**kw)
    await nursery.start(fake.serve)
    return fake


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_discover_send_get_cancel(dialect: str, http: httpx.AsyncClient, rpc: Http11) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            fake = await _serve(nursery, dialect=dialect)
            client = await A2AClient.discover(http, rpc=rpc, url=fake.base_url)
            assert client.dialect == dialect
            assert client.card.streaming and client.card.push
            fake.plan(Plan("work"), Plan("complete", "first\n\nsecond"), Plan("message", "hi"))
            push = PushConfig("http://127.0.0.1:1/a2a/push/x", "tok", "cred")
            task = await client.send(message_id="m-1", text="hello", push=push)
            assert isinstance(task, Task) and task.state == "working" and task.context_id
            sent = fake.sends()[0]
            config = sent["params"]["configuration"]
            if dialect == "1.0":
                assert config["returnImmediately"] is True
                assert config["taskPushNotificationConfig"]["token"] == "tok"
                assert sent["headers"]["a2a-version"] == "1.0"
            else:
                assert config["blocking"] is False
                assert config["pushNotificationConfig"]["authentication"]["schemes"] == ["Bearer"]
                assert sent["params"]["message"]["kind"] == "message"
                assert "a2a-version" not in sent["headers"]
            done = await client.send(message_id="m-2", text="again", context_id=task.context_id)
            assert isinstance(done, Task) and done.state == "completed"
            assert [a.texts for a in done.artifacts] == [("first", "second")]
            assert done.context_id == task.context_id
            answer = await client.send(message_id="m-3", text="x")
            assert isinstance(answer, Message) and answer.texts == ("hi",)
            got = await client.get_task(task.id)
            assert got.state == "working" and "m-1" in got.message_ids
            cancelled = await client.cancel_task(task.id)
            assert cancelled is not None and cancelled.state == "canceled"
            with pytest.raises(RemoteError) as lost:
                await client.get_task("nope")
            assert lost.value.code == -32001
            nursery.cancel_scope.cancel()


async def test_card_fallback_to_agent_json_and_protocol_override(
    http: httpx.AsyncClient, rpc: Http11
) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            fake = await _serve(nursery, dialect="0.3", legacy_card=True)
            client = await A2AClient.discover(http, rpc=rpc, url=fake.base_url)
            assert client.dialect == "0.3"
            forced = await A2AClient.discover(
                http, rpc=rpc, card_url=fake.base_url.rstrip("/") + "/.well-known/agent.json",
                protocol="1.0",
            )  # fmt: skip
            assert forced.dialect == "1.0"
            nursery.cancel_scope.cancel()


async def test_http_only_for_loopback(http: httpx.AsyncClient, rpc: Http11) -> None:
    with pytest.raises(CardError):
        await A2AClient.discover(http, rpc=rpc, url="http://agents.example.org/x/")
    with pytest.raises(CardError):
        await A2AClient.discover(http, rpc=rpc, card_url="ftp://127.0.0.1/card.json")


async def test_method_not_found_falls_back_to_v03_and_is_remembered(
    http: httpx.AsyncClient,
    rpc: Http11,
) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            fake = await _serve(nursery, dialect="0.3")
            client = await A2AClient.discover(http, rpc=rpc, url=fake.base_url, protocol="1.0")
            fake.plan(Plan("work"), Plan("work"))
            task = await client.send(message_id="m-1", text="hello")
            assert isinstance(task, Task) and client.dialect == "0.3"
            methods = [r["method"] for r in fake.requests]
            assert methods == ["SendMessage", "message/send"]
            # The retry is a whole v0.3 request; the next call goes straight to v0.3.
            assert fake.requests[1]["params"]["message"]["role"] == "user"
            await client.get_task(task.id)
            assert fake.requests[-1]["method"] == "tasks/get"
            assert fake.sends_of("m-1") == 1  # -32601 was not a send
            nursery.cancel_scope.cancel()


async def test_refusals_are_told_from_unknown_outcomes(
    http: httpx.AsyncClient, rpc: Http11
) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            fake = await _serve(nursery, dialect="1.0")
            client = await A2AClient.discover(http, rpc=rpc, url=fake.base_url)
            fake.friction("429")
            with pytest.raises(Refused) as rate:
                await client.send(message_id="m-1", text="x")
            assert rate.value.retry_after == 1.0
            fake.friction("503")
            with pytest.raises(Refused):
                await client.send(message_id="m-1", text="x")
            fake.friction("-32009")
            with pytest.raises(RemoteError) as version:
                await client.send(message_id="m-1", text="x")
            assert version.value.code == -32009
            assert fake.sends_of("m-1") == 0 and not fake.tasks  # refused, not processed
            fake.friction("cut")
            with pytest.raises(OutcomeUnknown):
                await client.send(message_id="m-2", text="x")
            assert len(fake.tasks) == 1  # the cut request did create the task
            orphan, _next_page = await client.list_tasks()
            assert any("m-2" in t.message_ids for t in orphan)
            await fake.stop()
            with pytest.raises(Refused) as down:
                await client.send(message_id="m-3", text="x")
            assert down.value.reason == "connect"
            nursery.cancel_scope.cancel()


async def test_redirect_to_the_same_origin_is_followed_once(
    http: httpx.AsyncClient, rpc: Http11
) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            fake = await _serve(nursery, dialect="1.0")
            client = await A2AClient.discover(http, rpc=rpc, url=fake.base_url)
            client.url = fake.base_url.rstrip("/")
            fake.plan(Plan("work"))
            task = await client.send(message_id="m-1", text="x")
            assert isinstance(task, Task) and client.url == fake.base_url
            assert fake.sends_of("m-1") == 1
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("dialect", DIALECTS)
async def test_subscribe_streams_until_terminal(
    dialect: str, http: httpx.AsyncClient, rpc: Http11
) -> None:
    with trio.fail_after(10):
        async with trio.open_nursery() as nursery:
            fake = await _serve(nursery, dialect=dialect)
            client = await A2AClient.discover(http, rpc=rpc, url=fake.base_url)
            fake.plan(Plan("work"))
            task = await client.send(message_id="m-1", text="x")
            assert isinstance(task, Task)
            seen: list[Any] = []

            async def follow() -> None:
                await client.subscribe(task.id, lambda item: _record(seen, item))

            nursery.start_soon(follow)
            # The snapshot has reached the client: only then does the task move on.
            await wait_until(lambda: bool(seen), 0.01)
            await fake.move(task.id, "completed", "the answer", push=False)
            await wait_until(lambda: any(isinstance(s, StatusUpdate) for s in seen), 0.01)
            assert isinstance(seen[0], Task) and seen[0].state == "working"
            assert seen[-1].state == "completed"
            final = await client.get_task(task.id)
            assert final.artifacts[0].texts == ("the answer",)
            with pytest.raises(RemoteError):
                await client.subscribe(task.id, lambda _item: False)
            nursery.cancel_scope.cancel()


def test_observations_of_both_dialects_and_unknown_fields() -> None:
    v1 = read_observation(
        {"statusUpdate": {"taskId": "t", "contextId": "c",
                          "status": {"state": "TASK_STATE_INPUT_REQUIRED", "future": 1}}}
    )  # fmt: skip
    assert isinstance(v1, StatusUpdate) and v1.state == "input-required"
    v03 = read_observation({"kind": "task", "id": "t", "contextId": "c",
                            "status": {"state": "completed"}, "zzz": []})  # fmt: skip
    assert isinstance(v03, Task) and v03.terminal
    bare = read_observation({"id": "t", "status": {}})
    assert isinstance(bare, Task) and bare.state == "unknown"
    assert read_observation({"nonsense": True}) is None
    assert read_observation([1, 2]) is None
    assert retry_after_s("7") == 7.0
    assert retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0
    assert retry_after_s("soon") is None


def _record(seen: list[Any], item: Any) -> bool:
    seen.append(item)
    return False
