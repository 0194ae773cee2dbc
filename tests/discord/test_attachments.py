"""Images as model input, through the fake Discord and the real runtime: an image reaches
an agent that takes images (fetched with a fresh URL, from the CDN, without the token);
one over the cap is refused with the runtime's fixed notice and never downloaded; one that
turns out larger than it said is not read past the cap."""

from __future__ import annotations

import pytest
import trio

from adapters.discord._media import allowed_url, document_refs, image_refs
from prismd.agents import ImageBlock
from prismd.channel import AttachmentRef
from stores import Store
from tests.fakes.discord_api import FakeDiscord
from tests.support.harness import Host
from tests.support.scripted import ScriptedAgent, image_blocks, input_text
from tests.support.waiting import wait_until

from .conftest import CONN, DM, USER, AdapterFactory, serving

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4
CAP = 1024 * 1024
UNSUPPORTED = "That attachment cannot be processed by the selected agent."


def _vision() -> tuple[ScriptedAgent, Host]:
    agent = ScriptedAgent(answer="a cat", capabilities=frozenset({"text", "image"}))
    return agent, Host(agent=agent)


async def test_an_image_reaches_an_agent_that_takes_images(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    agent, host = _vision()
    adapter = make_adapter()
    assert adapter.features.attachments
    image = fake.attachment(DM, "cat.png", PNG, "image/png")
    with trio.fail_after(20):
        async with serving(store, adapter, host, fetch_attachment=adapter.fetch_attachment):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(DM, USER, "what is this?", attachments=[image])
            await wait_until(lambda: len(fake.bot_messages(DM)) == 1)
    [request] = agent.inputs
    assert image_blocks(request) == [ImageBlock(data=PNG, mime_type="image/png")]
    assert fake.bot_messages(DM)[0]["content"] == "a cat"
    # The message read again (fresh signed URLs), then the CDN, without the bot token.
    [(path, authorized)] = fake.cdn_requests
    assert path.endswith("/cat.png") and not authorized
    assert fake.calls("GET", f"/channels/{DM}/messages/")


async def test_a_forwarded_message_is_answered_and_its_image_fetched(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """A forward's text and image are the forwarded message's (``message_snapshots``): the
    agent gets both, the image read again from the forward and fetched from the CDN; the
    answer replies to the forward."""
    agent, host = _vision()
    adapter = make_adapter()
    image = fake.attachment(DM, "cat.png", PNG, "image/png")
    with trio.fail_after(20):
        async with serving(store, adapter, host, fetch_attachment=adapter.fetch_attachment):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            sent = fake.forward(DM, USER, "seen this?", attachments=[image])
            await wait_until(lambda: len(fake.bot_messages(DM)) == 1)
    [request] = agent.inputs
    assert image_blocks(request) == [ImageBlock(data=PNG, mime_type="image/png")]
    assert input_text(request) == "seen this?"
    [answer] = fake.bot_messages(DM)
    assert answer["content"] == "a cat"
    assert answer["message_reference"]["message_id"] == sent["id"]
    assert fake.calls("GET", f"/channels/{DM}/messages/{sent['id']}")


async def test_an_image_over_the_cap_is_refused_with_the_notice_and_never_downloaded(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    agent, host = _vision()
    adapter = make_adapter(max_attachment_bytes=CAP)
    big = fake.attachment(DM, "big.png", b"\0" * (CAP + 1), "image/png")
    with trio.fail_after(20):
        async with serving(store, adapter, host, fetch_attachment=adapter.fetch_attachment):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.gateway.duplicate_next = 1  # Discord delivers it twice
            inbound = fake.user_message(DM, USER, "look", attachments=[big])
            await wait_until(lambda: len(fake.bot_messages(DM)) == 1)
            await trio.sleep(0.5)
    [notice] = fake.bot_messages(DM)
    assert notice["content"] == f"Attachments too large: at most {CAP} bytes in all."
    assert notice["message_reference"]["message_id"] == inbound["id"]
    assert len(fake.calls("POST", f"/channels/{DM}/messages")) == 2  # one nonce: posted once
    assert fake.cdn_requests == [] and agent.inputs == []


async def test_an_image_larger_than_it_said_is_not_read_past_the_cap(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    agent, host = _vision()
    adapter = make_adapter(max_attachment_bytes=CAP)
    liar = fake.attachment(DM, "liar.png", b"\0" * (2 * CAP), "image/png", size=1000)
    with trio.fail_after(20):
        async with serving(store, adapter, host, fetch_attachment=adapter.fetch_attachment):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(DM, USER, "", attachments=[liar])
            await wait_until(lambda: len(fake.bot_messages(DM)) == 1)
    assert fake.bot_messages(DM)[0]["content"] == UNSUPPORTED
    assert len(fake.cdn_requests) == 1 and agent.inputs == []


async def test_refs_name_ids_only_and_only_discords_cdn_is_fetched(
    fake: FakeDiscord, make_adapter: AdapterFactory
) -> None:
    message = {
        "id": "11",
        "channel_id": "22",
        "attachments": [
            {"id": "33", "filename": "a.png", "size": 5, "content_type": "image/png", "url": "x"},
            {"id": "44", "filename": "b.pdf", "size": 5, "content_type": "application/pdf"},
            {"id": "55", "filename": "c.png", "size": True, "content_type": "image/png"},
        ],
    }
    [ref] = image_refs(message, CONN)
    assert (ref.transport_file_id, ref.byte_length, ref.mime_type) == ("22/11/33", 5, "image/png")
    origin = fake.origin
    assert allowed_url("https://cdn.discordapp.com/attachments/1/2/a.png?ex=1", origin)
    assert allowed_url(f"{origin}/attachments/1/2/a.png", origin)
    for url in (
        "http://cdn.discordapp.com/attachments/1/2/a.png",
        "https://cdn.discordapp.com:8443/a.png",
        "https://169.254.169.254/latest/meta-data",
        "https://cdn.discordapp.com.evil.example/a.png",
        f"{origin.replace('127.0.0.1', 'localhost')}/a.png",
    ):
        assert allowed_url(url, origin) is None, url
    adapter = make_adapter()
    for bad in (
        AttachmentRef("image", "22/11/33", 5, connection_id="another-bot"),
        AttachmentRef("image", "../11/33", 5, connection_id=CONN),
        AttachmentRef("document", "22/11/33", 5, connection_id=CONN),
        AttachmentRef("image", "22/11/33", 2 * CAP, connection_id=CONN),
    ):
        with trio.fail_after(5):
            assert await adapter.fetch_attachment(bad) is None
    await adapter.aclose()
    assert fake.requests == []  # none of them asked anything


@pytest.mark.parametrize("size", [0, CAP])
def test_image_refs_keep_the_declared_size(size: int) -> None:
    message = {
        "id": "11",
        "channel_id": "22",
        "attachments": [{"id": "33", "size": size, "content_type": "image/jpeg"}],
    }
    [ref] = image_refs(message, CONN)
    assert ref.byte_length == size and ref.file_name is None and ref.connection_id == CONN


async def test_a_file_alone_gets_the_notice_and_with_text_the_text_is_answered(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """A PDF is no model input: alone, the runtime's fixed notice answers it (it was
    ignored silently); with text, the text is answered, whatever the file's size (it is
    left out). Neither is ever downloaded."""
    agent, host = _vision()
    adapter = make_adapter()
    pdf = b"%PDF-1.4\n" + b"0" * 100
    with trio.fail_after(20):
        async with serving(store, adapter, host, fetch_attachment=adapter.fetch_attachment):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            alone = fake.attachment(DM, "report.pdf", pdf, "application/pdf")
            first = fake.user_message(DM, USER, "", attachments=[alone])
            await wait_until(lambda: len(fake.bot_messages(DM)) == 1)
            with_text = fake.attachment(DM, "big.pdf", pdf, "application/pdf", size=CAP * 9)
            second = fake.user_message(DM, USER, "summarize", attachments=[with_text])
            await wait_until(lambda: len(fake.bot_messages(DM)) == 2)
    notice, answer = fake.bot_messages(DM)
    assert notice["content"] == UNSUPPORTED
    assert notice["message_reference"]["message_id"] == first["id"]
    assert answer["content"] == "a cat"
    assert answer["message_reference"]["message_id"] == second["id"]
    [request] = agent.inputs
    assert image_blocks(request) == [] and fake.cdn_requests == []


def test_document_refs_are_the_other_attachments() -> None:
    message = {
        "id": "11",
        "channel_id": "22",
        "attachments": [
            {"id": "33", "filename": "a.png", "size": 5, "content_type": "image/png"},
            {"id": "44", "filename": "b.pdf", "size": 7, "content_type": "application/pdf"},
            {"id": "55", "filename": "c.bin", "size": 9},
            {"id": "66", "filename": "d.pdf", "size": -1, "content_type": "application/pdf"},
            {"id": "x", "filename": "e.pdf", "size": 1},
        ],
    }
    refs = document_refs(message, CONN)
    assert [(r.kind, r.transport_file_id, r.byte_length, r.mime_type) for r in refs] == [
        ("document", "22/11/44", 7, "application/pdf"),
        ("document", "22/11/55", 9, None),
    ]
