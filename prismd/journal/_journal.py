"""The channel journal: namespaces, keys and records of contract §5 over a CheckpointStore.

This module is the only place that knows how channel state is laid out in the store. It
adds no schema: every record is a JSON value under a versioned namespace, a category, and
a key that embeds the connection and the ownership scope, and every write passes that same
scope to the store, so the store itself refuses a cross-scope write.

Guarantees:

* ``create_*``/``stage`` are create-only (``expected_version=0``, version 1, never fenced)
  and return ``None`` when the record already exists.
* ``save_*``/``mark`` are CAS writes at ``expected_version`` (``version = expected + 1``)
  carrying the lease fencing token when one is held; a lost CAS (version, fence or scope)
  returns ``None``. Every other store error propagates unchanged.
* A value whose JSON encoding exceeds ``max(1024, max_journal_record_bytes)`` bytes is
  refused with :class:`JournalRecordTooLargeError` *before* anything is written.
* Saves carry ``metadata={"kind": …, "state": …}`` only (no text, no ids beyond the key),
  so the store's journal event stream shows state transitions without payload.
* An operation record carries its turn's :class:`OperationInput` (inbound text, attachment
  refs, a few claims) only while it is ``accepted``: :meth:`ChannelJournal.save` strips
  ``input`` from every operation record it writes in any other state (the claim, cancel,
  fail, abandon), so inbound text rests in the journal only until the message's first run
  (SPEC difference 8: an acknowledged message survives a kill and runs after a restart).
"""

from __future__ import annotations

import builtins
import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import attrs
import trio

from stores import (
    ANY_SCOPE,
    CheckpointRecord,
    CheckpointStore,
    OwnershipScope,
    SaveCheckpoint,
    StoreUnavailableError,
    WriteStatus,
    compact_json,
)

from ..channel import utf8_len
from ._records import (
    BindingRecord,
    CursorRecord,
    JournalRecordTooLargeError,
    OperationRecord,
    ReplyRecord,
)

NS_BINDING = "prism.channels.v1.binding"
NS_OPERATION = "prism.channels.v1.operation"
NS_CURSOR = "prism.channels.v1.cursor"
NS_REPLY = "prism.channels.v1.reply"
NS_CONTROL = "prism.channels.v1.control"

CATEGORY = {
    NS_BINDING: "channel-binding",
    NS_OPERATION: "channel-operation",
    NS_CURSOR: "channel-cursor",
    NS_REPLY: "channel-reply",
    NS_CONTROL: "channel-control",
}

OPEN_CATEGORY = {
    NS_OPERATION: "channel-operation-open",
    NS_REPLY: "channel-reply-open",
}
"""The category of operations and replies an operator may have to settle. The store keeps
its category index in the same transaction as the record, so listing what is unresolved
reads the unresolved set only, however long the journal is."""

UNRESOLVED_OPERATION_STATES = frozenset({"accepted", "executing"})
FOLLOWING_STATE = "following"
"""An operation whose remote task is known and followed: open (restart recovery finds it,
prune keeps it), but not unresolved — nothing in it needs an operator's decision."""
UNSETTLED_REPLY_STATES = frozenset({"pending", "delivery_unknown"})
UNRESOLVED_REPLY_STATES = frozenset({"pending", "delivery_unknown", "delivery_failed"})
ANSWERED_STATES = frozenset({"succeeded", "failed"})


def maybe_answerless(record: OperationRecord) -> bool:
    """An agent run reached a terminal state that always answers, yet no reply is flagged
    staged (a journal written before the settlement and the reply committed together, killed
    between the two): the operator must see it.

    ``cancelled`` is excluded: stop() settles queued and stuck work without an answer by design.
    """
    return (
        record.kind == "message"
        and record.state in ANSWERED_STATES
        and record.run_id is not None
        and not record.reply_staged
    )


def category_of(namespace: str, record: object) -> str:
    """The category a record is stored under: open while an operator may have to act."""
    if isinstance(record, OperationRecord) and (
        record.state in UNRESOLVED_OPERATION_STATES
        or record.state == FOLLOWING_STATE
        or maybe_answerless(record)
    ):
        return OPEN_CATEGORY[NS_OPERATION]
    if isinstance(record, ReplyRecord) and record.state in UNRESOLVED_REPLY_STATES:
        return OPEN_CATEGORY[NS_REPLY]
    return CATEGORY[namespace]


def categories(namespace: str, *, open_only: bool = False) -> tuple[str, ...]:
    """Every category ``namespace`` stores (or only the open one, when it has one)."""
    opened = OPEN_CATEGORY.get(namespace)
    if open_only and opened is not None:
        return (opened,)
    return (CATEGORY[namespace],) if opened is None else (CATEGORY[namespace], opened)


# --------------------------------------------------------------------------- keys


def _any_scope(_scope: OwnershipScope) -> bool:
    return True


def _scope_parts(scope: OwnershipScope) -> str:
    # Written out (every key of every write is built with it): no generator to join.
    tenant, account, user = scope.tenant_id, scope.account_id, scope.user_id
    return (
        f"{'-' if tenant is None else tenant}:{'-' if account is None else account}:"
        f"{'-' if user is None else user}"
    )


def _part(value: str | None) -> str:
    return value if value else "-"


def binding_key(
    connection_id: str,
    scope: OwnershipScope,
    external_conversation_id: str,
    thread_id: str | None,
    actor_id: str,
    alias: str,
) -> str:
    """``b1:<conn>:<T>:<A>:<U>:<conv>:<thread>:<actor>:<alias>`` (§5)."""
    return (
        f"b1:{_part(connection_id)}:{_scope_parts(scope)}:{_part(external_conversation_id)}:"
        f"{_part(thread_id)}:{_part(actor_id)}:{_part(alias)}"
    )


def binding_actor_prefix(
    connection_id: str,
    scope: OwnershipScope,
    external_conversation_id: str,
    thread_id: str | None,
    actor_id: str | None = None,
) -> str:
    """Key prefix of every binding of one conversation/thread (and actor, when given).

    Keys are not escaped, so a prefix match is only a candidate set: callers compare the
    record's own fields.
    """
    prefix = f"b1:{_part(connection_id)}:{_scope_parts(scope)}:{_part(external_conversation_id)}:"
    prefix += f"{_part(thread_id)}:"
    if actor_id is not None:
        prefix += f"{_part(actor_id)}:"
    return prefix


def operation_key(connection_id: str, scope: OwnershipScope, operation_id: str) -> str:
    return f"o1:{_part(connection_id)}:{_scope_parts(scope)}:{_part(operation_id)}"


def cursor_key(connection_id: str, scope: OwnershipScope) -> str:
    return f"c1:{_part(connection_id)}:{_scope_parts(scope)}"


def reply_key(connection_id: str, scope: OwnershipScope, operation_id: str) -> str:
    return f"r1:{connection_id or '-'}:{_scope_parts(scope)}:{operation_id}"


# --------------------------------------------------------------------------- identifiers
# The contract's identifier derivations (§4), exactly as the reference computes them:
# ``J(parts)`` joins the parts with NUL (an absent part is the empty string) and hashes the
# UTF-8 bytes with SHA-256, rendered as lowercase hex.


def _joined(parts: tuple[str | None, ...]) -> str:
    return "\u0000".join("" if p is None else p for p in parts)


def _sha(parts: tuple[str | None, ...]) -> str:
    return hashlib.sha256(_joined(parts).encode("utf-8", "surrogatepass")).hexdigest()


def operation_id_for(connection_id: str, event_id: str) -> str:
    """``chan-op-`` + 32 hex of SHA-256(J([conn, eventId])) (§4)."""
    return "chan-op-" + _sha((connection_id, event_id))[:32]


def notify_operation_id(
    connection_id: str, scope: OwnershipScope, actor_id: str, alias: str, notify_id: str
) -> str:
    parts = (
        "notify",
        connection_id,
        scope.tenant_id,
        scope.account_id,
        scope.user_id,
        actor_id,
        alias,
        notify_id,
    )
    return "chan-op-" + _sha(parts)[:32]


def default_session_id(
    connection_id: str,
    external_conversation_id: str,
    thread_id: str | None,
    actor_id: str,
    scope: OwnershipScope,
    alias: str,
    generation: int,
) -> str:
    """``chan-`` + 40 hex of SHA-256(J([conn, conv, thread, actor, T, A, U, alias, gen]))."""
    parts = (
        connection_id,
        external_conversation_id,
        thread_id,
        actor_id,
        scope.tenant_id,
        scope.account_id,
        scope.user_id,
        alias,
        str(generation),
    )
    return "chan-" + _sha(parts)[:40]


R = TypeVar("R")


class Loaded(NamedTuple, Generic[R]):
    """A record as stored: its version (for CAS), the parsed record, the stored fence and
    the stored ownership scope (which a partial-scope operator uses to settle it). A named
    tuple, as :class:`Write` and :class:`Committed` are: every write of a message makes
    one of each (built in one step; an attrs class sets its fields one by one)."""

    version: int
    record: R
    fencing_token: int | None = None
    scope: OwnershipScope = ANY_SCOPE
    updated_at_ms: int = 0


_DECODERS: dict[str, Callable[[object], Any]] = {
    NS_BINDING: BindingRecord.from_json,
    NS_OPERATION: OperationRecord.from_json,
    NS_CURSOR: CursorRecord.from_json,
    NS_REPLY: ReplyRecord.from_json,
}


def _meta(record: object) -> tuple[str, str]:
    if isinstance(record, OperationRecord | ReplyRecord):
        return record.kind, record.state
    if isinstance(record, BindingRecord):
        return "binding", "suspended" if record.suspended else "ready"
    return "cursor", "advanced"


_META_JSON: dict[tuple[str, str], str] = {}
"""The encoded metadata of each ``(kind, state)`` pair met: a small closed set (the
record kinds times their states), so each is encoded once."""


def _meta_json(record: object) -> str:
    """A save's metadata (``{"kind": …, "state": …}``, never text or ids), encoded."""
    meta = _meta(record)
    encoded = _META_JSON.get(meta)
    if encoded is None:
        encoded = _META_JSON[meta] = compact_json({"kind": meta[0], "state": meta[1]})
    return encoded


def _key_of(namespace: str, scope: OwnershipScope, record: Any) -> str:
    """The key a record is stored under (§5): derived from the record's own ids."""
    if isinstance(record, OperationRecord):
        return operation_key(record.connection_id, scope, record.operation_id)
    if isinstance(record, ReplyRecord):
        return reply_key(record.connection_id, scope, record.operation_id)
    raise TypeError(f"the key of a {type(record).__name__} is given by its caller")


class Write(NamedTuple):
    """One record of a :meth:`ChannelJournal.commit`: saved by compare-and-swap at
    ``expected_version`` (0 = create-only), fenced by ``fence`` when given."""

    namespace: str
    scope: OwnershipScope
    record: Any
    expected_version: int
    fence: int | None = None
    key: str | None = None
    """Bindings and cursors name their key; operations and replies derive it."""

    def address(self) -> str:
        if self.key is not None:
            return self.key
        return _key_of(self.namespace, self.scope, self.record)


_OK: WriteStatus = "ok"


class Committed(NamedTuple):
    """What :meth:`ChannelJournal.commit` wrote: per write, the stored record or ``None``,
    and the store's status (``ok``, ``conflict`` — a lost CAS —, or ``aborted``: an atomic
    commit in which another write lost)."""

    items: tuple[Loaded[Any] | None, ...]
    statuses: tuple[WriteStatus, ...]

    @property
    def ok(self) -> bool:
        return all(status == "ok" for status in self.statuses)

    def lost(self, index: int) -> bool:
        """The write at ``index`` lost its own compare-and-swap (not merely aborted)."""
        return self.statuses[index] == "conflict"


STORE_LOG_INTERVAL_S = 30.0
"""While the store keeps failing, one warning per this interval (not one per call)."""

log = logging.getLogger("prismd.journal")


@attrs.define(eq=False)
class StoreHealth:
    """Whether the journal's store answers: ``failing`` from the first store error until the
    next call that succeeds. Logged when it starts failing (then at most once per
    :data:`STORE_LOG_INTERVAL_S`) and when it recovers; the message names the error's class
    only (store messages may quote paths or URLs)."""

    failing_since: float | None = None
    failures: int = 0
    _logged_at: float = 0.0

    @property
    def state(self) -> str:
        return "ok" if self.failing_since is None else "failing"

    def failed(self, exc: BaseException) -> None:
        now = trio.current_time()
        self.failures += 1
        if self.failing_since is None:
            self.failing_since = now
        elif now - self._logged_at < STORE_LOG_INTERVAL_S:
            return
        self._logged_at = now
        log.warning(
            "the store is failing (%s, %d failure(s) so far); acknowledged messages stay"
            " journaled and are retried",
            type(exc).__name__,
            self.failures,
        )

    def answered(self) -> None:
        if self.failing_since is not None:
            log.warning(
                "the store answers again after %.1f s", trio.current_time() - self.failing_since
            )
            self.failing_since = None
            self.failures = 0


@attrs.define(eq=False)
class ChannelJournal:
    """Typed access to the channel namespaces of one CheckpointStore (§5.9).

    Every write goes through :meth:`commit`: one store transaction for one or several
    records, each with its own compare-and-swap and fence (the write protocol of
    :mod:`prismd.journal._protocol` builds on it).
    """

    checkpoints: CheckpointStore
    max_record_bytes: int = 128 * 1024
    health: StoreHealth = attrs.field(factory=StoreHealth)

    def _encoded(self, record: Any) -> str:
        """``record``'s compact JSON, which the store keeps as given (encoded once), when
        it fits ``max_journal_record_bytes``; raises before anything is written. Operations
        and replies write their own text (``to_json_text``: the same JSON, built without a
        dict); the other records go through their ``to_json``."""
        limit = max(1024, self.max_record_bytes)
        text = (
            record.to_json_text()
            if type(record) is OperationRecord or type(record) is ReplyRecord
            else compact_json(record.to_json())
        )
        if len(text) > limit // 4 and utf8_len(text) > limit:
            raise JournalRecordTooLargeError(
                f"journal record exceeds max_journal_record_bytes ({limit} bytes)"
            )
        return text

    @staticmethod
    def _loaded(stored: CheckpointRecord, record: Any) -> Loaded[Any]:
        return Loaded(
            version=stored.version,
            record=record,
            fencing_token=stored.fencing_token,
            scope=stored.scope,
            updated_at_ms=stored.updated_at_ms,
        )

    async def load(self, namespace: str, scope: OwnershipScope, key: str) -> Loaded[Any] | None:
        """The parsed record, ``None`` when missing (or another scope's);
        :class:`CorruptRecordError` when it does not parse."""
        try:
            stored = await self.checkpoints.load_checkpoint(
                namespace=namespace, key=key, scope=scope
            )
        except StoreUnavailableError as exc:
            self.health.failed(exc)
            raise
        self.health.answered()
        return None if stored is None else self._loaded(stored, _DECODERS[namespace](stored.value))

    @staticmethod
    def _stored_form(record: Any) -> Any:
        # An operation record carries its inbound text only while ``accepted``
        # (docs/architecture.md, "Guarantees"): every other state is written without it.
        if (
            isinstance(record, OperationRecord)
            and record.input is not None
            and record.state != "accepted"
        ):
            return record.replace(input=None)
        return record

    async def commit(
        self, writes: Sequence[Write], *, atomic: bool = False, linger_s: float = 0.0
    ) -> Committed:
        """Write every record in one store transaction; a lost CAS is a ``None`` item.

        With ``atomic`` either all are written or none. ``linger_s``: the store may hold
        the writes that long for company (:meth:`~stores.CheckpointStore.write_checkpoints`). Raises
        :class:`JournalRecordTooLargeError` before anything is written when a record does
        not fit, and the store's errors (``StoreUnavailableError``) unchanged.
        """
        records = [self._stored_form(w.record) for w in writes]
        saves = [
            SaveCheckpoint(
                w.namespace,
                w.address(),
                w.scope,
                w.expected_version + 1,
                expected_version=w.expected_version,
                fencing_token=w.fence,
                category=category_of(w.namespace, record),
                value_json=self._encoded(record),
                metadata_json=_meta_json(record),
            )
            for w, record in zip(writes, records, strict=True)
        ]
        try:
            results = await self.checkpoints.write_checkpoints(
                saves, atomic=atomic, linger_s=linger_s
            )
        except StoreUnavailableError as exc:
            self.health.failed(exc)
            raise
        self.health.answered()
        items = tuple(
            None
            if result.updated_at_ms is None
            else Loaded(save.version, record, save.fencing_token, save.scope, result.updated_at_ms)
            for save, record, result in zip(saves, records, results, strict=True)
        )
        if all(result.ok for result in results):
            return Committed(items, (_OK,) * len(items))
        return Committed(items, tuple(result.status for result in results))

    async def save(
        self,
        namespace: str,
        scope: OwnershipScope,
        key: str,
        record: Any,
        *,
        expected_version: int,
        fence: int | None = None,
    ) -> Loaded[Any] | None:
        """CAS write of one record (``expected_version=0`` = create-only); ``None`` on a
        lost CAS."""
        write = Write(namespace, scope, record, expected_version, fence, key=key)
        return (await self.commit((write,))).items[0]

    async def create(
        self, namespace: str, scope: OwnershipScope, key: str, record: Any
    ) -> Loaded[Any] | None:
        return await self.save(namespace, scope, key, record, expected_version=0)

    async def remove(self, namespace: str, scope: OwnershipScope, key: str) -> bool:
        return await self.checkpoints.delete_checkpoint(namespace=namespace, key=key, scope=scope)

    async def list(
        self,
        scope: OwnershipScope,
        namespace: str,
        limit: int,
        *,
        key_prefix: str | None = None,
        cursor: str | None = None,
        open_only: bool = False,
    ) -> tuple[list[CheckpointRecord], str | None]:
        """One page (newest first) under a *partial* scope filter: raw rows, unparsed.

        ``open_only``: only the records an operator may have to settle (the store's index).
        """
        try:
            page = await self.checkpoints.list_checkpoints(
                namespace=namespace,
                key_prefix=key_prefix,
                # Namespaces outside the journal (the agents', pruned with it) are not
                # filtered by category.
                category=(
                    categories(namespace, open_only=open_only) if namespace in CATEGORY else None
                ),
                scope=scope,
                cursor=cursor,
                limit=limit,
            )
        except StoreUnavailableError as exc:
            self.health.failed(exc)
            raise
        self.health.answered()
        return list(page.items), page.next_cursor

    async def records(
        self,
        scope: OwnershipScope,
        namespace: str,
        *,
        key_prefix: str | None = None,
        page_size: int = 500,
        max_pages: int | None = None,
        open_only: bool = False,
        within: Callable[[OwnershipScope], bool] | None = None,
    ) -> builtins.list[Loaded[Any]]:
        """The records of ``namespace`` (newest first), decoded, each with the scope it is
        stored under: only those stored under exactly ``scope``, or, with ``within``, those
        whose stored scope it accepts (an operator's partial scope: the store lists every
        row ``scope`` filters to). A row that does not decode is skipped.

        Read a page of ``page_size`` rows at a time, following the cursor to the end or
        for at most ``max_pages`` pages; ``key_prefix`` and ``open_only`` as for
        :meth:`list`. Keys are not escaped: a prefix is only a candidate set, and callers
        compare the records' own fields.
        """
        decode = _DECODERS[namespace]
        found: builtins.list[Loaded[Any]] = []
        cursor: str | None = None
        pages = 0
        while True:
            rows, cursor = await self.list(
                scope,
                namespace,
                page_size,
                key_prefix=key_prefix,
                cursor=cursor,
                open_only=open_only,
            )
            pages += 1
            for row in rows:
                if not (row.scope == scope if within is None else within(row.scope)):
                    continue
                try:
                    record = decode(row.value)
                except ValueError:
                    continue
                found.append(self._loaded(row, record))
            if cursor is None or not rows or (max_pages is not None and pages >= max_pages):
                return found

    async def open_records(
        self, namespace: str, *, page_size: int, max_pages: int | None = None
    ) -> builtins.list[Loaded[Any]]:
        """The open records of ``namespace`` under every scope (newest first): what a
        restart re-drives or an operator lists. :meth:`records` from :data:`ANY_SCOPE`,
        ``page_size`` (at least 1) rows a page."""
        return await self.records(
            ANY_SCOPE,
            namespace,
            page_size=max(1, page_size),
            max_pages=max_pages,
            open_only=True,
            within=_any_scope,
        )

    # ---------------------------------------------------------------- typed helpers

    async def load_binding(self, scope: OwnershipScope, key: str) -> Loaded[BindingRecord] | None:
        return await self.load(NS_BINDING, scope, key)

    async def create_binding(
        self, scope: OwnershipScope, key: str, record: BindingRecord
    ) -> Loaded[BindingRecord] | None:
        return await self.create(NS_BINDING, scope, key, record)

    async def load_operation(
        self, scope: OwnershipScope, connection_id: str, operation_id: str
    ) -> Loaded[OperationRecord] | None:
        return await self.load(
            NS_OPERATION, scope, operation_key(connection_id, scope, operation_id)
        )

    async def remove_operation(
        self, scope: OwnershipScope, connection_id: str, operation_id: str
    ) -> bool:
        return await self.remove(
            NS_OPERATION, scope, operation_key(connection_id, scope, operation_id)
        )

    async def load_cursor(
        self, scope: OwnershipScope, connection_id: str
    ) -> Loaded[CursorRecord] | None:
        return await self.load(NS_CURSOR, scope, cursor_key(connection_id, scope))

    async def advance_cursor(
        self,
        scope: OwnershipScope,
        connection_id: str,
        last_event_id: str | None,
        now_ms: int,
        *,
        known: Loaded[CursorRecord] | None = None,
        fence: int | None = None,
        count: int = 1,
    ) -> Loaded[CursorRecord] | None:
        """Move the cursor to ``last_event_id``, ``admitted`` + ``count``: a CAS from
        ``known`` (the cursor as the caller last stored or loaded it; read here when not
        given). A lost CAS is swallowed as ``None``. ``fence`` is the writer's lease
        fencing token (a receiver's); without it, the stored record's."""
        current = known if known is not None else await self.load_cursor(scope, connection_id)
        admitted = 0 if current is None else current.record.admitted
        record = CursorRecord(admitted + count, last_event_id, now_ms)
        if fence is None and current is not None:
            fence = current.fencing_token
        return await self.save(
            NS_CURSOR,
            scope,
            cursor_key(connection_id, scope),
            record,
            expected_version=0 if current is None else current.version,
            fence=fence,
        )

    async def load_reply(
        self, scope: OwnershipScope, connection_id: str, operation_id: str
    ) -> Loaded[ReplyRecord] | None:
        return await self.load(NS_REPLY, scope, reply_key(connection_id, scope, operation_id))
