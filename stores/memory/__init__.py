"""``MemoryStore``: the store contract in process memory, for unit tests.

It follows every rule of :mod:`stores._contracts` exactly like the durable backends (the
conformance suite runs against all of them), but nothing survives the process. Values are
deep-copied through JSON on save and on load, so a caller mutating a value it saved or loaded
never changes what is stored.

Every method runs synchronously between two Trio checkpoints, so each call is atomic with
respect to other tasks: that is the memory store's "transaction".

The package: ``_state`` (the rows and the shared state), ``_checkpoints``, ``_leases``,
``_inbox`` (the three facets) and ``_store`` (the store that holds them).
"""

from __future__ import annotations

from ._checkpoints import MemoryCheckpointStore as MemoryCheckpointStore
from ._inbox import MemoryInboxStore as MemoryInboxStore
from ._leases import MemoryLeaseStore as MemoryLeaseStore
from ._store import MemoryStore as MemoryStore
