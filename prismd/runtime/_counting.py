"""How many entries ``list_unresolved`` would list, counted often (the daemon's ``STATUS=``
and health, every 10 s) at a cost that does not follow the replies waiting to be sent.

The listing decides an unsettled reply by its operation: not listed while that is
unresolved (listed with it), nor without an operation record (but a relay), else listed
(:func:`~._recovery.reply_listed`). Loading every pending reply's operation at every
count made the refresh cost one read per queued reply (a backlog behind Discord's global
rate limit: 1,000 reads every 10 s). :class:`UnresolvedCounter` reads what the listing
reads — the open operations and the open replies, a page at a time, the operations decided
exactly as listed — and decides a reply without a read:

* its operation is **open** (in the page of open operations just read): by the state read;
* else it **exists or not**, which only a create or a delete changes. Whether it exists is
  remembered, and kept exact by the store's event feed (every committed save and delete,
  in commit order, without values), read from where the previous count stopped: a save
  means it exists, a delete that it is gone. An operation saved with its reply (a turn's
  answer) is known from the feed; one no event spoke of since the counter started is loaded
  once.

So a count costs the pages of open rows, the new events (500 a read) and a load per reply
whose operation the feed has not seen; not a read per reply. What is remembered is trimmed
to the operations of the replies just counted.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import trio

from ..grants import AgentIdentity, ownership_from_identity
from ..journal import (
    NS_OPERATION,
    NS_REPLY,
    CheckpointRecord,
    OwnershipScope,
    ReplyRecord,
    operation_key,
)
from ._core import Core
from ._recovery import open_reply, reply_listed, unresolved_entry

EVENT_PAGE = 500
"""Events read a call: the most a store's page holds."""

_Address = tuple[OwnershipScope, str]
"""An operation record's stored scope and key."""

_SETTLED = "settled"
"""The state :func:`reply_listed` is given for an operation that exists and is not open
(any state but an unresolved one decides the same)."""


@attrs.define(eq=False)
class UnresolvedCounter:
    """Counts the listing's entries for a runtime (see the module docstring); one count at
    a time."""

    core: Core
    _exists: dict[_Address, bool] = attrs.field(factory=dict, init=False)
    """Whether an operation record exists, as of the events read up to ``_seen``."""
    _seen: int | None = attrs.field(default=None, init=False)
    """The last event read (``None``: the feed is not followed yet)."""
    _lock: trio.Lock = attrs.field(factory=trio.Lock, init=False)

    async def count(self, identities: Sequence[AgentIdentity], limit: int) -> tuple[int, bool]:
        """``(entries, capped)``: what ``list_unresolved_page`` lists for each identity
        (walked to its end), summed; ``capped`` when counting stopped at ``limit`` entries
        (there may be more). Store errors propagate (counted ``storage_failures``)."""
        async with self._lock:
            try:
                return await self._count(identities, max(1, limit))
            except Exception:
                self.core.count("storage_failures")
                raise

    async def _count(self, identities: Sequence[AgentIdentity], limit: int) -> tuple[int, bool]:
        core = self.core
        journal = core.journal
        if journal is None:
            return 0, False
        if self._seen is None:
            # From here on every change is in the feed; anything older is loaded once.
            self._seen = await journal.checkpoints.last_event_seq()
        total = 0
        replies: list[tuple[_Address, ReplyRecord]] = []
        opened: dict[_Address, str] = {}
        capped = False
        for identity in identities:
            if capped:
                break
            if not core.active(identity):
                continue
            scope = ownership_from_identity(identity)
            rows, capped = await self._open_rows(scope, NS_OPERATION, limit - total)
            for row in rows:
                value = row.value
                state = value.get("state") if isinstance(value, dict) else None
                opened[(row.scope, row.key)] = state if isinstance(state, str) else _SETTLED
                if await unresolved_entry(core, NS_OPERATION, row) is not None:
                    total += 1
            if capped:
                break
            rows, capped = await self._open_rows(scope, NS_REPLY, limit - total - len(replies))
            for row in rows:
                reply = open_reply(row)
                if reply is not None:
                    key = operation_key(reply.connection_id, row.scope, reply.operation_id)
                    replies.append(((row.scope, key), reply))
        await self._follow_events()
        for address, reply in replies:
            state = opened.get(address)
            if state is None:
                state = _SETTLED if await self._exists_now(address) else None
            else:
                # Open when listed: it exists, unless the events read since say otherwise.
                self._exists.setdefault(address, True)
            if reply_listed(reply, state):
                total += 1
        self._exists = {a: self._exists[a] for a, _reply in replies if a in self._exists}
        return total, capped

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

    async def _follow_events(self) -> None:
        """Read the feed from the last event seen: what exists of the operations."""
        assert self.core.journal is not None and self._seen is not None
        while True:
            page = await self.core.journal.checkpoints.list_events(
                after=self._seen, limit=EVENT_PAGE
            )
            for event in page.items:
                if event.namespace == NS_OPERATION:
                    self._exists[(event.scope, event.key)] = event.action == "save"
            self._seen = page.last_seq
            if len(page.items) < EVENT_PAGE:
                return

    async def _exists_now(self, address: _Address) -> bool:
        known = self._exists.get(address)
        if known is None:
            assert self.core.journal is not None
            scope, key = address
            row = await self.core.journal.checkpoints.load_checkpoint(
                namespace=NS_OPERATION, key=key, scope=scope
            )
            known = self._exists[address] = row is not None
        return known
