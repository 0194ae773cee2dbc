"""The Signal receiver against the fake signal-cli (contract §12.1–12.4; behaviours 157,
158, 160–167 adapted): construction, filtering, the receiver lease and readiness probe,
pausing without losing what signal-cli handed over, reconnecting without hot loops."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import pytest
import trio
from trio.testing import MockClock

from adapters.signal import KIND, RECEIVER_NAMESPACE, SignalAdapter
from prismd.channel import AdapterFatalError, Admission, BuildContext, InboundEvent
from stores import InboxItem, Store, StoreUnavailableError
from stores.memory import MemoryStore
from tests.fakes.signal_cli import (
    ACCOUNT,
    SENDER_UUID,
    FakeSignalCli,
    manual_notification,
    other_envelope,
    text_envelope,
)
from tests.support.clocks import TrioClock
from tests.support.recorder import Recorder
from tests.support.waiting import raises_flat, wait_until

from .conftest import CONN, SERVICE

LEASE_KEY = f"r1:{CONN}"


@asynccontextmanager
async def running(adapter: SignalAdapter) -> AsyncIterator[trio.Nursery]:
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        yield nursery
        nursery.cancel_scope.cancel()


async def waiting(store: Store) -> list[InboxItem]:
    """The connection's items in the store's inbox that wait for a final admission."""
    items: list[InboxItem] = []
    for state in ("pending", "claimed"):
        page = await store.inbox.list_items(source=CONN, state=state, limit=500)
        items.extend(page.items)
    return items


def current_subscription(fake: FakeSignalCli) -> int:
    assert fake.subscriptions, "nobody is subscribed"
    return max(fake.subscriptions)


def no_account_in(caplog: pytest.LogCaptureFixture) -> None:
    for record in caplog.records:
        assert ACCOUNT not in record.getMessage(), record.getMessage()
        assert SENDER_UUID not in record.getMessage(), record.getMessage()


async def readiness(store: MemoryStore) -> Any:
    return await store.checkpoints.load_checkpoint(
        namespace=RECEIVER_NAMESPACE, key=LEASE_KEY, scope=SERVICE
    )


# --------------------------------------------------------------------------- construction


async def test_157_construction_is_inert(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any, store: MemoryStore
) -> None:
    adapter = make_adapter()
    built = KIND.build(  # type: ignore[misc]
        KIND.parse(_Table({"account": ACCOUNT, "socket": fake.socket_path}), CONN),
        BuildContext(admit=Recorder(), store=store, owner_id="o", secret=lambda *_a: ""),
    )
    assert isinstance(built, SignalAdapter)
    await trio.sleep(5)
    assert fake.connections_opened == 0
    assert await readiness(store) is None
    assert (
        await store.leases.get_lease(namespace=RECEIVER_NAMESPACE, key=LEASE_KEY, scope=SERVICE)
        is None
    )
    assert adapter.health() == {
        "state": "idle",
        "bridge": "unavailable",
        "subscription": "inactive",
        "account": "unverified",
    }
    assert adapter.capabilities == {
        "acknowledgement": "none",
        "controls": "command",
        "max_text_code_units": 2000,
    }
    assert not adapter.receiver_lease_held


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"account": "15550000000"}, "international format"),
        ({"account": ""}, "international format"),
        ({"socket": None}, "exactly one of socket and tcp"),
        ({"tcp": "127.0.0.1:7583", "socket": "/tmp/s"}, "exactly one of socket and tcp"),
        ({"socket": "/tmp/" + "x" * 200}, "1-107 bytes"),
        ({"socket": "/tmp/a\0b"}, "without NUL"),
        ({"connection_id": ""}, "connection_id"),
        ({"max_frame_bytes": 512}, "max_frame_bytes must be in 1024..524288"),
        ({"max_pending_events": 0}, "max_pending_events"),
        ({"lease_ttl_ms": 1000}, "lease_ttl_ms"),
        ({"request_timeout_s": 0}, "request_timeout_s"),
        ({"reconnect_delay_s": 5.0, "max_reconnect_delay_s": 1.0}, "max_reconnect_delay_s"),
    ],
)
async def test_158_bad_configuration_is_refused(
    make_adapter: Any, changes: dict[str, Any], message: str
) -> None:
    """158 adapted: the reference checked a signal-cli version string and an operator policy;
    ours checks what it uses, with fixed messages that never quote the value."""
    with pytest.raises(ValueError, match=message) as info:
        make_adapter(**changes)
    assert "15550000000" not in str(info.value)


@attrs.define
class _Table:
    """A minimal :class:`prismd.channel.ConfigTable` (the daemon's is tested in tests/daemon)."""

    data: dict[str, Any]

    def get_str(self, name: str, default: Any = None, *, required: bool = False) -> Any:
        return self.data.get(name, default)

    def get_int(self, name: str, default: Any = None, **_kw: Any) -> Any:
        return self.data.get(name, default)

    def get_bool(self, name: str, default: bool = False) -> bool:
        return bool(self.data.get(name, default))

    def choice(self, name: str, choices: tuple[str, ...], default: str | None) -> Any:
        return self.data.get(name, default)

    def get_address(self, name: str, default: str | None = None) -> Any:
        return self.data.get(name, default)

    def get_env_name(self, name: str) -> str | None:
        value: str | None = self.data.get(name)
        return value

    def str_list(self, name: str) -> tuple[str, ...] | None:
        value = self.data.get(name)
        return None if value is None else tuple(value)

    def error(self, name: str | None, message: str) -> Exception:
        return ValueError(f"{name}: {message}")


# --------------------------------------------------------------------------- filtering


async def test_160_only_direct_texts_reach_the_receiver(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any, recorder: Recorder
) -> None:
    adapter = make_adapter()
    with trio.fail_after(60):
        async with running(adapter):
            fake.push(text_envelope("group", groupInfo={"groupId": "R1JQ", "type": "DELIVER"}))
            fake.push(text_envelope("file", timestamp=2, attachments=[{}]))
            fake.push(other_envelope("receiptMessage", {"isDelivery": True, "timestamps": [1]}))
            await fake.wait_until(lambda: len(fake.deliveries) == 3)
            await fake.inject({"jsonrpc": "2.0", "method": "send", "params": {}})
            fake.push(text_envelope("hello Prism", timestamp=4))
            await recorder.wait_for(1)
            await trio.sleep(1)
    assert recorder.texts == ["hello Prism"]
    event = recorder.events[0]
    assert (event.external_conversation_id, event.external_actor_id) == (SENDER_UUID, SENDER_UUID)
    stats = adapter.statistics()
    assert stats.ignored == {"group": 1, "attachment": 1, "receipt": 1, "other_notification": 1}
    assert (stats.notifications, stats.admitted) == (4, 1)


async def test_161_another_account_pauses_for_good(
    autojump_clock: MockClock,
    fake: FakeSignalCli,
    make_adapter: Any,
    recorder: Recorder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    adapter = make_adapter()
    with trio.fail_after(60), raises_flat(AdapterFatalError, "another account"):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            sub = current_subscription(fake)
            await fake.inject(manual_notification(sub, text_envelope("hi"), "+19998887777"))
            await trio.sleep(120)
    assert recorder.events == []
    assert adapter.health() == {
        "state": "account_mismatch",
        "bridge": "unavailable",
        "subscription": "inactive",
        "account": "mismatch",
    }
    assert fake.connections_opened == 1, "no reconnect after a mismatch"
    assert [r["params"] for _c, r in fake.requests_for("unsubscribeReceive")] == [
        {"subscription": 0}
    ]
    assert not adapter.receiver_lease_held
    no_account_in(caplog)


async def test_a_notification_for_another_subscription_is_ignored(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any, recorder: Recorder
) -> None:
    adapter = make_adapter()
    with trio.fail_after(60):
        async with running(adapter):
            sub = current_subscription(fake)
            await fake.inject(manual_notification(sub + 7, text_envelope("not ours"), ACCOUNT))
            # pre-0.12 inline subscription: ours is taken, another one is not
            legacy = {"envelope": text_envelope("legacy ours", timestamp=5), "account": ACCOUNT}
            await fake.inject(
                {
                    "jsonrpc": "2.0",
                    "method": "receive",
                    "params": {**legacy, "subscription": sub + 1},
                }
            )
            await fake.inject(
                {"jsonrpc": "2.0", "method": "receive", "params": {**legacy, "subscription": sub}}
            )
            await recorder.wait_for(1)
            fake.push(text_envelope("ours", timestamp=9))
            await recorder.wait_for(2)
    assert recorder.texts == ["legacy ours", "ours"]
    assert adapter.statistics().foreign_subscription == 2
    assert adapter.health()["account"] == "ready"


async def test_automatic_mode_copies_are_ignored_with_one_warning(
    autojump_clock: MockClock,
    fake: FakeSignalCli,
    make_adapter: Any,
    recorder: Recorder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    adapter = make_adapter()
    with trio.fail_after(60):
        async with running(adapter):
            for ts in (1, 2):
                note = {"envelope": text_envelope("auto", timestamp=ts), "account": ACCOUNT}
                await fake.inject({"jsonrpc": "2.0", "method": "receive", "params": note})
            fake.push(text_envelope("manual", timestamp=3))
            await recorder.wait_for(1)
    assert recorder.texts == ["manual"]
    assert adapter.statistics().unsubscribed == 2
    warnings = [r for r in caplog.records if "--receive-mode=manual" in r.getMessage()]
    assert len(warnings) == 1


# --------------------------------------------------------------------------- pausing


async def test_162_a_retryable_admission_pauses_and_resumes_without_loss(
    autojump_clock: MockClock,
    fake: FakeSignalCli,
    make_adapter: Any,
    store: MemoryStore,
) -> None:
    answers = iter([Admission(status="denied", reason="unavailable")])
    recorder = Recorder(answer=lambda _e: next(answers, Admission(status="accepted")))
    adapter = make_adapter(admit=recorder)
    inbox_seen: list[int] = []
    with trio.fail_after(120):
        async with running(adapter):
            fake.push(text_envelope("first"))
            await recorder.wait_for(1)
            await fake.wait_until(lambda: not fake.subscriptions)  # unsubscribed, socket dropped
            assert adapter.health()["subscription"] == "paused"
            inbox_seen.append(len(await waiting(store)))
            fake.push(text_envelope("while paused", timestamp=2))  # waits on the server
            await recorder.wait_for(3)
            await wait_until(lambda: adapter.health()["subscription"] == "active")
    assert recorder.texts == ["first", "first", "while paused"]
    assert recorder.events[0].event_id == recorder.events[1].event_id
    assert inbox_seen == [1]
    assert await waiting(store) == []
    subscribers = [conn for _t, conn, _s in fake.subscribe_log]
    assert len(subscribers) == 2 and subscribers[0] != subscribers[1]  # a second socket
    assert adapter.statistics().retried == 1


@attrs.define
class FlakyCheckpoints:
    """Checkpoints whose ``save_checkpoint`` fails while ``failing`` (a store outage)."""

    inner: Any
    failing: bool = True
    saves: list[str] = attrs.field(factory=list)

    async def save_checkpoint(self, **kwargs: Any) -> Any:
        if self.failing:
            raise StoreUnavailableError("store down")
        self.saves.append(kwargs["namespace"])
        return await self.inner.save_checkpoint(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@attrs.define
class FlakyInbox:
    """The store's inbox, failing with ``outage`` (the same store down)."""

    inner: Any
    outage: FlakyCheckpoints

    def __getattr__(self, name: str) -> Any:
        call = getattr(self.inner, name)

        async def calling(*args: Any, **kwargs: Any) -> Any:
            if self.outage.failing:
                raise StoreUnavailableError("store down")
            return await call(*args, **kwargs)

        return calling


@attrs.define
class WrappedStore:
    checkpoints: Any
    leases: Any
    inbox: Any
    url: str = "memory://"

    async def aclose(self) -> None:
        return None


async def test_163_no_subscription_while_the_readiness_probe_fails(
    autojump_clock: MockClock,
    fake: FakeSignalCli,
    make_adapter: Any,
    store: MemoryStore,
    recorder: Recorder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """163 adapted: a probe that cannot be written is writer loss — nothing is asked of
    signal-cli (no connection at all) until the store takes the write; then it subscribes."""
    flaky = FlakyCheckpoints(store.checkpoints)
    adapter = make_adapter(store=WrappedStore(flaky, store.leases, store.inbox))
    with trio.fail_after(300):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(adapter.run)
            await trio.sleep(60)
            assert fake.connections_opened == 0
            assert adapter.health()["state"] == "backoff"
            flaky.failing = False
            await wait_until(lambda: adapter.health()["subscription"] == "active")
            fake.push(text_envelope("after the outage"))
            await recorder.wait_for(1)
            nursery.cancel_scope.cancel()
    lines = [r.getMessage() for r in caplog.records if "readiness probe failed" in r.getMessage()]
    assert lines and all("StoreUnavailableError" in line for line in lines)
    assert 4 <= len(lines) <= 60, f"{len(lines)} probe attempts in a minute"
    assert flaky.saves[0] == RECEIVER_NAMESPACE


async def test_writer_loss_while_receiving_pauses_until_the_store_takes_writes(
    autojump_clock: MockClock,
    fake: FakeSignalCli,
    make_adapter: Any,
    store: MemoryStore,
    recorder: Recorder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The inbox write fails: the message read is kept (and admitted), but nothing more is
    taken from signal-cli — unsubscribed, and no new subscription while the probe cannot be
    written; once the store takes writes again, what waited on the server comes."""

    @attrs.define
    class Outage(FlakyCheckpoints):
        async def write_checkpoints(self, writes: Any, **kwargs: Any) -> Any:
            if self.failing:
                raise StoreUnavailableError("store down")
            return await self.inner.write_checkpoints(writes, **kwargs)

    flaky = Outage(store.checkpoints, failing=False)
    adapter = make_adapter(store=WrappedStore(flaky, store.leases, FlakyInbox(store.inbox, flaky)))
    with trio.fail_after(600):
        async with running(adapter):
            flaky.failing = True
            fake.push(text_envelope("read during the outage"))
            await recorder.wait_for(1)
            await fake.wait_until(lambda: not fake.subscriptions)
            fake.push(text_envelope("waits on the server", timestamp=2))
            await trio.sleep(60)
            assert len(fake.subscribe_log) == 1 and len(recorder.events) == 1
            flaky.failing = False
            await recorder.wait_for(2)
    assert recorder.texts == ["read during the outage", "waits on the server"]
    assert "the journal does not take writes" in caplog.text
    assert await waiting(store) == []


async def test_a_subscribe_answer_that_never_comes_still_loses_nothing(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any, recorder: Recorder
) -> None:
    """signal-cli subscribed and handed out a message, but its answer came after the
    deadline: the adapter ends the connection's subscription without knowing its id, takes
    the message sent meanwhile, and admits it."""
    fake.slow_subscribe_s = 60.0
    fake.push(text_envelope("sent before the answer"))
    adapter = make_adapter(request_timeout_s=5.0)
    with trio.fail_after(300):
        async with running(adapter):
            await recorder.wait_for(1)
    assert recorder.texts == ["sent before the answer"]
    first_conn = fake.subscribe_log[0][1]
    assert (
        first_conn,
        {"jsonrpc": "2.0", "id": 2, "method": "unsubscribeReceive"},
    ) in fake.requests
    assert len(fake.subscribe_log) == 2


async def test_164_a_destroyed_socket_reconnects(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any, recorder: Recorder
) -> None:
    adapter = make_adapter()
    with trio.fail_after(120):
        async with running(adapter):
            first = fake.subscriptions[current_subscription(fake)]
            fake.drop_connection()
            await fake.wait_until(lambda: len(fake.subscribe_log) == 2)
            await wait_until(lambda: adapter.health()["subscription"] == "active")
            assert fake.subscriptions[current_subscription(fake)] != first
            fake.push(text_envelope("after reconnect"))
            await recorder.wait_for(1)
    assert adapter.statistics().connects == 2


async def test_165_a_socket_closing_on_subscribe_is_retried_with_backoff(
    autojump_clock: MockClock,
    fake: FakeSignalCli,
    make_adapter: Any,
    recorder: Recorder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "prismd.signal")
    fake.close_on_subscribe = 3
    adapter = make_adapter()
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)  # started only once subscribed
            assert adapter.health()["subscription"] == "active"
            nursery.cancel_scope.cancel()
    attempts = [c for c, r in fake.requests_for("subscribeReceive")]
    assert len(attempts) == 4 and len(set(attempts)) == 4  # each on a new connection
    lines = [r.getMessage() for r in caplog.records if "reconnecting in" in r.getMessage()]
    assert len(lines) == 3
    assert all("subscribeReceive failed" in line for line in lines)
    delays = [float(line.split("reconnecting in ")[1].split(" s")[0]) for line in lines]
    assert all(d >= 0.5 for d in delays) and delays[2] > delays[0]
    assert "receiving again after 3 failed attempt(s)" in caplog.text
    no_account_in(caplog)


@pytest.mark.parametrize(
    ("frame", "why"),
    [
        (b'{"jsonrpc":"2.0","method":"receive","params":"' + b"x" * 2000 + b'"}', "oversized"),
        (b"this is not json", "malformed"),
        (b'{"jsonrpc":"1.0","method":"receive","params":{}}', "malformed"),
        (b"[1,2,3]", "malformed"),
    ],
)
async def test_166_a_bad_frame_closes_and_reconnects(
    autojump_clock: MockClock,
    fake: FakeSignalCli,
    make_adapter: Any,
    recorder: Recorder,
    caplog: pytest.LogCaptureFixture,
    frame: bytes,
    why: str,
) -> None:
    adapter = make_adapter(max_frame_bytes=1024)
    with trio.fail_after(120):
        async with running(adapter):
            await fake.inject(frame + b"\n")
            await fake.wait_until(lambda: len(fake.subscribe_log) == 2)
            await wait_until(lambda: adapter.health()["subscription"] == "active")
            fake.push(text_envelope("good"))
            await recorder.wait_for(1)
    assert recorder.texts == ["good"]
    assert adapter.statistics().bad_frames == 1
    assert (
        f"signal-cli sent an {why} frame" in caplog.text
        or f"signal-cli sent a {why} frame" in caplog.text
    )
    no_account_in(caplog)


async def test_167_an_admission_in_progress_when_the_socket_dies_runs_once(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any
) -> None:
    release = trio.Event()
    calls: list[InboundEvent] = []

    async def admit(event: InboundEvent) -> Admission:
        calls.append(event)
        if len(calls) == 1:
            fake.drop_connection()
            await release.wait()
        return Admission(status="accepted")

    adapter = make_adapter(admit=admit)
    with trio.fail_after(120):
        async with running(adapter):
            fake.push(text_envelope("in flight"))
            await wait_until(lambda: bool(calls))
            await trio.sleep(5)
            release.set()
            await fake.wait_until(lambda: len(fake.subscribe_log) == 2)
            await wait_until(lambda: adapter.health()["subscription"] == "active")
            await trio.sleep(30)
    assert [e.text for e in calls] == ["in flight"]


async def test_the_fake_killed_and_restarted_is_reconnected_without_a_hot_loop(
    autojump_clock: MockClock,
    fake: FakeSignalCli,
    make_adapter: Any,
    recorder: Recorder,
    nursery: trio.Nursery,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, "prismd.signal")
    adapter = make_adapter()
    with trio.fail_after(600):
        async with running(adapter):
            await fake.kill()
            fake.push(text_envelope("sent while signal-cli was down"))
            opened = fake.connections_opened
            await trio.sleep(120)
            assert fake.connections_opened == opened  # nothing listens
            assert adapter.health()["bridge"] == "unavailable"
            await fake.start(nursery)
            await wait_until(lambda: adapter.health()["subscription"] == "active")
            assert current_subscription(fake) == 0  # a new process counts from 0 again
            await recorder.wait_for(1)
    assert recorder.texts == ["sent while signal-cli was down"]
    retries = [r for r in caplog.records if "reconnecting in" in r.getMessage()]
    # 120 s of outage at 1 s doubling to 30 s (jittered 0.5-1x): a handful, not hundreds
    assert 4 <= len(retries) <= 16, len(retries)
    assert any("signal-cli is unreachable" in r.getMessage() for r in retries)
    assert "receiving again" in caplog.text


async def test_tcp_transport(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any, recorder: Recorder
) -> None:
    adapter = make_adapter(tcp=fake.tcp_address)
    with trio.fail_after(60):
        async with running(adapter):
            fake.push(text_envelope("over tcp"))
            await recorder.wait_for(1)
    assert recorder.texts == ["over tcp"]


# --------------------------------------------------------------------------- lease, probe


async def test_the_readiness_probe_precedes_every_subscription(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any, store: MemoryStore
) -> None:
    order: list[int] = []

    @attrs.define
    class Watching(FlakyCheckpoints):
        async def save_checkpoint(self, **kwargs: Any) -> Any:
            if kwargs["namespace"] == RECEIVER_NAMESPACE:
                order.append(len(fake.subscribe_log))
            return await self.inner.save_checkpoint(**kwargs)

    adapter = make_adapter(
        store=WrappedStore(Watching(store.checkpoints, failing=False), store.leases, store.inbox)
    )
    with trio.fail_after(120):
        async with running(adapter):
            fake.drop_connection()
            await fake.wait_until(lambda: len(fake.subscribe_log) == 2)
            lease = await store.leases.get_lease(
                namespace=RECEIVER_NAMESPACE, key=LEASE_KEY, scope=SERVICE
            )
    assert order == [0, 1]
    record = await readiness(store)
    assert record is not None and record.version == 2
    assert record.value["schema"] == 1 and isinstance(record.value["updatedAt"], str)
    assert record.category == "channel-signal-receiver" and record.scope == SERVICE
    assert lease is not None and record.fencing_token == lease.fencing_token


async def test_standby_while_another_daemon_holds_the_lease(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any, store: MemoryStore
) -> None:
    other = await store.leases.try_acquire_lease(
        namespace=RECEIVER_NAMESPACE,
        key=LEASE_KEY,
        scope=SERVICE,
        owner_id="daemon-b",
        ttl_ms=90_000,
    )
    assert other is not None
    adapter = make_adapter(lease_ttl_ms=9_000)
    with trio.fail_after(300):
        async with running(adapter):
            assert adapter.health()["state"] == "standby"
            await trio.sleep(60)
            assert fake.connections_opened == 0
            released = trio.current_time()
            await store.leases.release_lease(
                namespace=RECEIVER_NAMESPACE,
                key=LEASE_KEY,
                scope=SERVICE,
                owner_id="daemon-b",
                token=other.token,
            )
            await wait_until(lambda: adapter.health()["subscription"] == "active")
            took = trio.current_time() - released
    assert took <= 3.5, f"took {took:.1f} s (at most a third of the TTL)"


async def test_a_restarted_daemon_adopts_its_predecessors_lease_at_once(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any, store: MemoryStore
) -> None:
    stale = await store.leases.try_acquire_lease(
        namespace=RECEIVER_NAMESPACE,
        key=LEASE_KEY,
        scope=SERVICE,
        owner_id="daemon-a",
        ttl_ms=90_000,
    )
    assert stale is not None
    adapter = make_adapter()  # the same stable owner id, as after a SIGKILL + restart
    with trio.fail_after(30):
        async with running(adapter):
            assert adapter.health()["subscription"] == "active"
            start = trio.current_time()
    assert start < 5
    lease = await store.leases.get_lease(namespace=RECEIVER_NAMESPACE, key=LEASE_KEY, scope=SERVICE)
    assert lease is None  # released at the stop


async def test_a_lost_lease_unsubscribes_and_resumes_when_it_is_ours_again(
    autojump_clock: MockClock,
    fake: FakeSignalCli,
    make_adapter: Any,
    store: MemoryStore,
    recorder: Recorder,
) -> None:
    adapter = make_adapter(lease_ttl_ms=9_000)
    with trio.fail_after(300):
        async with running(adapter):
            ours = await store.leases.get_lease(
                namespace=RECEIVER_NAMESPACE, key=LEASE_KEY, scope=SERVICE
            )
            assert ours is not None
            # another daemon takes it over (ours released behind our back, then acquired)
            await store.leases.release_lease(
                namespace=RECEIVER_NAMESPACE,
                key=LEASE_KEY,
                scope=SERVICE,
                owner_id="daemon-a",
                token=ours.token,
            )
            theirs = await store.leases.try_acquire_lease(
                namespace=RECEIVER_NAMESPACE,
                key=LEASE_KEY,
                scope=SERVICE,
                owner_id="daemon-b",
                ttl_ms=20_000,
            )
            assert theirs is not None
            await fake.wait_until(lambda: not fake.subscriptions)
            await wait_until(lambda: adapter.health()["state"] == "standby")
            assert [r["params"] for _c, r in fake.requests_for("unsubscribeReceive")] == [
                {"subscription": 0}
            ]
            fake.push(text_envelope("waits on the server"))
            await trio.sleep(10)
            assert not recorder.events
            await store.leases.release_lease(
                namespace=RECEIVER_NAMESPACE,
                key=LEASE_KEY,
                scope=SERVICE,
                owner_id="daemon-b",
                token=theirs.token,
            )
            await recorder.wait_for(1)
    assert recorder.texts == ["waits on the server"]
    assert len(fake.subscribe_log) == 2


# --------------------------------------------------------------------------- stop


async def test_a_stop_keeps_what_signal_cli_already_sent_and_a_restart_admits_it(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any, store: MemoryStore
) -> None:
    """A graceful stop while admissions are slow: the one being admitted finishes, the rest
    that signal-cli wrote before the unsubscribe is kept in the inbox; the next run admits
    them before subscribing. Nothing handed out is lost, nothing is admitted twice."""
    gate = trio.Event()
    first: list[str] = []

    async def slow(event: InboundEvent) -> Admission:
        first.append(event.text)
        await gate.wait()
        return Admission(status="accepted")

    adapter = make_adapter(admit=slow, max_pending_events=2)
    for n in range(6):
        fake.push(text_envelope(f"m{n}", timestamp=n + 1))
    stop = trio.CancelScope()

    async def run() -> None:
        with stop:
            await adapter.run()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run)
            await wait_until(lambda: bool(first))
            stop.cancel()  # the stop: the admission in progress ends first
            await trio.sleep(1)
            gate.set()
    handed = [d.envelope["dataMessage"]["message"] for d in fake.deliveries]
    kept = await waiting(store)
    assert first == ["m0"] and len(kept) == len(handed) - 1, (
        handed,
        [item.key for item in kept],
        fake.requests,
    )
    assert not fake.lost_in_write
    again = Recorder()
    order: list[str] = []

    def answer(e: InboundEvent) -> Admission:
        order.append(f"admit:{e.text}")
        return Admission(status="accepted")

    again.answer = answer
    restarted = make_adapter(admit=again)
    with trio.fail_after(60):
        async with running(restarted):
            await again.wait_for(5)
    assert first + again.texts == [f"m{n}" for n in range(6)]
    assert await waiting(store) == []
    assert restarted.statistics().replayed == len(handed) - 1


async def test_a_held_message_survives_a_stop_in_the_inbox(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any, store: MemoryStore
) -> None:
    stopping = Recorder(answer=lambda _e: Admission(status="denied", reason="stopped"))
    adapter = make_adapter(admit=stopping)
    with trio.fail_after(60):
        async with running(adapter):
            fake.push(text_envelope("during the stop"))
            await stopping.wait_for(1)
            await fake.wait_until(lambda: not fake.subscriptions)
    rows = await waiting(store)
    assert len(rows) == 1 and rows[0].source == CONN
    assert rows[0].key == stopping.events[0].event_id
    kept = await store.inbox.get(source=CONN, key=rows[0].key)
    assert kept is not None and kept.payload["text"] == "during the stop"
    accepted = Recorder()
    with trio.fail_after(60):
        async with running(make_adapter(admit=accepted)):
            await accepted.wait_for(1)
    assert accepted.events[0] == attrs.evolve(stopping.events[0])
    assert await waiting(store) == []


async def test_health_moves_through_its_states(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any
) -> None:
    adapter = make_adapter(store=MemoryStore(clock=TrioClock()))
    with trio.fail_after(60):
        async with running(adapter):
            assert adapter.health() == {
                "state": "receiving",
                "bridge": "connected",
                "subscription": "active",
                "account": "ready",
            }
            assert adapter.receiver_lease_held
    assert adapter.health() == {
        "state": "stopped",
        "bridge": "unavailable",
        "subscription": "inactive",
        "account": "ready",
    }
    assert not adapter.receiver_lease_held
