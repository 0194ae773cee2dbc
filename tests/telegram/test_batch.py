"""The poller's batch (issue 40): one ``getUpdates`` answer admitted concurrently across
chats, in order within each; the offset is the contiguous watermark of admitted updates,
written through the journal's cursor — and a journal whose offset the poller wrote in its
own JSON before keeps it."""

from __future__ import annotations

import datetime
import shutil
from pathlib import Path
from typing import Any

import trio
from trio.testing import MockClock

from prismd.channel import Admission, InboundEvent
from prismd.journal import ChannelJournal
from stores import open_store
from tests.fakes.telegram_api import FakeBotApi
from tests.support.waiting import wait_until, wait_until_async

from .conftest import CONN, SERVICE, TG_FIXTURES, cursor_value, private_message

OLD_JOURNAL = TG_FIXTURES / "journal_before_issue_40.sqlite"


async def _cursor_is(store: Any, last: str) -> bool:
    cursor = await cursor_value(store)
    return cursor is not None and cursor["lastEventId"] == last


async def test_one_answer_is_admitted_across_chats_at_once_in_order_within_each(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, store: Any
) -> None:
    for i in range(100):
        fake.push_update(private_message(str(i), chat=1000 + i % 20, user=2000 + i % 20))
    admitted: list[InboundEvent] = []
    active = peak = 0

    async def admit(event: InboundEvent) -> Admission:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        await trio.sleep(0.01)  # the journal's commit
        active -= 1
        admitted.append(event)
        return Admission("accepted")

    adapter = make_adapter(admit=admit)
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        started = trio.current_time()
        await wait_until_async(lambda: _cursor_is(store, "100"))
        took = trio.current_time() - started
        nursery.cancel_scope.cancel()
    assert peak == 20 and len(admitted) == 100
    assert took < 0.2  # 5 admissions of 10 ms one after another per chat, not 100
    for chat in range(1000, 1020):
        texts = [int(e.text) for e in admitted if e.external_conversation_id == str(chat)]
        assert texts == sorted(texts) and len(texts) == 5, chat
    cursor = await cursor_value(store)
    assert cursor is not None and cursor["admitted"] == 100
    stored = await store.checkpoints.load_checkpoint(
        namespace="prism.channels.v1.cursor",
        key=f"c1:{CONN}:prismd-service:{CONN}:-",
        scope=SERVICE,
    )
    # The lanes' cursor writes coalesce (one in flight, the next carries the watermark):
    # the 20 lanes finish each round together, so a round costs one or two writes.
    assert stored is not None and stored.version <= 12, stored.version
    polls = fake.calls_to("getUpdates")
    assert "offset" not in polls[0].params and polls[1].params["offset"] == 101


async def test_the_offset_never_passes_an_update_still_being_admitted(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, store: Any
) -> None:
    fake.push_update(private_message("a1", chat=1, user=1))
    fake.push_update(private_message("b1", chat=2, user=2))
    fake.push_update(private_message("b2", chat=2, user=2))
    fake.push_update(private_message("c1", chat=3, user=3))
    gate = trio.Event()
    admitted: list[str] = []

    async def admit(event: InboundEvent) -> Admission:
        if event.text == "a1":
            await gate.wait()
        admitted.append(event.text)
        return Admission("accepted")

    adapter = make_adapter(admit=admit)
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        await wait_until(lambda: len(admitted) == 3)
        await trio.sleep(20)
        # Updates 2-4 are admitted, 1 is not yet: nothing is acknowledged, nothing re-polled.
        assert sorted(admitted) == ["b1", "b2", "c1"]
        assert await cursor_value(store) is None
        assert len(fake.calls_to("getUpdates")) == 1
        gate.set()
        await wait_until_async(lambda: _cursor_is(store, "4"))
        await wait_until(lambda: len(fake.calls_to("getUpdates")) >= 2)
        nursery.cancel_scope.cancel()
    assert admitted.index("b1") < admitted.index("b2")
    assert fake.calls_to("getUpdates")[1].params["offset"] == 5
    assert fake.updates == []


async def test_a_refused_update_holds_its_chat_and_the_watermark(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, store: Any
) -> None:
    """Chat a's first update is refused (capacity) once: a's second is not admitted before
    it, the offset stays before it, and chat b's updates admitted meanwhile are polled
    again (the journal would answer ``duplicate``)."""
    for text, chat in (("a1", 1), ("b1", 2), ("a2", 1), ("b2", 2)):
        fake.push_update(private_message(text, chat=chat, user=chat))
    seen: list[tuple[str, str]] = []

    async def admit(event: InboundEvent) -> Admission:
        refuse = event.text == "a1" and not any(t == "a1" for t, _ in seen)
        seen.append((event.text, "refused" if refuse else "accepted"))
        return Admission("denied", reason="capacity") if refuse else Admission("accepted")

    adapter = make_adapter(admit=admit)
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        await wait_until_async(lambda: _cursor_is(store, "4"))
        nursery.cancel_scope.cancel()
    a = [s for s in seen if s[0].startswith("a")]
    assert a == [("a1", "refused"), ("a1", "accepted"), ("a2", "accepted")]
    assert sorted(t for t, _ in seen if t.startswith("b")) == ["b1", "b1", "b2", "b2"]
    polls = fake.calls_to("getUpdates")
    assert "offset" not in polls[0].params and "offset" not in polls[1].params
    assert polls[1].at - polls[0].at >= 0.5  # after the admission backoff, not at once


async def test_a_journal_written_before_keeps_its_offset(
    tmp_path: Path, fake: FakeBotApi, make_adapter: Any
) -> None:
    """A journal whose offset the poller wrote in its own JSON (no ``updatedAtMs``, no
    metadata; a file written by the code before issue 40) opens with that offset: the
    first poll asks from update 44, only the new update is admitted, and the cursor
    moves on through the journal, counting on from the old record."""
    path = tmp_path / "journal.sqlite"
    shutil.copyfile(OLD_JOURNAL, path)
    for text, update_id in (("one", 41), ("two", 42), ("three", 43), ("four", 44)):
        fake.push_update(private_message(text), update_id=update_id)
    admitted: list[str] = []

    async def admit(event: InboundEvent) -> Admission:
        admitted.append(event.text)
        return Admission("accepted")

    with trio.fail_after(30):
        async with open_store(f"sqlite:///{path}") as store:
            journal = ChannelJournal(store.checkpoints)
            old = await journal.load_cursor(SERVICE, CONN)
            assert old is not None
            assert (old.record.admitted, old.record.last_event_id) == (3, "43")
            assert old.record.updated_at_ms == _ms("2026-12-05T11:41:45.278Z")
            adapter = make_adapter(admit=admit, store=store)
            async with trio.open_nursery() as nursery:
                await nursery.start(adapter.run)
                await wait_until_async(lambda: _journal_cursor_is(journal, "44"))
                nursery.cancel_scope.cancel()
            new = await journal.load_cursor(SERVICE, CONN)
            raw = await store.checkpoints.load_checkpoint(
                namespace="prism.channels.v1.cursor",
                key=f"c1:{CONN}:prismd-service:{CONN}:-",
                scope=SERVICE,
            )
    assert admitted == ["four"]
    assert fake.calls_to("getUpdates")[0].params["offset"] == 44
    assert new is not None and new.record.admitted == 4 and new.version == old.version + 1
    assert raw is not None and "updatedAtMs" in raw.value


async def _journal_cursor_is(journal: ChannelJournal, last: str) -> bool:
    cursor = await journal.load_cursor(SERVICE, CONN)
    return cursor is not None and cursor.record.last_event_id == last


def _ms(iso: str) -> int:
    return round(datetime.datetime.fromisoformat(iso).timestamp() * 1000)


async def test_an_unreadable_stored_offset_is_written_over(
    autojump_clock: MockClock, fake: FakeBotApi, make_adapter: Any, store: Any
) -> None:
    """A cursor record that does not parse (the old poller tolerated one) neither stops the
    poller nor stays: polling starts from what Telegram holds and the next advance writes a
    good cursor over it at its version."""
    await store.checkpoints.save_checkpoint(
        namespace="prism.channels.v1.cursor",
        key=f"c1:{CONN}:prismd-service:{CONN}:-",
        scope=SERVICE,
        version=3,
        expected_version=0,
        value={"admitted": -5, "lastEventId": 7, "updatedAt": "yesterday"},
        category="channel-cursor",
    )
    fake.push_update(private_message("hello"), update_id=9)
    admitted: list[str] = []

    async def admit(event: InboundEvent) -> Admission:
        admitted.append(event.text)
        return Admission("accepted")

    adapter = make_adapter(admit=admit)
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        await wait_until_async(lambda: _cursor_is(store, "9"))
        nursery.cancel_scope.cancel()
    assert admitted == ["hello"]
    assert "offset" not in fake.calls_to("getUpdates")[0].params
    cursor = await cursor_value(store)
    assert cursor is not None and cursor["admitted"] == 1
