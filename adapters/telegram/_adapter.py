"""The Telegram channel adapter: configuration, and the parts that do the work; and its
connection kind (:data:`KIND`: the config keys, the secrets and the builder).

Contract §11. :class:`TelegramAdapter` validates its configuration and wires parts of one
job each:

* receiving — :class:`~adapters.telegram._poller.Poller` (long polling with a durable
  offset) or :class:`~adapters.telegram._webhook.WebhookServer`; with ``webhook_inbox``
  the webhook commits updates to the store's durable inbox on every instance and
  :class:`~adapters.telegram._inbox.InboxWorker` admits them (no receiver lease: any number
  of instances serve one bot). Otherwise both run under the bot's
  receiver lease (:class:`~adapters.toolkit.ReceiverLease`,
  ``prism.channels.v1.telegram.receiver`` / ``r1:<connection>``); a daemon that does not
  get it waits in ``standby`` (health) and retries; a restarted daemon adopts its
  predecessor's lease at once (``adopt=True`` with the daemon's stable owner id, SPEC
  difference 8). Losing the lease raises :class:`~adapters.toolkit.LeaseLostError`
  (``ReceiverLeaseLostError``) so the supervisor restarts ``run``;
* one update → ``admit``: :class:`~adapters.telegram._updates.UpdateHandler`;
* sending and typing: :class:`~adapters.telegram._send.TelegramSender`;
* files and the voice/document hooks: :class:`~adapters.telegram._updates.TelegramMedia`;
* streaming previews (``sendMessageDraft``, when ``send_drafts`` is on, private chats
  only): :class:`~adapters.telegram._drafts.DraftStreamer`.

**No secrets out.** The token is read per request and lives only in URLs; every exception
message is fixed text; httpx's logger is filtered (see :mod:`adapters.telegram._api`).
**Diagnosable.** Every failed Bot API call that is retried is logged (WARNING) with its
cause class and the delay (``getUpdates failed: network error (ConnectError); retry in
1.7 s``), the first success after failures at INFO; receiver lease acquire / renew /
release at DEBUG, its loss at WARNING. Logs never carry text, ids of users or chats, the
token or a URL.
"""

from __future__ import annotations

import random as _random
import re
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any, Literal

import attrs
import trio

from prismd.channel import (
    DEFAULT_TYPING_DELAY_MS,
    AdapterFeatures,
    Admit,
    AttachmentRef,
    BuildContext,
    ConfigTable,
    ConnectionKind,
    OutboundFile,
    Preview,
    Reply,
    SecretSource,
    SendResult,
)
from stores import SYSTEM_CLOCK, Clock, OwnershipScope, Store

from ..toolkit import (
    LeaseWatch,
    ReceiverLease,
    TokenConnection,
    api_origin,
    bounded_field,
    check_connection_id,
    connection_service_scope,
    token_keys,
    typing_delay_ms,
)
from ._api import (
    DEFAULT_API_ORIGIN,
    ReceiverStatus,
    TelegramApi,
    fixed_token,
    log,
    validate_api_origin,
)
from ._drafts import DraftStreamer
from ._files import send_file
from ._inbox import BusyConversations, InboxWorker
from ._poller import Poller
from ._send import MAX_CHUNK_UNITS, Synthesize, TelegramSender
from ._updates import (
    MAX_ATTACHMENT_BYTES_CAP,
    ExtractDocumentText,
    FetchedAttachment,
    TelegramMedia,
    Transcribe,
    UpdateHandler,
)
from ._webhook import WebhookServer

__all__ = ["KIND", "RECEIVER_NAMESPACE", "TelegramAdapter", "TelegramConnectionConfig"]

RECEIVER_NAMESPACE = "prism.channels.v1.telegram.receiver"
CLOSE_BUDGET_S = 5.0
_SECRET_RE = re.compile(r"^[A-Za-z0-9_-]{1,256}$")


def _declare_again(adapter: TelegramAdapter, attribute: Any, value: Any) -> Any:
    """Set one of the values the features are made of, then declare them again."""
    object.__setattr__(adapter, attribute.name, value)
    adapter.features = _features(adapter)
    return value


_DECLARE_AGAIN = attrs.setters.pipe(attrs.setters.validate, _declare_again)


@attrs.define(eq=False, kw_only=True)
class TelegramAdapter:
    """The Telegram channel adapter (implements :class:`prismd.channel.ChannelAdapter`).

    Construction is inert: no network, no credential read. ``run`` polls (or serves the
    webhook) until cancelled; ``send`` may be called concurrently and also when ``run`` is
    not running.
    """

    connection_id: str = attrs.field(validator=check_connection_id)
    token: Callable[[], str] = attrs.field(repr=False)
    admit: Admit
    store: Store
    owner_id: str
    service_scope: OwnershipScope = attrs.field(default=None)
    adopt: bool = True
    api_origin: str = attrs.field(default=DEFAULT_API_ORIGIN)
    mode: Literal["polling", "webhook"] = "polling"
    webhook_listen: str = "127.0.0.1:8443"
    webhook_path: str | None = None
    webhook_secret: str | None = attrs.field(default=None, repr=False)
    webhook_inbox: bool = False
    """Webhook mode on several instances: commit updates to the durable inbox before the
    2xx; inbox workers admit them (claims last ``lease_ttl_ms``)."""
    busy_conversations: BusyConversations | None = None
    """The runtime's conversations still in work here (inbox mode keeps their order)."""
    allow_groups: bool = False
    send_drafts: bool = attrs.field(default=False, on_setattr=_DECLARE_AGAIN)
    poll_timeout_s: int = bounded_field(30, 1, 50)
    poll_limit: int = bounded_field(100, 1, 100)
    typing_delay_ms: int = attrs.field(default=DEFAULT_TYPING_DELAY_MS, on_setattr=_DECLARE_AGAIN)
    """How long a turn runs before ``sendChatAction`` starts (declared in :attr:`features`;
    the runtime keeps the time)."""
    lease_ttl_ms: int = 90_000
    max_attachment_bytes: int = bounded_field(
        1024 * 1024, 1, MAX_ATTACHMENT_BYTES_CAP, on_setattr=_DECLARE_AGAIN
    )
    max_request_bytes: int = 128 * 1024
    clock: Clock = SYSTEM_CLOCK
    transcribe: Transcribe | None = None
    extract_document_text: ExtractDocumentText | None = None
    synthesize: Synthesize | None = None
    random: _random.Random | None = None

    _api: TelegramApi = attrs.field(init=False)
    """Sending, files, typing, drafts: lives until :meth:`aclose` (``send`` may run while
    ``run`` is restarted by the supervisor; closing it then would make sends ambiguous)."""
    _rx_api: TelegramApi = attrs.field(init=False)
    """Receiving (getMe, getUpdates, callback answers): closed when ``run`` ends."""
    _status: ReceiverStatus = attrs.field(init=False)
    _lease: ReceiverLease = attrs.field(init=False, repr=False)
    _lease_watch: LeaseWatch = attrs.field(factory=LeaseWatch, init=False, repr=False)
    _sender: TelegramSender = attrs.field(init=False)
    _media: TelegramMedia = attrs.field(init=False)
    _drafts: DraftStreamer = attrs.field(init=False)
    _updates: UpdateHandler = attrs.field(init=False)
    _poller: Poller | None = attrs.field(default=None, init=False)
    _webhook: WebhookServer | None = attrs.field(default=None, init=False)
    _inbox_worker: InboxWorker | None = attrs.field(default=None, init=False)
    features: AdapterFeatures = attrs.field(init=False)
    """Declared for the host (:class:`prismd.channel.AdapterFeatures`), which reads them on
    every turn: built once, and again when what they are made of is set."""
    send: Callable[[Reply], Coroutine[Any, Any, SendResult]] = attrs.field(init=False, repr=False)
    """``send(reply)``: :meth:`adapters.telegram._send.TelegramSender.send` itself."""

    @api_origin.validator
    def _check_origin(self, _a: object, value: str) -> None:
        validate_api_origin(value)

    @typing_delay_ms.validator
    def _check_typing_delay(self, _a: object, value: int) -> None:
        AdapterFeatures(typing=True, typing_delay_ms=value)  # one rule: the record's

    def __attrs_post_init__(self) -> None:
        if self.service_scope is None:
            self.service_scope = connection_service_scope(self.connection_id)
        if self.mode not in ("polling", "webhook"):
            raise ValueError("mode must be 'polling' or 'webhook'")
        if self.webhook_inbox and self.mode != "webhook":
            raise ValueError("webhook_inbox needs mode 'webhook'")
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
        rng = self.random if self.random is not None else _random.Random()
        self._api = TelegramApi(
            token=self.token,
            api_origin=self.api_origin,
            read_timeout_s=60.0,
        )
        self._rx_api = TelegramApi(
            token=self.token,
            api_origin=self.api_origin,
            read_timeout_s=float(self.poll_timeout_s + 15),
        )
        self._status = ReceiverStatus(self.connection_id)
        self._lease = ReceiverLease.for_adapter(
            self,
            kind="telegram",
            namespace=RECEIVER_NAMESPACE,
            log=log,
            random=rng,
            watch=self._lease_watch,
        )
        self._sender = TelegramSender(
            connection_id=self.connection_id, api=self._api, synthesize=self.synthesize
        )
        self._media = TelegramMedia(
            connection_id=self.connection_id,
            api=self._api,
            max_attachment_bytes=self.max_attachment_bytes,
            transcribe=self.transcribe,
            extract_document_text=self.extract_document_text,
        )
        self._drafts = DraftStreamer(connection_id=self.connection_id, api=self._api)
        self._updates = UpdateHandler(
            connection_id=self.connection_id,
            admit=self._status.seeing(self.admit),
            api=self._rx_api,
            media=self._media,
            allow_groups=self.allow_groups,
        )
        if self.mode == "webhook":
            assert self.webhook_secret is not None
            if self.webhook_inbox:
                self._inbox_worker = InboxWorker(
                    connection_id=self.connection_id,
                    inbox=self.store.inbox,
                    updates=self._updates,
                    owner_id=self.owner_id,
                    reservation_ttl_ms=self.lease_ttl_ms,
                    busy_conversations=self.busy_conversations,
                    adopt=self.adopt,
                    random=rng,
                )
            self._webhook = WebhookServer(
                connection_id=self.connection_id,
                listen=self.webhook_listen,
                path=self.webhook_path,
                secret=self.webhook_secret,
                max_request_bytes=self.max_request_bytes,
                lease=self._lease,
                updates=self._updates,
                status=self._status,
                api=self._rx_api,
                inbox=self.store.inbox if self.webhook_inbox else None,
                on_put=None if self._inbox_worker is None else self._inbox_worker.wake,
            )
        else:
            self._poller = Poller(
                connection_id=self.connection_id,
                api=self._rx_api,
                lease=self._lease,
                updates=self._updates,
                status=self._status,
                checkpoints=self.store.checkpoints,
                service_scope=self.service_scope,
                clock=self.clock,
                poll_timeout_s=self.poll_timeout_s,
                poll_limit=self.poll_limit,
                random=rng,
            )
        self.send = self._sender.send
        self.features = _features(self)

    # ------------------------------------------------------------------ public surface

    def health(self) -> Mapping[str, str]:
        """``{"state": …, "mode": …}`` (``"receiver": "inbox"`` in inbox mode): state idle,
        starting, standby, polling, serving, backoff, rate_limited, conflict, unauthorized,
        webhook_active, stopped; ``lastUpdateAt``, ``lastError`` and ``lastErrorAt`` once
        known (:meth:`ReceiverStatus.health_fields`)."""
        health = {"state": self._status.state, "mode": self.mode}
        if self._inbox_worker is not None:
            health["receiver"] = "inbox"
        health.update(self._status.health_fields())
        return health

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
        return self._updates.bot_username

    @property
    def uses_inbox(self) -> bool:
        """Updates go through the store's durable inbox (``webhook_inbox``)."""
        return self._inbox_worker is not None

    @property
    def receiver_lease_held(self) -> bool:
        """This adapter holds the bot's receiver lease now (for metrics)."""
        return self._lease.held

    async def wait_receiver_lease(self, held: bool) -> None:
        await self._lease_watch.wait(lambda: self._lease.held, held)

    @property
    def webhook_address(self) -> tuple[str, int] | None:
        """``(host, port)`` the webhook server listens on, once it does (port 0 resolved)."""
        return None if self._webhook is None else self._webhook.address

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Receive until cancelled. Raises :class:`AdapterFatalError` for 401/403 or a webhook
        conflict, :class:`~adapters.toolkit.LeaseLostError` when the lease is lost."""
        self._media.stopped = self._drafts.stopped = False
        try:
            async with trio.open_nursery() as nursery:
                if self.send_drafts:
                    nursery.start_soon(self._drafts.run)
                if self._inbox_worker is not None:
                    await nursery.start(self._inbox_worker.run)
                if self._webhook is not None:
                    await self._webhook.serve(task_status=task_status)
                else:
                    assert self._poller is not None
                    await self._poller.run(task_status)
        finally:
            self._status.stopped()  # a fatal state stays visible: it says why we stopped
            with trio.move_on_after(CLOSE_BUDGET_S, shield=True):
                await self._lease.release()
                await self._rx_api.aclose()

    async def aclose(self) -> None:
        """Mark stopped (``fetch_attachment`` and drafts then do nothing) and close the HTTP
        clients. ``send`` still works afterwards (it opens a new client)."""
        self._media.stopped = self._drafts.stopped = True
        self._status.state = "stopped"
        await self._api.aclose()
        await self._rx_api.aclose()

    async def send_typing(
        self, external_conversation_id: str, thread_id: str | None = None
    ) -> None:
        """``sendChatAction typing`` (lasts ≤5 s on the client); failures are ignored."""
        await self._sender.send_typing(external_conversation_id, thread_id)

    def send_draft(self, preview: Preview) -> None:
        """Stream a preview as ``sendMessageDraft`` (fire-and-forget; the runtime's
        ``on_preview``): see :class:`~adapters.telegram._drafts.DraftStreamer`. A no-op
        unless ``send_drafts`` is on and ``run`` is active. Drafts are never journaled."""
        if self.send_drafts:
            self._drafts.offer(preview)

    async def fetch_attachment(self, ref: AttachmentRef) -> FetchedAttachment | None:
        """The file's bytes, or ``None`` (:meth:`._updates.TelegramMedia.fetch`)."""
        return await self._media.fetch(ref)

    async def send_file(self, reply: Reply, file: OutboundFile) -> SendResult:  # see _files
        return await send_file(self._api, self.connection_id, reply, file)


def _features(adapter: TelegramAdapter) -> AdapterFeatures:
    return AdapterFeatures(
        previews=adapter.send_drafts,
        typing=True,
        typing_delay_ms=adapter.typing_delay_ms,
        attachments=True,
        inbox=adapter.uses_inbox,
        max_file_bytes=adapter.max_attachment_bytes,
    )


# The connection kind: the config keys, the secrets and the builder of the adapter above.


@attrs.frozen
class TelegramConnectionConfig(TokenConnection):
    api_origin: str = DEFAULT_API_ORIGIN
    mode: Literal["polling", "webhook"] = "polling"
    webhook_listen: str = "127.0.0.1:8443"
    webhook_path: str | None = None
    """``None`` means ``/telegram/<id>``; see :attr:`effective_webhook_path`."""
    webhook_secret_env: str | None = None
    webhook_inbox: bool = False
    allow_groups: bool = False
    poll_timeout_s: int = 30
    typing_delay_ms: int = DEFAULT_TYPING_DELAY_MS
    """A turn shows ``typing`` only once it has run this long (0..60,000; 0 = at once)."""
    kind: Literal["telegram"] = "telegram"

    @property
    def effective_webhook_path(self) -> str:
        return self.webhook_path if self.webhook_path is not None else f"/telegram/{self.id}"


def _parse(table: ConfigTable, conn_id: str) -> TelegramConnectionConfig:
    token_env, token_file = token_keys(table)
    origin = api_origin(table, DEFAULT_API_ORIGIN)
    mode = table.choice("mode", ("polling", "webhook"), "polling")
    webhook_listen: str = table.get_address("webhook_listen", "127.0.0.1:8443")
    webhook_path = table.get_str("webhook_path")
    if webhook_path is not None and not webhook_path.startswith("/"):
        raise table.error("webhook_path", "must start with '/'")
    webhook_secret_env = table.get_env_name("webhook_secret_env")
    if mode == "webhook" and webhook_secret_env is None:
        # Telegram echoes the secret in a header; without it anyone could post updates.
        raise table.error("webhook_secret_env", "is required in webhook mode")
    webhook_inbox = table.get_bool("webhook_inbox")
    if webhook_inbox and mode != "webhook":
        raise table.error("webhook_inbox", "needs mode = 'webhook'")
    return TelegramConnectionConfig(
        id=conn_id,
        token_env=token_env,
        token_file=token_file,
        api_origin=origin,
        mode=mode,
        webhook_listen=webhook_listen,
        webhook_path=webhook_path,
        webhook_secret_env=webhook_secret_env,
        webhook_inbox=webhook_inbox,
        allow_groups=table.get_bool("allow_groups"),
        poll_timeout_s=table.get_int("poll_timeout_s", 30, low=1, high=50),
        typing_delay_ms=typing_delay_ms(table),
    )


def _secrets(conn: TelegramConnectionConfig) -> Sequence[SecretSource]:
    sources = [conn.token_source]
    if conn.webhook_secret_env is not None:
        sources.append(SecretSource("webhook_secret_env", conn.webhook_secret_env))
    return sources


def _build(conn: TelegramConnectionConfig, context: BuildContext) -> TelegramAdapter:
    # Read once now so a missing token fails the start, not the first poll.
    token = conn.read_token(context)
    secret = None
    if conn.webhook_secret_env:
        secret = context.secret("webhook_secret_env", conn.webhook_secret_env, None)
    # The receiver lease (and the inbox's claims) last the daemon's lease_ttl_ms, so a
    # standby takes over that soon; a long poll must fit inside it with room to spare.
    floor = conn.poll_timeout_s * 1000 + 10_000 if conn.mode == "polling" else 5_000
    lease_ttl_ms = min(max(context.lease_ttl_ms, floor), 300_000)
    return TelegramAdapter(
        connection_id=conn.id,
        token=fixed_token(token),
        admit=context.admit,
        store=context.store,
        owner_id=context.owner_id,
        adopt=True,
        api_origin=conn.api_origin,
        mode=conn.mode,
        webhook_listen=conn.webhook_listen,
        webhook_path=conn.webhook_path,
        webhook_secret=secret,
        webhook_inbox=conn.webhook_inbox,
        busy_conversations=getattr(context.conversations, "busy_conversations", None),
        allow_groups=conn.allow_groups,
        poll_timeout_s=conn.poll_timeout_s,
        typing_delay_ms=conn.typing_delay_ms,
        lease_ttl_ms=lease_ttl_ms,
        max_attachment_bytes=context.max_attachment_bytes,
    )


KIND = ConnectionKind(
    name="telegram",
    label="telegram",
    parse=_parse,
    build=_build,
    secrets=_secrets,
    listen_address=lambda conn: conn.webhook_listen if conn.mode == "webhook" else None,
    where=lambda conn, _adapter: f"({conn.mode}{', inbox' if conn.webhook_inbox else ''})",
)
"""The ``telegram`` connection kind (collected by :mod:`adapters.kinds`)."""
