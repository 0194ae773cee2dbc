"""Markdown answers as Telegram HTML (``parse_mode="HTML"``), with a plain-text fallback.

Models answer in Markdown. :func:`to_telegram_html` converts the common subset — fenced and
inline code, bold, italic, strikethrough, spoilers, links, headings (bold), quotes, bullet
lists — into the tags Telegram's HTML mode accepts, escaping ``<``, ``>`` and ``&``
everywhere else. Its output is checked to be well formed (only supported tags, properly
nested); anything it cannot render safely stays literal, escaped text.

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

from ._api import TelegramApiError

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
