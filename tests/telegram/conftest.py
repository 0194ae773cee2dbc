"""Shared helpers for the Telegram adapter tests: the fake Bot API, a memory store on
virtual time, a recording ``admit``, a Bot API of one handler (``serve_bot_api``)."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from adapters.telegram import TelegramAdapter
from stores import OwnershipScope
from stores.memory import MemoryStore
from tests.conftest import FIXTURES
from tests.fakes.telegram_api import FakeBotApi, start_fake
from tests.support.clocks import TrioClock
from tests.support.handler_server import Handler, serve_handler
from tests.support.recorder import Recorder

TOKEN = "123456:secret-token"
CONN = "telegram-main"
SERVICE = OwnershipScope(tenant_id="prismd-service", account_id=CONN)
TG_FIXTURES = FIXTURES / "telegram"
TOKEN_43 = "A" * 43


ServeBotApi = Callable[[Handler], Awaitable[str]]


@pytest.fixture
def serve_bot_api(nursery: trio.Nursery) -> ServeBotApi:
    """Serve a test's handler as the Bot API on loopback (for the tests whose Bot API is
    one function: errors, cut connections, dripping answers); its origin, for
    ``api_origin``. Served until the test ends."""

    async def serve(handler: Handler) -> str:
        return await serve_handler(nursery, handler)

    return serve


def fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(Path(TG_FIXTURES / name).read_text())
    return data


def private_message(
    text: str = "hello Prism", *, chat: int = 101, user: int = 202, **extra: Any
) -> dict[str, Any]:
    return {
        "message": {
            "message_id": 1,
            "from": {"id": user, "is_bot": False, "first_name": "U"},
            "chat": {"id": chat, "type": "private", "first_name": "U"},
            "date": 1_700_000_000,
            "text": text,
            **extra,
        }
    }


def topic_message(text: str = "topic", **extra: Any) -> dict[str, Any]:
    return {
        "message": {
            "message_id": 5,
            "message_thread_id": 77,
            "is_topic_message": True,
            "from": {"id": 202, "is_bot": False, "first_name": "U"},
            "chat": {"id": -100123, "type": "supergroup", "title": "G", "is_forum": True},
            "date": 1_700_000_000,
            "text": text,
            **extra,
        }
    }


def callback(
    data: str, *, chat: dict[str, Any] | None = None, thread: int | None = None
) -> dict[str, Any]:
    message: dict[str, Any] = {
        "message_id": 9,
        "from": {"id": 123456, "is_bot": True, "first_name": "Bot"},
        "chat": chat or {"id": 101, "type": "private", "first_name": "U"},
        "date": 1_700_000_000,
        "text": "Approve?",
    }
    if thread is not None:
        message["message_thread_id"] = thread
    return {
        "callback_query": {
            "id": "cbq-1",
            "from": {"id": 202, "is_bot": False, "first_name": "U"},
            "message": message,
            "chat_instance": "42",
            "data": data,
        }
    }


@pytest.fixture
async def fake(nursery: trio.Nursery) -> FakeBotApi:
    return await start_fake(nursery)


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore(clock=TrioClock())


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
async def make_adapter(
    fake: FakeBotApi, store: MemoryStore, recorder: Recorder
) -> AsyncIterator[Callable[..., TelegramAdapter]]:
    """Builds adapters against the fake; every one is closed (``aclose``) at teardown."""
    made: list[TelegramAdapter] = []

    def make(**kwargs: Any) -> TelegramAdapter:
        options: dict[str, Any] = {
            "connection_id": CONN,
            "token": lambda: TOKEN,
            "admit": recorder,
            "store": store,
            "owner_id": "daemon-a",
            "api_origin": fake.origin,
            "clock": TrioClock(),
            "random": random.Random(7),
        }
        options.update(kwargs)
        adapter = TelegramAdapter(**options)
        made.append(adapter)
        return adapter

    yield make
    for adapter in made:
        await adapter.aclose()


async def cursor_value(store: MemoryStore) -> dict[str, Any] | None:
    record = await store.checkpoints.load_checkpoint(
        namespace="prism.channels.v1.cursor",
        key=f"c1:{CONN}:prismd-service:{CONN}:-",
        scope=SERVICE,
    )
    return None if record is None else dict(record.value)


async def run_until_admitted(adapter: TelegramAdapter, recorder: Recorder, count: int = 1) -> None:
    """Run the adapter until ``recorder`` has ``count`` events, then stop it."""
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        await recorder.wait_for(count)
        nursery.cancel_scope.cancel()
