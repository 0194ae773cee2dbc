"""Long polling: ``getUpdates`` under the receiver lease, with a durable offset.

* **One receiver per bot.** Polling runs only while :class:`~adapters.toolkit.ReceiverLease`
  holds the bot's receiver lease (renewed at half its TTL beside the loop); a poller that
  does not get it stands by (``standby``) and takes over when it frees. A lost lease cuts
  a long poll or a backoff short and raises :class:`~adapters.toolkit.LeaseLostError`; an
  update being admitted is finished first, and the loss is noticed before the cursor moves.
* **Nothing acknowledged is lost.** The durable offset (the journal's §5.3 cursor under the
  service scope, :meth:`~prismd.journal.ChannelJournal.advance_cursor`, fenced by the
  lease's token) advances past an update only after ``admit`` returned a final disposition
  for it and for every update before it; a retryable admission (or any failure) re-polls
  from the first update not acknowledged, after a backoff.
* **One batch, admitted together.** The updates of one ``getUpdates`` answer are admitted
  concurrently across chats — one lane per chat, in update order within it — so their
  journal writes share the store's group commits instead of each waiting for its own. The
  offset is the contiguous watermark of admitted updates: never past one still being
  admitted or refused. A chat whose update was refused admits nothing after it in the
  batch (its order is kept); other chats go on, and what they admitted beyond the
  watermark is polled again and answered ``duplicate`` by the journal. The cursor writes
  of the lanes coalesce: one in flight at a time, the next one carries the latest
  watermark.
* **Never a hot loop.** 429 sleeps ``retry_after`` (body or ``Retry-After`` header); 409,
  5xx, network and store failures back off exponentially with jitter up to 30 s; an empty
  answer is a long poll that lasted ``poll_timeout_s``.
* **401/403** raise :class:`~prismd.channel.AdapterFatalError` (state ``unauthorized``);
  a webhook set while we would poll is fatal too (state ``webhook_active``).
"""

from __future__ import annotations

import logging
import random as _random
from collections.abc import Mapping
from typing import Any

import attrs
import trio

from prismd.channel import AdapterFatalError
from prismd.journal import NS_CURSOR, ChannelJournal, CursorRecord, Loaded, cursor_key
from stores import CheckpointStore, Clock, OwnershipScope

from ..toolkit import Backoff, LeaseLostError, ReceiverLease
from ._api import ReceiverStatus, TelegramApi, TelegramApiError, TelegramError
from ._updates import ALLOWED_UPDATES, UpdateHandler, conversation_of, update_id_of

log = logging.getLogger("prismd.telegram")

MAX_BACKOFF_S = 30.0
UPDATES_RESPONSE_BYTES = 8 * 1024 * 1024
"""Cap of a ``getUpdates`` answer: Telegram caps its body at about 4 MB, and a backlog of long
messages legitimately exceeds the 128 KiB that bounds every other answer (with that cap the
same oversized batch was re-polled forever)."""


@attrs.define(eq=False, kw_only=True)
class Poller:
    connection_id: str
    api: TelegramApi
    """The receiving client (its read timeout covers the long poll)."""
    lease: ReceiverLease
    updates: UpdateHandler
    status: ReceiverStatus
    checkpoints: CheckpointStore
    service_scope: OwnershipScope
    clock: Clock
    poll_timeout_s: int
    poll_limit: int
    random: _random.Random
    _journal: ChannelJournal = attrs.field(init=False)
    _cursor: Loaded[CursorRecord] | None = attrs.field(default=None, init=False)
    _cursor_loaded: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        self._journal = ChannelJournal(self.checkpoints)

    async def run(self, task_status: trio.TaskStatus[None]) -> None:
        """Poll until cancelled (see the module docstring); ``task_status.started()`` once
        polling or standing by."""
        self.status.state = "starting"

        def standby() -> None:
            self.status.state = "standby"
            task_status.started()

        stood_by = await self.lease.acquire(on_standby=standby)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.lease.keep)
            await self._poll(task_status if not stood_by else None)

    # ------------------------------------------------------------------ the loop

    async def _poll(self, task_status: trio.TaskStatus[None] | None) -> None:
        backoff = Backoff(self.random, cap_s=MAX_BACKOFF_S)
        # Separate from ``backoff``: successful polls must not reset the delay between
        # re-tries of an update the runtime keeps refusing for now.
        admit_backoff = Backoff(self.random, cap_s=MAX_BACKOFF_S)
        await self._check_start(backoff)
        offset = await self._load_offset()
        self.status.state = "polling"
        if task_status is not None:
            task_status.started()
        while True:
            params: dict[str, Any] = {
                "timeout": self.poll_timeout_s,
                "limit": self.poll_limit,
                "allowed_updates": list(ALLOWED_UPDATES),
            }
            if offset is not None:
                params["offset"] = offset
            polled_at = trio.current_time()
            try:
                with self.lease.guard():
                    result = await self.api.call(
                        "getUpdates", params, max_response_bytes=UPDATES_RESPONSE_BYTES
                    )
            except TelegramError as error:
                fatal = self.status.fatal(error)
                if fatal is not None:
                    raise fatal from None
                if isinstance(error, TelegramApiError) and error.status == 409:
                    await self._check_start(backoff)
                await self.lease.sleep(self._delay_for("getUpdates", error, backoff))
                continue
            self.status.log_reachable()
            if not isinstance(result, list):
                self.status.state = "backoff"
                await self.lease.sleep(backoff.next_delay())
                continue
            self.status.state = "polling"
            if not result:
                backoff.reset()
                if trio.current_time() - polled_at < 1:
                    # An empty answer should mean a long poll ran out; one that comes back at
                    # once (a proxy, a misbehaving server) must not turn into a hot loop.
                    await self.lease.sleep(1.0)
                continue
            fresh: dict[int, Mapping[str, Any]] = {}
            for u in result:
                uid = update_id_of(u)
                if uid is not None and (offset is None or uid >= offset):
                    fresh.setdefault(uid, u)  # an id answered twice is admitted once
            updates = [fresh[uid] for uid in sorted(fresh)]
            if not updates:
                # Only junk (no usable update_id) or updates already acknowledged: the next
                # poll would get the same answer at once, so wait instead of spinning.
                self.status.state = "backoff"
                await self.lease.sleep(backoff.next_delay())
                continue
            backoff.reset()
            batch = _Batch(sorted(fresh))
            await self._admit_batch(updates, batch)
            if batch.stored is not None:
                offset = batch.stored + 1
            if batch.refused:
                self.status.state = "backoff"
                delay = admit_backoff.next_delay()
                log.debug(
                    "telegram %s: update not acknowledged; polling it again in %.1f s",
                    self.connection_id,
                    delay,
                )
                await self.lease.sleep(delay)
            else:
                admit_backoff.reset()

    # ------------------------------------------------------------------ the batch

    async def _admit_batch(self, updates: list[Mapping[str, Any]], batch: _Batch) -> None:
        """Admit ``updates`` (sorted, one ``getUpdates`` answer): one lane per chat, run
        concurrently; returns once every lane stopped. A lost lease or a fatal answer
        stops every lane before its next update and is raised here."""
        lanes: dict[str | None, list[Mapping[str, Any]]] = {}
        for update in updates:
            lanes.setdefault(conversation_of(update), []).append(update)
        if len(lanes) == 1:
            await self._lane(updates, batch)
        else:
            async with trio.open_nursery() as nursery:
                for lane in lanes.values():
                    nursery.start_soon(self._lane, lane, batch)
        if batch.fatal is not None:
            raise batch.fatal

    async def _lane(self, updates: list[Mapping[str, Any]], batch: _Batch) -> None:
        """One chat's updates in order; stops at the first one not acknowledged."""
        for update in updates:
            if batch.fatal is not None:
                return
            update_id = update_id_of(update)
            assert update_id is not None
            try:
                self.lease.check()
                final = await self.updates.process(update, strict=False)
                if final and batch.admitted(update_id):
                    await self._store_watermark(batch)
            except (LeaseLostError, AdapterFatalError) as exc:
                # A lease lost while admitting: the next holder re-polls the update (the
                # journal deduplicates), so the cursor must not move.
                batch.fatal = batch.fatal or exc
                return
            except Exception as exc:
                log.warning(
                    "telegram %s: processing an update failed (%s)",
                    self.connection_id,
                    type(exc).__name__,
                )
                final = False
            if not final:
                batch.refused = True
                return

    async def _store_watermark(self, batch: _Batch) -> None:
        """Write the batch's watermark to the cursor unless a write is in flight (that one
        writes it next, coalescing): each write is fenced by the receiver lease."""
        if batch.writing:
            return
        batch.writing = True
        try:
            while batch.watermark is not None and batch.watermark != batch.stored:
                target, count = batch.watermark, batch.unstored
                # The loss is noticed before the cursor moves.
                self.lease.check()
                await self._advance_cursor(target, count)
                batch.stored = target
                batch.unstored -= count
        finally:
            batch.writing = False

    async def _check_start(self, backoff: Backoff) -> None:
        me = await self._call_retrying("getMe", backoff)
        if isinstance(me, Mapping) and isinstance(me.get("username"), str):
            self.updates.bot_username = me["username"]
        info = await self._call_retrying("getWebhookInfo", backoff)
        if isinstance(info, Mapping) and isinstance(info.get("url"), str) and info["url"]:
            self.status.state = "webhook_active"
            raise AdapterFatalError("Telegram webhook is active; polling is refused")

    async def _call_retrying(self, method: str, backoff: Backoff) -> Any:
        """A start-up call, retried on transient failures; fatal on 401/403."""
        while True:
            try:
                with self.lease.guard():
                    result = await self.api.call(method, {})
            except TelegramError as error:
                fatal = self.status.fatal(error)
                if fatal is not None:
                    raise fatal from None
                await self.lease.sleep(self._delay_for(method, error, backoff))
                continue
            self.status.log_reachable()
            return result

    def _delay_for(self, method: str, error: TelegramError, backoff: Backoff) -> float:
        """The wait before retrying ``method`` after ``error`` (sets the health state; logged)."""
        if isinstance(error, TelegramApiError) and error.retry_after is not None:
            self.status.state = "rate_limited"
            delay = float(min(error.retry_after, 3600)) + self.random.random()
        elif isinstance(error, TelegramApiError) and error.status == 409:
            self.status.state = "conflict"
            # Telegram spaces poller conflicts 3 s apart; never retry faster than that.
            delay = backoff.next_delay(minimum=3.0)
        else:
            self.status.state = "backoff"
            delay = backoff.next_delay()
        self.status.log_retry(method, error, delay)
        return delay

    # ------------------------------------------------------------------ cursor

    async def _load_offset(self) -> int | None:
        """The offset after the stored cursor (``None``: from whatever Telegram holds). A
        cursor that does not parse is logged and written over by the next advance, as an
        offset says nothing the journal needs: its records deduplicate a re-polled update."""
        try:
            self._cursor = await self._journal.load_cursor(self.service_scope, self.connection_id)
        except ValueError:  # CorruptRecordError
            log.warning("telegram %s: the stored offset is unreadable", self.connection_id)
            stored = await self.checkpoints.load_checkpoint(
                namespace=NS_CURSOR,
                key=cursor_key(self.connection_id, self.service_scope),
                scope=self.service_scope,
            )
            self._cursor = None
            if stored is not None:
                self._cursor = Loaded(stored.version, CursorRecord(), stored.fencing_token)
        self._cursor_loaded = True
        last = None if self._cursor is None else self._cursor.record.last_event_id
        if isinstance(last, str) and last.isdigit() and int(last) < 2**53 - 1:
            return int(last) + 1
        return None

    async def _advance_cursor(self, update_id: int, count: int) -> None:
        """Durably move the offset past ``update_id`` (``count`` updates admitted since the
        last write), fenced by the receiver lease: a CAS from the cursor as last stored,
        re-read once when another writer moved it; lost twice, the lease is taken as lost."""
        for _attempt in range(2):
            if not self._cursor_loaded:
                await self._load_offset()
            stored = await self._journal.advance_cursor(
                self.service_scope,
                self.connection_id,
                str(update_id),
                self.clock.now_ms(),
                known=self._cursor,
                fence=self.lease.fencing_token,
                count=count,
            )
            if stored is not None:
                self._cursor = stored
                return
            self._cursor_loaded = False
        raise LeaseLostError()


@attrs.define(eq=False)
class _Batch:
    """The admission state of one ``getUpdates`` answer (see :meth:`Poller._admit_batch`)."""

    ids: list[int]
    """Its update ids, ascending."""
    done: set[int] = attrs.field(factory=set)
    next_index: int = 0
    """``ids[:next_index]`` are all acknowledged: the contiguous watermark."""
    watermark: int | None = None
    stored: int | None = None
    """The watermark the cursor holds (``None``: nothing of this batch written yet)."""
    unstored: int = 0
    writing: bool = False
    refused: bool = False
    fatal: BaseException | None = None

    def admitted(self, update_id: int) -> bool:
        """Mark ``update_id`` acknowledged; True when the watermark moved."""
        self.done.add(update_id)
        moved = False
        while self.next_index < len(self.ids) and self.ids[self.next_index] in self.done:
            self.watermark = self.ids[self.next_index]
            self.next_index += 1
            self.unstored += 1
            moved = True
        return moved
