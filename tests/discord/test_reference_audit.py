"""Discord against the reference (issue 39 audit): what a faithful Discord may send that
our fake did not, and kills at moments between a lost session and its backfill.

Each test drives the adapter with a reference-legal input (reference/discord-protocol.md
section named in its docstring) through the fake, or the parsers directly."""

from __future__ import annotations

import time
import urllib.parse
from typing import Any

import attrs
import pytest
import trio

from adapters.discord import _gateway, _rest
from adapters.discord import _protocol as proto
from adapters.discord._parse import parse_message
from adapters.discord._rest import DiscordRest
from adapters.discord._send import NONCE_WINDOW_MS
from prismd.channel import DeliveryOutcomeUnknownError
from stores import Store
from tests.fakes.discord_api import FakeDiscord
from tests.support.clocks import ManualClock
from tests.support.waiting import wait_until, wait_until_async

from .conftest import DM, USER, AdapterFactory, serving
from .test_resume import answered, stored_state
from .test_send import POST, reply_to

DEADLINE_S = 20


# ---------------------------------------------------------------------------- payloads


async def test_hello_interval_as_a_json_float_connects(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """§1.2: ``heartbeat_interval`` is "in milliseconds", a JSON number; ``1000.0`` is one
    (a server computing it from seconds writes it so). Before: every Hello was a protocol
    error, the shard reconnected forever and never identified."""
    fake.heartbeat_interval_ms = 1000.0
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(DM, USER, "one")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
            await wait_until(lambda: len(fake.gateway.heartbeats()) >= 1)
    assert answered(fake) == ["echo: one"]
    assert len(fake.gateway.identifies()) == 1


def test_session_start_limit_in_json_floats_is_read() -> None:
    """§1.1: ``session_start_limit`` is numbers (``reset_after`` in ms); read as floats
    they must still bound the identifies (before: ignored, Discord's ``remaining`` unseen)."""
    limit = proto.StartLimit.from_json(
        {"total": 1000.0, "remaining": 3.0, "reset_after": 14_400_000.0, "max_concurrency": 1.0}
    )
    assert limit == proto.StartLimit(1000, 3, 14_400_000, 1)
    wait = proto.identify_wait_ms(now_ms=0, history=[], limit=limit, own_daily_cap=50)
    assert wait == 14_400_000
    assert proto.StartLimit.from_json({"total": True, "remaining": 1, "reset_after": 1}) is None


def _message(**fields: Any) -> dict[str, Any]:
    message: dict[str, Any] = {
        "id": "1100000000000000001",
        "channel_id": DM,
        "author": {"id": USER, "username": "u", "global_name": None},
        "content": "hello",
        "type": 0,
    }
    message.update(fields)
    return message


@pytest.mark.parametrize(
    "fields",
    [
        {"webhook_id": None},
        {"guild_id": None, "member": None},
        {"message_reference": None, "referenced_message": None, "flags": None},
        {"mentions": None, "attachments": None, "nonce": None},
        {"author": {"id": USER, "username": "u", "bot": None, "system": None}},
    ],
)
def test_optional_fields_sent_as_null_do_not_drop_a_message(fields: dict[str, Any]) -> None:
    """§3: a field given as null is not a webhook, a bot, a guild. Before: ``webhook_id:
    null`` dropped every message silently."""
    event = parse_message(
        _message(**fields),
        connection_id="c",
        bot_user_id="1000000000000000001",
        allow_guilds=False,
        respond_to="mentions",
    )
    assert event is not None
    assert (event.event_id, event.text) == ("1100000000000000001", "hello")


def test_a_webhook_post_is_still_ignored() -> None:
    event = parse_message(
        _message(webhook_id="1200000000000000001"),
        connection_id="c",
        bot_user_id="1000000000000000001",
        allow_guilds=False,
        respond_to="mentions",
    )
    assert event is None


# ---------------------------------------------------------------------------- URLs


@pytest.mark.parametrize(
    ("base", "wanted"),
    [
        ("wss://gateway.discord.gg", "wss://gateway.discord.gg/?v=10&encoding=json"),
        ("wss://gateway.discord.gg/", "wss://gateway.discord.gg/?v=10&encoding=json"),
        ("ws://127.0.0.1:9/resume", "ws://127.0.0.1:9/resume?v=10&encoding=json"),
        ("ws://127.0.0.1:9/gw/?v=9&encoding=etf", "ws://127.0.0.1:9/gw/?v=10&encoding=json"),
        ("ws://127.0.0.1:9/?region=eu", "ws://127.0.0.1:9/?region=eu&v=10&encoding=json"),
    ],
)
def test_gateway_url_keeps_the_path_and_query_it_was_given(base: str, wanted: str) -> None:
    """§1.6: open a socket *to* ``resume_gateway_url`` with the same ``v`` and
    ``encoding``. Before: a slash was added to its path and its query was dropped."""
    assert proto.gateway_url(base) == wanted


async def test_resume_goes_to_the_resume_url_as_given(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    fake.resume_url_override = f"ws://127.0.0.1:{fake.gateway_port}/resume?region=eu"
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.gateway.reconnect()
            await wait_until(lambda: len(fake.gateway.resumes) == 1)
            fake.user_message(DM, USER, "after the resume")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
    assert [outcome for _s, _q, outcome in fake.gateway.resumes] == ["replayed"]
    resumed = urllib.parse.urlsplit(fake.gateway.paths[1])
    assert resumed.path == "/resume"
    assert urllib.parse.parse_qs(resumed.query) == {
        "region": ["eu"],
        "v": ["10"],
        "encoding": ["json"],
    }


async def _closed_port() -> int:
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port: int = listeners[0].socket.getsockname()[1]
    for listener in listeners:
        await listener.aclose()
    return port


async def test_an_unreachable_resume_url_resumes_through_the_gateway_url(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """§1.1/§1.6: the resume host may be down; the session is still resumable through the
    gateway URL ("fetch a new one only when you cannot connect with the cached one").
    Before: the shard retried the dead host until the session expired, then forever."""
    fake.resume_url_override = f"ws://127.0.0.1:{await _closed_port()}/"
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(DM, USER, "one")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
            fake.gateway.reconnect()
            await wait_until(lambda: len(fake.gateway.resumes) == 1)
            fake.user_message(DM, USER, "two")
            await wait_until(lambda: len(fake.bot_messages()) == 2)
    assert answered(fake) == ["echo: one", "echo: two"]
    assert [outcome for _s, _q, outcome in fake.gateway.resumes] == ["replayed"]
    assert len(fake.gateway.identifies()) == 1


async def test_a_gateway_that_never_says_hello_is_left_and_retried(
    fake: FakeDiscord,
    store: Store,
    make_adapter: AdapterFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """§1.2/§9: a socket that opens and then stays silent (no Hello) is a dead connection.
    Before: the shard waited on it forever (no heartbeat runs before Hello)."""
    monkeypatch.setattr(_gateway, "HELLO_TIMEOUT_S", 0.5)
    fake.gateway.silent_before_hello = 1
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(DM, USER, "one")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
    assert fake.gateway.client_close_codes[0] == 4000  # left resumable, never 1000
    assert fake.gateway.connection_count == 2


# ---------------------------------------------------------------------------- REST


async def test_a_global_429_with_the_reference_headers_is_waited_not_a_ban(
    fake: FakeDiscord,
) -> None:
    """§5/§9: a global 429 is ``{message, retry_after, global:true}`` with
    ``X-RateLimit-Global``. Before: without ``X-RateLimit-Scope`` or ``Retry-After`` it was
    taken for Cloudflare's ban and every request paused 60 s."""
    rest = DiscordRest(token=lambda: fake.token, api_origin=fake.origin)
    fake.fail_next("GET /api/v10/users/@me", "429_global_bare")
    try:
        started = trio.current_time()
        with trio.fail_after(10):
            me = await rest.request("GET", "/users/@me")
        waited = trio.current_time() - started
    finally:
        await rest.aclose()
    assert me["id"] == fake.bot_user_id
    assert [r.status for r in fake.calls("GET", "/users/@me")] == [429, 200]
    assert 0.25 <= waited < 5.0


# ---------------------------------------------------------------------------- backfill


async def _answer_one_then_stop(fake: FakeDiscord, store: Store, adapter: Any) -> None:
    async with serving(store, adapter):
        await wait_until(lambda: adapter.health()["state"] == "connected")
        fake.user_message(DM, USER, "one")
        await wait_until(lambda: len(fake.bot_messages()) == 1)
        await trio.sleep(0.2)


async def test_a_backfill_that_fails_is_tried_again(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """§8: a 502 while reading a channel's history ends that connection; the next one
    resumes the new session. Before: the backfill was not due any more (cleared before it
    ran): the gap was lost, uncounted."""
    with trio.fail_after(DEADLINE_S):
        await _answer_one_then_stop(fake, store, make_adapter())
        fake.user_message(DM, USER, "two")
        fake.gateway.expire_sessions()
        fake.fail_next("GET /api/v10/channels/", "502")
        second = make_adapter()
        async with serving(store, second):
            await wait_until(lambda: len(fake.bot_messages()) == 2)
            await trio.sleep(0.3)
    assert answered(fake) == ["echo: one", "echo: two"]
    assert [c.status for c in fake.calls("GET", "/messages")][:2] == [502, 200]
    assert not (await stored_state(store)).backfill_due


async def test_a_stop_during_the_backfill_leaves_it_due(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """A daemon killed while it backfills resumes its new session on restart (no READY).
    Before: the backfill was in memory only: the restart never read the gap."""
    with trio.fail_after(DEADLINE_S):
        await _answer_one_then_stop(fake, store, make_adapter())
        fake.user_message(DM, USER, "two")
        fake.gateway.expire_sessions()
        fake.fail_next("GET /api/v10/channels/", "commit_hang")  # the history never comes
        second = make_adapter()
        async with serving(store, second):
            await wait_until(lambda: len(fake.calls("GET", "/messages")) == 1)
        assert (await stored_state(store)).backfill_due
        third = make_adapter()
        async with serving(store, third):
            await wait_until(lambda: len(fake.bot_messages()) == 2)
            await trio.sleep(0.3)
    assert answered(fake) == ["echo: one", "echo: two"]
    assert len(fake.gateway.identifies()) == 2  # the third resumed the second's session
    assert [outcome for _s, _q, outcome in fake.gateway.resumes] == ["invalid", "replayed"]


async def test_a_stop_between_a_lost_session_and_ready_still_backfills(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """Op 9 ``false`` forgets the session (stored); a daemon killed before the next READY
    starts without a session. Before: only the process that saw op 9 knew a backfill was
    due; the restart identified and never read the gap."""
    with trio.fail_after(DEADLINE_S):
        first = make_adapter()
        async with serving(store, first):
            await wait_until(lambda: first.health()["state"] == "connected")
            fake.user_message(DM, USER, "one")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
            fake.gateway.reconnect_before_hello = 1_000  # no READY for this daemon
            fake.gateway.drop_next = 1
            fake.user_message(DM, USER, "two")  # never sent by the gateway
            fake.gateway.invalidate(resumable=False)

            async def forgotten() -> bool:
                return (await stored_state(store)).session is None

            await wait_until_async(forgotten)
        fake.gateway.reconnect_before_hello = 0
        second = make_adapter()
        async with serving(store, second):
            await wait_until(lambda: len(fake.bot_messages()) == 2)
            await trio.sleep(0.3)
    assert answered(fake) == ["echo: one", "echo: two"]
    assert second.shard_statuses[0].backfilled >= 1


# ---------------------------------------------------------------------------- proof of delivery


async def test_another_reply_to_the_same_message_is_no_proof_of_delivery(
    fake: FakeDiscord, make_adapter: AdapterFactory
) -> None:
    """§9 "Outbound": past the nonce window a reply is proved by the bot's reply to the
    inbound message. One message can have several (an approval notice, then the answer).
    Before: the notice was taken for the answer, which was marked delivered unsent."""
    inbound = fake.user_message(DM, USER, "question")
    clock = ManualClock()
    first = make_adapter(clock=clock)
    with trio.fail_after(DEADLINE_S):
        notice = await first.send(reply_to(inbound["id"], "Approve?", operation="op-notice"))
    assert notice.delivered
    fake.fail_next(POST, *["502"] * 8)  # the answer's attempts: none committed
    with trio.move_on_after(1.0):
        await first.send(reply_to(inbound["id"], "the answer", operation="op-answer"))
    await first.aclose()
    fake._faults.clear()
    clock.advance(NONCE_WINDOW_MS + 1)
    second = make_adapter(clock=clock)
    posted = len(fake.calls("POST", f"/channels/{DM}/messages"))
    with trio.fail_after(DEADLINE_S), pytest.raises(DeliveryOutcomeUnknownError):
        await second.send(reply_to(inbound["id"], "the answer", operation="op-answer"))
    await second.aclose()
    assert len(fake.calls("POST", f"/channels/{DM}/messages")) == posted  # never blindly
    assert [m["content"] for m in fake.bot_messages(DM)] == ["Approve?"]


async def test_the_answer_itself_is_proof_of_delivery_past_the_window(
    fake: FakeDiscord, make_adapter: AdapterFactory
) -> None:
    inbound = fake.user_message(DM, USER, "question")
    clock = ManualClock()
    first = make_adapter(clock=clock)
    with trio.fail_after(DEADLINE_S):
        await first.send(reply_to(inbound["id"], "Approve?", operation="op-notice"))
    fake.fail_next(POST, "commit_hang")  # the answer is posted, its response never comes
    with trio.move_on_after(1.0):
        await first.send(reply_to(inbound["id"], "the answer", operation="op-answer"))
    await first.aclose()
    fake._faults.clear()
    clock.advance(NONCE_WINDOW_MS + 1)
    second = make_adapter(clock=clock)
    with trio.fail_after(DEADLINE_S):
        result = await second.send(reply_to(inbound["id"], "the answer", operation="op-answer"))
    await second.aclose()
    assert result.delivered
    answer = next(m for m in fake.bot_messages(DM) if m["content"] == "the answer")
    assert result.message_id == answer["id"]


def test_an_image_without_content_type_is_known_by_its_name() -> None:
    """§3: ``content_type`` is optional. Before: an image without it was no image, and a
    message of that image alone was dropped silently."""
    attachment = {"id": "1300000000000000001", "filename": "Cat.PNG", "size": 10}
    attachment |= {"url": "https://cdn.discordapp.com/x/Cat.PNG", "proxy_url": "https://x"}
    message = _message(content="", attachments=[attachment, {**attachment, "filename": "a.pdf"}])
    event = parse_message(
        message,
        connection_id="c",
        bot_user_id="1000000000000000001",
        allow_guilds=False,
        respond_to="mentions",
    )
    assert event is not None
    [ref] = event.attachments
    assert (ref.mime_type, ref.byte_length) == ("image/png", 10)


# ---------------------------------------------------------------------------- sequence gaps


async def test_a_dispatch_lost_on_the_way_is_replayed_by_a_resume(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """§1.4/§1.6: ``s`` counts a session's dispatches; a jump means some were sent and
    lost on the way, and a Resume from the watermark replays them ("the missed events in
    order"). Before: the watermark passed the gap and the message was never answered,
    never listed."""
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(DM, USER, "one")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
            fake.gateway.lose_next = 1
            fake.user_message(DM, USER, "lost on the way")
            fake.user_message(DM, USER, "after it")
            await wait_until(lambda: len(fake.bot_messages()) == 3)
            await trio.sleep(0.3)
    assert answered(fake) == ["echo: after it", "echo: lost on the way", "echo: one"]
    assert [outcome for _s, _q, outcome in fake.gateway.resumes] == ["replayed"]
    assert len(fake.gateway.identifies()) == 1


# ---------------------------------------------------------------------------- unknown channels


async def test_a_channel_first_seen_after_a_lost_session_has_its_gap_read(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """§3/§8: a bot cannot list its DM channels, so a backfill reads only channels a message
    was journaled from. A user whose first messages fell in the outage is seen with their
    next one: that channel's messages since the outage, before it, are read then (oldest
    first). Before: the first ones were lost, never listed (the channel's pointer started
    after them)."""
    newcomer, channel = "2000000000000000009", "3000000000000000009"
    with trio.fail_after(DEADLINE_S):
        await _answer_one_then_stop(fake, store, make_adapter())
        fake.gateway.expire_sessions()
        fake.user_message(channel, newcomer, "first, during the outage")
        fake.user_message(channel, newcomer, "second, during the outage")
        second = make_adapter()
        async with serving(store, second):
            await wait_until(lambda: second.health()["state"] == "connected")
            fake.user_message(channel, newcomer, "third, live")
            await wait_until(lambda: len(fake.bot_messages(channel)) == 3)
            await trio.sleep(0.3)
    assert [m["content"] for m in fake.bot_messages(channel)] == [
        "echo: first, during the outage",
        "echo: second, during the outage",
        "echo: third, live",
    ]
    assert len(fake.bot_messages()) == 4


async def test_a_reply_where_history_cannot_be_read_goes_out_without_its_reference(
    fake: FakeDiscord, make_adapter: AdapterFactory
) -> None:
    """§4: a reply needs READ_MESSAGE_HISTORY (else 160002). The answer still goes out, as
    a plain message with the same nonce. Before: every answer there was delivery_failed."""
    inbound = fake.user_message(DM, USER, "question")
    fake.channels[DM].no_history = True
    adapter = make_adapter()
    with trio.fail_after(DEADLINE_S):
        result = await adapter.send(reply_to(inbound["id"], "the answer"))
    await adapter.aclose()
    assert result.delivered
    [message] = fake.bot_messages(DM)
    assert result.message_id == message["id"]
    assert "message_reference" not in message
    bodies = [r.body for r in fake.calls("POST", f"/channels/{DM}/messages")]
    assert [("message_reference" in b, b["nonce"]) for b in bodies] == [
        (True, bodies[0]["nonce"]),
        (False, bodies[0]["nonce"]),
    ]


async def test_routes_that_share_a_bucket_are_paced_as_one(fake: FakeDiscord) -> None:
    """§5: ``X-RateLimit-Bucket`` "identifies a shared limit": routes that answer with the
    same bucket share its ``Remaining``. Before: each route was counted apart and the
    request over the shared limit met a 429 (counted as an invalid request)."""
    fake.shared_message_bucket = True
    fake.route_limit, fake.route_window_s = 2, 1.0
    inbound = fake.user_message(DM, USER, "question")
    rest = DiscordRest(token=lambda: fake.token, api_origin=fake.origin)
    path = f"/channels/{DM}/messages"
    try:
        with trio.fail_after(DEADLINE_S):
            posted = await rest.request("POST", path, json_body={"content": "a"})
            await rest.request("PATCH", f"{path}/{posted['id']}", json_body={"content": "b"})
            await rest.request("POST", path, json_body={"content": "c"})
            await rest.request("DELETE", f"{path}/{posted['id']}")
    finally:
        await rest.aclose()
    assert [r.status for r in fake.requests if "/messages" in r.path] == [200, 200, 200, 204]
    assert rest.invalid_requests == 0
    assert inbound["id"]


async def test_idle_buckets_are_forgotten(
    fake: FakeDiscord, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One bucket per route and channel used: a bot in many channels kept every one.
    Before: the table only grew."""
    monkeypatch.setattr(_rest, "MAX_BUCKETS", 8)
    fake.route_window_s = 0.01  # every bucket resets at once
    rest = DiscordRest(token=lambda: fake.token, api_origin=fake.origin)
    try:
        with trio.fail_after(DEADLINE_S):
            for n in range(30):
                channel = f"{3100000000000000000 + n}"
                fake.channel(channel)
                await rest.request("POST", f"/channels/{channel}/typing")
                await trio.sleep(0.02)
    finally:
        await rest.aclose()
    assert len(rest._buckets) <= 9
    assert [r.status for r in fake.requests].count(204) == 30


async def test_a_rate_limit_never_carries_a_resend_past_the_nonce_window(
    fake: FakeDiscord, make_adapter: AdapterFactory
) -> None:
    """§4/§5: the resend of a POST whose answer was lost must leave inside the window the
    nonce deduplicates in; a 429 (``retry_after`` 64.57 in the reference's example) or a
    bucket's reset may lie past it. Before: the REST client slept through it and posted
    again outside the window (the user could get the reply twice); now the window's end
    turns the wait into the lookup."""
    inbound = fake.user_message(DM, USER, "question")
    fake.route_window_s = 100.0  # the forced 429 asks for ~100 s
    fake.fail_next(POST, "commit_drop", "429")
    adapter = make_adapter()
    staged = attrs.evolve(
        reply_to(inbound["id"]), staged_at_ms=int(time.time() * 1000) - NONCE_WINDOW_MS + 4_000
    )
    with trio.fail_after(DEADLINE_S):
        result = await adapter.send(staged)
    await adapter.aclose()
    assert result.delivered
    [message] = fake.bot_messages(DM)
    assert result.message_id == message["id"]
    statuses = [r.status for r in fake.calls("POST", f"/channels/{DM}/messages")]
    assert statuses[0] == 0 and set(statuses[1:]) <= {429}  # nothing posted after the 429


async def test_a_second_lost_session_keeps_the_first_gap_for_new_channels(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """A session lost again before its backfill completed: the gap still open dates from
    the first loss. Before: the new READY dated it from the newest message journaled since
    (one the unfinished backfill admitted), and a newcomer's message in between was lost."""
    a, c, b = "3000000000000000001", "3000000000000000002", "3000000000000000003"
    with trio.fail_after(DEADLINE_S):
        first = make_adapter()
        async with serving(store, first):
            await wait_until(lambda: first.health()["state"] == "connected")
            fake.user_message(a, USER, "a1")
            fake.user_message(c, "2000000000000000002", "c1")
            await wait_until(lambda: len(fake.bot_messages()) == 2)
            await trio.sleep(1.3)  # the channels saved with the watermark
        fake.gateway.expire_sessions()
        fake.user_message(b, "2000000000000000003", "b1, the newcomer's first")
        fake.user_message(a, USER, "a2")
        fake.fail_next(f"GET /api/v10/channels/{c}/messages", "commit_hang")
        second = make_adapter()
        async with serving(store, second):  # backfills a (a2), then hangs on c
            await wait_until(lambda: len(fake.bot_messages(a)) == 2)
        fake.gateway.expire_sessions()
        third = make_adapter()
        async with serving(store, third):
            await wait_until(lambda: third.health()["state"] == "connected")
            fake.user_message(b, "2000000000000000003", "b2")
            await wait_until(lambda: len(fake.bot_messages(b)) == 2)
            await trio.sleep(0.3)
    assert [m["content"] for m in fake.bot_messages(b)] == [
        "echo: b1, the newcomer's first",
        "echo: b2",
    ]
