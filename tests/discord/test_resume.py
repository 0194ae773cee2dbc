"""Sessions that outlive a connection, a restart and an instance: resume, not identify;
what cannot be resumed is backfilled; fatal closes stop with a stored failure."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio

from adapters.discord._cursor import ShardState
from prismd.channel import AdapterFatalError
from prismd.journal import NS_CURSOR
from stores import Store
from tests.fakes.discord_api import FakeDiscord
from tests.support.waiting import raises_flat, wait_until

from .conftest import DM, USER, AdapterFactory, serving

DEADLINE_S = 30


def answered(fake: FakeDiscord) -> list[str]:
    return sorted(m["content"] for m in fake.bot_messages())


async def stored_state(store: Store) -> ShardState:
    page = await store.checkpoints.list_checkpoints(namespace=NS_CURSOR)
    [row] = [r for r in page.items if r.scope.user_id == "shard:0/1"]
    return ShardState.from_json(row.value)


async def test_restart_resumes_and_replays_what_was_missed(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    with trio.fail_after(DEADLINE_S):
        first = make_adapter()
        async with serving(store, first):
            await wait_until(lambda: first.health()["state"] == "connected")
            fake.user_message(DM, USER, "one")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
            await trio.sleep(0.2)
        assert fake.gateway.client_close_codes == [4000]
        fake.user_message(DM, USER, "two")  # while no daemon runs
        fake.user_message(DM, USER, "three")
        second = make_adapter()
        async with serving(store, second):
            await wait_until(lambda: len(fake.bot_messages()) == 3)
            await trio.sleep(0.5)
    assert answered(fake) == ["echo: one", "echo: three", "echo: two"]
    assert len(fake.gateway.identifies()) == 1
    assert [outcome for _s, _q, outcome in fake.gateway.resumes] == ["replayed"]
    assert fake.gateway.client_close_codes == [4000, 4000]


async def test_seq_stored_only_after_the_admission_committed(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """A message whose admission never finished is replayed after a restart: the stored
    sequence did not pass it."""
    gate = trio.Event()
    admitted: list[str] = []

    with trio.fail_after(DEADLINE_S):
        first = make_adapter()
        async with serving(store, first) as (rt, _host):

            async def stuck(event: Any) -> Any:
                if event.text == "stuck":
                    await gate.wait()  # never set: the process "dies" here
                admitted.append(event.text)
                return await rt.admit(event)

            first.admit = stuck
            await wait_until(lambda: first.health()["state"] == "connected")
            fake.user_message(DM, USER, "fine")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
            fake.user_message(DM, USER, "stuck")
            await trio.sleep(0.3)
            seq_before = (await stored_state(store)).session
        assert seq_before is not None
        second = make_adapter()
        async with serving(store, second):
            await wait_until(lambda: len(fake.bot_messages()) == 2)
            await trio.sleep(0.3)
    assert answered(fake) == ["echo: fine", "echo: stuck"]
    assert admitted == ["fine"]
    assert len(fake.gateway.identifies()) == 1


@pytest.mark.parametrize(
    "fault",
    [
        "reconnect",
        "zombie",
        "stalled",
        "invalid_true",
        "drop_tcp",
        "close_4000",
        "close_1000_by_discord",
        "op7_before_hello",
    ],
)
async def test_connection_faults_resume_without_loss(
    fault: str, fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(DM, USER, "before")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
            if fault == "reconnect":
                fake.gateway.reconnect()
            elif fault == "zombie":
                fake.gateway.withhold_acks = 1
            elif fault == "invalid_true":
                fake.gateway.invalidate(resumable=True)
            elif fault == "stalled":
                fake.gateway.mute()  # silent, TCP open: no ACK comes, so a zombie
            elif fault == "drop_tcp":
                fake.gateway.close_all(None)
            elif fault == "close_1000_by_discord":
                fake.gateway.close_all(1000)
            elif fault == "op7_before_hello":
                fake.gateway.reconnect_before_hello = 1
                fake.gateway.close_all(4000)
            else:
                fake.gateway.close_all(4000)
            await wait_until(lambda: len(fake.gateway.resumes) == 1)
            fake.user_message(DM, USER, "after")
            await wait_until(lambda: len(fake.bot_messages()) == 2)
            await trio.sleep(0.3)
    assert answered(fake) == ["echo: after", "echo: before"]
    assert len(fake.gateway.identifies()) == 1
    assert [outcome for _s, _q, outcome in fake.gateway.resumes] == ["replayed"]
    assert 1000 not in fake.gateway.client_close_codes
    assert 1001 not in fake.gateway.client_close_codes


async def test_a_gateway_that_keeps_saying_reconnect_is_not_a_hot_loop(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            before = fake.gateway.connection_count
            fake.gateway.reconnect_before_hello = 1000
            fake.gateway.close_all(4000)
            await trio.sleep(3.0)
            attempts = fake.gateway.connection_count - before
            fake.gateway.reconnect_before_hello = 0
            fake.user_message(DM, USER, "still there")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
    assert 3 <= attempts <= 8  # 0.125-0.25 s, doubling: about five in three seconds
    assert len(fake.gateway.identifies()) == 1


async def test_duplicate_and_replayed_dispatches_answered_once(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.gateway.duplicate_next = 1
            fake.user_message(DM, USER, "twice")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
            await trio.sleep(0.5)
    assert answered(fake) == ["echo: twice"]


async def test_expired_session_is_backfilled(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    with trio.fail_after(DEADLINE_S):
        first = make_adapter()
        async with serving(store, first):
            await wait_until(lambda: first.health()["state"] == "connected")
            fake.user_message(DM, USER, "one")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
            await trio.sleep(0.2)
        fake.user_message(DM, USER, "two")
        fake.user_message(DM, USER, "three")
        fake.gateway.expire_sessions()  # the resume window passed while we were down
        second = make_adapter()
        async with serving(store, second):
            await wait_until(lambda: len(fake.bot_messages()) == 3)
            await trio.sleep(0.5)
            statuses = second.shard_statuses
    assert answered(fake) == ["echo: one", "echo: three", "echo: two"]
    assert [outcome for _s, _q, outcome in fake.gateway.resumes] == ["invalid"]
    assert len(fake.gateway.identifies()) == 2
    assert statuses[0].backfilled == 3  # "two", "three" and the bot's own reply to "one"
    assert [c.path for c in fake.calls("GET", "/messages")] == [f"/api/v10/channels/{DM}/messages"]


async def test_invalid_session_false_mid_session_identifies_and_backfills(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    with trio.fail_after(DEADLINE_S):
        adapter = make_adapter()
        async with serving(store, adapter):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(DM, USER, "one")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
            fake.gateway.drop_next = 1  # "never sent" by the gateway
            fake.user_message(DM, USER, "lost on the gateway")
            fake.gateway.invalidate(resumable=False)
            await wait_until(lambda: len(fake.bot_messages()) == 2)
            await trio.sleep(0.3)
    assert answered(fake) == ["echo: lost on the gateway", "echo: one"]
    assert len(fake.gateway.identifies()) == 2


@pytest.mark.parametrize("code", [4004, 4013, 4014])
async def test_fatal_close_stops_with_a_stored_failure(
    code: int, fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    choices: dict[int, dict[str, Any]] = {
        4004: {"token": lambda: "a-token-that-was-reset"},
        4013: {"intents": 1 << 30},
        4014: {"intents": 1 << 15 | 1 << 12},  # message content, not enabled in the portal
    }
    adapter = make_adapter(**choices[code])
    with trio.fail_after(DEADLINE_S):
        with raises_flat(AdapterFatalError):
            async with serving(store, adapter):
                await trio.sleep_forever()
    assert adapter.health()["state"] == "failed"
    if code != 4004:
        state = await stored_state(store)
        assert state.failed is not None and state.failed["code"] == code
        # A standby that started before the failure does not connect again.
        standby = make_adapter()
        standby._started_at_ms = 1
        identifies = len(fake.gateway.identifies())
        with trio.fail_after(DEADLINE_S), raises_flat(AdapterFatalError):
            await standby.run()
        assert len(fake.gateway.identifies()) == identifies
        await standby.aclose()


@attrs.define
class _Leases:
    """A lease store whose holder "dies": it never releases (the process was killed)."""

    inner: Any

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def release_lease(self, **_kwargs: Any) -> None:
        return None


@attrs.define
class _DyingStore:
    checkpoints: Any
    leases: Any


async def test_lease_takeover_resumes_the_session(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """Two instances: the standby opens no gateway connection; when the holder dies
    without releasing its lease, the standby takes over once it expires and resumes the
    stored session — Discord replays the gap, nothing is identified again."""
    with trio.fail_after(DEADLINE_S):
        dying = _DyingStore(store.checkpoints, _Leases(store.leases))
        holder = make_adapter(owner_id="daemon-a", store=dying, lease_ttl_ms=2_000)
        standby = make_adapter(owner_id="daemon-b", lease_ttl_ms=2_000)
        async with trio.open_nursery() as nursery:
            holder_scope = await nursery.start(_serve_in_scope, store, holder)
            await wait_until(lambda: holder.health()["state"] == "connected")
            standby_scope = await nursery.start(_serve_in_scope, store, standby)
            await trio.sleep(0.5)
            assert standby.health()["state"] == "standby"
            assert fake.gateway.connection_count == 1
            fake.user_message(DM, USER, "one")
            await wait_until(lambda: len(fake.bot_messages()) == 1)
            await trio.sleep(0.2)
            holder_scope.cancel()  # the holder is gone; its lease is not
            fake.user_message(DM, USER, "two")
            await wait_until(lambda: standby.health()["state"] == "connected")
            await wait_until(lambda: len(fake.bot_messages()) == 2)
            await trio.sleep(0.3)
            standby_scope.cancel()
    assert answered(fake) == ["echo: one", "echo: two"]
    assert len(fake.gateway.identifies()) == 1
    assert [outcome for _s, _q, outcome in fake.gateway.resumes] == ["replayed"]
    assert fake.gateway.connection_count == 2


async def _serve_in_scope(
    store: Store, adapter: Any, *, task_status: trio.TaskStatus[trio.CancelScope]
) -> None:
    with trio.CancelScope() as scope:
        async with serving(store, adapter):
            task_status.started(scope)
            await trio.sleep_forever()


@pytest.mark.slow
async def test_crash_loop_stays_inside_the_identify_budget(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """Every session lost (op 9 false on each resume) and the adapter restarted 20 times:
    the stored identify history spaces identifies out (1 s, doubling), so a few seconds of
    crash loop identify at most 4 times."""
    with trio.fail_after(DEADLINE_S):
        for _round in range(20):
            fake.gateway.expire_sessions()
            adapter = make_adapter(identify_spacing_ms=1_000)
            with trio.move_on_after(0.25):
                await adapter.run()
            await adapter.aclose()
    assert 1 <= len(fake.gateway.identifies()) <= 4
    assert fake.identify_remaining >= fake.identify_total - 4


async def test_low_session_start_limit_waits_for_the_reset(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """Discord's remaining identifies at a tenth of the total: no Identify is sent (the
    daily limit running out resets the token)."""
    fake.identify_remaining = 100
    adapter = make_adapter()
    with trio.fail_after(DEADLINE_S):
        with trio.move_on_after(1.5):
            await adapter.run()
        await adapter.aclose()
    assert fake.gateway.identifies() == []
    assert adapter.health()["state"] == "stopped"
    assert adapter.shard_statuses[0].identifies == 0
