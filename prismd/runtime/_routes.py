"""The route table: one in-memory route per binding, hydrated once from the durable binding.

A route is created on the first event of a (connection, conversation, thread, actor,
alias, scope); an idle, unleased route is evicted when the table is full (the journal
keeps everything it held). Its binding is read once per process and written back only
when it changed (:meth:`Routes.binding_write`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import attrs

from ..identity import AgentIdentity
from ..journal import (
    NS_BINDING,
    BindingRecord,
    ChannelJournal,
    Loaded,
    OperationRef,
    OwnershipScope,
    Write,
    finish,
)
from ..limits import Limits
from ._ids import default_session_id
from ._types import BindingInput, QueueTally, ResolveBinding, Route, RouteKey, TurnQueue

MAX_ID_BYTES = 256


@attrs.define(eq=False)
class Routes:
    """The table of routes and their bindings (journal may be ``None``: no journal)."""

    journal: ChannelJournal | None
    limits: Limits
    now_ms: Callable[[], int]
    count: Callable[[str], None]
    resolve_binding: ResolveBinding | None = None
    tally: QueueTally = attrs.field(init=False, factory=QueueTally)
    """The turns queued on all routes (every route's queue counts into it)."""
    _table: dict[RouteKey, Route] = attrs.field(init=False, factory=dict)

    def values(self) -> Iterator[Route]:
        return iter(list(self._table.values()))

    def __len__(self) -> int:
        return len(self._table)

    def route_key(
        self,
        connection_id: str,
        conversation_id: str,
        thread_id: str | None,
        actor_id: str,
        alias: str,
        ownership: OwnershipScope,
    ) -> RouteKey:
        return (
            connection_id,
            conversation_id,
            thread_id,
            actor_id,
            alias,
            ownership.tenant_id,
            ownership.account_id,
            ownership.user_id,
        )

    def route(
        self,
        connection_id: str,
        conversation_id: str,
        thread_id: str | None,
        actor_id: str,
        alias: str,
        ownership: OwnershipScope,
    ) -> Route | None:
        """The route, created when absent; ``None`` when the table is full of busy routes."""
        key = self.route_key(connection_id, conversation_id, thread_id, actor_id, alias, ownership)
        route = self._table.get(key)
        if route is not None:
            return route
        if len(self._table) >= self.limits.max_routes and not self._evict_idle_route():
            return None
        route = Route(
            key=key,
            connection_id=connection_id,
            conversation_id=conversation_id,
            thread_id=thread_id,
            actor_id=actor_id,
            alias=alias,
            ownership=ownership,
            queue=TurnQueue(self.tally),
        )
        self._table[key] = route
        return route

    def _evict_idle_route(self) -> bool:
        # An idle, hydrated, unleased route holds nothing the journal does not: forget it.
        for key, route in self._table.items():
            if (
                not route.busy
                and route.lease is None
                and route.lease_users == 0
                and route.pins == 0
                and not route.hydrating()
            ):
                if route.suspended and self.journal is None:
                    continue
                del self._table[key]
                return True
        return False

    @contextmanager
    def pinned(self, route: Route) -> Iterator[Route]:
        """Keep ``route`` in the table (not evictable) for the duration of the block."""
        route.pins += 1
        try:
            yield route
        finally:
            route.pins -= 1

    async def derive_session(
        self, route: Route, identity: AgentIdentity, generation: int
    ) -> tuple[str, str | None]:
        if self.resolve_binding is not None:
            resolved = await self.resolve_binding(
                BindingInput(
                    connection_id=route.connection_id,
                    external_conversation_id=route.conversation_id,
                    external_actor_id=route.actor_id,
                    identity=identity,
                    ownership=route.ownership,
                    agent_alias=route.alias,
                    generation=generation,
                    thread_id=route.thread_id,
                )
            )
            sid = resolved.session_id
            if not isinstance(sid, str) or not sid or len(sid.encode("utf-8")) > MAX_ID_BYTES:
                raise TypeError("resolve_binding returned an invalid session id")
            return sid, resolved.leaf_id
        sid = default_session_id(
            route.connection_id,
            route.conversation_id,
            route.thread_id,
            route.actor_id,
            route.ownership,
            route.alias,
            generation,
        )
        return sid, None

    def binding_record(self, route: Route, updated_at_ms: int | None = None) -> BindingRecord:
        return BindingRecord(
            session_id=route.session_id or "",
            agent_alias=route.alias,
            generation=route.generation,
            suspended=route.suspended,
            leaf_id=route.leaf_id,
            suspended_run=route.suspended_run,
            updated_at_ms=self.now_ms() if updated_at_ms is None else updated_at_ms,
            connection_id=route.connection_id,
            external_conversation_id=route.conversation_id,
            external_actor_id=route.actor_id,
            thread_id=route.thread_id,
            selected_at_ms=route.selected_at_ms,
        )

    def apply_binding(self, route: Route, version: int, record: BindingRecord) -> None:
        route.binding_version = version
        route.binding_stored = record
        route.session_id = record.session_id or None
        route.leaf_id = record.leaf_id
        route.generation = record.generation
        route.suspended = record.suspended
        route.suspended_run = record.suspended_run
        route.selected_at_ms = record.selected_at_ms

    async def hydrate(self, route: Route, identity: AgentIdentity, *, create: bool = True) -> bool:
        """Load the durable binding once per process, creating it when absent and ``create``.

        Returns False when there is no binding and ``create`` is False. Store errors and
        corrupt records propagate (callers answer ``unavailable``).
        """
        if route.hydrated:
            return True
        try:
            async with route.hydrate_lock:
                return await self._hydrate_once(route, identity, create)
        finally:
            route.shed_locks()

    async def _hydrate_once(self, route: Route, identity: AgentIdentity, create: bool) -> bool:
        if route.hydrated:
            return True
        if self.journal is None:
            route.hydrated = True
            return True
        loaded = await self.journal.load_binding(route.ownership, route.binding_key)
        if loaded is None:
            if not create:
                return False
            sid, leaf = await self.derive_session(route, identity, 0)
            route.session_id, route.leaf_id = sid, leaf
            record = self.binding_record(route)
            created = await self.journal.create_binding(route.ownership, route.binding_key, record)
            if created is None:
                loaded = await self.journal.load_binding(route.ownership, route.binding_key)
                if loaded is None:
                    raise RuntimeError("binding vanished during hydration")
            else:
                loaded = created
        self.apply_binding(route, loaded.version, loaded.record)
        route.hydrated = True
        return True

    def binding_write(self, route: Route, fence: int | None) -> Write | None:
        """The write that stores the route's binding, or ``None`` when it has not changed
        since it was last read or written (or there is no journal)."""
        if self.journal is None:
            return None
        stored = route.binding_stored
        if stored is not None and _unchanged(route, stored):
            return None
        record = self.binding_record(route)
        return Write(
            NS_BINDING, route.ownership, record, route.binding_version, fence, key=route.binding_key
        )

    def binding_written(self, route: Route, stored: Loaded[Any] | None) -> None:
        if stored is not None:
            self.apply_binding(route, stored.version, stored.record)

    async def persist_binding(self, route: Route, fence: int | None) -> bool:
        """Store the route's binding when it changed (a stale version is re-read and the
        write retried: this runtime's binding is the newer truth). False on a failure."""
        write = self.binding_write(route, fence)
        if write is None or self.journal is None:
            return True
        try:
            finished = await finish(
                self.journal,
                OperationRef(route.ownership, route.connection_id, ""),
                None,
                now_ms=self.now_ms(),
                binding=write,
                settle=False,
            )
        except Exception:
            finished = None
        if finished is None or finished.binding is None:
            self.count("storage_failures")
            return False
        self.binding_written(route, finished.binding)
        return True


def _unchanged(route: Route, stored: BindingRecord) -> bool:
    """``route``'s binding is ``stored`` but for its time: field by field what
    :meth:`Routes.binding_record` would write (no record built to compare)."""
    return (
        stored.session_id == (route.session_id or "")
        and stored.agent_alias == route.alias
        and stored.generation == route.generation
        and stored.suspended == route.suspended
        and stored.leaf_id == route.leaf_id
        and stored.suspended_run == route.suspended_run
        and stored.connection_id == route.connection_id
        and stored.external_conversation_id == route.conversation_id
        and stored.external_actor_id == route.actor_id
        and stored.thread_id == route.thread_id
        and stored.selected_at_ms == route.selected_at_ms
    )
