"""``MemoryStore``: the store contract in process memory (see ``_store``); this commit only
moves the module into the package."""

from __future__ import annotations

from ._store import MemoryCheckpointStore as MemoryCheckpointStore
from ._store import MemoryInboxStore as MemoryInboxStore
from ._store import MemoryLeaseStore as MemoryLeaseStore
from ._store import MemoryStore as MemoryStore
