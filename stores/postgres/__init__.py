"""The PostgreSQL store: asyncpg on a trio-asyncio loop, the contract of :mod:`stores`.

Opened through ``stores.open_store("postgresql://…")``; its schema is inspected and migrated
through ``stores.migrate_store``. This face holds what needs no driver: the URL parser
(``check-config`` uses it without importing asyncpg) and the pool settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._url import DEFAULT_CONNECT_TIMEOUT_MS as DEFAULT_CONNECT_TIMEOUT_MS
from ._url import DEFAULT_SCHEMA as DEFAULT_SCHEMA
from ._url import DEFAULT_STATEMENT_TIMEOUT_MS as DEFAULT_STATEMENT_TIMEOUT_MS
from ._url import MAX_POOL_SIZE as MAX_POOL_SIZE
from ._url import PostgresOptions as PostgresOptions
from ._url import PostgresURL as PostgresURL
from ._url import default_pool_size as default_pool_size
from ._url import is_postgres_url as is_postgres_url
from ._url import parse_postgres_url as parse_postgres_url

if TYPE_CHECKING:
    from .._types import Store
    from ._store import BridgeSamples


async def measure_bridge(store: Store, samples: int) -> BridgeSamples:
    """``prismd bench``'s ``postgres-bridge``: seconds per single-row write through the store,
    through the bare trio-asyncio bridge and from plain asyncio (see ``BridgeSamples``).
    ``store`` must be a PostgreSQL store (``TypeError`` otherwise)."""
    from ._store import PostgresStore
    from ._store import measure_bridge as measure

    if not isinstance(store, PostgresStore):
        raise TypeError("the postgres-bridge measure needs a postgresql:// store")
    return await measure(store, samples)
