"""The operator control socket: newline-delimited JSON-RPC 2.0 over a Unix socket.

:func:`serve_control` owns the socket file; :class:`ControlHandler` maps the methods of
SPEC "Control socket" onto the runtime. Guarantees:

* The socket is created under a restrictive umask (socket 0600, or 0660 with ``group``) inside a
  directory that is 0700 (0750 and owned by ``group`` when set), so there is never a
  moment where another user could connect. A stale socket file is replaced; a socket a
  live daemon still answers on is not (:class:`ControlSocketInUseError`). The file is
  removed when the server stops.
* The peer's uid (``SO_PEERCRED``) must map to an :class:`~prismd.config.Operator`, checked
  at accept before anything else; anyone else gets one error (``-32001 permission
  denied``) and the connection is closed. Refused connections cost operators nothing: they
  have their own small budget (:data:`MAX_REFUSED_CONNECTIONS` being answered at once, for
  at most :data:`REFUSED_DRAIN_S`; beyond it they are closed unanswered), and they are
  logged at most once per minute per uid, with a count.
* At most :data:`MAX_OPERATOR_CONNECTIONS` operator connections are open at once (further
  ones are closed at accept); out of file descriptors, accept backs off and logs once a
  minute (:func:`adapters.toolkit.serve_limited`).
* Every input gets a JSON-RPC answer or a closed connection, never a crash: bad UTF-8 or
  JSON → ``-32700``; not a request object (or no ``id``; notifications are not
  supported) → ``-32600``; a line longer than ``max_request_bytes`` → ``-32600`` and close;
  unknown method → ``-32601``; bad params → ``-32602`` naming the param (and the allowed
  range, e.g. ``ttlMs`` at most 5 minutes); pairing refused → ``-32002 pairing
  unavailable: <reason>`` (a connection without a pairing grant is named: ``no [[grants]]
  entry for connection 'tg' with pairing = true``); anything else the handler raises →
  ``-32603 internal error`` (only the exception type is logged).
* Results keep the contract's fields. A refusal the operator can act on adds ``hint``
  (one sentence: what is missing or what to pass), and a reconcile ``conflict`` adds
  ``currentVersion`` (the version to retry with); both keys are absent when there is
  nothing to say, so results that were complete before are unchanged. Hints carry ids and
  numbers only, never message text or tokens.
* Each request line must arrive whole within ``idle_timeout_ms`` of the connection's
  start or of the previous answer, counted for the whole line and not per read, so a
  client dripping a byte a second is closed at that deadline like a silent one.

``events {after?, follow?, fromNow?}`` answers one page ``{"events": […], "cursor": N}``
read from the store's committed event stream (so every instance on one store shows what
any of them wrote); pass ``cursor`` back as ``after`` for the next page. ``fromNow: true``
starts at the stream's end (the first page is empty, with the cursor to follow from). With
``follow: true`` the connection turns into a stream: the same request id gets one result
line per page — first the page at ``after`` (possibly empty), then every further page as
events commit (polled every 200 ms) — until the client closes the connection. Further
input on a following connection is ignored. The store never shows an event N+1 before a
committed N, so a follower that always asks after its last cursor skips nothing.

The durable inbox (Telegram ``webhook_inbox``): ``health`` adds its depth (``inbox``:
pending, claimed, dead) for the connections that use it; ``listInbox {connectionId?,
state?, limit?, after?}`` pages its rows (default: the dead letters), never their content;
``settleInbox {connectionId, updateId, action}`` retries or discards a dead letter; ``prune``
also deletes the rows admitted more than ``retention_days`` ago (counted in its totals). An
operator sees and settles the rows of a connection when its scope names no user and no
other account.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import functools
import grp
import logging
import os
import socket as _socket
import stat
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import trio

from adapters.toolkit import (
    Budget,
    ConnectionLimiter,
    LogThrottle,
    Slot,
    close_gracefully,
    quiet_note,
    serve_limited,
)
from stores import (
    INBOX_STATES,
    InboxItem,
    InboxState,
    InvalidCheckpointError,
    InvalidInboxError,
    OwnershipScope,
    Store,
    ms_to_iso,
)

from ..grants import missing_grant
from ..grants import operator_identity as _grant_identity
from ..identity import AgentIdentity, ownership_from_identity
from ..journal import PAIRING_TTL_MAX_MS, PAIRING_TTL_MIN_MS
from ..jsonrpc import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    METHOD_NOT_FOUND,
    FrameBuffer,
    FrameTooLargeError,
    Request,
    RequestError,
    RpcError,
    encode_error,
    encode_result,
    parse_request,
)
from ..redact import LONE_SURROGATE_RE
from ..runtime import MessagingRuntime, PairingUnavailableError, ReconcileResult

__all__ = [
    "ControlHandler",
    "ControlSocketError",
    "ControlSocketInUseError",
    "ParamsError",
    "RpcError",
    "operator_identity",
    "pairing_aliases_from_grants",
    "serve_control",
    "to_wire",
]

if TYPE_CHECKING:
    # Types only: the daemon serves this socket (it imports this package), and the
    # config records are all the server needs of it, as values it is handed.
    from ..daemon import ControlConfig, GrantConfig, Operator

MAX_SAFE_INT = 2**53 - 1
log = logging.getLogger("prismd.control")

PERMISSION_DENIED = -32001
PAIRING_UNAVAILABLE = -32002

EVENTS_PAGE = 100
FOLLOW_POLL_S = 0.2
INBOX_PRUNE_BATCH = 500
"""Inbox rows one ``prune`` call of the store deletes (it is called until fewer go)."""
_RECEIVE_CHUNK = 65536
_CLOSE_BUDGET_S = 1.0
MAX_OPERATOR_CONNECTIONS = 32
"""Operator connections at once (an ``events --follow`` holds one for as long as it runs)."""
MAX_REFUSED_CONNECTIONS = 8
"""Refused connections being answered at once; further ones are closed unanswered."""
REFUSED_DRAIN_S = 0.25
OPERATORS, REFUSED = "operators", "refused"


class ControlSocketError(Exception):
    """The control socket cannot be set up (its path is not ours to use)."""


class ControlSocketInUseError(ControlSocketError):
    """A live process already answers on the control socket path."""


class ParamsError(RpcError):
    def __init__(self, message: str) -> None:
        super().__init__(INVALID_PARAMS, message)


# --------------------------------------------------------------------------- wire format


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def to_wire(value: Any) -> Any:
    """attrs records → dicts with camelCase keys, recursively; tuples → lists.

    Only attrs field names are converted; keys of plain mappings (metadata, health) are
    kept as they are.
    """
    if attrs.has(type(value)):
        return {
            _camel(field.name): to_wire(getattr(value, field.name))
            for field in attrs.fields(type(value))
        }
    if isinstance(value, Mapping):
        return {str(k): to_wire(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [to_wire(v) for v in value]
    return value


def operator_identity(operator: Operator, *, now_ms: int | None = None) -> AgentIdentity:
    """:func:`prismd.grants.operator_identity`, issued now unless ``now_ms`` is given."""
    issued = now_ms if now_ms is not None else time.time_ns() // 1_000_000
    return _grant_identity(operator, now_ms=issued)


def pairing_aliases_from_grants(
    grants: Sequence[GrantConfig],
) -> Callable[[str], tuple[str, ...] | None]:
    """``pair_aliases`` from the config: the aliases of a connection's first pairing grant,
    ``None`` for a connection without one."""
    table: dict[str, tuple[str, ...]] = {}
    for grant in grants:
        if grant.pairing and grant.connection not in table:
            table[grant.connection] = tuple(grant.aliases)
    return table.get


def _default_health() -> Mapping[str, Any]:
    return {"status": "ok"}


def _reconcile_hint(result: ReconcileResult) -> str | None:
    """What to do about a reconcile that did not resolve, in the method's own terms."""
    if result.status == "conflict":
        if result.detail == "duplicate_risk":
            if result.state == "executing":
                return (
                    "the agent may have run already: pass acknowledgeDuplicateRisk: true to "
                    "settle it as execution_unknown (it is never re-run)"
                )
            return (
                "the reply may have been delivered already: pass acknowledgeDuplicateRisk: "
                "true to resend the stored reply (the user may get it twice)"
            )
        if result.detail == "ambiguous":
            return (
                "the operation id matches records of several scopes inside yours; "
                "an operator scoped to one account and user can settle it"
            )
        if result.current_version is not None:
            return (
                f"expectedVersion is stale: the operation is at version "
                f"{result.current_version} now; retry with that version"
            )
        return "the operation changed meanwhile; list it again and retry"
    if result.status == "not_found":
        return "no such operation on this connection in your scope (see listUnresolved)"
    if result.status == "unavailable":
        return "the journal could not be read or written; try again"
    if result.status == "denied":
        return "this operator identity is not active"
    return None


_SENT_ONLY_WHEN_SET = frozenset({"hint", "currentVersion"})


def _present(wire: dict[str, Any], **extras: Any) -> dict[str, Any]:
    """``wire`` plus ``extras``, keeping keys outside the contract's shape only when set."""
    out = {**wire, **extras}
    return {
        key: value
        for key, value in out.items()
        if value is not None or key not in _SENT_ONLY_WHEN_SET
    }


# --------------------------------------------------------------------------- params


class _Params:
    """Typed access to a params object; unknown names are an error (typos get caught)."""

    def __init__(self, raw: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
        unknown = sorted(set(raw) - set(allowed))
        if unknown:
            raise ParamsError(f"unknown param {unknown[0]!r}")
        self.raw = raw

    def text(self, name: str, *, required: bool = True) -> Any:
        value = self.raw.get(name)
        if value is None:
            if required:
                raise ParamsError(f"param {name!r} is required")
            return None
        if not isinstance(value, str) or not value:
            raise ParamsError(f"param {name!r} must be a non-empty string")
        _check_unicode(name, value)
        return value

    def integer(
        self, name: str, *, low: int, high: int, required: bool = False, unit: str = ""
    ) -> Any:
        value = self.raw.get(name)
        if value is None:
            if required:
                raise ParamsError(f"param {name!r} is required")
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            suffix = f" ({unit})" if unit else ""
            raise ParamsError(f"param {name!r} must be an integer between {low} and {high}{suffix}")
        return value

    def flag(self, name: str) -> bool:
        value = self.raw.get(name, False)
        if not isinstance(value, bool):
            raise ParamsError(f"param {name!r} must be true or false")
        return value


def _check_unicode(name: str, value: str) -> None:
    # ``"\ud800"`` is valid JSON, but no store can hold a lone surrogate: refuse it here as
    # the caller's mistake instead of failing deep inside the runtime or the store.
    if LONE_SURROGATE_RE.search(value):
        raise ParamsError(f"param {name!r} must be valid Unicode text")


def _parse_iso_ms(name: str, value: str) -> int:
    try:
        moment = _dt.datetime.fromisoformat(value)
    except ValueError:
        raise ParamsError(f"param {name!r} must be an ISO 8601 timestamp") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=_dt.UTC)
    return int(moment.timestamp() * 1000)


REMOTE_SCAN_PAGES = 20
"""``listRemoteTasks`` reads at most this many pages of open operations for their versions."""

# --------------------------------------------------------------------------- handler


@attrs.define(eq=False)
class ControlHandler:
    """Maps control methods to the runtime, the store's event stream and health.

    :meth:`call` returns a JSON-ready result, or an async iterator of results for
    ``events`` with ``follow: true``. It raises :class:`RpcError` for the caller's
    mistakes; anything else it raises is an internal error.
    """

    runtime: MessagingRuntime
    store: Store
    health: Callable[[], Mapping[str, Any]] = _default_health
    identity_for: Callable[[Operator], AgentIdentity] = operator_identity
    pair_aliases: Callable[[str], tuple[str, ...] | None] | None = None
    """The aliases a ``pair`` without ``aliases`` grants on a connection (normally those of
    its pairing grant, see :func:`pairing_aliases_from_grants`)."""
    follow_poll_s: float = FOLLOW_POLL_S
    inbox_sources: tuple[str, ...] = ()
    """The connections whose updates go through the store's inbox (their depth is health)."""
    retention_ms: int | None = None
    """``retention_days`` in ms: ``prune`` deletes inbox rows settled before ``now`` minus
    this (``None``: the inbox is not pruned)."""
    cancel_remote: Callable[[OwnershipScope, str], Awaitable[Mapping[str, Any]]] | None = None
    """``reconcile … cancelRemote`` (the daemon's a2a agents); ``None``: none configured."""

    def methods(self) -> frozenset[str]:
        return frozenset(self._table())

    def _table(self) -> dict[str, Callable[[Operator, Mapping[str, Any]], Any]]:
        return {
            "listUnresolved": self._list_unresolved,
            "reconcile": self._reconcile,
            "prune": self._prune,
            "diagnostics": self._diagnostics,
            "health": self._health,
            "notify": self._notify,
            "pair": self._pair,
            "events": self._events,
            "listInbox": self._list_inbox,
            "settleInbox": self._settle_inbox,
            "listRemoteTasks": self._list_remote_tasks,
        }

    async def call(self, operator: Operator, method: str, params: Mapping[str, Any]) -> Any:
        target = self._table().get(method)
        if target is None:
            raise RpcError(METHOD_NOT_FOUND, "method not found")
        return await target(operator, params)

    async def _list_unresolved(self, operator: Operator, raw: Mapping[str, Any]) -> Any:
        """The contract's list (one page); with ``paged: true`` an object with the entries,
        ``nextCursor`` (pass it as ``after``; ``null`` on the last page), the page ``limit``
        used and whether the asked one was ``capped``."""
        params = _Params(raw, ("limit", "after", "paged"))
        limit = params.integer("limit", low=1, high=MAX_SAFE_INT)
        after = params.text("after", required=False)
        page = await self.runtime.list_unresolved_page(
            identity=self.identity_for(operator), limit=limit, after=after
        )
        entries = to_wire(list(page.entries))
        if not params.flag("paged"):
            return entries
        return {
            "entries": entries,
            "nextCursor": page.next_cursor,
            "limit": page.limit,
            "capped": page.capped,
        }

    async def _reconcile(self, operator: Operator, raw: Mapping[str, Any]) -> Any:
        params = _Params(
            raw,
            (
                "connectionId",
                "operationId",
                "expectedVersion",
                "acknowledgeDuplicateRisk",
                "cancelRemote",
            ),
        )
        if params.flag("cancelRemote"):
            return await self._cancel_remote(operator, params)
        result = await self.runtime.reconcile(
            identity=self.identity_for(operator),
            connection_id=params.text("connectionId"),
            operation_id=params.text("operationId"),
            expected_version=params.integer(
                "expectedVersion", low=0, high=2**53 - 1, required=True
            ),
            acknowledge_duplicate_risk=params.flag("acknowledgeDuplicateRisk"),
        )
        return _present(to_wire(result), hint=_reconcile_hint(result))

    async def _prune(self, operator: Operator, raw: Mapping[str, Any]) -> Any:
        params = _Params(raw, ("now",))
        now = params.text("now", required=False)
        now_ms = _parse_iso_ms("now", now) if now is not None else None
        result = await self.runtime.prune(identity=self.identity_for(operator), now_ms=now_ms)
        wire: dict[str, Any] = to_wire(result)
        if self.retention_ms is not None:
            moment = now_ms if now_ms is not None else time.time_ns() // 1_000_000
            cutoff = max(0, moment - self.retention_ms)
            deleted = 0
            while True:  # the store deletes a bounded batch per call
                batch = await self.store.inbox.prune(before_ms=cutoff, limit=INBOX_PRUNE_BATCH)
                deleted += batch
                if batch < INBOX_PRUNE_BATCH:
                    break
            wire["scanned"] = wire.get("scanned", 0) + deleted
            wire["deleted"] = wire.get("deleted", 0) + deleted
        return wire

    async def _diagnostics(self, operator: Operator, raw: Mapping[str, Any]) -> Any:
        _Params(raw, ())
        await trio.lowlevel.checkpoint()
        return to_wire(self.runtime.diagnostics())

    async def _health(self, operator: Operator, raw: Mapping[str, Any]) -> Any:
        _Params(raw, ())
        await trio.lowlevel.checkpoint()
        health: dict[str, Any] = to_wire(self.health())
        if self.inbox_sources:
            try:
                depth = await self.store.inbox.depth(sources=self.inbox_sources)
            except Exception as exc:
                log.warning("reading the inbox depth failed: %s", type(exc).__name__)
                health["inbox"] = "unavailable"
            else:
                health["inbox"] = to_wire(depth)
        return health

    async def _notify(self, operator: Operator, raw: Mapping[str, Any]) -> Any:
        params = _Params(
            raw, ("connectionId", "externalConversationId", "threadId", "notifyId", "text")
        )
        text = raw.get("text")
        if not isinstance(text, str):
            raise ParamsError("param 'text' must be a string")
        _check_unicode("text", text)
        admission = await self.runtime.notify(
            identity=self.identity_for(operator),
            connection_id=params.text("connectionId"),
            external_conversation_id=params.text("externalConversationId"),
            notify_id=params.text("notifyId"),
            text=text,
            thread_id=params.text("threadId", required=False),
        )
        return _present(to_wire(admission))

    async def _pair(self, operator: Operator, raw: Mapping[str, Any]) -> Any:
        params = _Params(raw, ("connectionId", "aliases", "ttlMs"))
        aliases = raw.get("aliases")
        if aliases is not None and (
            not isinstance(aliases, list)
            or not aliases
            or not all(isinstance(a, str) and a for a in aliases)
        ):
            raise ParamsError("param 'aliases' must be a non-empty array of strings")
        for alias in aliases or ():
            _check_unicode("aliases", alias)
        connection_id = params.text("connectionId")
        # Refused, not clamped: an operator asking for an hour must not get 5 minutes silently.
        ttl_ms = params.integer(
            "ttlMs",
            low=PAIRING_TTL_MIN_MS,
            high=PAIRING_TTL_MAX_MS,
            unit="milliseconds; at most 5 minutes",
        )
        configured = None if self.pair_aliases is None else self.pair_aliases(connection_id)
        if self.pair_aliases is not None and configured is None:
            raise RpcError(
                PAIRING_UNAVAILABLE,
                f"pairing unavailable: {missing_grant(connection_id, 'pairing')}",
            )
        chosen = tuple(aliases) if aliases is not None else configured
        if not chosen:
            raise ParamsError("param 'aliases' is required: no pairing grant names aliases")
        try:
            ticket = await self.runtime.create_pairing(
                identity=self.identity_for(operator),
                connection_id=connection_id,
                aliases=chosen,
                ttl_ms=ttl_ms,
            )
        except PairingUnavailableError as exc:
            # The runtime's "pairing unavailable" reasons are fixed texts, safe to show.
            raise RpcError(PAIRING_UNAVAILABLE, f"pairing unavailable: {exc}") from None
        return to_wire(ticket)

    async def _events(self, operator: Operator, raw: Mapping[str, Any]) -> Any:
        params = _Params(raw, ("after", "follow", "limit", "fromNow"))
        after: int = params.integer("after", low=0, high=2**63 - 1) or 0
        limit: int = params.integer("limit", low=1, high=500) or EVENTS_PAGE
        if params.flag("fromNow"):
            if "after" in raw:
                raise ParamsError("param 'fromNow' and param 'after' exclude each other")
            after = await self.store.checkpoints.last_event_seq()
        scope = OwnershipScope(operator.tenant, operator.account, operator.user)
        if params.flag("follow"):
            return self._follow(scope, after, limit)
        return await self._page(scope, after, limit)

    async def _page(self, scope: OwnershipScope, after: int, limit: int) -> dict[str, Any]:
        page = await self.store.checkpoints.list_events(after=after, limit=limit, scope=scope)
        return {"events": to_wire(page.items), "cursor": page.last_seq}

    async def _follow(
        self, scope: OwnershipScope, after: int, limit: int
    ) -> AsyncIterator[dict[str, Any]]:
        page = await self._page(scope, after, limit)
        yield page
        cursor = page["cursor"]
        while True:
            page = await self._page(scope, cursor, limit)
            cursor = page["cursor"]
            if page["events"]:
                yield page
            if len(page["events"]) < limit:
                await trio.sleep(self.follow_poll_s)

    # ------------------------------------------------------------------ remote tasks

    async def _cancel_remote(self, operator: Operator, params: _Params) -> Any:
        """``reconcile … cancelRemote``: CancelTask for the remote task the operation
        follows; its follower then settles the operation and tells the user."""
        from ..agents.a2a import Book
        from ..journal import ChannelJournal

        operation_id = params.text("operationId")
        connection_id = params.text("connectionId")
        expected = params.integer("expectedVersion", low=0, high=2**53 - 1, required=True)
        if self.cancel_remote is None:
            raise ParamsError("cancelRemote: this daemon follows no remote (a2a) tasks")
        scope = ownership_from_identity(self.identity_for(operator))
        task = await Book(self.store.checkpoints).find_operation(scope, operation_id)
        if task is None:
            return {"status": "not_found"}
        # The operator decided on the version listed: a CAS-like check before acting.
        loaded = await ChannelJournal(self.store.checkpoints).load_operation(
            task.scope, connection_id, operation_id
        )
        if loaded is None:
            return {"status": "not_found"}
        if loaded.version != expected:
            return {
                "status": "conflict",
                "state": loaded.record.state,
                "currentVersion": loaded.version,
            }
        return await self.cancel_remote(scope, operation_id)

    async def _list_remote_tasks(self, operator: Operator, raw: Mapping[str, Any]) -> Any:
        """The remote A2A tasks being followed in the operator's scope (a page): alias,
        operation, remote task id, phase, state, last observation, next poll, owner."""
        from ..agents.a2a import list_remote_tasks

        params = _Params(raw, ("limit", "after"))
        limit = params.integer("limit", low=1, high=500) or 100
        after = params.text("after", required=False)
        scope = ownership_from_identity(self.identity_for(operator))
        try:
            entries, cursor = await list_remote_tasks(
                self.store.checkpoints, scope, limit=limit, after=after
            )
        except InvalidCheckpointError:
            raise ParamsError("param 'after' must be a nextCursor of listRemoteTasks") from None
        if entries:
            # What `reconcile … --cancel-remote` needs: the operation's connection and version.
            operations = await self._open_operations(scope)
            for entry in entries:
                found = operations.get(entry["operationId"])
                entry["connectionId"], entry["version"] = found or (None, None)
        return {"tasks": entries, "nextCursor": cursor}

    async def _open_operations(self, scope: OwnershipScope) -> dict[str, tuple[str, int]]:
        """The open operations in ``scope`` (following ones among them): id → (connection,
        version), bounded to :data:`REMOTE_SCAN_PAGES` pages."""
        from ..journal import NS_OPERATION, ChannelJournal

        journal = ChannelJournal(self.store.checkpoints)
        out: dict[str, tuple[str, int]] = {}
        cursor: str | None = None
        for _page in range(REMOTE_SCAN_PAGES):
            rows, cursor = await journal.list(
                scope, NS_OPERATION, 500, cursor=cursor, open_only=True
            )
            for row in rows:
                value = row.value
                if isinstance(value, dict) and isinstance(value.get("operationId"), str):
                    out[value["operationId"]] = (str(value.get("connectionId")), row.version)
            if cursor is None:
                break
        return out

    # ------------------------------------------------------------------ the inbox

    def _may_see_inbox(self, operator: Operator, connection_id: str) -> bool:
        # Inbox rows are the connection's own (no user is known before admission): an
        # operator scoped to a user, or to another account, does not see them.
        return operator.user is None and operator.account in (None, connection_id)

    async def _list_inbox(self, operator: Operator, raw: Mapping[str, Any]) -> Any:
        params = _Params(raw, ("connectionId", "state", "limit", "after"))
        connection_id = params.text("connectionId", required=False)
        chosen = params.text("state", required=False) or "dead"
        if chosen not in (*INBOX_STATES, "all"):
            raise ParamsError(f"param 'state' must be one of {', '.join(INBOX_STATES)}, all")
        state: InboxState | None = next((s for s in INBOX_STATES if s == chosen), None)
        limit: int = params.integer("limit", low=1, high=500) or EVENTS_PAGE
        after = params.text("after", required=False)
        sources = [connection_id] if connection_id is not None else list(self.inbox_sources)
        sources = [c for c in sources if self._may_see_inbox(operator, c)]
        if len(sources) != 1 and after is not None:
            # Several connections would need a cursor each: they are listed up to ``limit``
            # each, and paging is per connection.
            raise ParamsError("param 'after' needs param 'connectionId'")
        items: list[Any] = []
        cursor: str | None = None
        for source in sources:
            try:
                page = await self.store.inbox.list_items(
                    source=source,
                    state=state,
                    cursor=after,
                    limit=limit,
                )
            except InvalidInboxError:
                raise ParamsError("param 'after' must be a nextCursor of listInbox") from None
            items += [_inbox_wire(item) for item in page.items]
            cursor = page.next_cursor if len(sources) == 1 else None
        return {"items": items, "nextCursor": cursor}

    async def _settle_inbox(self, operator: Operator, raw: Mapping[str, Any]) -> Any:
        params = _Params(raw, ("connectionId", "updateId", "action"))
        connection_id = params.text("connectionId")
        update_id = params.text("updateId")
        action = params.text("action")
        if action not in ("retry", "discard"):
            raise ParamsError("param 'action' must be 'retry' or 'discard'")
        if not self._may_see_inbox(operator, connection_id):
            return {"status": "not_found", "hint": _INBOX_NOT_FOUND}
        item = await self.store.inbox.settle(source=connection_id, key=update_id, action=action)
        if item is None:
            return {"status": "not_found", "hint": _INBOX_NOT_FOUND}
        return {"status": "settled", "item": _inbox_wire(item)}


_INBOX_NOT_FOUND = (
    "no dead letter with that update id on this connection in your scope"
    " (`prismctl list-inbox` lists them)"
)


def _inbox_wire(item: InboxItem) -> dict[str, Any]:
    """An inbox row for the operator: where, how far, why — never its content."""
    return {
        "connectionId": item.source,
        "updateId": item.key,
        "state": item.state,
        "attempts": item.attempts,
        "error": item.error,
        "createdAt": ms_to_iso(item.created_at_ms),
        "updatedAt": ms_to_iso(item.updated_at_ms),
    }


# --------------------------------------------------------------------------- server


def _peer_uid(sock: trio.socket.SocketType) -> int | None:
    try:
        raw = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    _pid, uid, _gid = struct.unpack("3i", raw)
    return int(uid)


@attrs.define(eq=False)
class _Connection:
    stream: trio.SocketStream
    operator: Operator
    handler: ControlHandler
    max_request_bytes: int
    idle_timeout_s: float
    frames: FrameBuffer = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.frames = FrameBuffer(self.max_request_bytes)

    async def run(self) -> None:
        while True:
            try:
                line = await self._next_line()
            except FrameTooLargeError:
                # Do not keep reading an oversize line: answer once and close.
                await self.stream.send_all(
                    encode_error(None, INVALID_REQUEST, "invalid request: request too large")
                )
                await close_gracefully(self.stream)
                return
            if line is None:
                return
            if not line.strip():
                continue
            try:
                request = parse_request(line)
            except RequestError as refused:
                await self.stream.send_all(
                    encode_error(refused.request_id, refused.code, refused.message)
                )
                continue
            outcome = await self._dispatch(request)
            if isinstance(outcome, bytes):
                await self.stream.send_all(outcome)
                continue
            await self._stream_results(request.id, outcome)
            return

    async def _next_line(self) -> bytes | None:
        """The next line without its newline; ``None`` on EOF or when the whole line did not
        arrive within ``idle_timeout_s``. :class:`~prismd.jsonrpc.FrameTooLargeError` for a
        line over ``max_request_bytes``."""
        deadline = trio.current_time() + self.idle_timeout_s
        while True:
            line = self.frames.next_frame()
            if line is not None:
                return line
            with trio.move_on_at(deadline):
                data = await self.stream.receive_some(_RECEIVE_CHUNK)
                if not data:
                    return None
                self.frames.feed(data)
                continue
            return None

    async def _dispatch(self, request: Request) -> bytes | AsyncIterator[Any]:
        try:
            result = await self.handler.call(self.operator, request.method, request.params)
            if isinstance(result, AsyncIterator):
                return result
            # Encoding is inside the guard: a result that is not JSON is an internal error.
            return encode_result(request.id, result)
        except RpcError as exc:
            return encode_error(request.id, exc.code, exc.message)
        except Exception as exc:
            # The type only: exception text may carry ids or user content.
            log.warning("control method %s failed: %s", request.method, type(exc).__name__)
            return encode_error(request.id, INTERNAL_ERROR, "internal error")

    async def _stream_results(self, request_id: Any, pages: AsyncIterator[Any]) -> None:
        """Send every page until the client closes (EOF) or a send fails."""

        async def watch_for_close(cancel_scope: trio.CancelScope) -> None:
            try:
                while await self.stream.receive_some(_RECEIVE_CHUNK):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_for_close, nursery.cancel_scope)
            try:
                async for page in pages:
                    await self.stream.send_all(encode_result(request_id, page))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            except Exception as exc:
                log.warning("control event stream failed: %s", type(exc).__name__)
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self.stream.send_all(
                        encode_error(request_id, INTERNAL_ERROR, "internal error")
                    )
            finally:
                aclose = getattr(pages, "aclose", None)
                if aclose is not None:
                    # An async generator's aclose only runs its finally blocks; bounded all
                    # the same, so a stuck one cannot hold the server's shutdown.
                    with trio.move_on_after(_CLOSE_BUDGET_S, shield=True):
                        await aclose()
            nursery.cancel_scope.cancel()


def _prepare_directory(directory: Path, gid: int | None, socket_name: str) -> None:
    """Create the socket's directory, or tighten an existing one of its own to 0700 /
    0750+group.

    Only a directory that holds nothing but (a stale copy of) our socket is tightened. A
    shared directory (world-writable or sticky, like /tmp) is refused, and so is a
    directory with other files in it that other users can reach (``socket =
    "prismd.sock"`` in a project or home directory): its mode is never changed for us.
    """
    try:
        mode = directory.stat().st_mode
    except FileNotFoundError:
        directory.mkdir(parents=True, mode=0o700)
    else:
        if not stat.S_ISDIR(mode):
            raise ControlSocketError(f"{directory} is not a directory")
        if mode & (stat.S_ISVTX | stat.S_IWOTH):
            raise ControlSocketError(
                f"{directory} is a shared directory; put the control socket in its own directory"
            )
        others = [entry for entry in os.listdir(directory) if entry != socket_name]
        if others:
            allowed = 0o750 if gid is not None else 0o700
            if stat.S_IMODE(mode) & ~allowed:
                raise ControlSocketError(
                    f"{directory} holds other files and is open to other users "
                    f"(mode {stat.S_IMODE(mode):o}); put the control socket in its own directory"
                )
            return
    if gid is not None:
        os.chown(directory, -1, gid)
        os.chmod(directory, 0o750)
    else:
        os.chmod(directory, 0o700)


def _remove_stale_socket(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ControlSocketError(f"{path} exists and is not a socket")
    probe = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)
        return
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            path.unlink(missing_ok=True)
            return
        raise ControlSocketError(f"cannot probe existing socket {path}") from None
    finally:
        probe.close()
    raise ControlSocketInUseError(f"another daemon is serving on {path}")


def _bind_socket(path: Path, *, group: bool) -> _socket.socket:
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        # The umask is process-wide: set it, bind (synchronously, no checkpoint in
        # between, so no other task of ours runs), restore at once.
        previous = os.umask(0o117 if group else 0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(previous)
        sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve_control(
    config: ControlConfig,
    *,
    handler: ControlHandler,
    daemon_uid: int | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the control socket at ``config.socket`` until cancelled.

    Calls ``task_status.started()`` once the socket accepts connections. Raises
    :class:`ControlSocketInUseError` when a live process answers on the path,
    :class:`ControlSocketError` when the path is something other than a socket, and
    ``KeyError`` for an unknown ``group``. The socket file is removed on exit.
    """
    path = Path(config.socket)
    gid = grp.getgrnam(config.group).gr_gid if config.group is not None else None
    _prepare_directory(path.parent, gid, path.name)
    _remove_stale_socket(path)
    raw = _bind_socket(path, group=gid is not None)
    identity = os.stat(path)
    try:
        if gid is not None:
            os.chown(path, -1, gid)
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(raw))
        limiter = ConnectionLimiter(
            "control socket",
            {
                OPERATORS: Budget(MAX_OPERATOR_CONNECTIONS, "refuse", "operator connections"),
                REFUSED: Budget(MAX_REFUSED_CONNECTIONS, "refuse", "refused connections"),
            },
            logger=log,
        )
        refusals = LogThrottle()

        def budget_for(stream: trio.SocketStream) -> str:
            uid = _peer_uid(stream.socket)
            if _operator(config, uid, daemon_uid) is not None:
                return OPERATORS
            quiet = refusals.passes(uid)
            if quiet is not None:
                log.info("control connection refused for uid %s%s", uid, quiet_note(quiet))
            return REFUSED

        async def serve_one(stream: trio.SocketStream, slot: Slot) -> None:
            await _serve_one(stream, slot, config, handler, daemon_uid)

        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(serve_limited, budget=budget_for),
                serve_one,
                [listener],
                limiter,
            )
            task_status.started()
    finally:
        raw.close()
        _remove_if_ours(path, identity)


def _remove_if_ours(path: Path, identity: os.stat_result) -> None:
    try:
        now = os.stat(path)
        # Only remove the file we created, not one a successor put there.
        if (now.st_ino, now.st_dev) == (identity.st_ino, identity.st_dev):
            os.unlink(path)
    except OSError:
        pass


def _operator(config: ControlConfig, uid: int | None, daemon_uid: int | None) -> Operator | None:
    return config.operator_for(uid, daemon_uid=daemon_uid) if uid is not None else None


async def _serve_one(
    stream: trio.SocketStream,
    slot: Slot,
    config: ControlConfig,
    handler: ControlHandler,
    daemon_uid: int | None,
) -> None:
    async with stream:
        try:
            operator = _operator(config, _peer_uid(stream.socket), daemon_uid)
            if slot.budget == REFUSED or operator is None:
                with trio.move_on_after(REFUSED_DRAIN_S):
                    await stream.send_all(
                        encode_error(None, PERMISSION_DENIED, "permission denied")
                    )
                await close_gracefully(stream, drain_s=REFUSED_DRAIN_S)
                return
            connection = _Connection(
                stream,
                operator,
                handler,
                config.max_request_bytes,
                config.idle_timeout_ms / 1000,
            )
            await connection.run()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception as exc:
            log.warning("control connection failed: %s", type(exc).__name__)
