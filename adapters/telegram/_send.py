"""Sending: replies as plain-text chunks (+ an optional synthesized voice), typing.

:meth:`TelegramSender.send` is the runtime's ``deliver`` for a Telegram connection. Its
outcome is exact: ``delivered``, a known failure (nothing was posted), or
:class:`~prismd.channel.DeliveryOutcomeUnknownError` when something may have been posted.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from prismd.channel import DeliveryOutcomeUnknownError, Reply, SendResult

from ..toolkit import chunk_text as _chunk_text
from ..toolkit import utf16_units as utf16_units
from ._api import TelegramApi, TelegramApiError, TelegramCredentialError, TelegramError, log_retry
from ._format import send_formatted
from ._parse import _bounded_str, clean_text

MAX_CHUNK_UNITS = 3_500
MAX_SEND_ATTEMPTS = 5
MAX_BUTTONS = 8

Synthesize = Callable[[str], Awaitable[tuple[bytes, str] | None]]
"""``synthesize(text) -> (audio, format)``; format like ``ogg``, ``audio/mpeg`` or ``.m4a``."""


def chunk_text(text: str, limit: int = MAX_CHUNK_UNITS) -> list[str]:
    """Telegram's chunking: :func:`adapters.toolkit.chunk_text` at 3,500 UTF-16 units."""
    return _chunk_text(text, limit)


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


@attrs.define(eq=False, kw_only=True)
class TelegramSender:
    """Replies and typing over ``api`` (the adapter's long-lived client: a send may run
    while ``run`` is restarted by the supervisor)."""

    connection_id: str
    api: TelegramApi
    synthesize: Synthesize | None = None

    async def send_typing(
        self, external_conversation_id: str, thread_id: str | None = None
    ) -> None:
        """``sendChatAction typing`` (lasts ≤5 s on the client); failures are ignored."""
        params: dict[str, Any] = {"chat_id": external_conversation_id, "action": "typing"}
        if thread_id is not None:
            params["message_thread_id"] = thread_id
        try:
            await self.api.call("sendChatAction", params)
        except TelegramError:
            pass

    async def send(self, reply: Reply) -> SendResult:
        """Deliver a reply as chunks (+ optional synthesized voice); a final answer goes out
        as Telegram HTML converted from Markdown, plain text when Telegram refuses it.

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
        if reply.buttons:
            buttons = reply.buttons
            if len(buttons) > MAX_BUTTONS or any(
                _bounded_str(c.label, 64) is None or _bounded_str(c.value, 64) is None
                for c in buttons
            ):
                return SendResult(delivered=False, reason="invalid_controls")
            markup = {
                "inline_keyboard": [[{"text": c.label, "callback_data": c.value} for c in buttons]]
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
                return await self.api.call("sendMessage", params)
            except TelegramApiError as error:
                # A gateway error may hide a posted message: resending could duplicate it.
                if error.retry_after is None or attempt == MAX_SEND_ATTEMPTS or _ambiguous(error):
                    raise
                delay = min(error.retry_after, 3600)
                log_retry(self.connection_id, "sendMessage", error, delay, attempt)
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
            await self.api.call("sendVoice", params, files=files)
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
