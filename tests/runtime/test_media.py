"""Attachments against the runtime (behaviours 54-60, contract §9.4), without a journal.

Bytes are fetched through the host's ``fetch_attachment`` seam only for image refs of the
event being run, only when the agent declares ``image`` input, and are never journaled.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio

from prismd.agents import AgentContext, ImageBlock, TextBlock, build_agent
from prismd.channel import AttachmentRef
from stores.memory import MemoryStore
from tests.support.builders import event
from tests.support.clocks import ManualClock
from tests.support.harness import open_harness
from tests.support.scripted import RecordingAgent

PNG = b"\x89PNG"
IMAGE = AttachmentRef(
    kind="image", transport_file_id="file-1", byte_length=4, mime_type="image/png"
)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def store(clock: ManualClock) -> AsyncIterator[MemoryStore]:
    async with MemoryStore(clock=clock) as s:
        yield s


class Fetcher:
    def __init__(self, result: Any = PNG) -> None:
        self.result = result
        self.calls: list[AttachmentRef] = []

    async def __call__(self, ref: AttachmentRef) -> Any:
        self.calls.append(ref)
        await trio.lowlevel.checkpoint()
        return self.result


def vision() -> RecordingAgent:
    return RecordingAgent(input_capabilities=frozenset({"text", "image"}))


async def test_image_is_fetched_once_and_given_to_a_vision_agent(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviours 54 and 55."""
    agent = vision()
    fetch = Fetcher()
    async with open_harness(
        store, clock, {"primary": agent}, use_journal=False, fetch_attachment=fetch
    ) as h:
        admission = await h.runtime.admit(event("1", "what is this?", attachments=(IMAGE,)))
        assert admission.status == "accepted"
        await h.settle()
        assert fetch.calls == [IMAGE]  # 54
        assert agent.inputs == [(TextBlock("what is this?"), ImageBlock(PNG, "image/png"))]  # 55
        assert h.last().text == "model answer" and h.last().kind == "final"


async def test_text_only_agent_gets_no_image(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviour 56."""
    agent = RecordingAgent()
    fetch = Fetcher()
    async with open_harness(
        store, clock, {"primary": agent}, use_journal=False, fetch_attachment=fetch
    ) as h:
        admission = await h.runtime.admit(event("1", "look", attachments=(IMAGE,)))
        assert admission.status == "accepted"
        await h.settle()
        assert fetch.calls == [] and agent.inputs == []
        assert h.runtime.diagnostics().unsupported == 1
        assert h.last().kind == "notice" and "cannot be processed" in h.last().text


@pytest.mark.parametrize("fetched", [None, b""])
async def test_missing_fetch_is_unsupported(
    store: MemoryStore,
    clock: ManualClock,
    autojump_clock: trio.testing.MockClock,
    fetched: bytes | None,
) -> None:
    """Behaviour 57: an image-only event whose fetch returns nothing (or empty bytes)."""
    agent = vision()
    fetch = Fetcher(fetched)
    async with open_harness(
        store, clock, {"primary": agent}, use_journal=False, fetch_attachment=fetch
    ) as h:
        assert (await h.runtime.admit(event("1", "", attachments=(IMAGE,)))).status == "accepted"
        await h.settle()
        assert fetch.calls == [IMAGE] and agent.inputs == []
        assert h.last().kind == "notice"


async def test_oversized_attachment_is_denied_before_anything(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviour 58: 2 MiB declared against the 1 MiB default cap."""
    agent = vision()
    fetch = Fetcher()
    big = AttachmentRef(kind="image", transport_file_id="big", byte_length=2 * 1024 * 1024)
    async with open_harness(
        store, clock, {"primary": agent}, use_journal=False, fetch_attachment=fetch
    ) as h:
        admission = await h.runtime.admit(event("1", "x", attachments=(big,)))
        assert (admission.status, admission.reason) == ("denied", "oversized")
        await h.settle()
        assert fetch.calls == [] and agent.inputs == [] and h.replies == []


async def test_voice_with_transcript_runs_as_text(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviour 59: the adapter already transcribed the voice note into the text."""
    agent = RecordingAgent()
    fetch = Fetcher()
    voice = AttachmentRef(kind="voice", transport_file_id="v-1", byte_length=100)
    async with open_harness(
        store, clock, {"primary": agent}, use_journal=False, fetch_attachment=fetch
    ) as h:
        admission = await h.runtime.admit(event("1", "transcribed words", attachments=(voice,)))
        assert admission.status == "accepted"
        await h.settle()
        assert fetch.calls == []
        assert len(agent.inputs) == 1
        given = agent.inputs[0]
        text = given if isinstance(given, str) else "".join(b.text for b in given)
        assert text == "transcribed words"
        assert h.last().text == "model answer"


async def test_too_many_or_unknown_attachments_are_malformed(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """Behaviour 60."""
    fetch = Fetcher()
    nine = tuple(
        AttachmentRef(kind="image", transport_file_id=f"f{i}", byte_length=1) for i in range(9)
    )
    video = AttachmentRef(kind="video", transport_file_id="v", byte_length=1)  # type: ignore[arg-type]
    async with open_harness(
        store, clock, {"primary": vision()}, use_journal=False, fetch_attachment=fetch
    ) as h:
        too_many = await h.runtime.admit(event("1", "x", attachments=nine))
        assert (too_many.status, too_many.reason) == ("denied", "malformed")
        bad_kind = await h.runtime.admit(event("2", "x", attachments=(video,)))
        assert (bad_kind.status, bad_kind.reason) == ("denied", "malformed")
        await h.settle()
        assert fetch.calls == [] and h.replies == []


async def test_mock_vision_agent_sees_images_and_bytes_are_never_journaled(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    """The ``mock`` agent with ``vision = true`` end to end, with a journal."""
    agent = build_agent(
        "mock",
        AgentContext(
            alias="primary",
            options={"vision": True},
            checkpoints=store.checkpoints,
            clock=clock,
        ),
    )
    marker = b"UNIQUE-IMAGE-BYTES"
    fetch = Fetcher(marker)
    async with open_harness(store, clock, {"primary": agent}, fetch_attachment=fetch) as h:
        assert (await h.runtime.admit(event("1", "see", attachments=(IMAGE,)))).status == (
            "accepted"
        )
        await h.settle()
        assert h.last().text == "mock: see [1 image(s)]"
        page = await store.checkpoints.list_checkpoints(limit=500)
        dump = repr([r.value for r in page.items])
        assert "UNIQUE-IMAGE-BYTES" not in dump
