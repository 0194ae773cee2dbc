"""The SQLite store (see ``_engine``); this commit only moves the module into the package."""

from __future__ import annotations

from ._engine import _SCHEMA as _SCHEMA
from ._engine import _SCHEMA_2 as _SCHEMA_2
from ._engine import COMMIT_TIME_DECAY as COMMIT_TIME_DECAY
from ._engine import INLINE_WRITES as INLINE_WRITES
from ._engine import MAX_JOBS_PER_TRANSACTION as MAX_JOBS_PER_TRANSACTION
from ._engine import SCHEMA_VERSION as SCHEMA_VERSION
from ._engine import WAL_CHECKPOINT_PAGES as WAL_CHECKPOINT_PAGES
from ._engine import SQLiteStore as SQLiteStore
from ._engine import open_sqlite_store as open_sqlite_store
from ._engine import sqlite_path_from_url as sqlite_path_from_url
from ._engine import sqlite_schema_status as sqlite_schema_status
