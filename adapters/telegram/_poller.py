"""Long polling: ``getUpdates`` under the receiver lease, with a durable offset.

* **One receiver per bot.** Polling runs only while :class:`~adapters.toolkit.ReceiverLease`
  holds the bot's receiver lease (renewed at half its TTL beside the loop); a poller that
  does not get it stands by (``standby``) and takes over when it frees. A lost lease cuts
  a long poll or a backoff short and raises :class:`~adapters.toolkit.LeaseLostError`; an
  update being admitted is finished first, and the loss is noticed before the cursor moves.
* **Nothing acknowledged is lost.** The durable offset (the §5.3 cursor record under the
  service scope, written with the lease's fencing token) advances past an update only after
  ``admit`` returned a final disposition; a retryable admission (or any failure) re-polls
  the same offset after a backoff.
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
from prismd.journal import cursor_key
from stores import CheckpointConflictError, CheckpointStore, Clock, OwnershipScope, ms_to_iso

from ..toolkit import Backoff, LeaseLostError, ReceiverLease
from ._api import TelegramApi, TelegramApiError, TelegramError
from ._parse import ALLOWED_UPDATES, update_id_of
from ._status import ReceiverStatus
from ._updates import UpdateHandler

log = logging.getLogger("prismd.telegram")

CURSOR_NAMESPACE = "prism.channels.v1.cursor"
CURSOR_CATEGORY = "channel-cursor"
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
    _cursor_version: int | None = attrs.field(default=None, init=False)
    _admitted: int = attrs.field(default=0, init=False)

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
            updates = sorted(
                (
                    u
                    for u in result
                    if (uid := update_id_of(u)) is not None and (offset is None or uid >= offset)
                ),
                key=lambda u: update_id_of(u) or 0,
            )
            if not updates:
                # Only junk (no usable update_id) or updates already acknowledged: the next
                # poll would get the same answer at once, so wait instead of spinning.
                self.status.state = "backoff"
                await self.lease.sleep(backoff.next_delay())
                continue
            backoff.reset()
            for update in updates:
                update_id = update_id_of(update)
                assert update_id is not None
                if offset is not None and update_id < offset:
                    continue
                self.lease.check()
                try:
                    final = await self.updates.process(update, strict=False)
                    if final:
                        # A lease lost while admitting: the next holder re-polls the update
                        # (the journal deduplicates), so the cursor must not move.
                        self.lease.check()
                        await self._advance_cursor(update_id)
                except (LeaseLostError, AdapterFatalError):
                    raise
                except Exception as exc:
                    log.warning(
                        "telegram %s: processing an update failed (%s)",
                        self.connection_id,
                        type(exc).__name__,
                    )
                    final = False
                if not final:
                    self.status.state = "backoff"
                    delay = admit_backoff.next_delay()
                    log.debug(
                        "telegram %s: update not acknowledged; polling it again in %.1f s",
                        self.connection_id,
                        delay,
                    )
                    await self.lease.sleep(delay)
                    break
                admit_backoff.reset()
                offset = update_id + 1

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

    def _cursor_key(self) -> str:
        return cursor_key(self.connection_id, self.service_scope)

    async def _load_offset(self) -> int | None:
        record = await self.checkpoints.load_checkpoint(
            namespace=CURSOR_NAMESPACE, key=self._cursor_key(), scope=self.service_scope
        )
        if record is None:
            self._cursor_version, self._admitted = 0, 0
            return None
        self._cursor_version = record.version
        value = record.value if isinstance(record.value, Mapping) else {}
        admitted = value.get("admitted")
        self._admitted = admitted if isinstance(admitted, int) and admitted >= 0 else 0
        last = value.get("lastEventId")
        if isinstance(last, str) and last.isdigit() and int(last) < 2**53 - 1:
            return int(last) + 1
        return None

    async def _advance_cursor(self, update_id: int) -> None:
        """Durably move the offset past ``update_id`` (fenced by the receiver lease)."""
        for _attempt in range(2):
            if self._cursor_version is None:
                await self._load_offset()
            current = self._cursor_version or 0
            value = {
                "admitted": self._admitted + 1,
                "lastEventId": str(update_id),
                "updatedAt": ms_to_iso(self.clock.now_ms()),
            }
            try:
                await self.checkpoints.save_checkpoint(
                    namespace=CURSOR_NAMESPACE,
                    key=self._cursor_key(),
                    scope=self.service_scope,
                    version=current + 1,
                    expected_version=current,
                    fencing_token=self.lease.fencing_token,
                    value=value,
                    category=CURSOR_CATEGORY,
                )
            except CheckpointConflictError:
                self._cursor_version = None
                continue
            self._cursor_version = current + 1
            self._admitted += 1
            return
        raise LeaseLostError()
