"""The generic durable-state contracts every backend implements (contract §1).

Everything durable in prismd goes through two contracts: a versioned key/value
:class:`CheckpointStore` with compare-and-swap and fencing, and a :class:`LeaseStore`
with fencing tokens. The channel journal adds no schema of its own; it picks
namespaces, keys, categories and JSON values.

Rules every backend follows (the conformance suite in ``tests/stores`` checks them):

* A checkpoint row is identified by ``(namespace, key)``; its ownership scope is stored
  with it. A load or delete under another exact scope is a miss; a save under another
  scope is an ordinary :class:`CheckpointConflictError`.
* ``expected_version=0`` means create-only; otherwise it must equal the stored version.
  A new ``version`` must be strictly greater than the stored one.
* A row stored with a fencing token refuses a write with a lower or a missing token.
* Lease fencing tokens start at 1 and grow by one on every acquisition of the row (after
  expiry or release too); renewal keeps token and fencing token.
* ``reclaim=True`` on :meth:`LeaseStore.try_acquire_lease` takes over an *unexpired*
  lease whose holder has the same ``owner_id`` (a restarted process taking over its own
  predecessor's lease). It still issues a new token and bumps the fencing token. Owner
  ids must therefore be unique per live process (the daemon guarantees it with a
  ``flock``-ed instance id).
* Every save and delete appends a :class:`JournalEvent` in the same transaction; events
  are read back in commit order by :meth:`CheckpointStore.list_events`.
* :meth:`CheckpointStore.write_checkpoints` commits several saves and deletes in one durable
  transaction. Each keeps its own compare-and-swap, fence and scope check, and a lost check
  is a :class:`WriteResult` for that write, not an exception; ``atomic=True`` makes the
  writes all-or-nothing. A backend may commit the writes of several concurrent callers in
  one transaction (group commit); nobody is answered before that transaction is durable,
  and a failed commit fails every write in it.
"""

from __future__ import annotations

import datetime as _dt
import functools
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, TypeAlias

import attrs

JSONValue: TypeAlias = Any
"""A value that survives ``json.dumps``/``json.loads`` unchanged."""

MAX_SAFE_INTEGER = 2**53 - 1
DEFAULT_MAX_VALUE_BYTES = 1024 * 1024
LIST_LIMIT_DEFAULT = 100
LIST_LIMIT_MAX = 500


# --------------------------------------------------------------------------- errors


class StoreError(Exception):
    """Base class of every error a store raises on purpose."""


class CheckpointConflictError(StoreError):
    """A save lost its compare-and-swap: version, create-only, fence or scope mismatch.

    The message never says which of these it was (no ownership-shaped oracle).
    """

    code = "ERR_PRISM_CHECKPOINT_CONFLICT"


class InvalidCheckpointError(CheckpointConflictError, ValueError):
    """The save itself is malformed: empty namespace/key, bad version, non-JSON value.

    Still a :class:`CheckpointConflictError` (the contract treats bad input as a
    conflict) but also a :class:`ValueError` so callers can tell it apart.
    """


class RecordTooLargeError(InvalidCheckpointError):
    """The JSON encoding of the value is larger than the store accepts."""


class LeaseConflictError(StoreError):
    """A lease call touched a row owned by another scope, or its input was invalid."""

    code = "ERR_PRISM_LEASE_CONFLICT"


class InvalidLeaseError(LeaseConflictError, ValueError):
    """Empty namespace/key/owner/token or a non-positive TTL."""


class StoreUnavailableError(StoreError):
    """The backend cannot be reached or its data cannot be trusted (I/O, corruption)."""


class StoreUnreachableError(StoreUnavailableError):
    """A network backend's server could not be reached (refused, timed out, starting up,
    no free connection slot): trying again later may succeed, unlike a refused login, a
    missing database or a schema newer than this build."""


class InvalidStoreURLError(StoreError, ValueError):
    """``open_store`` was given a URL it does not understand."""


# --------------------------------------------------------------------------- clock


class Clock(Protocol):
    """Wall-clock time in integer milliseconds since the Unix epoch."""

    def now_ms(self) -> int: ...


@attrs.frozen
class SystemClock:
    """The real wall clock."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000


SYSTEM_CLOCK: Clock = SystemClock()


def ms_to_datetime(ms: int) -> _dt.datetime:
    return _dt.datetime.fromtimestamp(ms / 1000, tz=_dt.UTC)


@functools.lru_cache(maxsize=256)
def _iso_second(second: int) -> str:
    return ms_to_datetime(second * 1000).isoformat(timespec="seconds").replace("+00:00", "")


def ms_to_iso(ms: int) -> str:
    """ISO 8601 UTC with millisecond precision and a ``Z`` suffix (``…T14:13:20.123Z``)."""
    second, milli = divmod(ms, 1000)
    # Every record carries its times in this form: the second's text is reused.
    return f"{_iso_second(second)}.{milli:03d}Z"


# --------------------------------------------------------------------------- records


@attrs.frozen
class OwnershipScope:
    """Who owns a record: tenant, account and user, each optional.

    ``None`` is distinct from every string, including ``""``. In list and event
    filters a ``None`` field matches any value; in load, save, delete and every lease
    call the whole scope must match exactly.
    """

    tenant_id: str | None = None
    account_id: str | None = None
    user_id: str | None = None

    def matches_filter(self, stored: OwnershipScope) -> bool:
        """True when every field set on ``self`` equals the same field of ``stored``."""
        return (
            (self.tenant_id is None or self.tenant_id == stored.tenant_id)
            and (self.account_id is None or self.account_id == stored.account_id)
            and (self.user_id is None or self.user_id == stored.user_id)
        )


ANY_SCOPE = OwnershipScope()


@attrs.frozen
class CheckpointRecord:
    namespace: str
    key: str
    version: int
    value: JSONValue
    scope: OwnershipScope
    created_at_ms: int
    updated_at_ms: int
    fencing_token: int | None = None
    category: str | None = None
    metadata: Mapping[str, JSONValue] | None = None

    @property
    def created_at(self) -> _dt.datetime:
        return ms_to_datetime(self.created_at_ms)

    @property
    def updated_at(self) -> _dt.datetime:
        return ms_to_datetime(self.updated_at_ms)


@attrs.frozen
class CheckpointPage:
    items: tuple[CheckpointRecord, ...]
    next_cursor: str | None = None


@attrs.frozen
class LeaseRecord:
    namespace: str
    key: str
    scope: OwnershipScope
    owner_id: str
    token: str
    fencing_token: int
    acquired_at_ms: int
    expires_at_ms: int
    updated_at_ms: int


EventAction: TypeAlias = Literal["save", "delete"]


@attrs.frozen
class JournalEvent:
    """One committed mutation of the checkpoint table, in commit order.

    Carries no value: only where, which version, and the caller's ``metadata`` (which
    the journal keeps free of message text and tokens).
    """

    seq: int
    at_ms: int
    action: EventAction
    namespace: str
    key: str
    scope: OwnershipScope
    version: int | None
    category: str | None = None
    metadata: Mapping[str, JSONValue] | None = None


@attrs.frozen
class SaveCheckpoint:
    """One save in :meth:`CheckpointStore.write_checkpoints`; the fields mean what the
    keyword arguments of :meth:`CheckpointStore.save_checkpoint` mean."""

    namespace: str
    key: str
    scope: OwnershipScope
    version: int
    value: JSONValue
    expected_version: int | None = None
    fencing_token: int | None = None
    category: str | None = None
    metadata: Mapping[str, JSONValue] | None = None
    value_json: str | None = None
    """``value`` already encoded as compact JSON by a caller that built it (the journal):
    stored as given, so the value is encoded once; its size is still checked."""


@attrs.frozen
class DeleteCheckpoint:
    """One delete in :meth:`CheckpointStore.write_checkpoints`: a row stored under another
    exact scope is a miss, as for :meth:`CheckpointStore.delete_checkpoint`."""

    namespace: str
    key: str
    scope: OwnershipScope


CheckpointWrite: TypeAlias = SaveCheckpoint | DeleteCheckpoint

WriteStatus: TypeAlias = Literal["ok", "conflict", "missing", "aborted"]


@attrs.frozen
class WriteResult:
    """What became of one write of a batch.

    ``ok``: saved (``record`` is the stored row) or deleted. ``conflict``: a save lost its
    compare-and-swap (version, create-only, fence or scope). ``missing``: a delete found no
    row in that scope. ``aborted``: the write would have applied, but another write of the
    same ``atomic`` batch did not, so none of them was written.
    """

    status: WriteStatus
    record: CheckpointRecord | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@attrs.frozen
class SchemaStatus:
    """Where a durable store's schema stands against this build (``prismd migrate``)."""

    schema: str
    """Which schema: a PostgreSQL schema name, or the SQLite file."""
    current: int
    """The highest version applied (0: none yet)."""
    latest: int
    """The highest version this build knows."""
    applied: tuple[int, ...] = ()
    """The versions this call applied."""

    @property
    def pending(self) -> tuple[int, ...]:
        return tuple(range(self.current + 1, self.latest + 1))

    @property
    def up_to_date(self) -> bool:
        return self.current == self.latest


@attrs.frozen
class EventPage:
    items: tuple[JournalEvent, ...]
    last_seq: int
    """The highest sequence number read, or ``after`` when nothing was read."""


# --------------------------------------------------------------------------- contracts


class CheckpointStore(Protocol):
    async def save_checkpoint(
        self,
        *,
        namespace: str,
        key: str,
        scope: OwnershipScope,
        version: int,
        value: JSONValue,
        expected_version: int | None = None,
        fencing_token: int | None = None,
        category: str | None = None,
        metadata: Mapping[str, JSONValue] | None = None,
    ) -> CheckpointRecord:
        """Store ``value`` under the rules in the module docstring.

        Raises :class:`CheckpointConflictError` (or its subclasses for bad input) and
        :class:`StoreUnavailableError`. Nothing is written when it raises.
        """
        ...

    async def write_checkpoints(
        self, writes: Sequence[CheckpointWrite], *, atomic: bool = False
    ) -> tuple[WriteResult, ...]:
        """Apply ``writes`` in order in one durable transaction; one result per write.

        Each write is checked as :meth:`save_checkpoint` / :meth:`delete_checkpoint` would
        check it, against the rows as the earlier writes of the batch left them, and each
        applied write appends its event. With ``atomic=True`` either every write applies or
        none does (the others are then ``aborted``).

        Raises :class:`InvalidCheckpointError` for a malformed write before anything is
        written, and :class:`StoreUnavailableError` when the transaction fails (nothing of
        it was written).
        """
        ...

    async def load_checkpoint(
        self, *, namespace: str, key: str, scope: OwnershipScope
    ) -> CheckpointRecord | None: ...

    async def list_checkpoints(
        self,
        *,
        namespace: str | None = None,
        key_prefix: str | None = None,
        category: str | Sequence[str] | None = None,
        scope: OwnershipScope = ANY_SCOPE,
        cursor: str | None = None,
        limit: int = LIST_LIMIT_DEFAULT,
    ) -> CheckpointPage:
        """Newest ``updated_at`` first, then key ascending; ``limit`` clamped to 1..500.

        ``scope`` is a partial filter. ``cursor`` is the opaque ``next_cursor`` of the
        previous page; paging under concurrent writes never returns a row twice and
        never skips a row that existed, unchanged, for the whole walk.
        """
        ...

    async def delete_checkpoint(self, *, namespace: str, key: str, scope: OwnershipScope) -> bool:
        """True when a row was removed; a foreign scope is a miss (False)."""
        ...

    async def list_events(
        self, *, after: int = 0, limit: int = LIST_LIMIT_DEFAULT, scope: OwnershipScope = ANY_SCOPE
    ) -> EventPage:
        """Committed events with ``seq > after`` in order, filtered by partial scope."""
        ...


class LeaseStore(Protocol):
    async def try_acquire_lease(
        self,
        *,
        namespace: str,
        key: str,
        scope: OwnershipScope,
        owner_id: str,
        ttl_ms: int,
        reclaim: bool = False,
    ) -> LeaseRecord | None:
        """A fresh lease, or ``None`` while another unexpired holder has it."""
        ...

    async def renew_lease(
        self,
        *,
        namespace: str,
        key: str,
        scope: OwnershipScope,
        owner_id: str,
        token: str,
        ttl_ms: int,
    ) -> LeaseRecord | None:
        """Extend an unexpired lease held by (owner_id, token); ``None`` otherwise."""
        ...

    async def release_lease(
        self, *, namespace: str, key: str, scope: OwnershipScope, owner_id: str, token: str
    ) -> bool: ...

    async def get_lease(
        self, *, namespace: str, key: str, scope: OwnershipScope
    ) -> LeaseRecord | None:
        """The unexpired lease on the row, or ``None``."""
        ...


class Store(Protocol):
    """What :func:`stores.open_store` returns."""

    @property
    def url(self) -> str: ...

    @property
    def checkpoints(self) -> CheckpointStore: ...

    @property
    def leases(self) -> LeaseStore: ...

    async def aclose(self) -> None: ...
