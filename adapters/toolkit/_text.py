"""Text measured the way chat platforms count it: UTF-16 code units; approval controls as
text lines for a channel that shows no buttons.

Telegram and Signal both limit a message by UTF-16 code units, in which a character outside
the Basic Multilingual Plane (most emoji) counts twice. Python strings hold code points, so
a split between two of them never cuts a surrogate pair in half.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from prismd.channel import Button

__all__ = ["button_lines", "chunk_text", "utf16_units"]

_BUTTON_RE = re.compile(r"^p:([ad]):([A-Za-z0-9_-]{32,64})$")


def button_lines(buttons: Sequence[Button]) -> list[str] | None:
    """The approval controls (at most two: allow, deny) as lines the user answers with a
    command: ``Reply /approve TOKEN to allow once.``, ``Reply /deny TOKEN to deny.``;
    ``None`` when there are more, or one is not an approval control.

    >>> button_lines([Control("Deny", "p:d:" + "t" * 32)])
    ['Reply /deny tttttttttttttttttttttttttttttttt to deny.']
    """
    if len(buttons) > 2:
        return None
    lines: list[str] = []
    for control in buttons:
        match = _BUTTON_RE.match(control.value) if isinstance(control.value, str) else None
        if match is None:
            return None
        verb, token = match.groups()
        lines.append(
            f"Reply /approve {token} to allow once."
            if verb == "a"
            else f"Reply /deny {token} to deny."
        )
    return lines


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
