"""The store backends every store-level test runs on.

A new backend joins by adding one entry to :data:`BACKENDS`; every backend but ``memory``
survives a reopen (:data:`DURABLE`). ``postgres`` runs against the server
``tests/with-services.sh`` starts (``make test``), in a schema of its own per test, dropped
by :meth:`Backend.discard` (:mod:`tests.support.pgserver`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import attrs

from stores import DEFAULT_MAX_VALUE_BYTES, Store, open_store
from tests.support import pgserver

from .clocks import TrioClock


@attrs.define
class Backend:
    """How to open (and, for durable backends, reopen) one store for a test."""

    name: str
    url: str

    @property
    def durable(self) -> bool:
        return self.name in DURABLE

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
