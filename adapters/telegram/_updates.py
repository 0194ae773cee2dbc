"""What comes in from Telegram: ``Update`` → :class:`~prismd.channel.InboundEvent`
(contract §11.4, §11.5), the files an event refers to, and the one step polling, the
webhook and its inbox share: :class:`UpdateHandler` takes an update to ``admit``.

The parse is pure functions, no I/O. Every update with a valid ``update_id`` yields a
:class:`ParsedUpdate`: either an event to admit or a deliberate ignore with a bounded
reason code. Ignored updates are still acknowledged by the caller (offset advanced or 2xx),
because re-delivering them could never produce an event.

Deliberate choices beyond the reference:

* ``/cmd@<this bot's username>`` is rewritten to ``/cmd`` so group-style commands
  (``/help@mybot``) reach the runtime's command parser; a command addressed to another
  bot (``/help@otherbot``) is ignored as not ours.
* A service message announcing a group → supergroup migration (``migrate_to_chat_id`` /
  ``migrate_from_chat_id``) is ignored and acknowledged: the supergroup is a new
  conversation id, and its next real message starts a new binding there.
* Edited messages, channel posts, ``my_chat_member`` and every other update type are
  ignored (and never requested in polling mode except ``my_chat_member``, see
  :data:`ALLOWED_UPDATES`).

An event's attachments are references (:class:`~prismd.channel.AttachmentRef`);
:class:`TelegramMedia` (the end of the module) fetches their bytes on demand over the Bot
API, within the attachment cap, and runs the §11.5 hooks that turn voice notes and documents
into text before admission (:meth:`TelegramMedia.enrich`). :class:`UpdateHandler` (the
end of the module) parses, answers a callback query, enriches and admits.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from prismd.channel import (
    LONE_SURROGATE_RE,
    Admit,
    ApprovalInput,
    AttachmentKind,
    AttachmentRef,
    InboundEvent,
    replace_surrogates,
    utf8_len,
)

from ._api import TelegramApi, TelegramApiError, TelegramError, log_retry

MAX_SAFE_INTEGER = 2**53 - 1
MAX_ATTACHMENTS = 8
MAX_ID_BYTES = 128
MAX_REF_BYTES = 256
CALLBACK_DATA_MAX_BYTES = 64

ALLOWED_UPDATES: tuple[str, ...] = ("message", "callback_query", "my_chat_member")
"""What we ask Telegram for. ``my_chat_member`` is requested only to be acknowledged (a user
blocking the bot); asking for it keeps the allowed list honest about what we read."""

_APPROVAL_RE = re.compile(r"^p:([ad]):([A-Za-z0-9_-]{32,64})$")
_COMMAND_RE = re.compile(r"^(/[A-Za-z0-9_]+)@([A-Za-z0-9_]{1,64})(?=\s|$)")


@attrs.frozen
class ParsedUpdate:
    """One update's meaning: ``event`` to admit, or ``ignored`` with a reason code."""

    update_id: int
    event: InboundEvent | None = None
    ignored: str | None = None
    callback_query_id: str | None = None
    """Set for every callback query with an id, answered whether or not it is ours."""


def update_id_of(update: object) -> int | None:
    """A valid non-negative safe-integer ``update_id``, else ``None``."""
    if not isinstance(update, Mapping):
        return None
    value = update.get("update_id")
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SAFE_INTEGER:
        return None
    return value


_CHAT_CARRIERS = (
    "message",
    "edited_message",
    "channel_post",
    "edited_channel_post",
    "my_chat_member",
    "chat_member",
    "message_reaction",
)


def conversation_of(update: Mapping[str, Any]) -> str | None:
    """The chat an update belongs to, as the event's conversation id would be (the chat of
    a callback query's message), or ``None`` when it names none."""
    chat: object = None
    for field in _CHAT_CARRIERS:
        carrier = update.get(field)
        if isinstance(carrier, Mapping):
            chat = carrier.get("chat")
            break
    else:
        callback = update.get("callback_query")
        if isinstance(callback, Mapping) and isinstance(callback.get("message"), Mapping):
            chat = callback["message"].get("chat")
    return _chat_id(chat.get("id")) if isinstance(chat, Mapping) else None


def _bounded_str(value: object, limit: int) -> str | None:
    # A lone surrogate (legal in JSON text, ``"\\ud800"``) must make this ``None``, not
    # raise; a raising parse would re-poll the same update forever.
    if not isinstance(value, str) or not value or LONE_SURROGATE_RE.search(value):
        return None
    if utf8_len(value) > limit:
        return None
    return value


def clean_text(value: str) -> str:
    """``value`` with every lone surrogate replaced by U+FFFD.

    ``json.loads`` joins escaped pairs into one code point, so any surrogate left is unpaired;
    it cannot be stored as UTF-8, and refusing the whole message would lose the rest of it.
    """
    return replace_surrogates(value)


def _chat_id(value: object) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and abs(value) <= MAX_SAFE_INTEGER:
        return str(value)
    return _bounded_str(value, MAX_ID_BYTES)


def _actor_id(value: object) -> str | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int) and 0 <= value <= MAX_SAFE_INTEGER:
        return str(value)
    return _bounded_str(value, MAX_ID_BYTES)


def _size(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return 0
    return min(value, MAX_SAFE_INTEGER)


def _file_ref(
    kind: AttachmentKind,
    file: Mapping[str, Any],
    connection_id: str | None,
    described: tuple[str, ...] = (),
) -> AttachmentRef:
    """The ref of one Telegram file object; ``described`` names the optional ``mime_type`` /
    ``file_name`` fields its kind carries (a photo size carries neither)."""

    def field(name: str) -> str | None:
        return _bounded_str(file.get(name), MAX_REF_BYTES) if name in described else None

    return AttachmentRef(
        kind=kind,
        transport_file_id=file["file_id"],
        byte_length=_size(file.get("file_size")),
        mime_type=field("mime_type"),
        file_name=field("file_name"),
        connection_id=connection_id,
    )


def attachment_refs(
    message: Mapping[str, Any], connection_id: str | None = None
) -> tuple[AttachmentRef, ...]:
    """Largest photo (by ``file_size``), voice and document refs of ``connection_id``; at
    most eight."""
    refs: list[AttachmentRef] = []
    photos = message.get("photo")
    if isinstance(photos, list):
        best: Mapping[str, Any] | None = None
        for size in photos:
            if not isinstance(size, Mapping) or _bounded_str(size.get("file_id"), 256) is None:
                continue
            if best is None or _size(size.get("file_size")) >= _size(best.get("file_size")):
                best = size
        if best is not None:
            refs.append(_file_ref("image", best, connection_id))
    described_files: tuple[tuple[AttachmentKind, tuple[str, ...]], ...] = (
        ("voice", ("mime_type",)),
        ("document", ("mime_type", "file_name")),
    )
    for kind, described in described_files:
        file = message.get(kind)
        if isinstance(file, Mapping) and _bounded_str(file.get("file_id"), 256):
            refs.append(_file_ref(kind, file, connection_id, described))
    return tuple(refs[:MAX_ATTACHMENTS])


def _thread(message: Mapping[str, Any]) -> str | None:
    value = message.get("message_thread_id")
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= MAX_SAFE_INTEGER:
        return None
    return str(value)


def _chat_and_actor(
    chat: object, sender: object, *, allow_groups: bool
) -> tuple[str, str, str] | str:
    """``(conversation, actor, chat type)`` or an ignore reason."""
    if not isinstance(chat, Mapping):
        return "malformed"
    chat_type = chat.get("type")
    if chat_type != "private" and not (allow_groups and chat_type in ("group", "supergroup")):
        return "chat_type"
    if not isinstance(sender, Mapping):
        return "no_sender"
    if sender.get("is_bot") is True:
        return "bot_sender"
    conversation = _chat_id(chat.get("id"))
    actor = _actor_id(sender.get("id"))
    if conversation is None or actor is None:
        return "malformed"
    return conversation, actor, str(chat_type)


def strip_bot_mention(text: str, bot_username: str | None) -> str | None:
    """``/cmd@bot rest`` → ``/cmd rest`` for our bot; ``None`` when addressed to another bot.

    With the username still unknown (``getMe`` not answered yet) every mention is stripped.
    """
    match = _COMMAND_RE.match(text)
    if match is None:
        return text
    if bot_username is None or match.group(2).lower() == bot_username.lower():
        return match.group(1) + text[match.end() :]
    return None


def parse_update(
    update: Mapping[str, Any],
    *,
    connection_id: str,
    allow_groups: bool = False,
    bot_username: str | None = None,
) -> ParsedUpdate | None:
    """Parse one update; ``None`` only when it has no valid ``update_id``."""
    update_id = update_id_of(update)
    if update_id is None:
        return None
    message = update.get("message")
    if isinstance(message, Mapping):
        return _parse_message(
            update_id,
            message,
            connection_id=connection_id,
            allow_groups=allow_groups,
            bot_username=bot_username,
        )
    callback = update.get("callback_query")
    if isinstance(callback, Mapping):
        return _parse_callback(
            update_id, callback, connection_id=connection_id, allow_groups=allow_groups
        )
    for kind in ("edited_message", "channel_post", "edited_channel_post", "my_chat_member"):
        if kind in update:
            return ParsedUpdate(update_id, ignored=kind)
    return ParsedUpdate(update_id, ignored="unsupported_update")


def _parse_message(
    update_id: int,
    message: Mapping[str, Any],
    *,
    connection_id: str,
    allow_groups: bool,
    bot_username: str | None,
) -> ParsedUpdate:
    if "sender_chat" in message:
        return ParsedUpdate(update_id, ignored="sender_chat")
    resolved = _chat_and_actor(message.get("chat"), message.get("from"), allow_groups=allow_groups)
    if isinstance(resolved, str):
        return ParsedUpdate(update_id, ignored=resolved)
    conversation, actor, chat_type = resolved
    if "migrate_to_chat_id" in message or "migrate_from_chat_id" in message:
        return ParsedUpdate(update_id, ignored="chat_migrated")
    text = message.get("text")
    if not isinstance(text, str):
        caption = message.get("caption")
        text = caption if isinstance(caption, str) else ""
    text = clean_text(text)
    stripped = strip_bot_mention(text, bot_username)
    if stripped is None:
        return ParsedUpdate(update_id, ignored="other_bot_command")
    refs = attachment_refs(message, connection_id)
    if not stripped and not refs:
        return ParsedUpdate(update_id, ignored="empty")
    claims: dict[str, Any] = {"platform": "telegram", "chatType": chat_type}
    chat = message["chat"]
    if chat.get("is_forum") is True:
        claims["isForum"] = True
    if "forward_origin" in message or "forward_date" in message:
        claims["forwarded"] = True
    return ParsedUpdate(
        update_id,
        event=InboundEvent(
            connection_id=connection_id,
            external_conversation_id=conversation,
            external_actor_id=actor,
            event_id=str(update_id),
            text=stripped,
            attachments=refs,
            thread_id=_thread(message),
            claims=claims,
        ),
    )


def _parse_callback(
    update_id: int,
    callback: Mapping[str, Any],
    *,
    connection_id: str,
    allow_groups: bool,
) -> ParsedUpdate:
    data = callback.get("data")
    query_id = _bounded_str(callback.get("id"), MAX_REF_BYTES)
    answerable = (
        query_id
        if query_id is not None
        and (data is None or _bounded_str(data, CALLBACK_DATA_MAX_BYTES) is not None)
        else None
    )
    match = _APPROVAL_RE.fullmatch(data) if isinstance(data, str) else None
    if match is None:
        return ParsedUpdate(update_id, ignored="callback_data", callback_query_id=answerable)
    message = callback.get("message")
    if not isinstance(message, Mapping):
        return ParsedUpdate(update_id, ignored="malformed", callback_query_id=answerable)
    resolved = _chat_and_actor(message.get("chat"), callback.get("from"), allow_groups=allow_groups)
    if isinstance(resolved, str):
        return ParsedUpdate(update_id, ignored=resolved, callback_query_id=answerable)
    conversation, actor, chat_type = resolved
    return ParsedUpdate(
        update_id,
        callback_query_id=answerable,
        event=InboundEvent(
            connection_id=connection_id,
            external_conversation_id=conversation,
            external_actor_id=actor,
            event_id=str(update_id),
            text="",
            approval=ApprovalInput(
                token=match.group(2),
                outcome="allow_once" if match.group(1) == "a" else "reject_once",
            ),
            thread_id=_thread(message),
            claims={"platform": "telegram", "chatType": chat_type, "control": "approval"},
        ),
    )


# ------------------------------------------ an event's files, fetched on demand (§11.5)

MAX_ATTACHMENT_BYTES_CAP = 4 * 1024 * 1024
FETCH_DEADLINE_S = 60.0
"""Whole-fetch deadline of :meth:`TelegramMedia.fetch` (getFile + download)."""
_FILE_SEGMENT_RE = re.compile(r"^[A-Za-z0-9._-]+$")

Transcribe = Callable[[bytes, str], Awaitable[str | None]]
"""``transcribe(audio, mime_type) -> text``."""
ExtractDocumentText = Callable[[bytes, str], Awaitable[str | None]]
"""``extract_document_text(data, mime_type) -> text``."""


@attrs.frozen
class FetchedAttachment:
    data: bytes = attrs.field(repr=False)
    mime_type: str | None = None
    file_name: str | None = None


def _valid_file_path(path: object) -> bool:
    if not isinstance(path, str) or not path or utf8_len(path) > 256:
        return False
    segments = path.split("/")
    return len(segments) <= 4 and all(
        _FILE_SEGMENT_RE.fullmatch(s) and s not in (".", "..") for s in segments
    )


@attrs.define(eq=False, kw_only=True)
class TelegramMedia:
    """Files of one bot, fetched over ``api`` within ``max_attachment_bytes``."""

    connection_id: str
    api: TelegramApi
    max_attachment_bytes: int
    transcribe: Transcribe | None = None
    extract_document_text: ExtractDocumentText | None = None
    stopped: bool = False

    async def fetch(self, ref: AttachmentRef) -> FetchedAttachment | None:
        """The file's bytes, or ``None`` (stopped, bad ref, another connection's ref, too
        large, any failure).

        The size cap is enforced from ``getFile``'s ``file_size`` (else the ref's) before
        downloading, then from ``Content-Length`` and while streaming. Redirects are refused.
        """
        if self.stopped or not isinstance(ref, AttachmentRef):
            return None
        if ref.connection_id is not None and ref.connection_id != self.connection_id:
            return None  # another bot's file id means nothing to this one
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
                info = await self.api.call("getFile", {"file_id": file_id})
                if not isinstance(info, Mapping) or not _valid_file_path(info.get("file_path")):
                    return None
                declared = info.get("file_size")
                if isinstance(declared, bool) or not isinstance(declared, int):
                    declared = length
                if declared > self.max_attachment_bytes:
                    return None
                data = await self.api.download(info["file_path"], self.max_attachment_bytes)
            except TelegramError:
                return None
        if data is None:
            return None
        return FetchedAttachment(data=data, mime_type=ref.mime_type, file_name=ref.file_name)

    async def enrich(self, event: InboundEvent) -> InboundEvent:
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
            fetched = await self.fetch(ref)
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


@attrs.define(eq=False, kw_only=True)
class UpdateHandler:
    connection_id: str
    admit: Admit
    api: TelegramApi
    """The receiving client (``answerCallbackQuery``)."""
    media: TelegramMedia
    allow_groups: bool = False
    bot_username: str | None = None
    """Learnt from ``getMe`` by the receiver; ``/cmd@other_bot`` is ignored once known."""

    async def process(self, update: Mapping[str, Any], *, strict: bool) -> bool:
        """Answer, parse, enrich and admit one update. True = acknowledge it (the
        admission is final, or there was nothing to admit).

        ``strict`` (webhook): a failed ``answerCallbackQuery`` raises so Telegram retries.
        """
        return await self.admit_update(update, strict=strict) is None

    async def admit_update(self, update: Mapping[str, Any], *, strict: bool) -> str | None:
        """:meth:`process`, answering ``None`` to acknowledge or the retryable admission's
        reason (``capacity``, ``unavailable``, ``stopped``) to try again later."""
        parsed = parse_update(
            update,
            connection_id=self.connection_id,
            allow_groups=self.allow_groups,
            bot_username=self.bot_username,
        )
        if parsed is None:
            return None
        if parsed.callback_query_id is not None:
            await self._answer_callback(parsed.callback_query_id, strict=strict)
        if parsed.event is None:
            return None
        admission = await self.admit(await self.media.enrich(parsed.event))
        return (admission.reason or "denied") if admission.retryable else None

    async def _answer_callback(self, query_id: str, *, strict: bool) -> None:
        for attempt in range(2):
            try:
                await self.api.call("answerCallbackQuery", {"callback_query_id": query_id})
                return
            except TelegramApiError as error:
                if error.retry_after is None or attempt == 1:
                    if strict:
                        raise
                    return
                delay = min(error.retry_after, 60)
                log_retry(self.connection_id, "answerCallbackQuery", error, delay, attempt + 1)
                await trio.sleep(delay)
            except TelegramError:
                if strict:
                    raise
                return
