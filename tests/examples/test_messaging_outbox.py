"""``examples/messaging_outbox.py`` as a real subprocess on the suite's PostgreSQL server,
sending through the fake Bot API: one send per reply, an idempotent repeat, a crash between
the outbox ``COMMIT`` and the send re-driven from the outbox."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.daemon.helpers import child_env
from tests.fakes.telegram_api import FakeBotApi, start_fake
from tests.support import pgserver

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "messaging_outbox.py"


@pytest.fixture
def url() -> Iterator[str]:
    fresh = pgserver.fresh_url("ox")
    yield fresh
    pgserver.drop_schema(fresh)


async def example(fake: FakeBotApi, url: str, *args: str) -> tuple[int, Any, str]:
    with trio.fail_after(90):
        done = await trio.run_process(
            [sys.executable, str(EXAMPLE), "--store", url, "--telegram-origin", fake.origin,
             *args],
            capture_stdout=True, capture_stderr=True, check=False,
            env=child_env(TELEGRAM_TOKEN=fake.token), cwd=str(REPO),
        )  # fmt: skip
    out = done.stdout.decode().strip()
    return done.returncode, json.loads(out) if out else None, done.stderr.decode()


def sent_texts(fake: FakeBotApi) -> list[tuple[str, str]]:
    return [(str(s["chat_id"]), str(s["text"])) for s in fake.sent]


async def test_the_reply_is_committed_with_the_business_change_then_sent_once(url: str) -> None:
    async with trio.open_nursery() as nursery:
        fake = await start_fake(nursery)
        fake.chats.update({"101", "102"})
        code, first, err = await example(fake, url, "--chat", "101", "--event-id", "e1",
                                         "--text", "hello desk")  # fmt: skip
        assert code == 0, err
        assert first["status"] == "accepted" and not first["duplicate"]
        op = first["operationId"]
        assert first["outbox"] == {
            "payload": {"connectionId": "tg", "eventId": "e1", "operationId": op,
                        "kind": "final"},
            "attempts": 1,
            "sent": True,
        }  # fmt: skip
        assert sent_texts(fake) == [("101", "hello desk")]

        # The same message again: a duplicate admission, nothing appended, nothing sent.
        code, again, err = await example(fake, url, "--chat", "101", "--event-id", "e1",
                                         "--text", "hello desk")  # fmt: skip
        assert code == 0, err
        assert again["duplicate"] and again["operationId"] == op
        assert again["outbox"]["attempts"] == 1
        assert len(fake.sent) == 1

        # A crash between the COMMIT and the send: the row is there, unsent; the re-drive
        # sends it once, and a second re-drive finds nothing to do.
        crash = ("--chat", "102", "--event-id", "e2", "--text", "after the crash")
        code, _, err = await example(fake, url, *crash, "--crash-after-commit")
        assert code == 3, err
        assert len(fake.sent) == 1
        code, redriven, err = await example(fake, url, "--redrive")
        assert (code, redriven) == (0, {"redriven": 1}), err
        assert sent_texts(fake)[1:] == [("102", "after the crash")]
        code, redriven, err = await example(fake, url, "--redrive")
        assert (code, redriven) == (0, {"redriven": 0}), err
        nursery.cancel_scope.cancel()
    assert len(fake.sent) == 2

    schema = f'"{pgserver.schema_of(url)}"'
    outbox = await pgserver.query(
        url, f"SELECT payload::text, sent_at IS NOT NULL FROM {schema}.desk_outbox"
    )
    assert len(outbox) == 2 and all(sent for _payload, sent in outbox)
    for payload, _sent in outbox:
        assert "hello" not in str(payload) and "crash" not in str(payload)  # ids only
        assert set(json.loads(str(payload))) == {"connectionId", "eventId", "operationId", "kind"}
    tickets = await pgserver.query(
        url, f"SELECT conversation_id, status, replies FROM {schema}.desk_tickets"
        " ORDER BY conversation_id",
    )  # fmt: skip
    assert tickets == [("101", "answered", 1), ("102", "answered", 1)]
