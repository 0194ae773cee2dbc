"""Telegram Bot API adapter: long polling (or a webhook endpoint), sending, attachments.

Contract §11, with these guarantees:

* **One receiver per bot.** Polling and the webhook server both hold the service-owned
  receiver lease (``prism.channels.v1.telegram.receiver`` / ``r1:<connection>``) for their
  whole lifetime. A daemon that does not get it waits in ``standby`` (health) and retries;
  a restarted daemon reclaims its predecessor's lease at once (``reclaim=True`` with the
  daemon's stable owner id, SPEC difference 8). Losing the lease raises
  :class:`ReceiverLeaseLostError` so the supervisor restarts ``run``.
* **Nothing acknowledged is lost.** The durable offset (the §5.3 cursor record under the
  service scope, written with the lease's fencing token) advances past an update only after
  ``admit`` returned a final disposition; a retryable admission (or any failure) re-polls
  the same offset after a backoff.
* **Never a hot loop.** 429 sleeps ``retry_after`` (body or ``Retry-After`` header); 409,
  5xx, network and store failures back off exponentially with jitter up to 30 s; an empty
  answer is a long poll that lasted ``poll_timeout_s``.
* **401/403** stop the adapter with :class:`~prismd.channel.AdapterFatalError`
  (health ``unauthorized``); a webhook set while we would poll is fatal too
  (health ``webhook_active``).
* **No secrets out.** The token is read per request and lives only in URLs; every exception
  message is fixed text; httpx's logger is filtered (see :mod:`adapters.telegram._api`).
* **Diagnosable.** Every failed Bot API call that is retried is logged (WARNING) with its
  cause class and the delay (``getUpdates failed: network error (ConnectError); retry in
  1.7 s``), the first success after failures at INFO; receiver lease acquire / renew /
  release at DEBUG, its loss at WARNING. Logs never carry text, ids of users or chats, the
  token or a URL.

Webhook mode (``mode="webhook"``) is served by :mod:`adapters.telegram._webhook`. Streaming
previews go out as ``sendMessageDraft`` through :meth:`TelegramAdapter.send_draft` when
``send_drafts`` is on (private chats only).
"""

from __future__ import annotations

import logging
import random as _random
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal

import attrs
import trio

from prismd.channel import (
    AdapterFatalError,
    Admission,
    Admit,
    AttachmentRef,
    DeliveryOutcomeUnknownError,
    InboundEvent,
    Preview,
    Reply,
    SendResult,
)
from prismd.journal import cursor_key
from prismd.redact import utf8_len
from stores import (
    SYSTEM_CLOCK,
    CheckpointConflictError,
    Clock,
    LeaseRecord,
    OwnershipScope,
    Store,
    ms_to_iso,
)

from ._api import (
    DEFAULT_API_ORIGIN,
    TelegramApi,
    TelegramApiError,
    TelegramCredentialError,
    TelegramError,
    describe_failure,
    validate_api_origin,
)
from ._format import send_formatted
from ._parse import (
    ALLOWED_UPDATES,
    ParsedUpdate,
    _bounded_str,
    clean_text,
    parse_update,
    update_id_of,
)

log = logging.getLogger("prismd.telegram")

RECEIVER_NAMESPACE = "prism.channels.v1.telegram.receiver"
CURSOR_NAMESPACE = "prism.channels.v1.cursor"
CURSOR_CATEGORY = "channel-cursor"
MAX_CHUNK_UNITS = 3_500
MAX_SEND_ATTEMPTS = 5
MAX_CONTROLS = 8
MAX_BACKOFF_S = 30.0
MAX_ATTACHMENT_BYTES_CAP = 4 * 1024 * 1024
FETCH_DEADLINE_S = 60.0
"""Whole-fetch deadline of :meth:`TelegramAdapter.fetch_attachment` (getFile + download)."""
UPDATES_RESPONSE_BYTES = 8 * 1024 * 1024
"""Cap of a ``getUpdates`` answer: Telegram caps its body at about 4 MB, and a backlog of long
messages legitimately exceeds the 128 KiB that bounds every other answer (with that cap the
same oversized batch was re-polled forever)."""
_FILE_SEGMENT_RE = re.compile(r"^[A-Za-z0-9._-]+$")
_SECRET_RE = re.compile(r"^[A-Za-z0-9_-]{1,256}$")

Transcribe = Callable[[bytes, str], Awaitable[str | None]]
"""``transcribe(audio, mime_type) -> text``."""
ExtractDocumentText = Callable[[bytes, str], Awaitable[str | None]]
"""``extract_document_text(data, mime_type) -> text``."""
Synthesize = Callable[[str], Awaitable[tuple[bytes, str] | None]]
"""``synthesize(text) -> (audio, format)``; format like ``ogg``, ``audio/mpeg`` or ``.m4a``."""


class ReceiverLeaseLostError(Exception):
    """The receiver lease was lost (expired or taken over); polling stopped."""

    def __init__(self) -> None:
        super().__init__("Telegram receiver lease lost")


@attrs.frozen
class FetchedAttachment:
    data: bytes = attrs.field(repr=False)
    mime_type: str | None = None
    file_name: str | None = None


def utf16_units(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


def chunk_text(text: str, limit: int = MAX_CHUNK_UNITS) -> list[str]:
    """Split into chunks of at most ``limit`` UTF-16 code units, never inside a surrogate pair.

    Python strings hold code points, so a chunk never splits a pair by construction; the
    budget counts astral characters as two units.
    """
    chunks: list[str] = []
    current: list[str] = []
    units = 0
    for char in text:
        width = 2 if ord(char) > 0xFFFF else 1
        if units + width > limit:
            chunks.append("".join(current))
            current, units = [], 0
        current.append(char)
        units += width
    if current:
        chunks.append("".join(current))
    return chunks


def tail_units(text: str, limit: int) -> str:
    """The longest suffix of at most ``limit`` UTF-16 units (never half a surrogate pair)."""
    units = 0
    for index in range(len(text) - 1, -1, -1):
        units += 2 if ord(text[index]) > 0xFFFF else 1
        if units > limit:
            return text[index + 1 :]
    return text


_VOICE_FORMATS = {"ogg": "audio/ogg", "oga": "audio/ogg", "opus": "audio/ogg"}
_VOICE_FORMATS |= {"mp3": "audio/mpeg", "mpeg": "audio/mpeg", "m4a": "audio/mp4"}


def _voice_format(fmt: str) -> tuple[str, str] | None:
    """``(file extension, mime type)`` for a synthesized format, or ``None`` to skip."""
    name = fmt.strip().lower().removeprefix("audio/").lstrip(".")
    mime = _VOICE_FORMATS.get(name)
    if mime is None:
        return None
    ext = {"oga": "ogg", "opus": "ogg", "mpeg": "mp3"}.get(name, name)
    return ext, mime


def _valid_file_path(path: object) -> bool:
    if not isinstance(path, str) or not path or utf8_len(path) > 256:
        return False
    segments = path.split("/")
    return len(segments) <= 4 and all(
        _FILE_SEGMENT_RE.fullmatch(s) and s not in (".", "..") for s in segments
    )


@attrs.define(eq=False)
class _Backoff:
    """Exponential backoff with jitter: 1, 2, 4 … 30 s, each scaled by a factor in [0.5, 1]."""

    random: _random.Random
    base_s: float = 1.0
    cap_s: float = MAX_BACKOFF_S
    failures: int = 0

    def next_delay(self, minimum: float = 0.0) -> float:
        delay = min(self.cap_s, self.base_s * 2.0**self.failures)
        self.failures = min(self.failures + 1, 16)
        return max(minimum, delay * (0.5 + self.random.random() / 2))

    def reset(self) -> None:
        self.failures = 0


@attrs.define(eq=False, kw_only=True)
class TelegramAdapter:
    """The Telegram channel adapter (implements :class:`prismd.channel.ChannelAdapter`).

    Construction is inert: no network, no credential read. ``run`` polls (or serves the
    webhook) until cancelled; ``send`` may be called concurrently and also when ``run`` is
    not running.
    """

    connection_id: str = attrs.field()
    token: Callable[[], str] = attrs.field(repr=False)
    admit: Admit
    store: Store
    owner_id: str
    service_scope: OwnershipScope = attrs.field(default=None)
    reclaim: bool = True
    api_origin: str = attrs.field(default=DEFAULT_API_ORIGIN)
    mode: Literal["polling", "webhook"] = "polling"
    webhook_listen: str = "127.0.0.1:8443"
    webhook_path: str | None = None
    webhook_secret: str | None = attrs.field(default=None, repr=False)
    allow_groups: bool = False
    send_drafts: bool = False
    poll_timeout_s: int = attrs.field(default=30)
    poll_limit: int = attrs.field(default=100)
    lease_ttl_ms: int = 90_000
    max_attachment_bytes: int = attrs.field(default=1024 * 1024)
    max_request_bytes: int = 128 * 1024
    clock: Clock = SYSTEM_CLOCK
    transport: Any = None
    """An ``httpx.AsyncBaseTransport`` (tests); ``None`` for the network."""
    transcribe: Transcribe | None = None
    extract_document_text: ExtractDocumentText | None = None
    synthesize: Synthesize | None = None
    random: _random.Random | None = None

    _api: TelegramApi = attrs.field(init=False)
    """Sending, files, typing, drafts: lives until :meth:`aclose` (``send`` may run while
    ``run`` is restarted by the supervisor; closing it then would make sends ambiguous)."""
    _rx_api: TelegramApi = attrs.field(init=False)
    """Receiving (getMe, getUpdates, callback answers): closed when ``run`` ends."""
    _lease_renewed_at: float = attrs.field(default=0.0, init=False)
    _state: str = attrs.field(default="idle", init=False)
    _stopped: bool = attrs.field(default=False, init=False)
    _lease: LeaseRecord | None = attrs.field(default=None, init=False, repr=False)
    _bot_username: str | None = attrs.field(default=None, init=False)
    _cursor_version: int | None = attrs.field(default=None, init=False)
    _admitted: int = attrs.field(default=0, init=False)
    _failed_calls: int = attrs.field(default=0, init=False)
    """Consecutive failed (retried) receiving calls, for the "reachable again" log line."""
    _rng: _random.Random = attrs.field(init=False)
    _draft: Preview | None = attrs.field(default=None, init=False, repr=False)
    _draft_wakeup: trio.Event = attrs.field(factory=trio.Event, init=False, repr=False)
    _draft_worker_running: bool = attrs.field(default=False, init=False)
    webhook_address: tuple[str, int] | None = attrs.field(default=None, init=False)
    """``(host, port)`` the webhook server listens on, once it does (port 0 resolved)."""

    @connection_id.validator
    def _check_connection(self, _a: object, value: str) -> None:
        if not isinstance(value, str) or not value or len(value.encode()) > 256:
            raise ValueError("connection_id must be a non-empty string of at most 256 bytes")

    @api_origin.validator
    def _check_origin(self, _a: object, value: str) -> None:
        validate_api_origin(value)

    @poll_timeout_s.validator
    def _check_poll_timeout(self, _a: object, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 50:
            raise ValueError("poll_timeout_s must be an integer in 1..50")

    @poll_limit.validator
    def _check_poll_limit(self, _a: object, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
            raise ValueError("poll_limit must be an integer in 1..100")

    @max_attachment_bytes.validator
    def _check_attachment_cap(self, _a: object, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError("max_attachment_bytes must be an integer")
        if not 1 <= value <= MAX_ATTACHMENT_BYTES_CAP:
            raise ValueError("max_attachment_bytes must be in 1..4 MiB")

    def __attrs_post_init__(self) -> None:
        if self.service_scope is None:
            self.service_scope = OwnershipScope(
                tenant_id="prismd-service", account_id=self.connection_id
            )
        if self.mode not in ("polling", "webhook"):
            raise ValueError("mode must be 'polling' or 'webhook'")
        if self.mode == "webhook" and not (
            isinstance(self.webhook_secret, str) and _SECRET_RE.fullmatch(self.webhook_secret)
        ):
            raise ValueError("webhook mode needs a webhook_secret of 1-256 [A-Za-z0-9_-]")
        if self.mode == "polling" and not (
            self.poll_timeout_s * 1000 + 10_000 <= self.lease_ttl_ms <= 300_000
        ):
            raise ValueError("lease_ttl_ms must cover the poll timeout plus 10 s, up to 5 min")
        if self.mode == "webhook" and not 5_000 <= self.lease_ttl_ms <= 300_000:
            raise ValueError("lease_ttl_ms must be in 5 s..5 min in webhook mode")
        if not 1024 <= self.max_request_bytes <= 1024 * 1024:
            raise ValueError("max_request_bytes must be in 1 KiB..1 MiB")
        if self.webhook_path is None:
            self.webhook_path = f"/telegram/{self.connection_id}"
        self._rng = self.random if self.random is not None else _random.Random()
        self._api = TelegramApi(
            token=self.token,
            api_origin=self.api_origin,
            transport=self.transport,
            read_timeout_s=60.0,
        )
        self._rx_api = TelegramApi(
            token=self.token,
            api_origin=self.api_origin,
            transport=self.transport,
            read_timeout_s=float(self.poll_timeout_s + 15),
        )

    # ------------------------------------------------------------------ public surface

    def health(self) -> Mapping[str, str]:
        """``{"state": …}``: idle, starting, standby, polling, serving, backoff,
        rate_limited, conflict, unauthorized, webhook_active, stopped."""
        return {"state": self._state, "mode": self.mode}

    @property
    def capabilities(self) -> Mapping[str, object]:
        """Contract §3 ``ChannelCapabilities``: offset acknowledgement, callback controls."""
        return {
            "acknowledgement": "telegram_offset" if self.mode == "polling" else "none",
            "controls": "callback",
            "max_text_code_units": MAX_CHUNK_UNITS,
        }

    @property
    def bot_username(self) -> str | None:
        return self._bot_username

    @property
    def receiver_lease_held(self) -> bool:
        """This adapter holds the bot's receiver lease now (for metrics)."""
        return self._lease is not None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Receive until cancelled. Raises :class:`AdapterFatalError` for 401/403 or a webhook
        conflict, :class:`ReceiverLeaseLostError` when the lease is lost."""
        self._stopped = False
        try:
            async with trio.open_nursery() as nursery:
                if self.send_drafts:
                    nursery.start_soon(self._draft_worker)
                if self.mode == "webhook":
                    from ._webhook import serve_webhook

                    await serve_webhook(self, task_status=task_status)
                else:
                    await self._run_polling(task_status)
        finally:
            if self._state not in ("unauthorized", "webhook_active"):
                self._state = "stopped"  # a fatal state stays visible: it says why we stopped
            with trio.move_on_after(5, shield=True):
                await self._release_lease()
                await self._rx_api.aclose()

    async def aclose(self) -> None:
        """Mark stopped (``fetch_attachment`` and drafts then do nothing) and close the HTTP
        clients. ``send`` still works afterwards (it opens a new client)."""
        self._stopped = True
        self._state = "stopped"
        await self._api.aclose()
        await self._rx_api.aclose()

    # ------------------------------------------------------------------ lease

    async def _acquire_lease(self) -> bool:
        lease = await self.store.leases.try_acquire_lease(
            namespace=RECEIVER_NAMESPACE,
            key=f"r1:{self.connection_id}",
            scope=self.service_scope,
            owner_id=self.owner_id,
            ttl_ms=self.lease_ttl_ms,
            reclaim=self.reclaim,
        )
        self._lease = lease
        self._lease_renewed_at = trio.current_time()
        log.debug(
            "telegram %s: receiver lease %s",
            self.connection_id,
            "acquired" if lease is not None else "held by another receiver",
        )
        return lease is not None

    async def _renew_lease(self) -> None:
        lease = self._lease
        if lease is None:
            raise ReceiverLeaseLostError()
        renewed = await self.store.leases.renew_lease(
            namespace=RECEIVER_NAMESPACE,
            key=lease.key,
            scope=self.service_scope,
            owner_id=self.owner_id,
            token=lease.token,
            ttl_ms=self.lease_ttl_ms,
        )
        if renewed is None:
            self._lease = None
            log.warning(
                "telegram %s: receiver lease lost (expired or taken over)", self.connection_id
            )
            raise ReceiverLeaseLostError()
        self._lease = renewed
        self._lease_renewed_at = trio.current_time()
        log.debug("telegram %s: receiver lease renewed", self.connection_id)

    async def _renew_if_due(self) -> None:
        """Renew when a third of the TTL has passed (long batches: slow hooks or admits)."""
        if trio.current_time() - self._lease_renewed_at >= self.lease_ttl_ms / 3000:
            await self._renew_lease()

    async def _release_lease(self) -> None:
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            await self.store.leases.release_lease(
                namespace=RECEIVER_NAMESPACE,
                key=lease.key,
                scope=self.service_scope,
                owner_id=self.owner_id,
                token=lease.token,
            )
        except Exception as exc:
            # it expires on its own; a release failure must not mask the exit reason
            log.debug(
                "telegram %s: releasing the receiver lease failed (%s); it expires on its own",
                self.connection_id,
                type(exc).__name__,
            )
            return
        log.debug("telegram %s: receiver lease released", self.connection_id)

    async def _await_lease(self, task_status: trio.TaskStatus[None]) -> bool:
        """Hold the lease, waiting in ``standby`` while another receiver has it.

        Returns True if ``task_status.started()`` was already called (standby).
        """
        if await self._acquire_lease():
            return False
        self._state = "standby"
        log.info("telegram %s: another receiver holds the lease; standing by", self.connection_id)
        task_status.started()
        while True:
            await trio.sleep(self.lease_ttl_ms / 3000 * (0.5 + self._rng.random() / 2))
            if await self._acquire_lease():
                return True

    async def _sleep_holding_lease(self, seconds: float) -> None:
        """Sleep, renewing the lease at a third of its TTL so long backoffs never lose it."""
        deadline = trio.current_time() + seconds
        step = self.lease_ttl_ms / 3000
        while (remaining := deadline - trio.current_time()) > 0:
            await trio.sleep(min(step, remaining))
            await self._renew_lease()

    # ------------------------------------------------------------------ polling

    def _fatal(self, error: TelegramError) -> AdapterFatalError | None:
        if isinstance(error, TelegramCredentialError) or (
            isinstance(error, TelegramApiError) and error.status in (401, 403)
        ):
            self._state = "unauthorized"
            return AdapterFatalError("Telegram rejected the bot credentials")
        return None

    async def _call_retrying(self, method: str, backoff: _Backoff) -> Any:
        """A start-up call, retried on transient failures; fatal on 401/403."""
        while True:
            try:
                result = await self._rx_api.call(method, {})
            except TelegramError as error:
                fatal = self._fatal(error)
                if fatal is not None:
                    raise fatal from None
                await self._sleep_holding_lease(self._delay_for(method, error, backoff))
                continue
            self._log_reachable()
            return result

    def _delay_for(self, method: str, error: TelegramError, backoff: _Backoff) -> float:
        """The wait before retrying ``method`` after ``error`` (sets the health state; logged)."""
        if isinstance(error, TelegramApiError) and error.retry_after is not None:
            self._state = "rate_limited"
            delay = float(min(error.retry_after, 3600)) + self._rng.random()
        elif isinstance(error, TelegramApiError) and error.status == 409:
            self._state = "conflict"
            # Telegram spaces poller conflicts 3 s apart; never retry faster than that.
            delay = backoff.next_delay(minimum=3.0)
        else:
            self._state = "backoff"
            delay = backoff.next_delay()
        self._log_retry(method, error, delay)
        return delay

    def _log_retry(
        self, method: str, error: TelegramError, delay_s: float, attempt: int | None = None
    ) -> None:
        """One WARNING per retried call. Receiving calls (``attempt`` omitted) count towards
        the "reachable again" line; a send names its own attempt."""
        if attempt is None:
            self._failed_calls += 1
            attempt = self._failed_calls
        log.warning(
            "telegram %s: %s failed: %s; retry in %.1f s (attempt %d)",
            self.connection_id,
            method,
            describe_failure(error),
            delay_s,
            attempt,
        )

    def _log_reachable(self) -> None:
        """After failed calls: one INFO line that the Bot API answers again (a reconnect)."""
        if self._failed_calls:
            log.info(
                "telegram %s: Bot API reachable again after %d failed call(s)",
                self.connection_id,
                self._failed_calls,
            )
            self._failed_calls = 0

    async def _check_start(self, backoff: _Backoff) -> None:
        me = await self._call_retrying("getMe", backoff)
        if isinstance(me, Mapping) and isinstance(me.get("username"), str):
            self._bot_username = me["username"]
        info = await self._call_retrying("getWebhookInfo", backoff)
        if isinstance(info, Mapping) and isinstance(info.get("url"), str) and info["url"]:
            self._state = "webhook_active"
            raise AdapterFatalError("Telegram webhook is active; polling is refused")

    async def _run_polling(self, task_status: trio.TaskStatus[None]) -> None:
        self._state = "starting"
        started = await self._await_lease(task_status)
        backoff = _Backoff(self._rng)
        # Separate from ``backoff``: successful polls must not reset the delay between
        # re-tries of an update the runtime keeps refusing for now.
        admit_backoff = _Backoff(self._rng)
        await self._check_start(backoff)
        offset = await self._load_offset()
        self._state = "polling"
        if not started:
            task_status.started()
        while True:
            await self._renew_lease()
            params: dict[str, Any] = {
                "timeout": self.poll_timeout_s,
                "limit": self.poll_limit,
                "allowed_updates": list(ALLOWED_UPDATES),
            }
            if offset is not None:
                params["offset"] = offset
            polled_at = trio.current_time()
            try:
                result = await self._rx_api.call(
                    "getUpdates",
                    params,
                    max_response_bytes=UPDATES_RESPONSE_BYTES,
                )
            except TelegramError as error:
                fatal = self._fatal(error)
                if fatal is not None:
                    raise fatal from None
                if isinstance(error, TelegramApiError) and error.status == 409:
                    await self._check_start(backoff)
                await self._sleep_holding_lease(self._delay_for("getUpdates", error, backoff))
                continue
            self._log_reachable()
            await self._renew_lease()
            if not isinstance(result, list):
                self._state = "backoff"
                await self._sleep_holding_lease(backoff.next_delay())
                continue
            self._state = "polling"
            if not result:
                backoff.reset()
                if trio.current_time() - polled_at < 1:
                    # An empty answer should mean a long poll ran out; one that comes back at
                    # once (a proxy, a misbehaving server) must not turn into a hot loop.
                    await self._sleep_holding_lease(1.0)
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
                self._state = "backoff"
                await self._sleep_holding_lease(backoff.next_delay())
                continue
            backoff.reset()
            for update in updates:
                update_id = update_id_of(update)
                assert update_id is not None
                if offset is not None and update_id < offset:
                    continue
                await self._renew_if_due()
                try:
                    final = await self._process_holding_lease(update)
                    if final:
                        await self._advance_cursor(update_id)
                except (ReceiverLeaseLostError, AdapterFatalError):
                    raise
                except Exception as exc:
                    log.warning(
                        "telegram %s: processing an update failed (%s)",
                        self.connection_id,
                        type(exc).__name__,
                    )
                    final = False
                if not final:
                    self._state = "backoff"
                    delay = admit_backoff.next_delay()
                    log.debug(
                        "telegram %s: update not acknowledged; polling it again in %.1f s",
                        self.connection_id,
                        delay,
                    )
                    await self._sleep_holding_lease(delay)
                    break
                admit_backoff.reset()
                offset = update_id + 1

    # ------------------------------------------------------------------ cursor

    def _cursor_key(self) -> str:
        return cursor_key(self.connection_id, self.service_scope)

    async def _load_offset(self) -> int | None:
        record = await self.store.checkpoints.load_checkpoint(
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
                await self.store.checkpoints.save_checkpoint(
                    namespace=CURSOR_NAMESPACE,
                    key=self._cursor_key(),
                    scope=self.service_scope,
                    version=current + 1,
                    expected_version=current,
                    fencing_token=self._lease.fencing_token if self._lease else None,
                    value=value,
                    category=CURSOR_CATEGORY,
                )
            except CheckpointConflictError:
                self._cursor_version = None
                continue
            self._cursor_version = current + 1
            self._admitted += 1
            return
        raise ReceiverLeaseLostError()

    # ------------------------------------------------------------------ one update

    async def _process(self, update: Mapping[str, Any], *, strict: bool) -> bool:
        """Answer, parse, enrich and admit one update. True = acknowledge it.

        ``strict`` (webhook): a failed ``answerCallbackQuery`` raises so Telegram retries.
        """
        parsed = parse_update(
            update,
            connection_id=self.connection_id,
            allow_groups=self.allow_groups,
            bot_username=self._bot_username,
        )
        if parsed is None:
            return True
        if parsed.callback_query_id is not None:
            await self._answer_callback(parsed.callback_query_id, strict=strict)
        admission = await self._admit_parsed(parsed)
        return admission is None or not admission.retryable

    async def _process_holding_lease(self, update: Mapping[str, Any]) -> bool:
        """:meth:`_process` while a background task renews the receiver lease every third of
        its TTL, so a slow hook (a long transcription) cannot let it lapse mid-update.

        A failed renewal is not raised into the processing (cancelling an admission half-way
        helps nobody); a lost lease raises :class:`ReceiverLeaseLostError` afterwards, before
        the cursor moves, and the next holder re-polls the update (the journal deduplicates).
        """
        lost = False

        async def renew() -> None:
            nonlocal lost
            while True:
                await trio.sleep(self.lease_ttl_ms / 3000)
                try:
                    await self._renew_lease()
                except ReceiverLeaseLostError:
                    lost = True
                    return
                except Exception:
                    return  # a store hiccup: the renewal after this update tries again

        async with trio.open_nursery() as nursery:
            nursery.start_soon(renew)
            try:
                final = await self._process(update, strict=False)
            finally:
                nursery.cancel_scope.cancel()
        if lost:
            raise ReceiverLeaseLostError()
        return final

    async def _admit_parsed(self, parsed: ParsedUpdate) -> Admission | None:
        if parsed.event is None:
            return None
        event = await self._enrich(parsed.event)
        return await self.admit(event)

    async def _answer_callback(self, query_id: str, *, strict: bool) -> None:
        for attempt in range(2):
            try:
                await self._rx_api.call("answerCallbackQuery", {"callback_query_id": query_id})
                return
            except TelegramApiError as error:
                if error.retry_after is None or attempt == 1:
                    if strict:
                        raise
                    return
                delay = min(error.retry_after, 60)
                self._log_retry("answerCallbackQuery", error, delay, attempt + 1)
                await trio.sleep(delay)
            except TelegramError:
                if strict:
                    raise
                return

    async def _enrich(self, event: InboundEvent) -> InboundEvent:
        """Append transcripts / extracted document text (hooks of §11.5) to the event text."""
        added: list[str] = []
        for ref in event.attachments:
            hook: Callable[[bytes, str], Awaitable[str | None]] | None
            if ref.kind == "voice":
                hook, default_mime = self.transcribe, "audio/ogg"
            elif ref.kind == "document":
                hook, default_mime = self.extract_document_text, "application/octet-stream"
            else:
                continue
            if hook is None:
                continue
            fetched = await self.fetch_attachment(ref)
            if fetched is None:
                continue
            try:
                text = await hook(fetched.data, ref.mime_type or default_mime)
            except Exception:
                continue
            if isinstance(text, str) and text.strip():
                added.append(text)
        if not added:
            return event
        parts = [event.text, *added] if event.text.strip() else added
        return attrs.evolve(event, text="\n\n".join(parts))

    # ------------------------------------------------------------------ attachments

    async def fetch_attachment(self, ref: AttachmentRef) -> FetchedAttachment | None:
        """The file's bytes, or ``None`` (stopped, bad ref, too large, any failure).

        The size cap is enforced from ``getFile``'s ``file_size`` (else the ref's) before
        downloading, then from ``Content-Length`` and while streaming. Redirects are refused.
        """
        if self._stopped or not isinstance(ref, AttachmentRef):
            return None
        if ref.kind not in ("image", "document", "voice"):
            return None
        file_id = ref.transport_file_id
        if _bounded_str(file_id, 256) is None:
            return None
        length = ref.byte_length
        if isinstance(length, bool) or not isinstance(length, int) or length < 0:
            return None
        data: bytes | None = None
        # One deadline for both requests: httpx's timeouts bound each read, not the whole
        # download, and a server dripping bytes would otherwise hold the poller indefinitely.
        with trio.move_on_after(FETCH_DEADLINE_S):
            try:
                info = await self._api.call("getFile", {"file_id": file_id})
                if not isinstance(info, Mapping) or not _valid_file_path(info.get("file_path")):
                    return None
                declared = info.get("file_size")
                if isinstance(declared, bool) or not isinstance(declared, int):
                    declared = length
                if declared > self.max_attachment_bytes:
                    return None
                data = await self._api.download(info["file_path"], self.max_attachment_bytes)
            except TelegramError:
                return None
        if data is None:
            return None
        return FetchedAttachment(data=data, mime_type=ref.mime_type, file_name=ref.file_name)

    # ------------------------------------------------------------------ drafts

    def send_draft(self, preview: Preview) -> None:
        """Stream a preview as ``sendMessageDraft`` (fire-and-forget; the runtime's
        ``on_preview``).

        A no-op unless ``send_drafts`` is on, ``run`` is active, the preview is for this
        connection and a private chat (ids not starting with ``-``). One request is in flight
        at a time; newer previews replace a pending one (latest wins). The text is the last
        3,500 UTF-16 units. Errors are ignored; drafts are never journaled.
        """
        if (
            not self.send_drafts
            or self._stopped
            or not self._draft_worker_running
            or preview.connection_id != self.connection_id
            or not preview.external_conversation_id
            or preview.external_conversation_id.startswith("-")
        ):
            return
        self._draft = preview
        self._draft_wakeup.set()

    async def _draft_worker(self) -> None:
        self._draft_worker_running = True
        try:
            while True:
                await self._draft_wakeup.wait()
                self._draft_wakeup = trio.Event()
                preview, self._draft = self._draft, None
                if preview is None or self._stopped:
                    continue
                params: dict[str, Any] = {
                    "chat_id": preview.external_conversation_id,
                    "draft_id": 1,
                    "text": tail_units(clean_text(preview.text), MAX_CHUNK_UNITS),
                }
                if preview.thread_id is not None:
                    params["message_thread_id"] = preview.thread_id
                try:
                    await self._api.call("sendMessageDraft", params)
                except TelegramError:
                    pass
        finally:
            self._draft_worker_running = False
            self._draft = None

    # ------------------------------------------------------------------ sending

    async def send_typing(self, conversation_id: str, thread_id: str | None = None) -> None:
        """``sendChatAction typing`` (lasts ≤5 s on the client); failures are ignored."""
        params: dict[str, Any] = {"chat_id": conversation_id, "action": "typing"}
        if thread_id is not None:
            params["message_thread_id"] = thread_id
        try:
            await self._api.call("sendChatAction", params)
        except TelegramError:
            pass

    async def send(self, reply: Reply) -> SendResult:
        """Deliver a reply as chunks (+ optional synthesized voice); a final answer is sent as
        Telegram HTML converted from Markdown, plain text when Telegram refuses it (``_format``).

        Returns ``delivered`` or a known failure (``invalid_destination``, ``empty_reply``,
        ``invalid_controls``, ``telegram_unauthorized``, ``telegram_forbidden``,
        ``telegram_rate_limited``, ``telegram_credential``, ``telegram_chat_migrated``,
        ``telegram_api_error``). Raises :class:`DeliveryOutcomeUnknownError` when a chunk was
        already accepted or the outcome of a request is unknown (network error or an
        unreadable response — unlike the reference, which called the latter a failure).
        A 400 with ``migrate_to_chat_id`` is reported as ``telegram_chat_migrated``: we do not
        re-address a reply to another conversation id behind the operator's back.
        """
        if (
            reply.connection_id != self.connection_id
            or not isinstance(reply.external_conversation_id, str)
            or not reply.external_conversation_id
        ):
            return SendResult(delivered=False, reason="invalid_destination")
        # A lone surrogate would make httpx's JSON encoding raise before anything is sent.
        chunks = chunk_text(clean_text(reply.text))
        if not chunks:
            return SendResult(delivered=False, reason="empty_reply")
        markup: dict[str, Any] | None = None
        if reply.controls:
            controls = reply.controls
            if len(controls) > MAX_CONTROLS or any(
                _bounded_str(c.label, 64) is None or _bounded_str(c.value, 64) is None
                for c in controls
            ):
                return SendResult(delivered=False, reason="invalid_controls")
            markup = {
                "inline_keyboard": [[{"text": c.label, "callback_data": c.value} for c in controls]]
            }
        message_id: str | None = None
        for index, chunk in enumerate(chunks):
            params: dict[str, Any] = {"chat_id": reply.external_conversation_id, "text": chunk}
            if reply.thread_id is not None:
                params["message_thread_id"] = reply.thread_id
            if markup is not None and index == len(chunks) - 1:
                params["reply_markup"] = markup
            try:
                # Agents answer in Markdown: final answers go out as Telegram HTML, with a
                # plain-text resend when Telegram cannot parse the entities.
                result = await send_formatted(
                    self._send_chunk, params, markdown=reply.kind == "final"
                )
            except TelegramApiError as error:
                if index > 0 or _ambiguous(error):
                    raise DeliveryOutcomeUnknownError("Telegram delivery outcome unknown") from None
                return SendResult(delivered=False, reason=_failure_reason(error))
            except TelegramCredentialError:
                if index > 0:
                    raise DeliveryOutcomeUnknownError("Telegram delivery outcome unknown") from None
                return SendResult(delivered=False, reason="telegram_credential")
            except Exception:  # any other TelegramError (network, unreadable answer) too
                raise DeliveryOutcomeUnknownError("Telegram delivery outcome unknown") from None
            if isinstance(result, Mapping) and isinstance(result.get("message_id"), int):
                message_id = str(result["message_id"])
        if reply.kind == "final" and self.synthesize is not None and reply.text.strip():
            await self._send_voice(reply)
        return SendResult(delivered=True, message_id=message_id)

    async def _send_chunk(self, params: Mapping[str, Any]) -> Any:
        for attempt in range(1, MAX_SEND_ATTEMPTS + 1):
            try:
                return await self._api.call("sendMessage", params)
            except TelegramApiError as error:
                # A gateway error may hide a posted message: resending could duplicate it.
                if error.retry_after is None or attempt == MAX_SEND_ATTEMPTS or _ambiguous(error):
                    raise
                delay = min(error.retry_after, 3600)
                self._log_retry("sendMessage", error, delay, attempt)
                await trio.sleep(delay)
        raise AssertionError("unreachable")

    async def _send_voice(self, reply: Reply) -> None:
        """Optional synthesized voice after the text; every failure is swallowed."""
        assert self.synthesize is not None
        try:
            produced = await self.synthesize(reply.text)
            if produced is None:
                return
            audio, fmt = produced
            voice = _voice_format(fmt) if isinstance(fmt, str) else None
            if voice is None or not isinstance(audio, bytes) or not audio:
                return
            ext, mime = voice
            params: dict[str, Any] = {"chat_id": reply.external_conversation_id}
            if reply.thread_id is not None:
                params["message_thread_id"] = reply.thread_id
            files = {"voice": (f"reply.{ext}", audio, mime)}
            await self._api.call("sendVoice", params, files=files)
        except Exception:
            return


def _ambiguous(error: TelegramApiError) -> bool:
    """A 5xx without Telegram's JSON error body (a proxy/gateway 502/503/504 page).

    The gateway may have forwarded the request and lost Telegram's answer, so the message may
    be posted: calling it a failure would let reconcile resend it without acknowledgement.
    A parsable ``{"ok": false, ...}`` 5xx is Telegram's own verdict and stays a failure.
    """
    return not error.enveloped and error.status >= 500


def _failure_reason(error: TelegramApiError) -> str:
    if error.migrate_to_chat_id is not None:
        return "telegram_chat_migrated"
    return {
        401: "telegram_unauthorized",
        403: "telegram_forbidden",
        429: "telegram_rate_limited",
    }.get(error.status, "telegram_api_error")
