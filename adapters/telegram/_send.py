"""Sending: replies as Telegram HTML chunks (+ an optional synthesized voice), typing.

:meth:`TelegramSender.send` is the runtime's ``deliver`` for a Telegram connection. Its
outcome is exact: ``delivered``, a known failure (nothing was posted), or
:class:`~prismd.channel.DeliveryOutcomeUnknownError` when something may have been posted.

Models answer in Markdown. :func:`to_telegram_html` converts the common subset — fenced and
inline code, bold, italic, strikethrough, spoilers, links, headings (bold), quotes, bullet
lists — into the tags Telegram's HTML mode accepts (``parse_mode="HTML"``), escaping ``<``,
``>`` and ``&`` everywhere else. Its output is checked to be well formed (only supported
tags, properly nested); anything it cannot render safely stays literal, escaped text.
:func:`send_formatted` sends one chunk as HTML and, when Telegram still refuses the
entities (``400 Bad Request: can't parse entities``), sends the same chunk again as plain
text: a formatting problem never loses a reply. Visible text never grows (markers are
removed, ``&lt;`` counts as one character), so a chunk that fits as plain text fits as HTML.
"""

from __future__ import annotations

import html
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import trio

from prismd.channel import DeliveryOutcomeUnknownError, Reply, SendResult

from ..toolkit import chunk_text as _chunk_text
from ..toolkit import utf16_units as utf16_units
from ._api import TelegramApi, TelegramApiError, TelegramCredentialError, TelegramError, log_retry
from ._updates import _bounded_str, clean_text

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


# --------------------------------------------------------------------------- Markdown as HTML

_FENCE_RE = re.compile(
    r"^(`{3,}|~{3,})[ \t]*([A-Za-z0-9_+#.-]*)[^\n]*\n(.*?)(?:^\1[ \t]*$|\Z)", re.M | re.S
)
_CODE_SPAN_RE = re.compile(r"(`+)(.+?)\1", re.S)
_LINK_RE = re.compile(r"\[([^\[\]\n]+)\]\(((?:https?://|tg://|mailto:)[^\s()<>]+)\)")
_BOLD_RE = re.compile(r"\*\*(?=\S)(.+?)(?<=\S)\*\*|__(?=\S)(.+?)(?<=\S)__", re.S)
_ITALIC_RE = re.compile(
    r"(?<![\w*])\*(?=[^\s*])(.+?)(?<=[^\s*])\*(?![\w*])|(?<![\w_])_(?=[^\s_])(.+?)(?<=[^\s_])_(?![\w_])"
)
_STRIKE_RE = re.compile(r"~~(?=\S)(.+?)(?<=\S)~~")
_SPOILER_RE = re.compile(r"\|\|(?=\S)(.+?)(?<=\S)\|\|")
_HEADING_RE = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$")
_BULLET_RE = re.compile(r"^([ \t]*)[-*+][ \t]+(.*)$")
_QUOTE_RE = re.compile(r"^>[ \t]?(.*)$")
_TAG_RE = re.compile(r"<(/?)([a-z-]+)(?:\s[^>]*)?>")
_ALLOWED_TAGS = frozenset({"b", "i", "s", "u", "a", "code", "pre", "blockquote", "tg-spoiler"})
_PLACEHOLDER = "\x00{}\x00"


def _inline(text: str) -> str:
    """One line (or paragraph) of inline Markdown → escaped HTML with inline tags."""
    codes: list[str] = []

    def keep(rendered: str) -> str:
        codes.append(rendered)
        return _PLACEHOLDER.format(len(codes) - 1)

    def code(match: re.Match[str]) -> str:
        return keep(
            f"<code>{html.escape(match.group(2).strip() or match.group(2), quote=False)}</code>"
        )

    def link(match: re.Match[str]) -> str:
        label, url = match.group(1), match.group(2)
        return keep(f'<a href="{html.escape(url, quote=True)}">{_formatted(label)}</a>')

    text = _CODE_SPAN_RE.sub(code, text.replace("\x00", ""))
    text = _LINK_RE.sub(link, text)
    rendered = _formatted(text)
    for _depth in range(2):  # a link label may hold a code span
        rendered = re.sub("\x00(\\d+)\x00", lambda m: codes[int(m.group(1))], rendered)
    return rendered


def _formatted(text: str) -> str:
    escaped = html.escape(text, quote=False)
    escaped = _BOLD_RE.sub(lambda m: f"<b>{m.group(1) or m.group(2)}</b>", escaped)
    escaped = _STRIKE_RE.sub(lambda m: f"<s>{m.group(1)}</s>", escaped)
    escaped = _SPOILER_RE.sub(lambda m: f"<tg-spoiler>{m.group(1)}</tg-spoiler>", escaped)
    return _ITALIC_RE.sub(lambda m: f"<i>{m.group(1) or m.group(2)}</i>", escaped)


def _blocks(text: str) -> str:
    """Line-level Markdown (headings, quotes, bullets) outside code fences."""
    out: list[str] = []
    quote: list[str] = []

    def flush_quote() -> None:
        if quote:
            out.append("<blockquote>" + "\n".join(quote) + "</blockquote>")
            quote.clear()

    for line in text.split("\n"):
        quoted = _QUOTE_RE.match(line)
        if quoted:
            quote.append(_inline(quoted.group(1)))
            continue
        flush_quote()
        heading = _HEADING_RE.match(line)
        bullet = _BULLET_RE.match(line)
        if heading:
            out.append(f"<b>{_inline(heading.group(1))}</b>")
        elif bullet and not re.fullmatch(r"[ \t]*([-*_])[ \t]*(\1[ \t]*){2,}", line):
            out.append(f"{bullet.group(1)}• {_inline(bullet.group(2))}")
        else:
            out.append(_inline(line))
    flush_quote()
    return "\n".join(out)


def well_formed(markup: str) -> bool:
    """Only Telegram's tags, each closed in order (what its HTML parser accepts)."""
    stack: list[str] = []
    for match in _TAG_RE.finditer(markup):
        closing, name = match.group(1), match.group(2)
        if name not in _ALLOWED_TAGS:
            return False
        if not closing:
            stack.append(name)
        elif not stack or stack.pop() != name:
            return False
    return not stack and "<" not in _TAG_RE.sub("", markup)


def to_telegram_html(markdown: str) -> str:
    """Telegram HTML for ``markdown``; never malformed (falls back to escaped text)."""
    parts: list[str] = []
    position = 0
    for fence in _FENCE_RE.finditer(markdown):
        parts.append(_blocks(markdown[position : fence.start()]))
        language = fence.group(2)
        body = html.escape(fence.group(3).rstrip("\n"), quote=False)
        if language and re.fullmatch(r"[A-Za-z0-9_+-]{1,32}", language):
            parts.append(f'<pre><code class="language-{language}">{body}</code></pre>')
        else:
            parts.append(f"<pre>{body}</pre>")
        position = fence.end()
    parts.append(_blocks(markdown[position:]))
    rendered = "".join(parts)
    if not well_formed(rendered):
        return html.escape(markdown, quote=False)
    return rendered


def visible_text(markup: str) -> str:
    """What Telegram shows for ``markup`` (tags dropped, entities decoded)."""
    return html.unescape(_TAG_RE.sub("", markup))


def cannot_parse_entities(error: TelegramApiError) -> bool:
    return error.status == 400 and "can't parse entities" in error.description.lower()


async def send_formatted(
    send: Callable[[Mapping[str, Any]], Awaitable[Any]],
    params: Mapping[str, Any],
    *,
    markdown: bool,
) -> Any:
    """Send ``params`` (a sendMessage chunk) as HTML converted from Markdown when
    ``markdown``; plain text when there is nothing to format or Telegram cannot parse
    the entities. Every other error propagates unchanged."""
    text = params.get("text")
    if not markdown or not isinstance(text, str):
        return await send(params)
    markup = to_telegram_html(text)
    if markup == html.escape(text, quote=False) and "&" not in markup:
        return await send(params)  # nothing to format: plain, as before
    if not visible_text(markup).strip():
        return await send(params)
    try:
        return await send({**params, "text": markup, "parse_mode": "HTML"})
    except TelegramApiError as error:
        if not cannot_parse_entities(error):
            raise
    return await send(params)
