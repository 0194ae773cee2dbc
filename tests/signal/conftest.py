"""Shared helpers for the Signal adapter tests: the fake signal-cli on a short Unix socket
path (and TCP), a memory store on virtual time, a recording ``admit``."""

from __future__ import annotations

import json
import random
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from adapters.signal import SignalAdapter
from prismd.channel import Admission, InboundEvent
from stores import OwnershipScope
from stores.memory import MemoryStore
from tests.conftest import FIXTURES
from tests.fakes.signal_cli import ACCOUNT, FakeSignalCli, start_fake

CONN = "signal-main"
SERVICE = OwnershipScope(tenant_id="prismd-service", account_id=CONN)
SG_FIXTURES = FIXTURES / "signal-cli"


class TrioClock:
    """Store wall clock that follows Trio's (virtual) clock, so leases expire in test time."""

    def now_ms(self) -> int:
        return 1_700_000_000_000 + int(trio.current_time() * 1000)


def fixture(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(Path(SG_FIXTURES / name).read_text())
    return data


@attrs.define(eq=False)
class Recorder:
    """An ``admit`` that records events and answers ``answer(event)`` (accepted by default)."""

    answer: Callable[[InboundEvent], Admission] = lambda _e: Admission(status="accepted")
    events: list[InboundEvent] = attrs.field(factory=list)
    changed: trio.Event = attrs.field(factory=trio.Event)

    async def __call__(self, event: InboundEvent) -> Admission:
        self.events.append(event)
        self.changed.set()
        self.changed = trio.Event()
        return self.answer(event)

    @property
    def texts(self) -> list[str]:
        return [e.text for e in self.events]

    async def wait_for(self, count: int) -> None:
        while len(self.events) < count:
            await self.changed.wait()


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


async def wait_until(predicate: Callable[[], bool], step: float = 0.05) -> None:
    """Poll a condition on (virtual) time; tests bound it with their own deadline."""
    while True:
        if predicate():
            return
        await trio.sleep(step)


def raises_flat(exc: type[BaseException], match: str | None = None) -> Any:
    """Expect ``exc`` raised bare or inside (nested) nursery exception groups."""
    return pytest.RaisesGroup(
        pytest.RaisesExc(exc, match=match), flatten_subgroups=True, allow_unwrapped=True
    )
