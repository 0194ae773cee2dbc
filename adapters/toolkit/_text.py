"""Text measured the way chat platforms count it: UTF-16 code units.

Telegram and Signal both limit a message by UTF-16 code units, in which a character outside
the Basic Multilingual Plane (most emoji) counts twice. Python strings hold code points, so
a split between two of them never cuts a surrogate pair in half.
"""

from __future__ import annotations

__all__ = ["chunk_text", "utf16_units"]


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
