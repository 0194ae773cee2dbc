"""Signal's inbox is the store's inbox (``store.inbox``), and a journal written before that
keeps its waiting messages.

Before, each received message waited as a checkpoint (namespace
``prism.channels.v1.signal.inbox``, key ``i1:<connection>:<event id>``, the service scope,
category ``channel-signal-inbox``). The rows below are written exactly as that code wrote
them, into a real SQLite file; the receiver that takes the lease moves them into the
inbox, admits each once, oldest first, and leaves none behind; a second start admits
nothing again. A row that does not read as a message stays where it was, as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import trio

from adapters.signal import INBOX_NAMESPACE, SignalAdapter
from adapters.signal._inbox import Inbox
from prismd.channel import InboundEvent
from stores import OwnershipScope, Store, StoreUnavailableError, open_store
from stores.memory import MemoryStore
from tests.fakes.signal_cli import FakeSignalCli, text_envelope
from tests.support.recorder import Recorder
from tests.support.waiting import wait_until

from .conftest import CONN, SERVICE

OLD_CATEGORY = "channel-signal-inbox"


def old_record(event_id: str, text: str, received_at: int, seq: int) -> dict[str, Any]:
    """The value the checkpoint inbox wrote (``Inbox._value`` before the move)."""
    return {
        "schema": 1,
        "eventId": event_id,
        "conversationId": "dm:alice",
        "actorId": "alice-uuid",
        "text": text,
        "receivedAt": received_at,
        "seq": seq,
        "claims": {"sourceDevice": 1},
    }


async def write_old_inbox(store: Store, scope: OwnershipScope = SERVICE) -> None:
    # Written out of order, and two in one millisecond (``seq`` orders those).
    for event_id, text, received_at, seq in (
        ("ev-3", "third", 1_768_839_400_500, 1),
        ("ev-1", "first", 1_768_839_400_100, 7),
        ("ev-2", "second", 1_768_839_400_100, 8),
    ):
        await store.checkpoints.save_checkpoint(
            namespace=INBOX_NAMESPACE,
            key=f"i1:{CONN}:{event_id}",
            scope=scope,
            version=1,
            expected_version=0,
            value=old_record(event_id, text, received_at, seq),
            category=OLD_CATEGORY,
        )
    await store.checkpoints.save_checkpoint(
        namespace=INBOX_NAMESPACE,
        key=f"i1:{CONN}:broken",
        scope=scope,
        version=1,
        expected_version=0,
        value={"schema": 99},
        category=OLD_CATEGORY,
    )


async def test_a_checkpoint_inbox_is_moved_and_each_message_admitted_once(
    tmp_path: Path, fake: FakeSignalCli, make_adapter: Any
) -> None:
    url = f"sqlite:///{tmp_path / 'journal.sqlite'}"
    async with open_store(url) as store:
        await write_old_inbox(store)

    admitted = Recorder()
    with trio.fail_after(30):
        async with open_store(url) as store:
            adapter: SignalAdapter = make_adapter(store=store, admit=admitted)
            async with trio.open_nursery() as nursery:
                await nursery.start(adapter.run)
                await admitted.wait_for(3)
                await wait_until(lambda: adapter.health()["subscription"] == "active")
                fake.push(text_envelope("new after the move"))
                await admitted.wait_for(4)
                nursery.cancel_scope.cancel()
            assert admitted.texts == ["first", "second", "third", "new after the move"]
            assert [e.event_id for e in admitted.events[:3]] == ["ev-1", "ev-2", "ev-3"]
            assert admitted.events[0].external_conversation_id == "dm:alice"
            assert admitted.events[0].claims == {"sourceDevice": 1}
            assert adapter.statistics().replayed == 3
            left = await store.checkpoints.list_checkpoints(namespace=INBOX_NAMESPACE)
            assert [row.key for row in left.items] == [f"i1:{CONN}:broken"]
            items = await store.inbox.list_items(source=CONN)
            assert sorted(i.key for i in items.items if i.key.startswith("ev-")) == [
                "ev-1",
                "ev-2",
                "ev-3",
            ]
            assert {i.state for i in items.items} == {"done"} and len(items.items) == 4

    again = Recorder()
    with trio.fail_after(30):
        async with open_store(url) as store:
            adapter = make_adapter(store=store, admit=again)
            async with trio.open_nursery() as nursery:
                await nursery.start(adapter.run)
                await wait_until(lambda: adapter.health()["subscription"] == "active")
                await trio.sleep(0.2)
                nursery.cancel_scope.cancel()
    assert again.events == [] and adapter.statistics().replayed == 0


async def test_a_new_holder_takes_over_the_claims_of_the_last(
    tmp_path: Path, fake: FakeSignalCli, make_adapter: Any
) -> None:
    """A receiver that stops with messages waiting leaves them claimed; the next one to hold
    the lease (another daemon: another owner id, the same receiver owner in the inbox) lets
    those claims go and admits them, once."""
    url = f"sqlite:///{tmp_path / 'journal.sqlite'}"
    gate = trio.Event()
    seen: list[str] = []

    async def stuck(event: Any) -> Any:
        seen.append(event.text)
        await gate.wait()
        raise AssertionError("not reached")

    with trio.fail_after(30):
        async with open_store(url) as store:
            first = make_adapter(store=store, admit=stuck, owner_id="daemon-a")
            async with trio.open_nursery() as nursery:
                await nursery.start(first.run)
                fake.push(text_envelope("waits", timestamp=1))
                fake.push(text_envelope("waits too", timestamp=2))
                await wait_until(lambda: bool(seen))
                nursery.cancel_scope.cancel()
            depth = await store.inbox.depth(sources=[CONN])
            assert depth.pending + depth.claimed == 2

    taken = Recorder()
    with trio.fail_after(30):
        async with open_store(url) as store:
            second = make_adapter(store=store, admit=taken, owner_id="daemon-b")
            async with trio.open_nursery() as nursery:
                await nursery.start(second.run)
                await taken.wait_for(2)
                nursery.cancel_scope.cancel()
            depth = await store.inbox.depth(sources=[CONN])
            assert (depth.pending, depth.claimed) == (0, 0)
    assert taken.texts == ["waits", "waits too"]


async def test_a_put_tried_again_keeps_its_place() -> None:
    """An event the store did not take at first is written again later (before its
    admission); it keeps its place before the events read after it."""
    store = MemoryStore()
    failing = {"a"}

    class Flaky:
        def __getattr__(self, name: str) -> Any:
            return getattr(store.inbox, name)

        async def put(self, **kw: Any) -> bool:
            if kw["key"] in failing:
                raise StoreUnavailableError("store down")
            return await store.inbox.put(**kw)

    def event(event_id: str) -> InboundEvent:
        return InboundEvent(CONN, "dm:alice", "alice-uuid", event_id, "hi", received_at_ms=5)

    inbox = Inbox(connection_id=CONN, store=Flaky(), checkpoints=store.checkpoints, scope=SERVICE)
    assert await inbox.put([event("a"), event("b")]) == [False, True]
    assert await inbox.put([event("c")]) == [True]
    failing.clear()
    assert await inbox.put([event("a")]) == [True]
    again = Inbox(
        connection_id=CONN, store=store.inbox, checkpoints=store.checkpoints, scope=SERVICE
    )
    assert [e.event_id for e in await again.load()] == ["a", "b", "c"]
