"""Fixtures for runtime tests: a store of each backend (memory and SQLite)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.support.harness import StoreFactory, store_factory


@pytest.fixture(params=["memory", "sqlite"])
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StoreFactory]:
    """A factory opening the same journal again on each call ("restart" = reopen)."""
    async with store_factory(request.param, tmp_path) as factory:
        yield factory
