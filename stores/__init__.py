"""Durable state for prismd: the CheckpointStore/LeaseStore contracts and their backends.

``async with open_store(url) as store:`` understands ``memory://``, ``sqlite:///path`` and
``postgresql://…`` (also ``postgres://``); every store has three facets: ``checkpoints``,
``leases`` and the durable ``inbox``. ``migrate_store(url)`` applies or reports a
durable store's schema. ``update_checkpoint`` is the one read-modify-write of a record by
compare-and-swap (read, decide, conditional write, retried a bounded number of times). The
PostgreSQL URL parser and pool settings are here too: they import
no driver (``check-config`` uses them), while :mod:`stores.postgres` (the store) does.
"""

from __future__ import annotations

from ._contracts import (
    CheckpointStore as CheckpointStore,
)
from ._contracts import (
    InboxStore as InboxStore,
)
from ._contracts import (
    LeaseStore as LeaseStore,
)
from ._contracts import (
    Store as Store,
)
from ._open import migrate_store as migrate_store
from ._open import open_store as open_store
from ._polling import PollLease as PollLease
from ._polling import PollStore as PollStore
from ._polling import PollWait as PollWait
from ._types import (
    ANY_SCOPE as ANY_SCOPE,
)
from ._types import (
    DEFAULT_MAX_VALUE_BYTES as DEFAULT_MAX_VALUE_BYTES,
)
from ._types import (
    INBOX_STATES as INBOX_STATES,
)
from ._types import (
    SYSTEM_CLOCK as SYSTEM_CLOCK,
)
from ._types import (
    CheckpointConflictError as CheckpointConflictError,
)
from ._types import (
    CheckpointPage as CheckpointPage,
)
from ._types import (
    CheckpointRecord as CheckpointRecord,
)
from ._types import (
    Clock as Clock,
)
from ._types import (
    DeleteCheckpoint as DeleteCheckpoint,
)
from ._types import (
    EventPage as EventPage,
)
from ._types import (
    InboxDepth as InboxDepth,
)
from ._types import (
    InboxItem as InboxItem,
)
from ._types import (
    InboxPage as InboxPage,
)
from ._types import (
    InboxReservation as InboxReservation,
)
from ._types import (
    InboxState as InboxState,
)
from ._types import (
    InvalidCheckpointError as InvalidCheckpointError,
)
from ._types import (
    InvalidInboxError as InvalidInboxError,
)
from ._types import (
    InvalidLeaseError as InvalidLeaseError,
)
from ._types import (
    InvalidStoreURLError as InvalidStoreURLError,
)
from ._types import (
    JournalEvent as JournalEvent,
)
from ._types import (
    JSONValue as JSONValue,
)
from ._types import (
    LeaseConflictError as LeaseConflictError,
)
from ._types import (
    LeaseRecord as LeaseRecord,
)
from ._types import (
    OwnershipScope as OwnershipScope,
)
from ._types import (
    RecordTooLargeError as RecordTooLargeError,
)
from ._types import (
    SaveCheckpoint as SaveCheckpoint,
)
from ._types import (
    SchemaStatus as SchemaStatus,
)
from ._types import (
    StoreError as StoreError,
)
from ._types import (
    StoreUnavailableError as StoreUnavailableError,
)
from ._types import (
    StoreUnreachableError as StoreUnreachableError,
)
from ._types import (
    SystemClock as SystemClock,
)
from ._types import (
    WriteResult as WriteResult,
)
from ._types import (
    WriteStatus as WriteStatus,
)
from ._types import compact_json as compact_json
from ._types import (
    ms_to_iso as ms_to_iso,
)
from ._update import LOST as LOST
from ._update import Keep as Keep
from ._update import Lost as Lost
from ._update import Replace as Replace
from ._update import retry_compare_and_swap as retry_compare_and_swap
from ._update import update_checkpoint as update_checkpoint
from .postgres._url import DEFAULT_CONNECT_TIMEOUT_MS as DEFAULT_CONNECT_TIMEOUT_MS
from .postgres._url import DEFAULT_STATEMENT_TIMEOUT_MS as DEFAULT_STATEMENT_TIMEOUT_MS
from .postgres._url import MAX_POOL_SIZE as MAX_POOL_SIZE
from .postgres._url import PostgresOptions as PostgresOptions
from .postgres._url import PostgresURL as PostgresURL
from .postgres._url import default_pool_size as default_pool_size
from .postgres._url import is_postgres_url as is_postgres_url
from .postgres._url import parse_postgres_url as parse_postgres_url
