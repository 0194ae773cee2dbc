"""Backends for the store conformance suite.

Every test that takes the ``store`` fixture runs once per backend (ids ``memory``,
``sqlite``, ``postgres``). A new backend joins by adding one entry to :data:`BACKENDS`; every
backend but ``memory`` survives a reopen (:data:`DURABLE`).

``postgres`` runs against the server ``tests/with-services.sh`` starts (``make test``), in a
schema of its own per test, dropped afterwards (:mod:`tests.pgserver`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import attrs
import pytest
import trio

from stores import DEFAULT_MAX_VALUE_BYTES, Store, open_store
from tests import pgserver

EPOCH_MS = 1_700_000_000_000


@attrs.frozen
class TrioClock:
    """A store clock that follows ``trio.current_time()``, so ``autojump_clock`` drives it.

    ``now_ms`` = a fixed wall-clock epoch + Trio time in whole milliseconds.
    """

    epoch_ms: int = EPOCH_MS

    def now_ms(self) -> int:
        return self.epoch_ms + int(trio.current_time() * 1000)


@attrs.define
class Backend:
    """How to open (and, for durable backends, reopen) one store for a test."""

    name: str
    url: str

    def discard(self) -> None:
        """Remove what the test left on a server (files go with ``tmp_path``)."""
        if self.name == "postgres":
            pgserver.drop_schema(self.url)

    def open(
        self, *, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
    ) -> AbstractAsyncContextManager[Store]:
        """``async with backend.open() as store:`` (a durable backend reopens the same data)."""
        return open_store(self.url, clock=TrioClock(), max_value_bytes=max_value_bytes)


def _memory(tmp_path: Path) -> Backend:
    return Backend("memory", "memory://")


def _sqlite(tmp_path: Path) -> Backend:
    return Backend("sqlite", f"sqlite:///{tmp_path}/journal.sqlite")


def _postgres(tmp_path: Path) -> Backend:
    return Backend("postgres", pgserver.fresh_url())


BACKENDS: dict[str, Callable[[Path], Backend]] = {
    "memory": _memory,
    "sqlite": _sqlite,
    "postgres": _postgres,
}
DURABLE = [name for name in BACKENDS if name != "memory"]


@pytest.fixture(params=list(BACKENDS), ids=list(BACKENDS))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    chosen = BACKENDS[request.param](tmp_path)
    yield chosen
    chosen.discard()


@pytest.fixture(params=DURABLE, ids=DURABLE)
def durable_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    chosen = BACKENDS[request.param](tmp_path)
    yield chosen
    chosen.discard()


@pytest.fixture
async def store(backend: Backend) -> AsyncIterator[Store]:
    async with backend.open() as opened:
        yield opened
