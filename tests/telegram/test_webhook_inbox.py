"""Webhook inbox mode: validated, committed to the durable inbox before the 2xx, admitted by
leased workers on every instance; retries with backoff, dead letters, order per chat."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
import trio

from adapters.telegram import TelegramAdapter
from prismd.channel import Admission, InboundEvent
from stores import InboxReservation, InboxStore, StoreUnavailableError
from stores.memory import MemoryStore
from tests.fakes.telegram_api import FakeBotApi
from tests.support.recorder import Recorder
from tests.support.waiting import wait_until, wait_until_async

from .conftest import CONN, private_message
from .test_webhook import post, webhook_adapter

RECEIVER = "prism.channels.v1.telegram.receiver"


def inbox_adapter(make_adapter: Any, **kwargs: Any) -> TelegramAdapter:
    options: dict[str, Any] = {"webhook_inbox": True, "lease_ttl_ms": 6_000}
    options.update(kwargs)
    return webhook_adapter(make_adapter, **options)


async def states(store: MemoryStore) -> dict[str, str]:
    page = await store.inbox.list_items(source=CONN)
    return {item.key: item.state for item in page.items}


@pytest.mark.slow
async def test_an_update_is_committed_before_the_2xx_and_admitted_once(
    fake: FakeBotApi, make_adapter: Any, recorder: Recorder, store: MemoryStore
) -> None:
    adapter = inbox_adapter(make_adapter)
    valid = {"update_id": 7, **private_message("hello")}
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            assert adapter.health() == {"state": "serving", "mode": "webhook", "receiver": "inbox"}
            # Refused before anything is written: secret, size, JSON, shape.
            assert await post(adapter, valid, secret="wrong") == 401
            assert await post(adapter, b"x" * 2000) == 413
            assert await post(adapter, b"{") == 400
            assert await post(adapter, {"update_id": "7"}) == 400
            assert await post(adapter, b"[1, 2]") == 400
            assert await states(store) == {}
            assert await post(adapter, valid) == 204
            item = await store.inbox.get(source=CONN, key="7")
            assert item is not None  # committed when the 204 was sent
            assert item.partition == "chat:101" and item.order == 7
            await recorder.wait_for(1)
            await wait_until_async(lambda: _state_is(store, "7", "done"))
            # Telegram redelivers (it missed our 204): acknowledged, no second row or run.
            assert await post(adapter, valid) == 204
            await trio.sleep(1)
            nursery.cancel_scope.cancel()
    assert [e.event_id for e in recorder.events] == ["7"]
    done = await store.inbox.get(source=CONN, key="7")
    assert done is not None and done.state == "done" and done.payload is None
    # No receiver lease in inbox mode: any number of instances serve the bot.
    assert store._state.leases == {}


async def _state_is(store: MemoryStore, key: str, state: str) -> bool:
    item = await store.inbox.get(source=CONN, key=key)
    return item is not None and item.state == state


@pytest.mark.slow
async def test_two_instances_serve_one_bot_and_admit_each_update_once(
    fake: FakeBotApi, make_adapter: Any, recorder: Recorder, store: MemoryStore
) -> None:
    a = inbox_adapter(make_adapter, owner_id="daemon-a")
    b = inbox_adapter(make_adapter, owner_id="daemon-b")
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            await nursery.start(b.run)
            for n in range(1, 21):
                update = {"update_id": n, **private_message(f"m{n}", chat=100 + n % 4)}
                target = a if n % 2 else b
                assert await post(target, update) == 204
                if n % 5 == 0:  # a redelivery to the other instance
                    assert await post(b if target is a else a, update) == 204
            await recorder.wait_for(20)
            await trio.sleep(1)
            nursery.cancel_scope.cancel()
    assert sorted(int(e.event_id) for e in recorder.events) == list(range(1, 21))
    assert set((await states(store)).values()) == {"done"}


async def test_retryable_admissions_back_off_then_end_as_dead_letters(
    fake: FakeBotApi, make_adapter: Any, store: MemoryStore, autojump_clock: Any
) -> None:
    recorder = Recorder(answer=lambda _e: Admission("denied", "capacity"))
    adapter = inbox_adapter(make_adapter, admit=recorder)
    assert adapter._inbox_worker is not None
    adapter._inbox_worker.max_attempts = 4
    with trio.fail_after(600):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            assert await post(adapter, {"update_id": 1, **private_message()}) == 204
            await wait_until_async(lambda: _state_is(store, "1", "dead"), step=0.5)
            nursery.cancel_scope.cancel()
    # Four attempts, spaced by the backoff (1 s, 2 s, 4 s, each 50–100 %), then kept.
    assert len(recorder.events) == 4
    dead = await store.inbox.get(source=CONN, key="1")
    assert dead is not None and (dead.attempts, dead.error) == (4, "capacity")
    assert dead.payload is not None and dead.payload["update_id"] == 1
    assert (await store.inbox.depth(sources=[CONN])).dead == 1


async def test_a_crash_between_the_journal_and_the_settle_is_a_duplicate(
    fake: FakeBotApi, make_adapter: Any, store: MemoryStore, autojump_clock: Any
) -> None:
    """The admission committed, then settling the row failed (the instance died there):
    the row's claim expires, another worker admits it again, and the runtime answers that
    admission as a duplicate; the row ends done."""
    answers = iter([Admission("accepted", operation_id="op-1")])
    duplicate = Admission("accepted", operation_id="op-1", duplicate=True)
    recorder = Recorder(answer=lambda _e: next(answers, duplicate))
    failing = FailingComplete(store.inbox, times=1)
    adapter = inbox_adapter(make_adapter, admit=recorder, store=WithInbox(store, failing))
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            assert await post(adapter, {"update_id": 3, **private_message()}) == 204
            await recorder.wait_for(2)
            await wait_until_async(lambda: _state_is(store, "3", "done"), step=0.5)
            nursery.cancel_scope.cancel()
    assert [e.event_id for e in recorder.events] == ["3", "3"]
    item = await store.inbox.get(source=CONN, key="3")
    assert item is not None and item.attempts == 2


@pytest.mark.slow
async def test_an_instance_started_again_takes_up_the_rows_it_had_claimed(
    fake: FakeBotApi, make_adapter: Any, recorder: Recorder, store: MemoryStore
) -> None:
    """Its previous process claimed a row for ten minutes and died; started again with the
    same owner id it admits the row now, while another instance would have to wait."""
    assert await store.inbox.put(
        source=CONN, key="8", partition="chat:101", order=8,
        payload={"update_id": 8, **private_message("before the crash")},
    )  # fmt: skip
    (dead,) = await store.inbox.reserve(
        owner_id="daemon-a", ttl_ms=600_000, max_attempts=10, sources=[CONN]
    )
    other = inbox_adapter(make_adapter, owner_id="daemon-b")
    again = inbox_adapter(make_adapter, owner_id="daemon-a")
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(other.run)
            await trio.sleep(1)
            assert recorder.events == []  # B may not take a live claim
            await nursery.start(again.run)
            await recorder.wait_for(1)
            await wait_until_async(lambda: _state_is(store, "8", "done"))
            nursery.cancel_scope.cancel()
    assert [e.event_id for e in recorder.events] == ["8"]
    item = await store.inbox.get(source=CONN, key="8")
    assert item is not None and item.attempts == 2 and item.owner_id == "daemon-a"
    assert not await store.inbox.complete(dead)


async def test_a_store_that_refuses_the_row_gets_503(
    fake: FakeBotApi, make_adapter: Any, recorder: Recorder, store: MemoryStore
) -> None:
    adapter = inbox_adapter(make_adapter, store=WithInbox(store, FailingPut(store.inbox)))
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            assert await post(adapter, {"update_id": 1, **private_message()}) == 503
            nursery.cancel_scope.cancel()
    assert recorder.events == []


@pytest.mark.slow
async def test_a_busy_chat_stays_with_its_instance_until_let_go(
    fake: FakeBotApi, make_adapter: Any, store: MemoryStore
) -> None:
    """While A's runtime still works on chat 101, its next updates go to A's worker (queued
    behind the earlier one there); once A lets the chat go, B may take the next one."""
    busy: set[str] = set()
    seen: dict[str, list[str]] = {"a": [], "b": []}

    def admit_as(name: str) -> Any:
        async def admit(event: InboundEvent) -> Admission:
            seen[name].append(event.event_id)
            if name == "a":
                busy.add(event.external_conversation_id)
            return Admission("accepted")

        return admit

    a = inbox_adapter(
        make_adapter,
        owner_id="daemon-a",
        admit=admit_as("a"),
        busy_conversations=lambda _c: frozenset(busy),
    )
    b = inbox_adapter(make_adapter, owner_id="daemon-b", admit=admit_as("b"))
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            await nursery.start(a.run)
            assert await post(a, {"update_id": 1, **private_message("one")}) == 204
            await wait_until(lambda: seen["a"] == ["1"])
            await wait_until_async(lambda: _state_is(store, "1", "done"))
            await nursery.start(b.run)  # B is up and idle, the chat is busy on A
            for n in (2, 3):
                assert await post(b, {"update_id": n, **private_message(f"m{n}")}) == 204
            await wait_until(lambda: seen["a"] == ["1", "2", "3"])
            assert seen["b"] == []
            busy.clear()  # A's runtime is done with the chat: the hold is released
            await trio.sleep(0.5)
            assert await post(a, {"update_id": 4, **private_message("m4")}) == 204
            await wait_until(lambda: "4" in seen["a"] + seen["b"])
            nursery.cancel_scope.cancel()
    assert sorted(seen["a"] + seen["b"], key=int) == ["1", "2", "3", "4"]


# --------------------------------------------------------------------------- store doubles


@attrs.define(eq=False)
class WithInbox:
    """``store`` with its inbox replaced (to inject a failure)."""

    store: MemoryStore
    inbox: Any

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    @property
    def checkpoints(self) -> Any:
        return self.store.checkpoints

    @property
    def leases(self) -> Any:
        return self.store.leases


@attrs.define(eq=False)
class FailingComplete:
    """Settling a row fails ``times`` times (as if the instance died right before it)."""

    inner: InboxStore
    times: int

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def complete(self, reservation: InboxReservation, *, keep_partition_ms: int = 0) -> bool:
        if self.times > 0:
            self.times -= 1
            raise StoreUnavailableError("store lost")
        return await self.inner.complete(reservation, keep_partition_ms=keep_partition_ms)


@attrs.define(eq=False)
class FailingPut:
    inner: InboxStore

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def put(self, **kwargs: Any) -> bool:
        raise StoreUnavailableError("store lost")
