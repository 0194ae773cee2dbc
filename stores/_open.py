"""``open_store(url)``: pick the backend from the URL scheme."""

from __future__ import annotations

from ._types import DEFAULT_MAX_VALUE_BYTES, SYSTEM_CLOCK, Clock, InvalidStoreURLError, Store


async def open_store(
    url: str, *, clock: Clock = SYSTEM_CLOCK, max_value_bytes: int = DEFAULT_MAX_VALUE_BYTES
) -> Store:
    """Open the store named by ``url``; the caller owns it and must ``aclose()`` it.

    * ``memory://`` — process-local, for tests.
    * ``sqlite:///relative/or/absolute/path.sqlite`` (``sqlite:////abs`` also accepted).

    ``max_value_bytes`` bounds the JSON encoding of one checkpoint value (default 1 MiB).

    Raises :class:`InvalidStoreURLError` for anything else and
    :class:`~stores.StoreUnavailableError` when the backend cannot be opened.
    """
    if not isinstance(url, str) or not url:
        raise InvalidStoreURLError("store URL must be a non-empty string")
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise InvalidStoreURLError("store URL has no scheme: expected memory:// or sqlite:///PATH")
    if scheme == "memory":
        if rest:
            raise InvalidStoreURLError("memory:// takes no path")
        from .memory import MemoryStore

        return MemoryStore(clock=clock, max_value_bytes=max_value_bytes)
    if scheme == "sqlite":
        from .sqlite import open_sqlite_store

        return await open_sqlite_store(url, clock=clock, max_value_bytes=max_value_bytes)
    raise InvalidStoreURLError(f"unsupported store URL scheme {scheme!r}")
