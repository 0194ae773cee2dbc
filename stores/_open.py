"""``open_store(url)``: pick the backend from the URL scheme."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import trio

from ._types import DEFAULT_MAX_VALUE_BYTES, SYSTEM_CLOCK, Clock, InvalidStoreURLError, Store

CLOSE_BUDGET_S = 10.0
"""How long leaving the block waits for the store to close, even when cancelled."""


@asynccontextmanager
async def open_store(
    url: str, *, clock: Clock = SYSTEM_CLOCK, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
) -> AsyncIterator[Store]:
    """``async with open_store(url) as store:`` — the store named by ``url``, open for the
    block and closed when it ends (a backend may own a loop, a pool or a task for exactly
    that long). ``store.aclose()`` inside the block closes it early; every later call then
    raises :class:`~stores.StoreUnavailableError`.

    * ``memory://`` — process-local, for tests.
    * ``sqlite:///relative/or/absolute/path.sqlite`` (``sqlite:////abs`` also accepted).

    ``max_value_bytes`` bounds the JSON encoding of one checkpoint value (default 1 MiB).

    Entering raises :class:`InvalidStoreURLError` for anything else and
    :class:`~stores.StoreUnavailableError` when the backend cannot be opened.
    """
    if not isinstance(url, str) or not url:
        raise InvalidStoreURLError("store URL must be a non-empty string")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise InvalidStoreURLError("store URL has no scheme: expected memory:// or sqlite:///PATH")
    store: Store
    if scheme == "memory":
        if rest:
            raise InvalidStoreURLError("memory:// takes no path")
        from .memory import MemoryStore

        store = MemoryStore(clock=clock, max_value_bytes=max_value_bytes)
    elif scheme == "sqlite":
        from .sqlite import open_sqlite_store

        store = await open_sqlite_store(url, clock=clock, max_value_bytes=max_value_bytes)
    else:
        raise InvalidStoreURLError(f"unsupported store URL scheme {scheme!r}")
    try:
        yield store
    finally:
        # Shielded so a cancelled block still closes (bounded: a wedged backend cannot hold
        # the caller forever).
        with trio.move_on_after(CLOSE_BUDGET_S, shield=True):
            await store.aclose()
