"""``open_store(url)`` and ``migrate_store(url)``: pick the backend from the URL scheme."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager

import trio

from ._contracts import (
    Store,
)
from ._types import (
    DEFAULT_MAX_VALUE_BYTES,
    SYSTEM_CLOCK,
    Clock,
    InvalidStoreURLError,
    SchemaStatus,
)
from .postgres._url import PostgresOptions, is_postgres_url

CLOSE_BUDGET_S = 10.0
"""How long leaving the block waits for the store to close, even when cancelled."""

_EXPECTED = "expected memory://, sqlite:///PATH or postgresql://…"


def _scheme(url: object) -> str:
    if not isinstance(url, str) or not url:
        raise InvalidStoreURLError("store URL must be a non-empty string")
    scheme, sep, _rest = url.partition("://")
    if not sep:
        raise InvalidStoreURLError(f"store URL has no scheme: {_EXPECTED}")
    return scheme


def open_store(
    url: str,
    *,
    clock: Clock = SYSTEM_CLOCK,
    max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES,
    postgres: PostgresOptions | None = None,
) -> AbstractAsyncContextManager[Store]:
    """``async with open_store(url) as store:`` — the store named by ``url``, open for the
    block and closed when it ends (a backend may own a loop, a pool or a task for exactly
    that long). ``store.aclose()`` inside the block closes it early; every later call then
    raises :class:`~stores.StoreUnavailableError`.

    * ``memory://`` — process-local, for tests.
    * ``sqlite:///relative/or/absolute/path.sqlite`` (``sqlite:////abs`` also accepted).
    * ``postgresql://user@host:port/database[?schema=…]`` (or ``postgres://``), with the pool
      settings and password in ``postgres`` (see :mod:`stores.postgres`). Entering applies
      missing schema migrations.

    ``max_value_bytes`` bounds the JSON encoding of one checkpoint value (default 1 MiB).

    Entering raises :class:`InvalidStoreURLError` for anything else and
    :class:`~stores.StoreUnavailableError` when the backend cannot be opened
    (:class:`~stores.StoreUnreachableError` when a server could not be reached).
    """
    return _open(url, clock, max_value_bytes, postgres)


@asynccontextmanager
async def _open(
    url: str, clock: Clock, max_value_bytes: int, postgres: PostgresOptions | None
) -> AsyncIterator[Store]:
    scheme = _scheme(url)
    if is_postgres_url(url):
        from .postgres._store import open_postgres_store

        async with open_postgres_store(
            url, clock=clock, max_value_bytes=max_value_bytes, options=postgres
        ) as pg:
            yield pg
        return
    store: Store
    if scheme == "memory":
        if url != "memory://":
            raise InvalidStoreURLError("memory:// takes no path")
        from .memory import MemoryStore

        store = MemoryStore(clock=clock, max_value_bytes=max_value_bytes)
    elif scheme == "sqlite":
        from .sqlite._store import open_sqlite_store

        store = await open_sqlite_store(url, clock=clock, max_value_bytes=max_value_bytes)
    else:
        raise InvalidStoreURLError(f"unsupported store URL scheme {scheme!r}: {_EXPECTED}")
    try:
        yield store
    finally:
        # Shielded so a cancelled block still closes (bounded: a wedged backend cannot hold
        # the caller forever).
        with trio.move_on_after(CLOSE_BUDGET_S, shield=True):
            await store.aclose()


async def migrate_store(
    url: str, *, apply: bool = True, postgres: PostgresOptions | None = None
) -> SchemaStatus:
    """Apply the schema migrations a durable store lacks (``apply=False``: only report).

    ``prismd migrate`` runs this; ``open_store`` applies the same migrations on entering,
    so running it first is optional. Raises as :func:`open_store` does, and
    :class:`InvalidStoreURLError` for ``memory://`` (which has no schema).
    """
    scheme = _scheme(url)
    if is_postgres_url(url):
        from .postgres._store import schema_status

        return await schema_status(url, options=postgres, apply=apply)
    if scheme == "sqlite":
        from .sqlite._store import sqlite_schema_status

        return await sqlite_schema_status(url, apply=apply)
    if scheme == "memory":
        raise InvalidStoreURLError("memory:// keeps nothing: it has no schema to migrate")
    raise InvalidStoreURLError(f"unsupported store URL scheme {scheme!r}: {_EXPECTED}")
