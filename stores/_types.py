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
* ``adopt=True`` on :meth:`LeaseStore.try_acquire_lease` takes over an *unexpired*
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
* :class:`InboxStore` (``store.inbox``) is a durable inbox of items a transport handed over
  (a Telegram webhook update), deduplicated on ``(source, key)``, reserved by leased workers on
  every instance. Its rules are in :class:`InboxStore`'s docstring.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple, Protocol, TypeAlias

import attrs

from ._polling import PollStore

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


class InvalidInboxError(StoreError, ValueError):
    """An inbox call's input was invalid (an empty name, a bad number, a payload that is not
    JSON or too large); nothing was written."""


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


_ISO_MEMO: dict[int, str] = {}
_ISO_MEMO_MAX = 1024
"""The texts of the milliseconds met lately: every record carries its two times in this
form, and the records of one moment share them (emptied when full)."""


def ms_to_iso(ms: int) -> str:
    """ISO 8601 UTC with millisecond precision and a ``Z`` suffix (``…T14:13:20.123Z``)."""
    text = _ISO_MEMO.get(ms)
    if text is None:
        second, milli = divmod(ms, 1000)
        text = f"{_iso_second(second)}.{milli:03d}Z"
        if len(_ISO_MEMO) >= _ISO_MEMO_MAX:
            _ISO_MEMO.clear()
        _ISO_MEMO[ms] = text
    return text


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


class SaveCheckpoint(NamedTuple):
    """One save of :meth:`CheckpointStore.write_checkpoints`; the fields mean what the
    keyword arguments of :meth:`CheckpointStore.save_checkpoint` mean. A named tuple, not
    an attrs class: the journal makes several for every message, and a tuple is built in
    one step.

    ``value_json`` / ``metadata_json``: the value (and the metadata, a JSON object) already
    encoded as compact JSON, as :func:`stores.compact_json` makes it, by a caller that built
    them (the journal, an agent's transcript): stored as given, so they are encoded once;
    their size is still checked. Give ``value`` (``None`` is JSON ``null``) or
    ``value_json``, ``metadata`` or ``metadata_json``: not both."""

    namespace: str
    key: str
    scope: OwnershipScope
    version: int
    value: JSONValue = None
    expected_version: int | None = None
    fencing_token: int | None = None
    category: str | None = None
    metadata: Mapping[str, JSONValue] | None = None
    value_json: str | None = None
    metadata_json: str | None = None


class DeleteCheckpoint(NamedTuple):
    """One delete of :meth:`CheckpointStore.write_checkpoints`: a row stored under another
    exact scope is a miss, as for :meth:`CheckpointStore.delete_checkpoint`."""

    namespace: str
    key: str
    scope: OwnershipScope


WriteStatus: TypeAlias = Literal["ok", "conflict", "missing", "aborted"]


class WriteResult(NamedTuple):
    """What became of one write of a batch.

    ``ok``: saved or deleted. ``conflict``: a save lost its compare-and-swap (version,
    create-only, fence or scope). ``missing``: a delete found no row in that scope.
    ``aborted``: the write would have applied, but another write of the same ``atomic``
    batch did not, so none of them was written.

    A written save carries the save as stored (``saved``, its value and metadata encoded)
    and the row's times; :attr:`record` builds the stored row from them when asked (the
    journal reads only ``updated_at_ms``, and builds no record per write).
    """

    status: WriteStatus
    saved: SaveCheckpoint | None = None
    created_at_ms: int | None = None
    updated_at_ms: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def record(self) -> CheckpointRecord | None:
        """The stored row of a written save (built anew on each access), else ``None``."""
        if self.saved is None or self.created_at_ms is None or self.updated_at_ms is None:
            return None
        return stored_record(self.saved, self.created_at_ms, self.updated_at_ms)


def stored_record(save: SaveCheckpoint, created_at_ms: int, updated_at_ms: int) -> CheckpointRecord:
    """The row a checked save (its value and metadata encoded) stored at these times."""
    assert save.value_json is not None
    return CheckpointRecord(
        namespace=save.namespace,
        key=save.key,
        version=save.version,
        value=json.loads(save.value_json),
        scope=save.scope,
        created_at_ms=created_at_ms,
        updated_at_ms=updated_at_ms,
        fencing_token=save.fencing_token,
        category=save.category,
        metadata=None if save.metadata_json is None else json.loads(save.metadata_json),
    )


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


InboxState: TypeAlias = Literal["pending", "claimed", "done", "dead", "discarded"]
INBOX_STATES: tuple[InboxState, ...] = ("pending", "claimed", "done", "dead", "discarded")
MAX_INBOX_ERROR_CHARS = 200


@attrs.frozen
class InboxItem:
    """One row of the durable inbox (see :class:`InboxStore`)."""

    source: str
    """Who handed it in: a connection id."""
    key: str
    """Unique within ``source`` (Telegram: the ``update_id``): the dedup key."""
    partition: str
    """Items of one ``(source, partition)`` are handed out one at a time, in ``order``."""
    order: int
    state: InboxState
    attempts: int
    """Reservations so far (each counts one attempt)."""
    available_at_ms: int
    """A ``pending`` item is not reserved before this (retry backoff)."""
    created_at_ms: int
    updated_at_ms: int
    payload: JSONValue = None
    """What was handed in; ``None`` once ``done`` or ``discarded`` (the inbox keeps a payload
    only while it may still be needed) and in listings."""
    error: str | None = None
    """The code the last failed attempt gave (a short fixed text, never payload text)."""
    owner_id: str | None = None
    """The owner of the current or last reservation."""
    claim_expires_at_ms: int = 0
    """Until when that reservation holds the item (and, for a ``done`` item, its partition).
    (The state ``claimed`` and this field keep the names they have on disk and on the wire.)"""


@attrs.frozen
class InboxReservation:
    """An item handed to one worker: valid while its ``token`` is the item's."""

    item: InboxItem
    token: str
    expires_at_ms: int

    @property
    def source(self) -> str:
        return self.item.source

    @property
    def key(self) -> str:
        return self.item.key


@attrs.frozen
class InboxPage:
    items: tuple[InboxItem, ...]
    next_cursor: str | None = None


@attrs.frozen
class InboxDepth:
    """How many items wait, are in a worker's hands, or are dead letters."""

    pending: int = 0
    claimed: int = 0
    dead: int = 0


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
        self, writes: Sequence[SaveCheckpoint | DeleteCheckpoint], *, atomic: bool = False
    ) -> tuple[WriteResult, ...]:
        """Apply ``writes`` in order in one durable transaction; one result per write.

        Each write is checked as :meth:`save_checkpoint` / :meth:`delete_checkpoint` would
        check it, against the rows as the earlier writes of the batch left them, and each
        applied write appends its event. With ``atomic=True`` either every write applies or
        none does (the others are then ``aborted``). A save given as ``value_json`` (and
        ``metadata_json``) is stored as given and loads as any other (its value is the
        decode of ``value_json``).

        Raises :class:`InvalidCheckpointError` (or :class:`RecordTooLargeError`) for a
        malformed write before anything is written, and :class:`StoreUnavailableError`
        when the transaction fails (nothing of it was written).
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
        """Committed events with ``seq > after`` in order, filtered by partial scope.

        Under concurrent writers a reader that pages with ``after = last_seq`` never sees an
        event N+1 before a committed event N: sequence numbers are visible in order (a
        number given back by a transaction that did not commit may be skipped)."""
        ...

    async def last_event_seq(self) -> int:
        """The highest committed event sequence number (0 when there is none): where a
        reader that wants only what happens from now on starts."""
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
        adopt: bool = False,
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


class InboxStore(Protocol):
    """A durable inbox: what a transport handed over, committed before it is acknowledged,
    then processed by leased workers on any instance.

    * :meth:`put` is the acknowledgment point: once it returned, the item is durable. A
      second put of the same ``(source, key)`` changes nothing and answers ``False`` (a
      redelivery is acknowledged without a second row), whatever state the item is in.
    * :meth:`reserve` hands out items *ready* for the caller ``owner_id`` at the store clock's
      now, oldest first, each under a fresh token, ``attempts`` + 1, until ``now + ttl_ms``.
      An item is ready when (a) it is ``pending`` and due, or ``claimed`` and its reservation
      expired (its worker died); (b) no item of its ``(source, partition)`` with a smaller
      ``(order, key)`` is ``pending`` or ``claimed`` — so a partition is handed out in
      order, one item at a time; and (c) no *other* owner holds the partition: no item of it
      is ``claimed`` or ``done`` by another owner with an unexpired reservation (see
      :meth:`complete`'s ``keep_partition_ms``). Concurrent reservers never get the same item
      (PostgreSQL: ``FOR UPDATE SKIP LOCKED``; SQLite: ``BEGIN IMMEDIATE``; memory: one
      synchronous step). An item whose reservation expired with ``attempts >= max_attempts``
      becomes ``dead`` instead of being reserved again (it kept killing its worker).
    * Every later call on a reservation is fenced by its token: once another reservation took
      the item it answers ``None``/``False`` and changes nothing. A reservation that expired
      but was not taken over still works (nobody else acted on the item).
    * :meth:`complete` settles the item ``done`` (payload dropped) and may keep its
      partition for the same owner for ``keep_partition_ms`` (extended by :meth:`extend`, ended by
      :meth:`release`): while the owner still works on what the item started, the next
      items of the partition go to that owner only, so their order is kept across instances.
    * :meth:`retry` puts it back ``pending`` after ``delay_ms``, or ``dead`` once
      ``attempts >= max_attempts``: never retried forever, never dropped. A ``dead`` item is
      listed (:meth:`list_items`) until an operator settles it (:meth:`settle`): ``retry`` (pending,
      attempts 0) or ``discard`` (``discarded``, payload dropped). ``dead`` and
      ``discarded`` items do not hold up their partition.
    * :meth:`prune` deletes ``done`` and ``discarded`` items last updated before a time,
      bounded per call; nothing else is ever deleted.
    """

    async def put(
        self, *, source: str, key: str, partition: str, order: int, payload: JSONValue
    ) -> bool:
        """Commit a new ``pending`` item (due now); ``False`` when ``(source, key)`` exists.

        Raises :class:`InvalidInboxError` for bad input (an empty name, an order that is not
        a non-negative safe integer, a payload that is not JSON or too large) and
        :class:`StoreUnavailableError`."""
        ...

    async def reserve(
        self,
        *,
        owner_id: str,
        ttl_ms: int,
        limit: int = 1,
        max_attempts: int,
        sources: Sequence[str] | None = None,
    ) -> tuple[InboxReservation, ...]:
        """Up to ``limit`` (1..500) ready items of ``sources`` (``None``: any), reserved."""
        ...

    async def expire_own_reservations(
        self, *, owner_id: str, sources: Sequence[str] | None = None
    ) -> int:
        """Let the ``claimed`` items of ``owner_id`` (of ``sources``; ``None``: any) be reserved
        now, as if their reservations had expired; how many. For an owner starting again whose
        previous process is known to be gone (its state directory's lock), so that what it
        held is taken up at once instead of after the reservations' time. Each item's attempt
        still counts; the old reservations are fenced once the items are reserved again."""
        ...

    async def extend(
        self, reservation: InboxReservation, *, ttl_ms: int
    ) -> InboxReservation | None:
        """Move the reservation's expiry to ``now + ttl_ms`` (a ``claimed`` item still worked on, or
        a ``done`` item's kept partition); ``None`` when the reservation is no longer the item's."""
        ...

    async def complete(self, reservation: InboxReservation, *, keep_partition_ms: int = 0) -> bool:
        """``done``, payload dropped; the partition stays the owner's for ``keep_partition_ms``."""
        ...

    async def release(self, reservation: InboxReservation) -> bool:
        """Release a ``done`` item's kept partition now."""
        ...

    async def retry(
        self, reservation: InboxReservation, *, delay_ms: int, error: str, max_attempts: int
    ) -> InboxItem | None:
        """Back to ``pending``, due after ``delay_ms``, with ``error`` (a short code); ``dead``
        when ``attempts >= max_attempts``. The item as stored, or ``None`` (reservation lost)."""
        ...

    async def get(self, *, source: str, key: str) -> InboxItem | None: ...

    async def list_items(
        self,
        *,
        source: str | None = None,
        state: InboxState | None = None,
        cursor: str | None = None,
        limit: int = LIST_LIMIT_DEFAULT,
    ) -> InboxPage:
        """Items in ``(source, order, key)`` order, without payloads; keyset-paged."""
        ...

    async def settle(
        self, *, source: str, key: str, action: Literal["retry", "discard"]
    ) -> InboxItem | None:
        """An operator's decision on a ``dead`` item; ``None`` when it is not dead (or absent)."""
        ...

    async def prune(self, *, before_ms: int, limit: int = LIST_LIMIT_MAX) -> int:
        """Delete up to ``limit`` ``done``/``discarded`` items updated before ``before_ms``
        whose kept partition is released; how many were deleted."""
        ...

    async def depth(self, *, sources: Sequence[str] | None = None) -> InboxDepth: ...


class Store(Protocol):
    """What :func:`stores.open_store` returns."""

    @property
    def url(self) -> str: ...

    @property
    def checkpoints(self) -> CheckpointStore: ...

    @property
    def leases(self) -> LeaseStore: ...

    @property
    def inbox(self) -> InboxStore: ...

    @property
    def polls(self) -> PollStore | None:
        """Due polls shared by instances (PostgreSQL); ``None`` where one instance polls."""
        ...

    async def aclose(self) -> None: ...
