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

from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

from ._polling import PollStore
from ._types import (
    ANY_SCOPE,
    LIST_LIMIT_DEFAULT,
    LIST_LIMIT_MAX,
    CheckpointPage,
    CheckpointRecord,
    DeleteCheckpoint,
    EventPage,
    InboxDepth,
    InboxItem,
    InboxPage,
    InboxReservation,
    InboxState,
    JSONValue,
    LeaseRecord,
    OwnershipScope,
    SaveCheckpoint,
    WriteResult,
)


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
        self,
        writes: Sequence[SaveCheckpoint | DeleteCheckpoint],
        *,
        atomic: bool = False,
        linger_s: float = 0.0,
    ) -> tuple[WriteResult, ...]:
        """Apply ``writes`` in order in one durable transaction; one result per write.

        ``linger_s`` lets a store that group-commits wait up to that long for other writes
        to share the transaction with, when none is in flight (the answer still comes
        once the writes are durable); a store may ignore it.

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

    async def count_checkpoints(
        self, *, namespace: str, category: str, scope: OwnershipScope, limit: int
    ) -> int:
        """How many rows of ``namespace`` and ``category`` within the partial ``scope``
        :meth:`list_checkpoints` would walk, counted up to ``limit`` (a positive integer,
        not clamped): ``min(rows, limit)``, without reading a row's value — "are there
        ``limit`` already?" costs at most ``limit`` index entries."""
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
