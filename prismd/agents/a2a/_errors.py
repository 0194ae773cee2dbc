"""The A2A client's errors: which way a call went wrong (see :mod:`._client`)."""

from __future__ import annotations


class A2AError(Exception):
    """Base of the client's errors; the message is a fixed phrase, never the peer's text."""


class Refused(A2AError):
    """Not processed by the peer: safe to make again (after ``retry_after`` seconds)."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(f"A2A request refused ({reason})")
        self.reason = reason
        self.retry_after = retry_after


class OutcomeUnknown(A2AError):
    """The request went out and no answer came back: it may have been processed."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"A2A request outcome unknown ({reason})")
        self.reason = reason


class RemoteError(A2AError):
    """The peer answered an error: a JSON-RPC ``code`` or, outside JSON-RPC, ``status``."""

    def __init__(self, code: int | None, status: int | None = None) -> None:
        what = f"code {code}" if code is not None else f"HTTP {status}"
        super().__init__(f"A2A peer answered an error ({what})")
        self.code = code
        self.status = status


class CardError(A2AError):
    """No usable agent card (absent, unreadable, no JSON-RPC interface, insecure URL)."""
