"""How many entries ``list_unresolved`` would list, counted often (the daemon's ``STATUS=``
and health, every 10 s) at a cost that does not follow the replies waiting to be sent.

The listing reads every open operation and every open reply, and decides a reply by its
operation: not listed while that is unresolved (listed with it), nor without an operation
record (but a relay), else listed (:func:`~._recovery.reply_listed`). Doing that at every
count cost a read per queued reply (a backlog behind Discord's global rate limit: 1,000
loads every 10 s, and the rows' text decoded). :class:`UnresolvedCounter` reads the open
operations as the listing does (they are decided exactly as listed), but keeps what it
needs of the open replies between counts and follows the store's event feed (every
committed save and delete, in commit order, with its category but no value) from where
the previous count stopped:

* **which reply rows are open**: a reply saved in the open category is added, one saved in
  another or deleted is dropped; only a reply row it has not seen before is read (the
  newest rows of the open category, a page at a time, where the new ones are; one not
  found there is loaded), once — for the operation it answers, which its key does not
  change;
* **whether an operation exists** (a reply whose operation is not open): a save means it
  does, a delete that it is gone; one no event spoke of since is loaded once.

The first count, a change of the identities asked about, a count that stopped at its
limit or failed, start over from a full read of the open replies (what the listing reads);
so does one with more new events than :data:`FOLLOW_PER_REPLY` per open reply, when that
read is the cheaper. Otherwise a count costs a page of open operations per identity, the
last event's number, the new events (500 a read) and the new open replies (500 a read):
nothing per reply waiting.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import trio

from ..grants import AgentIdentity, ownership_from_identity
from ..journal import (
    NS_OPERATION,
    NS_REPLY,
    OPEN_CATEGORY,
    CheckpointRecord,
    OwnershipScope,
    operation_key,
)
from ._core import Core
from ._recovery import open_reply, reply_listed, unresolved_entry

EVENT_PAGE = 500
"""Events (and new open replies) read a call: the most a store's page holds."""
FOLLOW_PER_REPLY = 4
"""Following an event costs about a quarter of reading an open reply again with its
operation (SQLite: 11 µs against 45 µs): with more new events than this many per open reply
kept, a count starts over instead (many messages, few of them waiting)."""

_OPEN_REPLY = OPEN_CATEGORY[NS_REPLY]
_EVERY_SCOPE = OwnershipScope()
"""A filter every stored scope matches."""

_Address = tuple[OwnershipScope, str]
"""A record's stored scope and key."""

_Answers = tuple[_Address, str] | None
"""What an open reply row answers: its operation's address and id (``None``: a row that
is never listed, its value not an unsettled reply)."""

_SETTLED = "settled"
"""The state :func:`reply_listed` is given for an operation that exists and is not open
(any state but an unresolved one decides the same)."""


@attrs.define(eq=False)
class UnresolvedCounter:
    """Counts the listing's entries for a runtime (see the module docstring); one count at
    a time."""

    core: Core
    _scopes: tuple[OwnershipScope, ...] | None = attrs.field(default=None, init=False)
    """The scopes of the identities counted for: the open replies kept are theirs."""
    _seen: int | None = attrs.field(default=None, init=False)
    """The last event read (``None``: start over)."""
    _replies: dict[_Address, _Answers] = attrs.field(factory=dict, init=False)
    """The open reply rows inside ``_scopes`` as of event ``_seen``."""
    _exists: dict[_Address, bool] = attrs.field(factory=dict, init=False)
    """Whether an operation record exists, as of event ``_seen`` (or its load since)."""
    _lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)

    async def count(self, identities: Sequence[AgentIdentity], limit: int) -> tuple[int, bool]:
        """``(entries, capped)``: what ``list_unresolved_page`` lists for each identity
        (walked to its end), summed; ``capped`` when counting stopped at ``limit`` rows
        (there may be more). Store errors propagate (counted ``storage_failures``)."""
        async with self._lock:
            try:
                return await self._count(identities, max(1, limit))
            except Exception:
                self._seen = None  # what was half read is not trusted: start over
                self.core.count("storage_failures")
                raise

    async def _count(self, identities: Sequence[AgentIdentity], limit: int) -> tuple[int, bool]:
        core = self.core
        if core.journal is None:
            return 0, False
        scopes = tuple(ownership_from_identity(i) for i in identities if core.active(i))
        newest = await core.journal.checkpoints.last_event_seq()
        if (
            self._seen is None
            or scopes != self._scopes
            or newest - self._seen > FOLLOW_PER_REPLY * len(self._replies)
        ):
            capped = await self._start_over(scopes, limit, newest)
        else:
            capped = False
            if newest > self._seen:
                await self._follow()
        total = 0
        opened: dict[_Address, str] = {}
        for scope in scopes:
            if capped:
                break
            rows, capped = await self._open_rows(scope, NS_OPERATION, limit - total)
            for row in rows:
                value = row.value
                state = value.get("state") if isinstance(value, dict) else None
                opened[(row.scope, row.key)] = state if isinstance(state, str) else _SETTLED
                if await unresolved_entry(core, NS_OPERATION, row) is not None:
                    total += 1
        for address, answers in list(self._replies.items()):
            if answers is None:
                continue
            operation, operation_id = answers
            state = opened.get(operation)
            if state is None:
                state = _SETTLED if await self._operation_exists(operation) else None
            else:
                # Open when listed: it exists, unless the events read say otherwise.
                self._exists.setdefault(operation, True)
            if reply_listed(operation_id, state):
                total += sum(1 for scope in scopes if scope.matches_filter(address[0]))
        kept = {answers[0] for answers in self._replies.values() if answers is not None}
        self._exists = {a: known for a, known in self._exists.items() if a in kept}
        if capped:
            self._seen = None  # not every row was read: the next count reads them again
        return total, capped

    async def _start_over(
        self, scopes: tuple[OwnershipScope, ...], limit: int, newest: int
    ) -> bool:
        """Read every open reply row of ``scopes`` (up to ``limit``; True when more were
        left) and follow the events after ``newest`` (the last one now)."""
        # Every change after ``newest`` is in the feed; what is read below is as new.
        self._seen = newest
        self._scopes = scopes
        self._replies = {}
        self._exists = {}
        for scope in scopes:
            rows, cut = await self._open_rows(scope, NS_REPLY, limit - len(self._replies))
            for row in rows:
                self._keep(row)
            if cut:
                return True
        return False

    async def _open_rows(
        self, scope: OwnershipScope, namespace: str, wanted: int
    ) -> tuple[list[CheckpointRecord], bool]:
        """The open rows of ``namespace`` inside ``scope``, a page at a time, and whether
        more were left unread: reading stops once ``wanted`` are read (at least one page)."""
        assert self.core.journal is not None
        page = self.core.limits.max_journal_page
        found: list[CheckpointRecord] = []
        cursor: str | None = None
        while True:
            rows, cursor = await self.core.journal.list(
                scope, namespace, page, cursor=cursor, open_only=True
            )
            found += [row for row in rows if scope.matches_filter(row.scope)]
            if cursor is None or not rows:
                return found, False
            if len(found) >= wanted:
                return found, True

    def _keep(self, row: CheckpointRecord) -> None:
        """Keep an open reply row: the operation it answers."""
        reply = open_reply(row)
        self._replies[(row.scope, row.key)] = (
            None
            if reply is None
            else (
                (row.scope, operation_key(reply.connection_id, row.scope, reply.operation_id)),
                reply.operation_id,
            )
        )

    def _inside(self, scope: OwnershipScope) -> bool:
        return any(mine.matches_filter(scope) for mine in self._scopes or ())

    async def _follow(self) -> None:
        """Read the feed from the last event seen: which reply rows are open, which
        operations exist; then read the reply rows opened since."""
        assert self.core.journal is not None and self._seen is not None
        new: dict[_Address, int] = {}  # a reply row opened since → when (its event)
        while True:
            page = await self.core.journal.checkpoints.list_events(
                after=self._seen, limit=EVENT_PAGE
            )
            for event in page.items:
                address = (event.scope, event.key)
                if event.namespace == NS_OPERATION:
                    self._exists[address] = event.action == "save"
                elif event.namespace != NS_REPLY or not self._inside(event.scope):
                    continue
                elif event.action == "save" and event.category == _OPEN_REPLY:
                    if self._replies.get(address) is None:
                        new.setdefault(address, event.at_ms)
                else:
                    self._replies.pop(address, None)
                    new.pop(address, None)
            self._seen = page.last_seq
            if len(page.items) < EVENT_PAGE:
                break
        if new:
            await self._read_new(new)

    async def _read_new(self, new: dict[_Address, int]) -> None:
        """Read the reply rows opened since the last count: the newest open rows first (a
        page holds many), then a load for each not found among those."""
        journal = self.core.journal
        assert journal is not None
        since = min(new.values())
        cursor: str | None = None
        while new:
            rows, cursor = await journal.list(
                _EVERY_SCOPE, NS_REPLY, EVENT_PAGE, cursor=cursor, open_only=True
            )
            for row in rows:
                if new.pop((row.scope, row.key), None) is not None:
                    self._keep(row)
            if cursor is None or not rows or rows[-1].updated_at_ms < since:
                break
        for scope, key in new:
            loaded = await journal.checkpoints.load_checkpoint(
                namespace=NS_REPLY, key=key, scope=scope
            )
            # Closed or gone since: a later event says so, and the row is not kept.
            if loaded is not None and loaded.category == _OPEN_REPLY:
                self._keep(loaded)

    async def _operation_exists(self, address: _Address) -> bool:
        known = self._exists.get(address)
        if known is None:
            assert self.core.journal is not None
            scope, key = address
            row = await self.core.journal.checkpoints.load_checkpoint(
                namespace=NS_OPERATION, key=key, scope=scope
            )
            known = self._exists[address] = row is not None
        return known
