"""Replies never posted twice: nonces, the two-minute window from the stored first attempt,
proof by the bot's reply outside it, definite failures, rate limits, chunks."""

from __future__ import annotations

import itertools
import re

import attrs
import pytest
import trio
import trio.testing

from adapters.discord import chunk_markdown
from adapters.discord._rest import (
    GLOBAL_PER_SECOND,
    GLOBAL_WINDOW_S,
    PACE_SLACK_S,
    DiscordApiError,
    DiscordGuardError,
    DiscordRest,
)
from adapters.discord._send import NONCE_WINDOW_MS, SEND_NAMESPACE, chunk_nonce, nonce_base
from prismd.channel import DeliveryOutcomeUnknownError, Preview, Reply
from stores import Store
from tests.fakes.discord_api import FakeDiscord
from tests.support.clocks import ManualClock

from .conftest import CONN, DM, USER, AdapterFactory

DEADLINE_S = 30
POST = f"POST /api/v10/channels/{DM}/messages"


def reply_to(inbound_id: str, text: str = "the answer", operation: str = "op-1") -> Reply:
    return Reply(
        connection_id=CONN,
        external_conversation_id=DM,
        text=text,
        kind="final",
        in_reply_to=inbound_id,
        operation_id=operation,
    )


def posts(fake: FakeDiscord) -> list[dict[str, object]]:
    return [r.body for r in fake.calls("POST", f"/channels/{DM}/messages")]


@pytest.mark.parametrize("fault", ["commit_drop", "commit_500", "502"])
async def test_lost_or_failed_response_resent_with_the_same_nonce(
    fault: str, fake: FakeDiscord, make_adapter: AdapterFactory
) -> None:
    inbound = fake.user_message(DM, USER, "question")
    fake.fail_next(POST, fault)
    adapter = make_adapter()
    with trio.fail_after(DEADLINE_S):
        result = await adapter.send(reply_to(inbound["id"]))
    await adapter.aclose()
    assert result.delivered
    [message] = fake.bot_messages(DM)
    assert result.message_id == message["id"]
    bodies = posts(fake)
    assert len(bodies) == 2
    assert bodies[0]["nonce"] == bodies[1]["nonce"] == chunk_nonce(nonce_base(CONN, "op-1"), 0)
    assert all(b["enforce_nonce"] is True for b in bodies)


async def test_restart_inside_the_window_posts_again_and_discord_dedups(
    fake: FakeDiscord, make_adapter: AdapterFactory, store: Store
) -> None:
    inbound = fake.user_message(DM, USER, "question")
    clock = ManualClock()
    fake.fail_next(POST, "commit_hang")
    first = make_adapter(clock=clock)
    with trio.move_on_after(1.0):  # the process dies while the POST hangs (committed)
        await first.send(reply_to(inbound["id"]))
    await first.aclose()
    clock.advance(60_000)
    second = make_adapter(clock=clock)
    with trio.fail_after(DEADLINE_S):
        result = await second.send(reply_to(inbound["id"]))
    await second.aclose()
    assert result.delivered
    assert len(fake.bot_messages(DM)) == 1
    assert len(posts(fake)) == 2


@pytest.mark.parametrize("committed", [True, False])
async def test_outside_the_window_proved_by_the_bots_reply_never_posted_blindly(
    committed: bool, fake: FakeDiscord, make_adapter: AdapterFactory
) -> None:
    inbound = fake.user_message(DM, USER, "question")
    clock = ManualClock()
    fake.fail_next(POST, "commit_hang" if committed else "502")
    fake.fail_next(POST, "502", "502", "502", "502", "502", "502", "502", "502")
    first = make_adapter(clock=clock)
    with trio.move_on_after(1.0):
        await first.send(reply_to(inbound["id"]))
    await first.aclose()
    fake._faults.clear()
    clock.advance(NONCE_WINDOW_MS + 1)
    second = make_adapter(clock=clock)
    posted = len(posts(fake))
    with trio.fail_after(DEADLINE_S):
        if committed:
            result = await second.send(reply_to(inbound["id"]))
            assert result.delivered
            assert result.message_id == fake.bot_messages(DM)[0]["id"]
        else:
            with pytest.raises(DeliveryOutcomeUnknownError):
                await second.send(reply_to(inbound["id"]))
    await second.aclose()
    assert len(posts(fake)) == posted  # nothing posted outside the window
    assert len(fake.bot_messages(DM)) == (1 if committed else 0)
    assert fake.calls("GET", f"/channels/{DM}/messages")


@pytest.mark.parametrize(
    ("setup", "reason"),
    [
        ("blocked", "blocked or DMs closed"),
        ("no_permission", "missing permissions"),
        ("unknown", "unknown channel"),
    ],
)
async def test_definite_failures_have_a_short_reason(
    setup: str, reason: str, fake: FakeDiscord, make_adapter: AdapterFactory
) -> None:
    inbound = fake.user_message(DM, USER, "question")
    if setup == "unknown":
        del fake.channels[DM]
    else:
        setattr(fake.channel(DM), setup, True)
    adapter = make_adapter()
    with trio.fail_after(DEADLINE_S):
        result = await adapter.send(reply_to(inbound["id"]))
    await adapter.aclose()
    assert not result.delivered
    assert result.reason is not None and reason in result.reason
    assert len(posts(fake)) == 1  # not retried


async def test_route_bucket_and_429_honoured(
    fake: FakeDiscord, make_adapter: AdapterFactory
) -> None:
    """Five replies into one channel whose bucket allows 2 per second: the headers make the
    client wait, so the fake answers no 429 except the one forced, whose retry_after is
    honoured; every reply arrives once."""
    fake.route_limit, fake.route_window_s = 2, 1.0
    inbound = fake.user_message(DM, USER, "question")
    fake.fail_next(POST, "429")
    adapter = make_adapter()
    with trio.fail_after(DEADLINE_S):
        for n in range(5):
            result = await adapter.send(reply_to(inbound["id"], f"answer {n}", f"op-{n}"))
            assert result.delivered
    await adapter.aclose()
    statuses = [r.status for r in fake.calls("POST", f"/channels/{DM}/messages")]
    assert statuses.count(429) == 1
    assert statuses.count(200) == 5
    assert sorted(m["content"] for m in fake.bot_messages(DM)) == [f"answer {n}" for n in range(5)]


async def test_global_limit_429_blocks_and_retries(
    fake: FakeDiscord, make_adapter: AdapterFactory
) -> None:
    fake.global_limit = 3
    inbound = fake.user_message(DM, USER, "question")
    adapter = make_adapter()
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            for n in range(4):
                nursery.start_soon(adapter.send, reply_to(inbound["id"], f"a{n}", f"op-{n}"))
    await adapter.aclose()
    assert len(fake.bot_messages(DM)) == 4
    # Each of the four concurrent senders meets at most one global 429: the first one
    # blocks every request until its retry_after has passed.
    global_429 = [r for r in fake.requests if r.status == 429]
    assert 1 <= len(global_429) <= 4
    assert len(fake.requests) <= 4 + 4 + len(global_429)  # /users/@me, the POSTs, retries


async def test_long_reply_in_chunks_each_with_its_own_nonce(
    fake: FakeDiscord, make_adapter: AdapterFactory
) -> None:
    inbound = fake.user_message(DM, USER, "question")
    text = (
        "Intro paragraph.\n\n" + "word " * 500 + "\n\n```python\n" + "x = 1\n" * 400 + "```\nEnd."
    )
    adapter = make_adapter()
    with trio.fail_after(DEADLINE_S):
        result = await adapter.send(reply_to(inbound["id"], text))
    await adapter.aclose()
    assert result.delivered
    messages = fake.bot_messages(DM)
    assert len(messages) == len(chunk_markdown(text)) >= 3
    nonces = [b["nonce"] for b in posts(fake)]
    assert len(set(nonces)) == len(nonces)
    assert all(isinstance(n, str) and len(n) <= 25 for n in nonces)
    assert all(m["message_reference"]["message_id"] == inbound["id"] for m in messages)


def test_chunks_cut_on_safe_boundaries_and_keep_fences_balanced() -> None:
    text = "p" * 1000 + "\n\n" + "a" * 1500 + "\n\n```js\n" + "let x = 1;\n" * 300 + "```\nafter"
    chunks = chunk_markdown(text)
    assert all(len(c.encode("utf-16-le")) // 2 <= 2000 for c in chunks)
    assert chunks[0] == "p" * 1000 + "\n\n"  # the paragraph, not 2,000 characters
    for chunk in chunks:
        assert len(re.findall(r"^```", chunk, re.MULTILINE)) % 2 == 0, chunk[:40]
    assert "".join(chunks).replace("\n```\n```js\n", "\n").count("let x = 1;") == 300
    assert chunks[-1].endswith("after")
    emoji = "\U0001f600" * 1500  # 3,000 UTF-16 units, no spaces
    assert [len(c) for c in chunk_markdown(emoji)] == [988, 512]
    assert chunk_markdown("   ") == []


def test_nonce_is_stable_and_short() -> None:
    base = nonce_base("conn", "op-123")
    assert base == nonce_base("conn", "op-123") != nonce_base("conn", "op-124")
    assert len(chunk_nonce(base, 999)) <= 25
    # The same on every version too: a daemon upgraded inside the window resends with it.
    assert base == "qxupmu6wrn6e2duy4j66"  # base32(sha256("conn\0op-123"))[:20], lower case


async def test_invalid_request_guard_and_cloudflare_ban(fake: FakeDiscord) -> None:
    """401/403/429 answers are counted; past the guard every call is refused locally (never
    reaching the 10,000 per 10 minutes that bans an IP). A headerless HTML 429 is the ban:
    every request pauses for the cooldown instead of hammering."""
    rest = DiscordRest(token=lambda: "wrong", api_origin=fake.origin, invalid_guard=5)
    with trio.fail_after(DEADLINE_S):
        for _ in range(5):
            with pytest.raises(DiscordApiError):
                await rest.request("GET", "/users/@me")
        with pytest.raises(DiscordGuardError):
            await rest.request("GET", "/users/@me")
    assert len(fake.requests) == 5
    await rest.aclose()
    fake.ban_after_invalid = 5
    banned = DiscordRest(token=lambda: fake.token, api_origin=fake.origin, ban_cooldown_s=0.5)
    with trio.fail_after(DEADLINE_S):
        started = trio.current_time()
        with pytest.raises(DiscordApiError):
            await banned.request("GET", "/users/@me")
        waited = trio.current_time() - started
    await banned.aclose()
    assert waited >= 4 * 0.5  # four 429s, each followed by the whole cooldown
    assert [r.status for r in fake.requests[5:]] == [429] * 4


async def test_previews_edit_one_message_at_most_once_a_second_then_the_reply_replaces_it(
    fake: FakeDiscord, make_adapter: AdapterFactory
) -> None:
    inbound = fake.user_message(DM, USER, "question")
    adapter = make_adapter(previews=True)
    assert adapter.features.previews
    with trio.fail_after(DEADLINE_S):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            text = ""
            for n in range(25):  # 2.5 s of streamed deltas, ten a second
                text += f"w{n} "
                adapter.send_draft(Preview(CONN, DM, text))
                await trio.sleep(0.1)
            await trio.sleep(1.1)
            result = await adapter.send(reply_to(inbound["id"], text.strip()))
            nursery.cancel_scope.cancel()
    await adapter.aclose()
    assert result.delivered
    previews = [r for r in fake.calls("POST", "/messages") if "message_reference" not in r.body]
    edits = fake.calls("PATCH", "/messages/")
    assert len(previews) == 1
    assert 1 <= len(edits) <= 3
    times = [r.at for r in [*previews, *edits]]
    assert all(b - a >= 0.9 for a, b in itertools.pairwise(times)), times  # ~1 s apart
    assert edits[-1].body["content"] == text  # the last edit shows everything streamed
    [deleted] = fake.deleted
    assert deleted["id"] not in {m["id"] for m in fake.bot_messages(DM)}
    assert [m["content"] for m in fake.bot_messages(DM)] == [text.strip()]


async def test_typing_indicator_and_its_failures_ignored(
    fake: FakeDiscord, make_adapter: AdapterFactory
) -> None:
    fake.channel(DM)
    adapter = make_adapter()
    assert adapter.features.typing
    with trio.fail_after(DEADLINE_S):
        await adapter.send_typing(DM)
        await adapter.send_typing("4040404040404040404")  # unknown channel: 404, ignored
        await adapter.send_typing("not-a-channel")  # never sent
    await adapter.aclose()
    assert [(r.path, r.status) for r in fake.calls("POST", "/typing")] == [
        (f"/api/v10/channels/{DM}/typing", 204),
        ("/api/v10/channels/4040404040404040404/typing", 404),
    ]


async def test_first_attempt_records_pruned_after_the_retention(
    fake: FakeDiscord, make_adapter: AdapterFactory, store: Store
) -> None:
    inbound = fake.user_message(DM, USER, "question")
    clock = ManualClock()
    adapter = make_adapter(clock=clock)
    with trio.fail_after(DEADLINE_S):
        for n in range(3):
            assert (await adapter.send(reply_to(inbound["id"], f"a{n}", f"op-{n}"))).delivered
            clock.advance(3 * 86_400_000)
        deleted = await adapter._sender.prune(keep_ms=7 * 86_400_000)
    await adapter.aclose()
    assert deleted == 1  # only the first is older than 7 days (9 days); 6 and 3 are kept
    page = await store.checkpoints.list_checkpoints(namespace=SEND_NAMESPACE)
    assert len(page.items) == 2
    assert all("a0" not in str(r.value) for r in page.items)  # no text is stored


async def test_the_typing_delay_reaches_the_runtime(make_adapter: AdapterFactory) -> None:
    """The adapter declares its connection's ``typing_delay_ms``, which the runtime's one
    typing rule applies (issue 40; tests/runtime/test_typing.py)."""
    assert make_adapter().features.typing_delay_ms == 1000
    assert make_adapter(typing_delay_ms=0).features.typing_delay_ms == 0
    assert make_adapter(typing_delay_ms=2500).features.typing
    await trio.lowlevel.checkpoint()


async def test_a_reply_sent_soon_after_staging_stores_no_first_attempt(
    fake: FakeDiscord, make_adapter: AdapterFactory, store: Store
) -> None:
    """Staged moments ago (``staged_at_ms``): every attempt came after that, so the window
    counts from it and nothing of the send is written; a lost answer is still resent
    with the same nonce, and Discord deduplicates."""
    inbound = fake.user_message(DM, USER, "question")
    clock = ManualClock()
    fake.fail_next(POST, "commit_drop")
    adapter = make_adapter(clock=clock)
    reply = attrs.evolve(reply_to(inbound["id"]), staged_at_ms=clock.now_ms() - 1_000)
    with trio.fail_after(DEADLINE_S):
        result = await adapter.send(reply)
    await adapter.aclose()
    assert result.delivered and len(fake.bot_messages(DM)) == 1 and len(posts(fake)) == 2
    page = await store.checkpoints.list_checkpoints(namespace=SEND_NAMESPACE)
    assert not page.items


@pytest.mark.parametrize("committed", [True, False])
async def test_staged_long_ago_without_a_record_is_looked_for_not_posted(
    committed: bool, fake: FakeDiscord, make_adapter: AdapterFactory, store: Store
) -> None:
    """A process that sent soon after staging stored nothing, then died; past the window
    the next one cannot tell whether it posted: it looks for the bot's reply (found:
    delivered) and otherwise leaves the reply to the operator — never a blind post."""
    inbound = fake.user_message(DM, USER, "question")
    clock = ManualClock()
    staged = clock.now_ms()
    fake.fail_next(POST, "commit_hang" if committed else "502")
    fake.fail_next(POST, *["502"] * 8)
    first = make_adapter(clock=clock)
    reply = attrs.evolve(reply_to(inbound["id"]), staged_at_ms=staged)
    with trio.move_on_after(1.0):
        await first.send(reply)
    await first.aclose()
    fake._faults.clear()
    assert not (await store.checkpoints.list_checkpoints(namespace=SEND_NAMESPACE)).items
    clock.advance(NONCE_WINDOW_MS + 1)
    second = make_adapter(clock=clock)
    posted = len(posts(fake))
    with trio.fail_after(DEADLINE_S):
        if committed:
            result = await second.send(reply)
            assert result.delivered
            assert result.message_id == fake.bot_messages(DM)[0]["id"]
        else:
            with pytest.raises(DeliveryOutcomeUnknownError):
                await second.send(reply)
    await second.aclose()
    assert len(posts(fake)) == posted  # nothing posted outside the window
    assert len(fake.bot_messages(DM)) == (1 if committed else 0)


async def test_the_global_window_dates_a_request_by_its_answer(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Discord counts a request when it receives it: anywhere between our write and its
    answer. So an unanswered request counts as sent now, and an answered one stays in the
    window from its answer: a delay on the way cannot bunch 51 into one of Discord's
    seconds."""
    rest = DiscordRest(token=lambda: "t", api_origin="http://127.0.0.1:9")
    for _ in range(50):
        await rest._wait_global()  # written, none answered yet
    with trio.move_on_after(5) as blocked:
        await rest._wait_global()
    assert blocked.cancelled_caught  # 50 unanswered: no 51st, however long ago they left
    answered_at = trio.current_time()
    rest._answered()
    await rest._wait_global()
    assert trio.current_time() - answered_at == pytest.approx(1.05)


async def _full_window(rest: DiscordRest, apart_s: float, unanswered: int = 0) -> float:
    """A full window: requests answered ``apart_s`` apart, then ``unanswered`` written and
    not answered; the time the first answered leaves the window."""
    start = trio.current_time()
    for _ in range(GLOBAL_PER_SECOND - unanswered):
        await rest._wait_global()
        rest._answered()
        await trio.sleep(apart_s)
    for _ in range(unanswered):
        await rest._wait_global()
    return start + GLOBAL_WINDOW_S


async def test_requests_waiting_for_the_global_window_leave_together(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """While the window is full, the requests waiting for it leave together once it has a
    place for each of them, if that comes within the slack of its first free place (one
    wake-up of the loop for them all); never before their places free."""
    rest = DiscordRest(token=lambda: "t", api_origin="http://127.0.0.1:9")
    first_leaves = await _full_window(rest, 0.01)  # places free 10 ms apart
    left: list[float] = []

    async def request() -> None:
        await rest._wait_global()
        left.append(trio.current_time())
        assert len(rest._global) + rest._in_flight <= GLOBAL_PER_SECOND

    async with trio.open_nursery() as nursery:
        for _ in range(3):
            nursery.start_soon(request)
    # The third place frees 20 ms after the first (within the slack): all three left
    # then, none earlier.
    assert [round(t - first_leaves, 6) for t in left] == [0.02, 0.02, 0.02]


async def test_a_free_place_waits_no_longer_than_the_slack(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Places that free far apart are not waited for: the first request leaves at most
    the slack after its place freed, the next at its own place."""
    rest = DiscordRest(token=lambda: "t", api_origin="http://127.0.0.1:9")
    first_leaves = await _full_window(rest, 0.03, unanswered=25)  # places free 30 ms apart
    left: list[float] = []

    async def request() -> None:
        await rest._wait_global()
        left.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        for _ in range(2):
            nursery.start_soon(request)
    assert [round(t - first_leaves, 6) for t in left] == [PACE_SLACK_S, 0.03]


async def test_replies_sent_at_once_through_the_adapter_are_all_delivered(
    fake: FakeDiscord, make_adapter: AdapterFactory
) -> None:
    inbound = [fake.user_message(DM, USER, f"q{n}") for n in range(6)]
    adapter = make_adapter()
    results = []

    async def send(n: int) -> None:
        results.append(await adapter.send(reply_to(inbound[n]["id"], f"a{n}", f"op-{n}")))

    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            for n in range(6):
                nursery.start_soon(send, n)
    await adapter.aclose()
    assert len(results) == 6 and all(r.delivered for r in results)
    assert sorted(m["content"] for m in fake.bot_messages(DM)) == [f"a{n}" for n in range(6)]
