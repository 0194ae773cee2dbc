"""Fixtures of the daemon tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import pgserver


@pytest.fixture(params=["sqlite", "postgres"])
def store_url(request: pytest.FixtureRequest) -> Iterator[str | None]:
    """The daemon's store, once per backend: ``None`` for the SQLite file of the test's
    layout, or a ``postgresql://`` URL to a fresh schema on the test server (dropped after)."""
    if request.param == "sqlite":
        yield None
        return
    url = pgserver.fresh_url("d")
    yield url
    pgserver.drop_schema(url)
