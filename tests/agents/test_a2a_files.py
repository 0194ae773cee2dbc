"""File parts of an A2A answer as attachments: the answer names them by reference (journaled
without their bytes), the agent fetches them at delivery (inline base64 or a URL, within the
channel's cap), and the host sends them after the reply's text — through the Telegram adapter
against the fake Bot API (multipart uploads) — or names them in fixed words when it cannot."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import attrs
import pytest
import trio

from adapters.telegram import TelegramAdapter
from prismd.agents import AgentContext, build_agent
from prismd.agents.a2a import A2AAgent
from prismd.channel import OutboundFile, Reply, ReplyFile
from prismd.daemon._files import deliver_with_files
from prismd.journal import NS_REPLY
from stores import SYSTEM_CLOCK, Store
from stores.memory import MemoryStore
from tests.fakes.a2a_agent import FakeA2A, FakeFile, Plan
from tests.fakes.telegram_api import FakeBotApi, start_fake
from tests.support.builders import event
from tests.support.harness import open_harness
from tests.support.recorder import Recorder
from tests.support.waiting import wait_until

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4 + b"\r\n"
PDF = b"%PDF-1.7\n" + b"\x00\xff" * 3000 + b"\n"


@pytest.fixture
async def mem() -> AsyncIterator[MemoryStore]:
    async with MemoryStore(clock=SYSTEM_CLOCK) as s:
        yield s


def a2a_agent(fake: FakeA2A, store: Store) -> A2AAgent:
    options = {"url": fake.base_url, "poll_interval_ms": 20, "max_poll_interval_ms": 60}
    agent = build_agent(
        "a2a", AgentContext(alias="primary", options=options, checkpoints=store.checkpoints)
    )
    assert isinstance(agent, A2AAgent)
    return agent


async def answered(
    fake: FakeA2A, mem: MemoryStore, agent: A2AAgent, text: str | None, *files: FakeFile
) -> Reply:
    """Run one message through the runtime; the remote completes it with ``files``."""
    fake.plan(Plan("work"))
    async with open_harness(mem, SYSTEM_CLOCK, {"primary": agent}) as h:
        await h.runtime.admit(event("1", "the report please"))
        await wait_until(lambda: len(fake.tasks) == 1)
        (task_id,) = fake.tasks
        await fake.move(task_id, "completed", text, files=files)
        await wait_until(lambda: len(h.replies) == 1)
        await h.settle()
        return h.last()


@pytest.mark.parametrize("dialect", ["1.0", "0.3"])
async def test_file_parts_are_named_by_reference_and_fetched_at_delivery(
    dialect: str, mem: MemoryStore
) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect=dialect, streaming=False)  # type: ignore[arg-type]
            await nursery.start(fake.serve)
            url = fake.offer_download("/files/q3.pdf", PDF, "application/pdf")
            agent = a2a_agent(fake, mem)
            reply = await answered(
                fake,
                mem,
                agent,
                "Here is the Q3 report.",
                FakeFile("chart.png", "image/png", data=PNG),
                FakeFile("q3.pdf", "application/pdf", url=url),
            )
            assert (reply.text, reply.kind) == ("Here is the Q3 report.", "final")
            chart, report = reply.files
            (task_id,) = fake.tasks
            assert (chart.source, chart.name, chart.media_type, chart.size) == (
                "primary",
                "chart.png",
                "image/png",
                len(PNG),
            )
            assert (report.name, report.media_type, report.size) == (
                "q3.pdf",
                "application/pdf",
                None,
            )
            assert chart.ref.startswith(task_id) and report.ref.startswith(task_id)
            # The journal names the files; their bytes are nowhere in it.
            page = await mem.checkpoints.list_checkpoints(namespace=NS_REPLY)
            (row,) = page.items
            assert [f["name"] for f in row.value["files"]] == ["chart.png", "q3.pdf"]
            everything = json.dumps(
                [r.value for r in (await mem.checkpoints.list_checkpoints(limit=500)).items]
            )
            assert base64.b64encode(PNG).decode() not in everything
            assert fake.fetched == []
            # Fetched when delivered: a GetTask, then the bytes.
            gets = len(fake.requests)
            opened = await agent.open_file(chart, 1 << 20)
            assert opened == OutboundFile("chart.png", "image/png", PNG)
            assert fake.requests[gets]["method"] in ("GetTask", "tasks/get")
            opened = await agent.open_file(report, 1 << 20)
            assert opened == OutboundFile("q3.pdf", "application/pdf", PDF)
            assert fake.fetched == ["/files/q3.pdf"]
            # Over the cap: known from the size (inline) or Content-Length (a URL).
            assert await agent.open_file(chart, len(PNG) - 1) == "too_large"
            assert await agent.open_file(report, len(PDF) - 1) == "too_large"
            assert fake.fetched == ["/files/q3.pdf"] * 2
            await agent.aclose()
            nursery.cancel_scope.cancel()


async def test_files_that_cannot_be_fetched_are_unavailable(mem: MemoryStore) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            missing = f"http://127.0.0.1:{fake.port}/files/gone.txt"
            agent = a2a_agent(fake, mem)
            reply = await answered(
                fake,
                mem,
                agent,
                None,
                FakeFile("far.txt", "text/plain", url="http://files.example.org/far.txt"),
                FakeFile("gone.txt", "text/plain", url=missing),
                FakeFile(None, None, data=b"no name"),
            )
            # No text of its own: fixed words, and the files.
            assert reply.text == "The remote agent answered with 3 files."
            far, gone, unnamed = reply.files
            assert unnamed.name == "file-1-3"
            assert await agent.open_file(far, 1 << 20) == "unavailable"  # http off loopback
            assert await agent.open_file(gone, 1 << 20) == "unavailable"  # 404
            assert await agent.open_file(unnamed, 1 << 20) == OutboundFile(
                "file-1-3", None, b"no name"
            )
            fake.forget(next(iter(fake.tasks)))
            assert await agent.open_file(unnamed, 1 << 20) == "unavailable"  # task gone
            foreign = ReplyFile("another", unnamed.ref, "x")
            assert await agent.open_file(foreign, 1 << 20) == "unavailable"
            await agent.aclose()
            nursery.cancel_scope.cancel()


async def telegram(nursery: trio.Nursery, **extra: Any) -> tuple[FakeBotApi, TelegramAdapter]:
    bot = await start_fake(nursery)
    bot.chats.add("101")
    adapter = TelegramAdapter(
        connection_id="tg",
        token=lambda: bot.token,
        admit=Recorder(),
        store=MemoryStore(),
        owner_id="daemon-a",
        api_origin=bot.origin,
        **extra,
    )
    return bot, adapter


async def test_telegram_sends_the_text_then_uploads_each_file(mem: MemoryStore) -> None:
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            url = fake.offer_download("/files/q3.pdf", PDF, "application/pdf")
            big = fake.offer_download("/files/big.bin", b"x" * 8000, "application/octet-stream")
            agent = a2a_agent(fake, mem)
            answer = await answered(
                fake,
                mem,
                agent,
                "Here it is.",
                FakeFile("chart.png", "image/png", data=PNG),
                FakeFile("q3.pdf", "application/pdf", url=url),
                FakeFile("big.bin", None, url=big),
                FakeFile("huge.bin", None, data=b"y" * 9000),
            )
            bot, adapter = await telegram(nursery, max_attachment_bytes=7000)
            reply = Reply(
                connection_id="tg",
                external_conversation_id="101",
                text=answer.text,
                kind="final",
                operation_id="op-1",
                files=answer.files,
            )
            result = await deliver_with_files(adapter, reply, {"primary": agent})
            assert result.delivered
            text, photo, document, notice = bot.sent
            assert text["text"] == (
                'Here it is.\n\nThe file "huge.bin" (9 KB) was not sent: it is larger than'
                " this chat's limit of 7 KB."
            )
            # Known only once fetched (its Content-Length): told after the files.
            assert notice["text"] == (
                'The file "big.bin" was not sent: it is larger than this chat\'s limit of 7 KB.'
            )
            assert photo["photo"] == {
                "filename": "chart.png",
                "content_type": "image/png",
                "data": PNG,
            }
            assert document["document"]["filename"] == "q3.pdf"
            assert document["document"]["data"] == PDF
            assert [c.method for c in bot.calls] == [
                "sendMessage",
                "sendPhoto",
                "sendDocument",
                "sendMessage",
            ]
            # Every delivery fetches again (a resend, a re-drive after a restart).
            again = await deliver_with_files(adapter, reply, {"primary": agent})
            assert again.delivered and len(bot.sent) == 8
            assert fake.fetched.count("/files/q3.pdf") == 2
            await adapter.aclose()
            await agent.aclose()
            nursery.cancel_scope.cancel()


async def test_a_channel_without_files_names_them_and_fetches_nothing(
    mem: MemoryStore,
) -> None:
    """A channel that sends no files (Discord and Signal, for now): the reply names each
    file, nothing is fetched."""
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="0.3", streaming=False)
            await nursery.start(fake.serve)
            agent = a2a_agent(fake, mem)
            answer = await answered(
                fake, mem, agent, "Done.", FakeFile("notes.txt", "text/plain", data=b"abc")
            )
            bot, adapter = await telegram(nursery)
            refusing = _NoFiles(adapter)
            reply = Reply("tg", "101", answer.text, "final", files=answer.files)
            gets = len(fake.requests)
            result = await deliver_with_files(refusing, reply, {"primary": agent})  # type: ignore[arg-type]
            assert result.delivered
            (text,) = bot.sent
            assert text["text"] == (
                'Done.\n\nThe file "notes.txt" (3 bytes) was not sent: this chat cannot receive'
                " files."
            )
            assert len(fake.requests) == gets  # nothing fetched
            await adapter.aclose()
            await agent.aclose()
            nursery.cancel_scope.cancel()


class _NoFiles:
    """A channel that declares no files (``max_file_bytes`` 0), sending through ``inner``."""

    def __init__(self, inner: TelegramAdapter) -> None:
        self.inner = inner

    @property
    def features(self) -> Any:
        return attrs.evolve(self.inner.features, max_file_bytes=0)

    async def send(self, reply: Reply) -> Any:
        return await self.inner.send(reply)

    async def send_file(self, reply: Reply, file: OutboundFile) -> Any:
        raise AssertionError("no file is sent to a channel without files")
