"""A hostile audit of the Discord connection (issue 39): what another faithful fake may
legally do that ours did not, and whether prismd still answers every message once.

Each test names the reference section (reference/discord-protocol.md) that makes the
input legal, and what prismd did before its fix."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio

from adapters.discord._media import allowed_url
from adapters.discord._parse import parse_message
from adapters.discord._protocol import Heartbeater
from adapters.discord._websocket import GatewaySocket
from prismd.agents import ImageBlock
from prismd.channel import Preview
from stores import Store
from tests.fakes.discord_api import FakeDiscord
from tests.support.scripted import image_blocks
from tests.support.waiting import wait_until

from .conftest import CONN, DM, GUILD, GUILD_CHANNEL, USER, AdapterFactory, serving
from .test_attachments import CAP, PNG, _vision
from .test_resume import answered
from .test_send import reply_to

DEADLINE_S = 20
OTHER_USER = "2000000000000000002"
OTHER_DM = "3000000000000000002"


# ---------------------------------------------------------------------------- gateway


@pytest.mark.parametrize("code", [4009, 4003, 4006])
async def test_a_resume_refused_by_a_close_falls_back_to_identify(
    code: int, fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """§1.5/§1.6: a gateway may turn an expired session's Resume down by closing (4009
    "Session timed out … start a new one", 4003 "this session has been invalidated", or a
    code it does not document) instead of op 9 ``false``. Before: 4009 and unknown codes
    meant "resume", so the shard resumed the dead session forever and never answered
    again."""
    fake.gateway.refuse_resume_with = code
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(DM, USER, "before")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
            fake.gateway.expire_sessions()
            fake.gateway.close_all(4000)
            await wait_until(lambda: len(fake.gateway.identifies()) == 2)
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(DM, USER, "after")
            await wait_until(lambda: len(fake.bot_messages()) == 2)
    assert answered(fake) == ["echo: after", "echo: before"]
    refused = [r for r in fake.gateway.resumes if r[2] == "invalid"]
    assert 1 <= len(refused) <= 2
    assert not {1000, 1001} & set(fake.gateway.client_close_codes)


@pytest.mark.parametrize("code", [4008, 4003, 4005])
async def test_a_close_that_leaves_the_session_alive_is_resumed_not_reidentified(
    code: int, fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """§1.5/§1.6/§9: "the session will remain active" after a close other than 1000/1001
    (DPY resumes after any reconnectable close; a gateway whose session is in fact gone
    answers the Resume with op 9). A new user's first message sent while the shard was
    away is in the session's replay and nowhere else (bots cannot list DMs, §3). Before:
    4003/4005/4008 dropped the session and identified — that message was never answered
    nor listed."""
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(DM, USER, "before")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
            fake.gateway.close_all(code)
            await wait_until(lambda: not fake.gateway.live())
            fake.user_message(OTHER_DM, OTHER_USER, "in the gap")
            await wait_until(lambda: len(fake.bot_messages()) == 2)
    assert answered(fake) == ["echo: before", "echo: in the gap"]
    assert len(fake.gateway.identifies()) == 1
    assert [outcome for _s, _q, outcome in fake.gateway.resumes] == ["replayed"]


# ---------------------------------------------------------------------------- payloads

BOT = "1000000000000000001"


@pytest.mark.parametrize("form", [f"<@{BOT}>", f"<@!{BOT}>"])
def test_a_mention_in_the_text_is_a_mention_without_the_mentions_array(form: str) -> None:
    """§3: a message's ``<@id>`` / ``<@!id>`` is how it mentions a user; ``mentions`` is the
    parsed list, which a gateway may leave out of a payload (optional fields absent, as
    GWE's "extra fields"). Before: a guild message mentioning the bot in its text, without
    the array, was ignored (never answered nor listed)."""
    message = {
        "id": "6000000000000000001",
        "channel_id": GUILD_CHANNEL,
        "guild_id": GUILD,
        "author": {"id": USER, "username": "u"},
        "content": f"{form} hello",
        "type": 0,
    }
    event = parse_message(
        message,
        connection_id="dc",
        bot_user_id=BOT,
        allow_guilds=True,
        respond_to="mentions",
    )
    assert event is not None and event.text == "hello"
    other = dict(message, content="<@2999999999999999999> hello")
    assert (
        parse_message(
            other, connection_id="dc", bot_user_id=BOT, allow_guilds=True, respond_to="mentions"
        )
        is None
    )


# ---------------------------------------------------------------------------- held


async def test_a_guild_create_burst_after_ready_delays_no_message(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """§1.3: READY's ``guilds`` are stubs "filled in later by GUILD_CREATE events" — for a
    bot in many guilds a burst of large dispatches, some with members and channels. The
    messages behind them are answered, in order, each once, and the heartbeat keeps going
    (no zombie close while the burst is read)."""
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            [session] = fake.gateway.sessions.values()
            members = [{"user": {"id": str(10**18 + i), "username": "x" * 20}} for i in range(300)]
            for n in range(400):
                guild = {
                    "id": str(4 * 10**18 + n),
                    "name": f"g{n}",
                    "unavailable": False,
                    "members": members,
                    "channels": [{"id": str(5 * 10**18 + n), "type": 0}],
                }
                fake.gateway.push(session, "GUILD_CREATE", guild)
                if n % 100 == 0:
                    fake.user_message(DM, USER, f"m{n}")
            await wait_until(lambda: len(fake.bot_messages()) == 4)
            await trio.sleep(0.5)
    assert [m["content"] for m in fake.bot_messages()] == [
        f"echo: m{n}" for n in (0, 100, 200, 300)
    ]
    assert fake.gateway.client_close_codes == [4000]  # only the stop's own close
    assert len(fake.gateway.identifies()) == 1


async def test_a_fast_heartbeat_under_a_burst_loses_and_repeats_nothing(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """§1.2/§9: Hello's interval is the server's choice ("use ms in tests"): at 100 ms a
    beat is due many times while a burst is admitted. Whatever zombie closes and resumes
    follow, every message is answered once."""
    fake.heartbeat_interval_ms = 100
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            for n in range(30):
                fake.user_message(DM if n % 2 else OTHER_DM, USER if n % 2 else OTHER_USER, f"b{n}")
                if n % 7 == 0:
                    fake.gateway.withhold_acks += 1
                await trio.sleep(0.03)
            await wait_until(lambda: len(fake.bot_messages()) == 30)
            await trio.sleep(0.5)
    assert answered(fake) == sorted(f"echo: b{n}" for n in range(30))
    assert len(fake.gateway.identifies()) == 1
    assert not {1000, 1001} & set(fake.gateway.client_close_codes)


async def test_an_ack_read_while_its_beat_is_still_being_sent_counts(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """§1.2: the ACK answers the beat; on a fast link (or a loaded machine) it is read by
    the socket's reader while the heartbeat task's send has not yet returned. Before the
    fix the beat was marked sent after the send, which undid that ACK: the next beat found
    the last unacknowledged and closed a live connection as a zombie (seen as a resume in
    a loaded full-suite run). Each send here returns only after its ACK was read."""
    fake.heartbeat_interval_ms = 400
    original = GatewaySocket.send_message
    acks = _calls(monkeypatch, "ack")

    async def send_message(ws: GatewaySocket, text: str) -> None:
        before = len(acks)
        await original(ws, text)
        if json.loads(text)["op"] == 1:
            await wait_until(lambda: len(acks) > before)  # the reader has read its ACK

    monkeypatch.setattr(GatewaySocket, "send_message", send_message)
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            await wait_until(lambda: len(fake.gateway.heartbeats()) >= 6)
            fake.user_message(DM, USER, "still here")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
    assert fake.gateway.client_close_codes == [4000]  # only the stop's own close
    assert len(fake.gateway.identifies()) == 1
    assert not [r for r in fake.gateway.received if r.op == 6]  # no Resume


async def test_the_reader_tells_the_heartbeat_rule_of_every_frame(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """§1.2: what the heartbeat rule knows of a backlog (an ACK behind frames still being
    read is not missing: tests/discord/test_kind.py) comes from the reader, one report a
    frame, the ACKs' too."""
    heard = _calls(monkeypatch, "heard")
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            [session] = fake.gateway.sessions.values()
            before, beats = len(heard), len(fake.gateway.heartbeats())
            for n in range(20):
                fake.gateway.push(session, "GUILD_CREATE", {"id": str(4 * 10**18 + n)})
            await wait_until(lambda: len(heard) >= before + 20)
            await wait_until(lambda: len(fake.gateway.heartbeats()) >= beats + 2)
            await trio.sleep(0.3)  # the last beat's ACK read
    assert heard == sorted(heard) and len(heard) >= before + 20 + 2


def _calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[tuple[Any, ...]]:
    """Each call of ``Heartbeater.<name>`` (its arguments), recorded and passed on."""
    calls: list[tuple[Any, ...]] = []
    original = getattr(Heartbeater, name)

    def spy(beat: Heartbeater, *args: Any) -> None:
        calls.append(args)
        original(beat, *args)

    monkeypatch.setattr(Heartbeater, name, spy)
    return calls


async def test_dispatches_lost_on_the_way_twice_in_a_minute_are_both_replayed(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """§1.6/§9.7: dispatches lost on the way (a jump in ``s``) are replayed by a Resume from
    the watermark. Before: only one gap a minute was resumed for; a second one within it
    was passed over and its message never answered nor listed."""
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            for n in range(8):
                fake.gateway.lose_next = 1
                fake.user_message(DM if n % 2 else OTHER_DM, USER, f"lost {n}")
                fake.user_message(DM if n % 2 else OTHER_DM, USER, f"after {n}")
                await wait_until(lambda: len(fake.gateway.resumes) > n)  # noqa: B023
            await wait_until(lambda: len(fake.bot_messages()) == 16)
    assert answered(fake) == sorted(f"echo: {w} {n}" for n in range(8) for w in ("lost", "after"))
    assert [outcome for _s, _q, outcome in fake.gateway.resumes] == ["replayed"] * 8
    assert len(fake.gateway.identifies()) == 1


async def test_a_gap_no_replay_fills_is_resumed_for_once(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """§9.3: ``s`` is "monotonically increasing per session"; a gateway may skip a number
    for good (nothing to replay). The gap is resumed for once, then passed over; after two
    such, the session's gaps are taken as numbering: no loop of resumes, nothing lost
    around them."""
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            for n in range(4):
                fake.gateway.skip_next = 1
                fake.user_message(DM, USER, f"over a hole {n}")
                fake.user_message(DM, USER, f"next {n}")
                await wait_until(lambda: len(fake.bot_messages()) == 2 * (n + 1))  # noqa: B023
                await trio.sleep(0.3)
    assert answered(fake) == sorted(
        f"echo: {w} {n}" for n in range(4) for w in ("next", "over a hole")
    )
    assert [outcome for _s, _q, outcome in fake.gateway.resumes] == ["replayed"] * 2
    assert len(fake.gateway.identifies()) == 1


# ---------------------------------------------------------------------------- previews


async def test_a_preview_whose_post_lost_its_answer_is_not_left_behind(
    fake: FakeDiscord, make_adapter: AdapterFactory
) -> None:
    """§8/§9: a POST may commit and lose its answer. Before: the preview was posted again
    with a fresh nonce — a second message — and the first, whose id was never learnt, was
    left in the channel beside the reply for good (a stale copy of the answer). Now the
    preview keeps its nonce, so the second POST returns the first message, the one the
    reply then deletes."""
    inbound = fake.user_message(DM, USER, "question")
    fake.fail_next(f"POST /api/v10/channels/{DM}/messages", "commit_drop")
    adapter = make_adapter(previews=True)
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            text = ""
            for n in range(15):
                text += f"w{n} "
                adapter.send_draft(Preview(CONN, DM, text))
                await trio.sleep(0.1)
            await trio.sleep(1.1)
            result = await adapter.send(reply_to(inbound["id"], text.strip()))
            nursery.cancel_scope.cancel()
    await adapter.aclose()
    assert result.delivered
    assert [m["content"] for m in fake.bot_messages(DM)] == [text.strip()]


# ---------------------------------------------------------------------------- notices


@pytest.mark.parametrize("fault", ["502", "commit_drop", "commit_500"])
async def test_a_refusal_notice_is_posted_once_through_a_failed_send(
    fault: str, fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """§4/§8: a message refused at admission (an image over the cap) is answered only by
    its notice — nothing is journaled, nothing listed. A 502 (nothing created) or a POST
    that committed and lost its answer is posted again with the notice's nonce. Before: the
    notice was tried once, so after a 502 the user was never answered and nothing listed
    the message."""
    agent, host = _vision()
    adapter = make_adapter(max_attachment_bytes=CAP)
    big = fake.attachment(DM, "big.png", b"\0" * (CAP + 1), "image/png")
    with trio.fail_after(DEADLINE_S):
        async with serving(store, adapter, host, fetch_attachment=adapter.fetch_attachment):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.fail_next(f"POST /api/v10/channels/{DM}/messages", fault)
            inbound = fake.user_message(DM, USER, "look", attachments=[big])
            await wait_until(lambda: len(fake.bot_messages(DM)) == 1)
            await trio.sleep(1.0)
    [notice] = fake.bot_messages(DM)
    assert notice["content"] == f"Attachments too large: at most {CAP} bytes in all."
    assert notice["message_reference"]["message_id"] == inbound["id"]
    assert agent.inputs == []


# ---------------------------------------------------------------------------- attachments


async def test_an_image_served_by_a_cdn_beside_a_loopback_api_is_fetched(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory, nursery: trio.Nursery
) -> None:
    """§3 "Signed Attachment CDN URLs": attachments are served by a CDN, not the API host.
    A Discord on loopback (tests, a proxy) may serve them from another port of the same
    host, as Discord's CDN is another host than its API. Before: only the API's own port
    was fetched from; the image was "cannot be processed". Another host is still refused."""
    cdn = FakeDiscord()
    await nursery.start(cdn.serve)
    agent, host = _vision()
    adapter = make_adapter()
    image = cdn.attachment(DM, "cat.png", PNG, "image/png")
    with trio.fail_after(DEADLINE_S):
        async with serving(store, adapter, host, fetch_attachment=adapter.fetch_attachment):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(DM, USER, "what is this?", attachments=[image])
            await wait_until(lambda: len(fake.bot_messages(DM)) == 1)
    [request] = agent.inputs
    assert image_blocks(request) == [ImageBlock(data=PNG, mime_type="image/png")]
    [(_path, authorized)] = cdn.cdn_requests
    assert not authorized  # never the bot token to the CDN
    port = cdn.origin.rsplit(":", 1)[1]
    assert allowed_url(f"http://127.0.0.2:{port}/a.png", fake.origin) is None
    assert allowed_url(f"http://localhost:{port}/a.png", fake.origin) is None
    assert allowed_url(f"https://127.0.0.1:{port}/a.png", fake.origin) is None


@pytest.mark.parametrize("fault", ["502", "commit_drop"])
async def test_a_preview_whose_delete_failed_is_deleted_again(
    fault: str, fake: FakeDiscord, make_adapter: AdapterFactory
) -> None:
    """§4/§8: a DELETE may meet a 502 or lose its answer like any request; deleting again is
    safe (a message already gone is 10008). Before: one try, so after a 502 the preview — a
    stale copy of the answer — stayed beside the reply for good."""
    inbound = fake.user_message(DM, USER, "question")
    adapter = make_adapter(previews=True)
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            adapter.send_draft(Preview(CONN, DM, "partial answer"))
            await wait_until(lambda: len(fake.bot_messages(DM)) == 1)
            fake.fail_next(f"DELETE /api/v10/channels/{DM}/messages/", fault)
            result = await adapter.send(reply_to(inbound["id"], "the answer"))
            nursery.cancel_scope.cancel()
    await adapter.aclose()
    assert result.delivered
    assert [m["content"] for m in fake.bot_messages(DM)] == ["the answer"]
