"""Shared helpers for the Signal adapter tests: the fake signal-cli on a short Unix socket
path (and TCP), a memory store on virtual time, a recording ``admit``."""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from adapters.signal import SignalAdapter
from stores import OwnershipScope
from stores.memory import MemoryStore
from tests.conftest import FIXTURES
from tests.fakes.signal_cli import ACCOUNT, FakeSignalCli, start_fake
from tests.support.clocks import TrioClock
from tests.support.recorder import Recorder

CONN = "signal-main"
SERVICE = OwnershipScope(tenant_id="prismd-service", account_id=CONN)
SG_FIXTURES = FIXTURES / "signal-cli"


def fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(Path(SG_FIXTURES / name).read_text())
    return data


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory for Unix sockets (``sun_path`` holds 107 bytes)."""
    with tempfile.TemporaryDirectory(prefix="sg-", dir="/tmp") as name:
        yield Path(name)


@pytest.fixture
async def fake(nursery: trio.Nursery, short_dir: Path) -> FakeSignalCli:
    return await start_fake(nursery, short_dir, tcp=True)


@pytest.fixture
def store() -> MemoryStore:
    return MemoryStore(clock=TrioClock())


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


@pytest.fixture
async def make_adapter(
    fake: FakeSignalCli, store: MemoryStore, recorder: Recorder
) -> AsyncIterator[Callable[..., SignalAdapter]]:
    """Builds adapters against the fake's Unix socket (``tcp=fake.tcp_address`` for TCP)."""

    def make(**kwargs: Any) -> SignalAdapter:
        options: dict[str, Any] = {
            "connection_id": CONN,
            "account": ACCOUNT,
            "admit": recorder,
            "store": store,
            "owner_id": "daemon-a",
            "clock": TrioClock(),
            "random": random.Random(7),
        }
        if "tcp" not in kwargs:
            options["socket"] = fake.socket_path
        options.update(kwargs)
        return SignalAdapter(**options)

    yield make
