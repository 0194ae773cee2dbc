"""What a receiving adapter last saw, for ``health()`` and ``prismctl health``: when a
message last reached it and the last error of its receiving side (a cause class, never a
URL, a token or a message's text)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import attrs

from stores import ms_to_iso

__all__ = ["ACTIVITY_FIELDS", "Activity"]

_E = TypeVar("_E")
_R = TypeVar("_R")

ACTIVITY_FIELDS = frozenset({"lastUpdateAt", "lastError", "lastErrorAt"})
"""The health fields :meth:`Activity.health_fields` adds: times and a cause, never metric
labels (their values would grow without bound)."""


@attrs.define(eq=False)
class Activity:
    last_update_ms: int | None = None
    """When a message last reached the adapter (Unix ms)."""
    last_error: str | None = None
    last_error_ms: int | None = None

    def health_fields(self) -> Mapping[str, str]:
        """``lastUpdateAt``, ``lastError`` and ``lastErrorAt`` (ISO 8601), those known."""
        fields: dict[str, str] = {}
        if self.last_update_ms is not None:
            fields["lastUpdateAt"] = ms_to_iso(self.last_update_ms)
        if self.last_error is not None and self.last_error_ms is not None:
            fields["lastError"] = self.last_error
            fields["lastErrorAt"] = ms_to_iso(self.last_error_ms)
        return fields

    def seeing(self, admit: Callable[[_E], Awaitable[_R]]) -> Callable[[_E], Awaitable[_R]]:
        """``admit``, noting the time of each message handed to it (``lastUpdateAt``)."""

        async def noted(event: _E) -> _R:
            self.last_update_ms = time.time_ns() // 1_000_000
            return await admit(event)

        return noted

    def note_error(self, cause: str) -> None:
        """The receiving side failed: ``cause`` is a fixed word or an exception class."""
        self.last_error = cause
        self.last_error_ms = time.time_ns() // 1_000_000
