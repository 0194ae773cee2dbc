"""Outbound text hygiene (contract §6.2, §16): exact-string secret redaction, and text
measured and cut the way it is stored and sent.

Every text that leaves the runtime (final answers, failure notices, approval reasons,
notify texts, previews) goes through :meth:`Redactor.redact` first and then through
:func:`truncate_utf8` with the reply cap. The journal measures in UTF-8 bytes
(:func:`utf8_len`); Telegram and Signal limit a message by UTF-16 code units
(:func:`utf16_units`, :func:`chunk_text`), in which a character outside the Basic
Multilingual Plane (most emoji) counts twice. Python strings hold code points, so a cut
between two of them never splits a surrogate pair.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import attrs

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
