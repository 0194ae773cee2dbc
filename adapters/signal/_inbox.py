"""The durable inbox: every received message, from the moment it is read until ``admit``
gave it a final answer.

signal-cli hands a message over once and forgets it (``protocols-telegram-signal.md`` §2:
no application acknowledgement, no replay), so the Signal adapter writes what it reads here
first, in the journal's store, before anything else happens to it: a crash, a stop or a
retryable admission (``capacity``, ``unavailable``, ``stopped``) while it waits then loses
nothing — the next receiver to hold the lease (this daemon after a restart, or a standby)
admits it before subscribing. (The Telegram adapter needs no such thing: Telegram keeps an
update until the offset moves past it.)

One record per event: namespace ``prism.channels.v1.signal.inbox``, key
``i1:<connection>:<event id>``, the adapter's service scope, category
``channel-signal-inbox``, created once (compare-and-swap on version 0; a batch of them in one
transaction) and deleted once the event got a final admission (in batches too). It holds
the message text — the only place beside the operation record of an ``accepted`` message
that does — for that long. An admission answered as a duplicate is final, so an event
written twice, or replayed by two daemons, is still admitted once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from prismd.channel import InboundEvent
from stores import CheckpointStore, DeleteCheckpoint, OwnershipScope, SaveCheckpoint

from ._status import log

__all__ = ["INBOX_CATEGORY", "INBOX_NAMESPACE", "Inbox"]

INBOX_NAMESPACE = "prism.channels.v1.signal.inbox"
INBOX_CATEGORY = "channel-signal-inbox"
MAX_REPLAY = 10_000
"""At most this many records are taken back at one start (the rest at the next)."""
_PAGE = 500


@attrs.define(eq=False, kw_only=True)
class Inbox:
    connection_id: str
    checkpoints: CheckpointStore
    scope: OwnershipScope
    _seq: int = attrs.field(default=0, init=False)
    """Orders events received in the same millisecond (as they were read)."""

    def key(self, event_id: str) -> str:
        return f"i1:{self.connection_id}:{event_id}"

    async def put(self, events: Sequence[InboundEvent]) -> list[bool]:
        """Write each event (once), all in one transaction; per event whether it is now
        durable (False for every event when the store failed: logged)."""
        if not events:
            return []
        writes = [
            SaveCheckpoint(
                namespace=INBOX_NAMESPACE,
                key=self.key(event.event_id),
                scope=self.scope,
                version=1,
                expected_version=0,
                value=self._value(event),
                category=INBOX_CATEGORY,
            )
            for event in events
        ]
        try:
            results = await self.checkpoints.write_checkpoints(writes)
        except Exception as exc:
            log.warning(
                "signal %s: keeping %d received message(s) in the inbox failed (%s); they "
                "wait in memory only",
                self.connection_id,
                len(events),
                type(exc).__name__,
            )
            return [False] * len(events)
        # a conflict on a create-only write: the record is there already (written before)
        return [result.status in ("ok", "conflict") for result in results]

    def _value(self, event: InboundEvent) -> dict[str, Any]:
        self._seq += 1
        return {
            "schema": 1,
            "eventId": event.event_id,
            "conversationId": event.external_conversation_id,
            "actorId": event.external_actor_id,
            "text": event.text,
            "receivedAt": event.received_at_ms,
            "seq": self._seq,
            "claims": dict(event.claims),
        }

    async def remove(self, events: Sequence[InboundEvent]) -> None:
        """Delete the records of events that got their final admission, in one transaction
        (failures logged: a record left behind is admitted again as a duplicate and removed
        then)."""
        if not events:
            return
        deletes = [
            DeleteCheckpoint(namespace=INBOX_NAMESPACE, key=self.key(e.event_id), scope=self.scope)
            for e in events
        ]
        try:
            await self.checkpoints.write_checkpoints(deletes)
        except Exception as exc:
            log.warning(
                "signal %s: removing %d admitted message(s) from the inbox failed (%s)",
                self.connection_id,
                len(events),
                type(exc).__name__,
            )

    async def load(self) -> list[InboundEvent]:
        """Every waiting event, oldest first (store errors propagate)."""
        rows: list[tuple[int, int, str, InboundEvent]] = []
        cursor: str | None = None
        while len(rows) < MAX_REPLAY:
            page = await self.checkpoints.list_checkpoints(
                namespace=INBOX_NAMESPACE,
                key_prefix=f"i1:{self.connection_id}:",
                scope=self.scope,
                cursor=cursor,
                limit=_PAGE,
            )
            for row in page.items:
                event = self._event(row.value)
                if event is not None:
                    seq = row.value.get("seq")
                    order = seq if isinstance(seq, int) and not isinstance(seq, bool) else 0
                    rows.append((event.received_at_ms or 0, order, row.key, event))
            cursor = page.next_cursor
            if cursor is None:
                break
        rows.sort(key=lambda item: item[:3])
        return [event for *_order, event in rows]

    def _event(self, value: Any) -> InboundEvent | None:
        if not isinstance(value, Mapping) or value.get("schema") != 1:
            return None
        parts = [value.get(k) for k in ("eventId", "conversationId", "actorId", "text")]
        if not all(isinstance(part, str) for part in parts):
            return None
        received = value.get("receivedAt")
        claims = value.get("claims")
        return InboundEvent(
            connection_id=self.connection_id,
            external_conversation_id=value["conversationId"],
            external_actor_id=value["actorId"],
            event_id=value["eventId"],
            text=value["text"],
            received_at_ms=received if isinstance(received, int) else None,
            claims=dict(claims) if isinstance(claims, Mapping) else {},
        )
