"""Fixtures for runtime tests: a store of each backend (memory and SQLite)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from .harness import StoreFactory, store_factory


@pytest.fixture(params=["memory", "sqlite"])
async def stores(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[StoreFactory]:
    """A factory opening the same journal again on each call ("restart" = reopen)."""
    opened = []
    base = store_factory(request.param, tmp_path)

    async def factory():  # type: ignore[no-untyped-def]
        store = await base()
        opened.append(store)
        return store

    yield factory
    for store in opened:
        try:
            await store.aclose()
        except Exception:
            pass
