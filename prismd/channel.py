"""Transport-neutral shapes that cross the runtime boundary (contract §3).

Adapters build :class:`InboundEvent` from a platform update, await
``runtime.admit(event)`` and acknowledge the transport only when the returned
:class:`Admission` is not :attr:`Admission.retryable`. Replies leave through the adapter of
their connection (:class:`AdapterRegistry`, which the runtime is opened with: its ``send``),
or a host's own ``deliver(reply) -> SendResult``; a send that raises means the outcome is
*ambiguous*. A ``SendResult`` with ``held=True`` means "not
sent, and not failed": the channel has no live connection to the conversation and asks
for the reply again when one opens (the web chat; see ``Runtime.redeliver_pending``).

These records have no validators on purpose: ``admit`` validates and answers
``denied/malformed`` instead of raising, whatever an adapter hands it.

Their text is measured, cut and redacted here too (the end of the module, §6.2, §16): what
leaves the runtime goes through :meth:`Redactor.redact`, then :func:`truncate_utf8` with
the reply cap; the journal measures UTF-8 bytes (:func:`utf8_len`), Telegram and Signal
UTF-16 units (:func:`utf16_units`, :func:`chunk_text`: most emoji count twice).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeAlias

import attrs
import trio

_log = logging.getLogger("prismd.channel")

AttachmentKind: TypeAlias = Literal["image", "document", "voice"]
ApprovalOutcome: TypeAlias = Literal["allow_once", "reject_once"]
Action: TypeAlias = Literal["message", "command", "approval", "notify"]
ReplyKind: TypeAlias = Literal["final", "notice"]
AdmissionStatus: TypeAlias = Literal["accepted", "denied", "unsupported"]

RETRYABLE_DENIALS = frozenset({"capacity", "unavailable", "stopped"})
DEFAULT_TYPING_DELAY_MS = 1000
"""How long a turn runs before its typing indicator starts: an answer ready sooner
needs none (one request less per message), a longer turn shows it."""
MAX_TYPING_DELAY_MS = 60_000


@attrs.frozen
class AttachmentRef:
    kind: AttachmentKind
    transport_file_id: str
    byte_length: int = 0
    mime_type: str | None = None
    file_name: str | None = None
    connection_id: str | None = None
    """The connection whose platform issued ``transport_file_id`` (a file id is valid only
    for the bot or account that saw it): the host asks that connection's adapter alone.
    ``None`` for a ref rebuilt from an older journal record."""


@attrs.frozen
class ApprovalInput:
    token: str
    outcome: ApprovalOutcome


@attrs.frozen
class InboundEvent:
    connection_id: str
    external_conversation_id: str
    external_actor_id: str
    event_id: str
    text: str = ""
    attachments: tuple[AttachmentRef, ...] = ()
    approval: ApprovalInput | None = None
    thread_id: str | None = None
    received_at_ms: int | None = None
    claims: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class Admission:
    status: AdmissionStatus
    reason: str | None = None
    operation_id: str | None = None
    duplicate: bool = False
    hint: str | None = None
    """For a refusal the user or operator can act on: one sentence saying what to do (a
    limit, a missing grant, ``/help``). Fixed text with ids or numbers only, never message
    text or secrets. Not part of the contract's shape: the control socket and the web chat
    send it only when set."""

    @property
    def retryable(self) -> bool:
        """The adapter must not acknowledge the transport (offset, 2xx) for this one."""
        return self.status == "denied" and self.reason in RETRYABLE_DENIALS


@attrs.frozen
class Button:
    label: str
    value: str


_APPROVAL_BUTTON_RE = re.compile(r"^p:([ad]):([A-Za-z0-9_-]{32,64})$")


def button_lines(buttons: Sequence[Button]) -> list[str] | None:
    """The approval buttons (at most two: allow, deny) as lines the user answers with a
    command, for a channel that shows no buttons: ``Reply /approve TOKEN to allow once.``,
    ``Reply /deny TOKEN to deny.``; ``None`` when there are more, or one is not an approval
    button.

    >>> button_lines([Button("Deny", "p:d:" + "t" * 32)])
    ['Reply /deny tttttttttttttttttttttttttttttttt to deny.']
    """
    if len(buttons) > 2:
        return None
    lines: list[str] = []
    for button in buttons:
        match = _APPROVAL_BUTTON_RE.match(button.value) if isinstance(button.value, str) else None
        if match is None:
            return None
        verb, token = match.groups()
        lines.append(
            f"Reply /approve {token} to allow once."
            if verb == "a"
            else f"Reply /deny {token} to deny."
        )
    return lines


MAX_REPLY_FILES = 10
"""Files one reply may carry (more are named in its text, not sent)."""
MAX_FILE_NAME_CHARS = 255


@attrs.frozen
class ReplyFile:
    """A file that goes with a reply, by reference: its bytes are fetched from ``source``
    when the reply is delivered (again at every resend), never journaled.

    ``name`` (and ``media_type``) come from the agent — peer text: shown in the chat,
    never logged."""

    source: str
    """Who fetches it: the alias of the agent that answered (see ``FileSource``)."""
    ref: str
    """The source's own reference (an ``a2a`` agent: which part of which artifact of which
    remote task); no bytes, no secret."""
    name: str
    media_type: str | None = None
    size: int | None = None
    """In bytes, when known before fetching (a file sent inline)."""


@attrs.frozen
class OutboundFile:
    """A reply's file as fetched, handed to :meth:`ChannelAdapter.send_file`."""

    name: str
    media_type: str | None
    data: bytes = attrs.field(repr=False)


@attrs.frozen
class Reply:
    connection_id: str
    external_conversation_id: str
    text: str
    kind: ReplyKind
    buttons: tuple[Button, ...] = ()
    thread_id: str | None = None
    in_reply_to: str | None = None
    operation_id: str | None = None
    """The journaled operation this reply answers (one reply per operation): a stable id a
    channel may show its client, so a reply seen twice (history and live) is shown once."""
    files: tuple[ReplyFile, ...] = ()
    """Files that go with the reply (by reference; the host fetches them and hands the
    adapter their bytes through :meth:`ChannelAdapter.send_file`)."""
    staged_at_ms: int | None = None
    """When the journal staged it (wall clock, ms): before any attempt to send it, so a
    channel that deduplicates resends for a while (Discord's nonce) may count from here
    instead of storing its own first attempt. ``None``: not known."""


def _held_is_not_delivered(instance: SendResult, _attribute: object, held: bool) -> None:
    if held and instance.delivered:
        raise ValueError("a held reply is not delivered")


@attrs.frozen
class SendResult:
    """The outcome of one ``deliver``: delivered, refused (``delivered=False``), or held.

    ``held=True``: nothing was sent *and* nothing failed — the channel has no live
    connection for the conversation right now and will ask the runtime to re-drive the
    reply when one opens. The runtime keeps the reply record ``pending`` (marked held)
    instead of settling it ``delivery_failed``.
    """

    delivered: bool
    message_id: str | None = None
    reason: str | None = None
    held: bool = attrs.field(default=False, validator=_held_is_not_delivered)

    @classmethod
    def hold(cls, reason: str | None = None) -> SendResult:
        """Not sent, not failed: re-drive it when the conversation reconnects."""
        return cls(False, reason=reason, held=True)


FILES_UNSUPPORTED = SendResult(False, reason="files_unsupported")
""":meth:`ChannelAdapter.send_file` of a channel that sends no files."""


@attrs.frozen
class PastReply:
    """A delivered reply the journal still holds (``Runtime.recent_replies``): the text as
    sent (redacted, bounded), without controls (their tokens are never stored)."""

    operation_id: str
    kind: ReplyKind
    text: str
    created_at_ms: int
    in_reply_to: str | None = None
    """The event id of the operation it answers, when that record is still kept."""


@attrs.frozen
class Preview:
    """A streaming preview of an answer (never journaled, never a reply)."""

    connection_id: str
    external_conversation_id: str
    text: str
    thread_id: str | None = None


# --------------------------------------------------------------------------- adapters
#
# What the supervisor needs from a channel adapter (Telegram, Signal, web chat).
#
# An adapter is built with an ``admit`` callable (``runtime.admit``) and whatever durable
# state it needs. The supervisor starts ``run`` with ``nursery.start``; ``run`` calls
# ``task_status.started()`` once it is serving (lease held, socket bound, …) and then runs
# until cancelled. A fatal condition (e.g. Telegram 401) is raised as
# :class:`AdapterFatalError`: the supervisor does not restart the adapter after it. Any other
# exception is a crash: the supervisor restarts ``run`` with bounded backoff.
#
# ``send`` is the runtime's ``deliver`` for replies on this connection: it returns a
# :class:`~prismd.channel.SendResult` for a known outcome and raises for an ambiguous one.

Admit = Callable[[InboundEvent], Awaitable[Admission]]


class AdapterFatalError(Exception):
    """The adapter cannot work with its configuration (bad credentials, webhook conflict)."""


class DeliveryOutcomeUnknownError(Exception):
    """The platform may or may not have accepted the message (ambiguous delivery)."""


@attrs.frozen
class AdapterFeatures:
    """What an adapter offers beyond receiving and sending, declared (never probed): a
    runtime opened with an :class:`AdapterRegistry` uses a seam (previews, typing, file
    fetches) only when some adapter declares the matching feature, and the registry routes
    each call to the adapter of the connection concerned."""

    previews: bool = False
    """:meth:`ChannelAdapter.send_draft` shows streaming previews (Telegram drafts)."""
    unanswered_notices: bool = False
    """Its users are told, by a notice through :meth:`ChannelAdapter.send`, when an operator
    settles one of their messages unanswered after a crash (``execution_unknown``,
    ``abandoned``); the runtime reads such notices back for its history
    (``unanswered_notices``). See :mod:`prismd.runtime._unanswered`."""
    idempotent_send: bool = False
    """:meth:`ChannelAdapter.send` may be called again for a reply whose first send's outcome
    is unknown: the repeat is deduplicated or proven by the channel itself (Discord's
    nonce, the reply looked up), never a blind second post. The runtime then re-drives
    such replies after a start (:mod:`prismd.runtime._unconfirmed`)."""
    typing: bool = False
    """:meth:`ChannelAdapter.send_typing` shows a typing indicator."""
    typing_delay_ms: int = attrs.field(default=DEFAULT_TYPING_DELAY_MS)
    """With ``typing``: the runtime starts the indicator only once a turn's agent run has
    lasted this long (then renews it while the run lasts); ``0`` starts it at once (a
    channel where showing it costs nothing, such as the web chat)."""
    attachments: bool = False
    """:meth:`ChannelAdapter.fetch_attachment` fetches the files its refs name."""
    inbox: bool = False
    """Its updates go through the store's durable inbox (``store.inbox``, source = the
    connection id): the control socket shows their depth and dead letters."""
    max_file_bytes: int = 0
    """:meth:`ChannelAdapter.send_file` sends files of up to this many bytes to its
    conversations (an agent's files that go with a reply); ``0``: it sends none, and a
    reply names its files instead."""

    @typing_delay_ms.validator
    def _check_typing_delay(self, _a: object, value: int) -> None:
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or not 0 <= value <= MAX_TYPING_DELAY_MS
        ):
            raise ValueError(f"typing_delay_ms must be an integer in 0..{MAX_TYPING_DELAY_MS}")


NO_FEATURES = AdapterFeatures()


class ChannelAdapter(Protocol):
    @property
    def connection_id(self) -> str: ...

    @property
    def features(self) -> AdapterFeatures: ...

    async def run(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None: ...

    async def send(self, reply: Reply) -> SendResult: ...

    def health(self) -> Mapping[str, str]:
        """Bounded enums only (no ids, numbers, paths or text)."""
        ...

    def send_draft(self, preview: Preview) -> None:
        """A streaming preview (fire-and-forget, never raises); a no-op unless
        ``features.previews``."""
        ...

    async def send_typing(
        self, external_conversation_id: str, thread_id: str | None = None
    ) -> None:
        """A typing indicator (failures ignored); a no-op unless ``features.typing``."""
        ...

    async def fetch_attachment(self, ref: AttachmentRef) -> Any:
        """The bytes of a file this connection's platform issued (an object with ``data``),
        or ``None``; always ``None`` unless ``features.attachments``."""
        ...

    async def send_file(self, reply: Reply, file: OutboundFile) -> SendResult:
        """Send ``file`` (at most ``features.max_file_bytes``) to ``reply``'s conversation,
        after the reply's text: delivered, refused, or held as :meth:`send` answers; raises
        when the outcome is unknown. Refused (``files_unsupported``) when
        ``features.max_file_bytes`` is 0."""
        ...

    async def aclose(self) -> None:
        """Release what the adapter holds outside ``run`` (HTTP clients)."""
        ...

    @property
    def receiver_lease_held(self) -> bool:
        """It holds its platform's receiver lease now; False without one (the web chat)."""
        ...

    async def wait_receiver_lease(self, held: bool) -> None:
        """Return once :attr:`receiver_lease_held` is ``held``, told by the lease itself."""


UNKNOWN_CONNECTION = "unknown_connection"
"""``SendResult.reason`` of a reply whose connection has no adapter."""


SendWithFiles: TypeAlias = Callable[[ChannelAdapter, Reply], Awaitable[SendResult]]
"""How a reply that carries files is sent (the host fetches them from the agent that
answered: :func:`prismd.daemon._files.deliver_with_files`); without it, only the text."""


class AdapterRegistry:
    """The adapters of the connections, by connection id: the way out of the runtime
    (``open_messaging_runtime(adapters=…)``). A reply, preview, typing indicator or file
    fetch goes to the adapter of its connection, and only when that adapter's features
    offer it."""

    def __init__(
        self,
        adapters: Sequence[ChannelAdapter] = (),
        *,
        send_with_files: SendWithFiles | None = None,
    ) -> None:
        self._by_id: dict[str, ChannelAdapter] = {}
        self._send_with_files = send_with_files
        for adapter in adapters:
            self.add(adapter)

    def add(self, adapter: ChannelAdapter) -> None:
        self._by_id[adapter.connection_id] = adapter

    def __getitem__(self, connection_id: str) -> ChannelAdapter:
        return self._by_id[connection_id]

    def get(self, connection_id: str) -> ChannelAdapter | None:
        return self._by_id.get(connection_id)

    def items(self) -> list[tuple[str, ChannelAdapter]]:
        return list(self._by_id.items())

    def values(self) -> list[ChannelAdapter]:
        return list(self._by_id.values())

    def any_offers(self, feature: str) -> bool:
        """Some adapter offers ``feature`` (``previews``, ``typing``, ``attachments``)."""
        return any(getattr(a.features, feature) for a in self._by_id.values())

    async def send(self, reply: Reply) -> SendResult:
        """The reply, sent by its connection's adapter; an unknown connection is not
        delivered. An adapter's exception propagates on purpose: the message may have gone
        out, and the runtime records a raising send as ambiguous (``delivery_unknown``)."""
        adapter = self._by_id.get(reply.connection_id)
        if adapter is None:
            return SendResult(delivered=False, reason=UNKNOWN_CONNECTION)
        if reply.files and self._send_with_files is not None:
            return await self._send_with_files(adapter, reply)
        return await adapter.send(reply)

    def send_draft(self, preview: Preview) -> None:
        """A streaming preview to its connection's adapter (Telegram drafts; adapters
        without previews are not asked). Never raises."""
        adapter = self._by_id.get(preview.connection_id)
        if adapter is None or not adapter.features.previews:
            return
        try:
            adapter.send_draft(preview)
        except Exception as exc:
            _log.warning("preview failed: %s", type(exc).__name__)

    async def send_typing(
        self, connection_id: str, external_conversation_id: str, thread_id: str | None
    ) -> None:
        """A typing indicator on the connection (when its adapter shows one)."""
        adapter = self._by_id.get(connection_id)
        if adapter is not None and adapter.features.typing:
            await adapter.send_typing(external_conversation_id, thread_id)

    def typing_delay_ms(self, connection_id: str) -> int:
        """The connection's typing delay, as its adapter declares it."""
        adapter = self._by_id.get(connection_id)
        return DEFAULT_TYPING_DELAY_MS if adapter is None else adapter.features.typing_delay_ms

    def tells_unanswered(self, connection_id: str) -> bool:
        """The connection's users are told when a message of theirs is settled unanswered."""
        adapter = self._by_id.get(connection_id)
        return adapter is not None and adapter.features.unanswered_notices

    async def fetch_attachment(self, ref: AttachmentRef) -> Any:
        """The file of ``ref``, asked of the adapter of its connection (a file id is only
        valid for the bot that saw it). A ref without a connection id (rebuilt from an
        older record) is asked of each adapter that fetches files; the others answer
        ``None`` for ids they did not issue, and the first answer wins."""
        if ref.connection_id is not None:
            adapter = self._by_id.get(ref.connection_id)
            if adapter is None or not adapter.features.attachments:
                return None
            return await adapter.fetch_attachment(ref)
        for adapter in self._by_id.values():
            if not adapter.features.attachments:
                continue
            fetched = await adapter.fetch_attachment(ref)
            if fetched is not None:
                return fetched
        return None

    async def aclose(self) -> None:
        """Close every adapter's resources outside ``run`` (HTTP clients); never raises."""
        for adapter in self._by_id.values():
            try:
                await adapter.aclose()
            except Exception as exc:
                _log.warning("closing %s failed: %s", adapter.connection_id, type(exc).__name__)


# --------------------------------------------------------------------------- connection kinds
#
# A connection kind (``[[connections]] kind = "telegram"``) is declared once, by its adapter
# package (``adapters.telegram.KIND``), and collected by :mod:`adapters.kinds`: how its config
# table is read, which secrets it needs, how its adapter is built, and what the daemon shows
# of it. The daemon's config and wiring read that registry; nothing else names a kind.


class ConnectionSettings(Protocol):
    """A parsed ``[[connections]]`` entry (each kind has its own frozen record)."""

    @property
    def id(self) -> str: ...

    @property
    def kind(self) -> str: ...


class ConfigTable(Protocol):
    """One ``[[connections]]`` table being read (the daemon's config reader): every
    getter marks the key as known, checks its TOML type and raises the error of
    :meth:`error`, which names the file and key (``[[connections]][2].mode``)."""

    def get_str(self, name: str, default: Any = None, *, required: bool = False) -> Any: ...

    def get_int(
        self, name: str, default: Any = None, *, low: int = 0, high: int = 2**53
    ) -> Any: ...

    def get_bool(self, name: str, default: bool = False) -> bool: ...

    def choice(self, name: str, choices: tuple[str, ...], default: str | None) -> Any: ...

    def get_address(self, name: str, default: str | None = None) -> Any:
        """A ``host:port`` string (checked), or ``default``."""
        ...

    def get_env_name(self, name: str) -> str | None:
        """The name of an environment variable (checked), or ``None``."""
        ...

    def str_list(self, name: str) -> tuple[str, ...] | None:
        """An array of non-empty strings (checked), or ``None`` when absent."""
        ...

    def error(self, name: str | None, message: str) -> Exception: ...


class GrantView(Protocol):
    """What a kind may check of the ``[[grants]]`` of its connection."""

    @property
    def actors(self) -> tuple[str, ...]: ...

    @property
    def pairing(self) -> bool: ...


@attrs.frozen
class SecretSource:
    """A secret a connection reads at start: ``key`` names it in errors (``token_env``)."""

    key: str
    env_name: str | None
    file_name: str | None = None


@attrs.frozen
class BuildContext:
    """What a kind's builder gets from the daemon (construction only, nothing is served)."""

    admit: Admit
    store: Any
    """The open :class:`stores.Store`."""
    owner_id: str
    """This daemon's stable owner id for the connection (its leases survive a restart)."""
    secret: Callable[[str, str | None, str | None], str] = attrs.field(repr=False)
    """``secret(key, env_name, file_name)``: read a secret (a missing one raises the
    config's error naming ``connections.<id>.<key>``); the value is also registered with
    the daemon's redactor."""
    grants: tuple[GrantView, ...] = ()
    """The ``[[grants]]`` entries of this connection."""
    retention_days: int = 7
    max_attachment_bytes: int = 1024 * 1024
    lease_ttl_ms: int = 30_000
    """``[limits] lease_ttl_ms``: how long a receiver's lease or inbox reservation outlives
    its holder."""
    conversations: Any = None
    """The runtime (built before it is opened: it answers nothing until then): its history
    and re-drive of held replies (the web chat), and the conversations it still works on
    (``busy_conversations``, the Telegram inbox)."""


@attrs.frozen
class ConnectionKind:
    """One connection kind, as its adapter package declares it."""

    name: str
    """The ``kind`` value in the config."""
    label: str
    """How the daemon's startup line names it (``web chat``)."""
    parse: Callable[[ConfigTable, str], ConnectionSettings]
    """``parse(table, connection_id)``: read the kind's own keys (the caller rejects the
    ones not read)."""
    build: Callable[[Any, BuildContext], ChannelAdapter] | None = None
    """``build(settings, context)``: the adapter, inert; ``None`` while the kind is not built
    (a config may name it, ``check-config`` and ``run`` refuse it)."""
    secrets: Callable[[Any], Sequence[SecretSource]] = lambda _settings: ()
    """The secrets ``build`` reads (``check-config`` proves they are present)."""
    check_grants: Callable[[Any, Sequence[GrantView]], tuple[str, str] | None] = (
        lambda _settings, _grants: None
    )
    """A cross-check of the connection's grants: ``(key, error text)``, or ``None``."""
    listen_address: Callable[[Any], str | None] = lambda _settings: None
    """The address the connection will listen on, if any (named in bind errors)."""
    where: Callable[[Any, Any], str] = lambda _settings, _adapter: "(connected)"
    """``where(settings, adapter)``: the startup line's hint (a URL, the mode)."""

    @property
    def available(self) -> bool:
        """The kind is built in this build."""
        return self.build is not None


# --------------------------------------------------- text: measured, cut and redacted

LONE_SURROGATE_RE = re.compile("[\ud800-\udfff]")
"""Any surrogate code point. ``"\\ud800"`` is legal JSON text but cannot be encoded as
UTF-8, so no store, socket or terminal can take it: inputs refuse it or replace it."""


def replace_surrogates(text: str) -> str:
    """``text`` with every surrogate code point replaced by U+FFFD."""
    return LONE_SURROGATE_RE.sub("\ufffd", text)


REDACTED = "[REDACTED]"
TRUNCATION_MARKER = "\u2026[truncated]"
MAX_DETAIL_BYTES = 512


def _normalize(values: Iterable[str]) -> tuple[str, ...]:
    return tuple(sorted({s for s in values if isinstance(s, str) and s}, key=len, reverse=True))


@attrs.frozen
class Redactor:
    """Replaces every occurrence of each secret with ``[REDACTED]``.

    Longer secrets are replaced first so a secret containing another one is removed whole.
    Empty secrets are ignored. Example::

        >>> Redactor(("s3cret",)).redact("token s3cret here")
        'token [REDACTED] here'
    """

    secrets: tuple[str, ...] = attrs.field(converter=_normalize, default=())

    @classmethod
    def of(cls, secrets: Iterable[str]) -> Redactor:
        return cls(tuple(secrets))

    def redact(self, text: str) -> str:
        for secret in self.secrets:
            if secret in text:
                text = text.replace(secret, REDACTED)
        return text


def utf8_len(text: str) -> int:
    """The UTF-8 length (lone surrogates counted as 3 bytes), without encoding ASCII text:
    the journal measures every record's JSON with it."""
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _prefix_bytes(text: str, max_bytes: int) -> str:
    # errors="ignore" drops a code point cut in half at the end of the byte prefix.
    data = text.encode("utf-8", "surrogatepass")[: max(0, max_bytes)]
    return data.decode("utf-8", "ignore")


def truncate_utf8(text: str, max_bytes: int) -> tuple[str, bool]:
    """``(text, False)`` when it fits in ``max_bytes`` UTF-8 bytes, else the largest
    prefix of ``max_bytes - len(marker)`` bytes (no broken code point) plus the marker,
    and ``True``."""
    if utf8_len(text) <= max_bytes:
        return text, False
    room = max_bytes - utf8_len(TRUNCATION_MARKER)
    return _prefix_bytes(text, room) + TRUNCATION_MARKER, True


def bound_detail(text: str, max_bytes: int = MAX_DETAIL_BYTES) -> str:
    """A detail string (error message, reason) cut to ``max_bytes`` without a marker."""
    if utf8_len(text) <= max_bytes:
        return text
    return _prefix_bytes(text, max_bytes)


def utf16_units(text: str) -> int:
    """The length of ``text`` in UTF-16 code units."""
    return len(text.encode("utf-16-le", "surrogatepass")) // 2


def chunk_text(text: str, limit: int) -> list[str]:
    """Split ``text`` into chunks of at most ``limit`` UTF-16 code units, in order, never
    inside a surrogate pair; ``[]`` for empty text. Joined, the chunks are ``text``.

    >>> chunk_text("ab\\U0001F600c", 2)
    ['ab', '\\U0001F600', 'c']
    """
    if limit < 2:
        raise ValueError("limit must be at least 2 (one astral character)")
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
