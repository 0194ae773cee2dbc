"""The store conformance suite's fixtures: every test that takes ``store`` runs once per
backend of :data:`tests.support.backends.BACKENDS` (ids ``memory``, ``sqlite``,
``postgres``); ``durable_backend`` only those that survive a reopen. The ``postgres``
legs are marked ``slow``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from stores import Store
from tests.support.backends import BACKENDS, DURABLE, Backend


def _params(names: list[str]) -> list[Any]:
    # The server's legs are slow (round trips to PostgreSQL); `make check` leaves them out.
    return [pytest.param(n, marks=pytest.mark.slow) if n == "postgres" else n for n in names]


@pytest.fixture(params=_params(list(BACKENDS)))
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    chosen = BACKENDS[request.param](tmp_path)
    yield chosen
    chosen.discard()


@pytest.fixture(params=_params(DURABLE))
def durable_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    chosen = BACKENDS[request.param](tmp_path)
    yield chosen
    chosen.discard()


@pytest.fixture
async def store(backend: Backend) -> AsyncIterator[Store]:
    async with backend.open() as opened:
        yield opened
