"""The control socket's methods: :class:`ControlHandler` maps the methods of SPEC "Control
socket" onto the runtime and the store, checks their params and shapes their results.

* Results keep the contract's fields. A refusal the operator can act on adds ``hint``
  (one sentence: what is missing or what to pass), and a reconcile ``conflict`` adds
  ``currentVersion`` (the version to retry with); both keys are absent when there is
  nothing to say, so results that were complete before are unchanged. Hints carry ids and
  numbers only, never message text or tokens.
* Bad params → :class:`ParamsError` (``-32602``) naming the param and, where it has one,
  its allowed range.

``events {after?, follow?, fromNow?}`` answers one page ``{"events": […], "cursor": N}``
read from the store's committed event stream (so every instance on one store shows what
any of them wrote); pass ``cursor`` back as ``after`` for the next page. ``fromNow: true``
starts at the stream's end (the first page is empty, with the cursor to follow from). With
``follow: true`` the connection turns into a stream: the same request id gets one result
line per page — first the page at ``after`` (possibly empty), then every further page as
events commit (polled every 200 ms) — until the client closes the connection. Further
input on a following connection is ignored. The store never shows an event N+1 before a
committed N, so a follower that always asks after its last cursor skips nothing.

``health`` is the daemon's snapshot (per child its state and the adapter's own: mode,
last update seen, last error) plus ``version``, ``startedAt`` (ISO 8601) and ``uptimeMs``.
The durable inbox (Telegram ``webhook_inbox``): ``health`` adds its depth (``inbox``:
pending, claimed, dead) for the connections that use it; ``listInbox {connectionId?,
state?, limit?, after?}`` pages its rows (default: the dead letters), never their content;
``settleInbox {connectionId, updateId, action}`` retries or discards a dead letter; ``prune``
also deletes the rows admitted more than ``retention_days`` ago (counted in its totals). An
operator sees and settles the rows of a connection when its scope names no user and no
other account.
"""

from __future__ import annotations

import datetime as _dt
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import attrs
import trio

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

from ..channel import LONE_SURROGATE_RE
from ..grants import AgentIdentity, GrantConfig, missing_grant, ownership_from_identity
from ..grants import operator_identity as _grant_identity
from ..journal import PAIRING_TTL_MAX_MS, PAIRING_TTL_MIN_MS
from ..jsonrpc import (
    INVALID_PARAMS,
    METHOD_NOT_FOUND,
    RpcError,
)
from ..runtime import MessagingRuntime, PairingUnavailableError, ReconcileResult
from ._config import Operator
from ._remote import RemoteTasks, cancel_remote, list_remote_tasks
from ._uptime import daemon_version, process_started_ms

__all__ = [
    "ControlHandler",
    "ParamsError",
    "RpcError",
    "operator_identity",
    "pairing_aliases_from_grants",
    "to_wire",
]

log = logging.getLogger("prismd.control")


MAX_SAFE_INT = 2**53 - 1
PERMISSION_DENIED = -32001
PAIRING_UNAVAILABLE = -32002
EVENTS_PAGE = 100
FOLLOW_POLL_S = 0.2
INBOX_PRUNE_BATCH = 500
"""Inbox rows one ``prune`` call of the store deletes (it is called until fewer go)."""


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
    remote: RemoteTasks | None = None
    """The daemon's a2a agents (``reconcile … cancelRemote``, next polls); ``None``: none."""
    started_at_ms: int = attrs.field(factory=process_started_ms)
    """When the daemon started (Unix ms): ``health``'s ``startedAt`` and ``uptimeMs``."""

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
        # An entry's ``reason`` (a failed reply's, outside the contract's shape) only when set.
        entries = [
            {key: value for key, value in entry.items() if key != "reason" or value is not None}
            for entry in to_wire(list(page.entries))
        ]
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
        now_ms = time.time_ns() // 1_000_000
        health["version"] = daemon_version()
        health["startedAt"] = ms_to_iso(self.started_at_ms)
        health["uptimeMs"] = max(0, now_ms - self.started_at_ms)
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
        """``reconcile … cancelRemote`` (see :func:`._remote.cancel_remote`)."""
        operation_id = params.text("operationId")
        connection_id = params.text("connectionId")
        expected = params.integer("expectedVersion", low=0, high=2**53 - 1, required=True)
        if self.remote is None:
            raise ParamsError("cancelRemote: this daemon follows no remote (a2a) tasks")
        scope = ownership_from_identity(self.identity_for(operator))
        return await cancel_remote(
            self.store, self.remote.cancel, scope, connection_id, operation_id, expected
        )

    async def _list_remote_tasks(self, operator: Operator, raw: Mapping[str, Any]) -> Any:
        """A page of the remote A2A tasks followed in the operator's scope."""
        params = _Params(raw, ("limit", "after"))
        limit = params.integer("limit", low=1, high=500) or 100
        after = params.text("after", required=False)
        scope = ownership_from_identity(self.identity_for(operator))
        try:
            return await list_remote_tasks(self.store, scope, self.remote, limit=limit, after=after)
        except InvalidCheckpointError:
            raise ParamsError("param 'after' must be a nextCursor of listRemoteTasks") from None

    # ------------------------------------------------------------------ the inbox

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
        sources = [c for c in sources if _may_see_inbox(operator, c)]
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
        if not _may_see_inbox(operator, connection_id):
            return {"status": "not_found", "hint": _INBOX_NOT_FOUND}
        item = await self.store.inbox.settle(source=connection_id, key=update_id, action=action)
        if item is None:
            return {"status": "not_found", "hint": _INBOX_NOT_FOUND}
        return {"status": "settled", "item": _inbox_wire(item)}


def _may_see_inbox(operator: Operator, connection_id: str) -> bool:
    # Inbox rows are the connection's own (no user is known before admission): an
    # operator scoped to a user, or to another account, does not see them.
    return operator.user is None and operator.account in (None, connection_id)


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
