"""Fake Bot API + the real runtime + the ``echo`` agent (behaviour 121 end to end), an adapter
restarted mid-batch, and two adapters on one SQLite file (one poller)."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.lowlevel
from trio.testing import MockClock

from adapters.telegram import TelegramAdapter
from prismd.agents._base import AgentContext
from prismd.agents.echo import EchoAgent
from prismd.channel import Admission, InboundEvent, Reply, SendResult
from prismd.grants import AgentIdentity, AuthorizeInput, Grant, Principal
from prismd.limits import Limits
from prismd.runtime import ResolveAgentInput, Runtime, open_messaging_runtime
from stores import Store, open_store
from tests.fakes.telegram_api import FakeBotApi
from tests.support.clocks import TrioClock
from tests.support.waiting import wait_until

from .conftest import private_message


async def authorize(inp: AuthorizeInput) -> Grant:
    identity = AgentIdentity(
        tenant_id="default",
        account_id=inp.connection_id,
        user_id=inp.external_actor_id,
        principal=Principal("user", inp.external_actor_id),
        scopes=("chat",),
        issued_at_ms=0,
    )
    return Grant(identity=identity, agent_aliases=("echo",), grant_revision="r1")


@asynccontextmanager
async def echo_runtime(store: Store, sender: TelegramAdapter) -> AsyncIterator[Runtime]:
    agent = EchoAgent.from_context(
        AgentContext(alias="echo", options={}, checkpoints=store.checkpoints, clock=TrioClock())
    )

    async def resolve_agent(_inp: ResolveAgentInput) -> EchoAgent:
        return agent

    async def deliver(reply: Reply) -> SendResult:
        return await sender.send(reply)

    async with open_messaging_runtime(
        authorize=authorize,
        resolve_agent=resolve_agent,
        deliver=deliver,
        store=store,
        limits=Limits(),
        clock=TrioClock(),
        owner_id="daemon-a",
    ) as runtime:
        yield runtime


async def test_121_end_to_end_echo_answered_once(
    autojump_clock: MockClock, fake: FakeBotApi, store: Any, make_adapter: Any
) -> None:
    """121 with the real runtime: one private update → exactly one sendMessage."""
    sender = make_adapter()
    async with echo_runtime(store, sender) as runtime:
        adapter = make_adapter(admit=runtime.admit)
        fake.push_update(private_message("hello Prism"))
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            await wait_until(lambda: bool(fake.sent))
            await trio.sleep(65)
            nursery.cancel_scope.cancel()
    await sender.aclose()
    assert [c.params for c in fake.calls_to("sendMessage")] == [
        {"chat_id": "101", "text": "hello Prism"}
    ]


async def test_adapter_restart_mid_batch_each_update_answered_once(
    autojump_clock: MockClock, fake: FakeBotApi, store: Any, make_adapter: Any
) -> None:
    """The adapter dies after ``admit`` accepted update 2 but before its offset was stored;
    the restarted adapter re-polls from 2, the journal says duplicate, and every update is
    answered exactly once."""
    sender = make_adapter()
    async with echo_runtime(store, sender) as runtime:
        first_scope = trio.CancelScope()

        async def admit_then_die(event: InboundEvent) -> Admission:
            admission = await runtime.admit(event)
            if event.text == "two":
                first_scope.cancel()
                await trio.lowlevel.checkpoint()  # the cancel lands before the cursor write
            return admission

        duplicates: list[str] = []

        async def admit_and_record(event: InboundEvent) -> Admission:
            admission = await runtime.admit(event)
            if admission.duplicate:
                duplicates.append(event.event_id)
            return admission

        ids = [fake.push_update(private_message(t)) for t in ("one", "two", "three")]
        with first_scope:
            await make_adapter(admit=admit_then_die).run()
        async with trio.open_nursery() as nursery:
            await nursery.start(make_adapter(admit=admit_and_record).run)
            await wait_until(lambda: len(fake.sent) >= 3)
            await trio.sleep(65)
            nursery.cancel_scope.cancel()
    await sender.aclose()
    assert sorted(c.params["text"] for c in fake.calls_to("sendMessage")) == [
        "one",
        "three",
        "two",
    ]
    assert duplicates == [str(ids[1])]


@pytest.mark.slow
async def test_two_adapters_on_one_sqlite_file_one_poller(
    fake: FakeBotApi, tmp_path: Path, make_adapter: Any
) -> None:
    """Two "daemons" (separate store connections) on one SQLite file: one polls, the other
    stands by; no 409 conflict ever reaches Telegram. Real time (SQLite worker threads)."""
    url = f"sqlite:///{tmp_path / 'journal.sqlite'}"
    async with open_store(url) as store_a, open_store(url) as store_b:
        received: list[str] = []

        async def admit(event: InboundEvent) -> Admission:
            received.append(event.text)
            return Admission("accepted", operation_id="op")

        from stores import SYSTEM_CLOCK

        a = make_adapter(
            store=store_a, owner_id="daemon-a", admit=admit, poll_timeout_s=1, clock=SYSTEM_CLOCK
        )
        b = make_adapter(
            store=store_b, owner_id="daemon-b", admit=admit, poll_timeout_s=1, clock=SYSTEM_CLOCK
        )
        with trio.fail_after(20):
            async with trio.open_nursery() as nursery:
                await nursery.start(a.run)
                await nursery.start(b.run)
                states = sorted([a.health()["state"], b.health()["state"]])
                assert states == ["polling", "standby"]
                fake.push_update(private_message("one"))
                fake.push_update(private_message("two"))
                await wait_until(lambda: len(received) >= 2)
                await trio.sleep(2.5)
                nursery.cancel_scope.cancel()
    assert received == ["one", "two"]
    assert fake.conflicts == 0


async def test_147_voice_end_to_end_audio_never_journaled(
    autojump_clock: MockClock, fake: FakeBotApi, store: Any, make_adapter: Any
) -> None:
    """147: a voice update + transcribe hook through the real runtime: the hook gets
    ``audio/ogg`` and the exact bytes, the echo reply is the transcript, and neither the
    operation nor the reply namespace (both non-empty) holds the audio (raw or base64)."""
    audio = b"OggS\x00\x02" + bytes(range(200))
    fake.add_file("voice-1", audio, file_path="voice/file_3.oga")
    seen: list[tuple[bytes, str]] = []

    async def transcribe(data: bytes, mime: str) -> str:
        seen.append((data, mime))
        return "spoken words"

    update = private_message("")
    del update["message"]["text"]
    update["message"]["voice"] = {
        "file_id": "voice-1",
        "file_unique_id": "v",
        "duration": 1,
        "mime_type": "audio/ogg",
        "file_size": len(audio),
    }
    sender = make_adapter()
    async with echo_runtime(store, sender) as runtime:
        adapter = make_adapter(admit=runtime.admit, transcribe=transcribe)
        fake.push_update(update)
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            await wait_until(lambda: bool(fake.sent))
            nursery.cancel_scope.cancel()
    await sender.aclose()
    assert seen == [(audio, "audio/ogg")]
    assert [c.params["text"] for c in fake.calls_to("sendMessage")] == ["spoken words"]
    encoded = base64.b64encode(audio).decode()
    for namespace in ("prism.channels.v1.operation", "prism.channels.v1.reply"):
        page = await store.checkpoints.list_checkpoints(namespace=namespace)
        assert page.items
        for record in page.items:
            dumped = json.dumps(record.value)
            assert encoded not in dumped and "OggS" not in dumped
