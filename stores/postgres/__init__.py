"""The PostgreSQL store (see ``_writer``); this commit only moves the modules into the
package. The store's names are loaded on first use, so the URL parser imports no driver."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._writer import PostgresStore as PostgresStore
    from ._writer import measure_bridge as measure_bridge
    from ._writer import open_postgres_store as open_postgres_store
    from ._writer import schema_status as schema_status

_LAZY = {"PostgresStore", "measure_bridge", "open_postgres_store", "schema_status"}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}._writer"), name)
