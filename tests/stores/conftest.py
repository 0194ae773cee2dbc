"""The store conformance suite's fixtures: every test that takes ``store`` runs once per
backend of :data:`tests.support.backends.BACKENDS` (ids ``memory``, ``sqlite``,
``postgres``); ``durable_backend`` only those that survive a reopen."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from stores import Store
from tests.support.backends import BACKENDS, DURABLE, Backend


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
