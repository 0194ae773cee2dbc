"""What an agent run produces, shared by turns and resumes: previews while it runs, and —
the one table — what its result means for the journal and the user when it ends."""

from __future__ import annotations

import attrs

from ..agents import EventSink, RunResult, StreamEvent
from ..channel import Preview
from ._core import Core
from ._types import ActiveTurn, Route

CANCELLED_TEXT = "Request cancelled."
EMPTY_ANSWER_TEXT = "The request completed without a text answer."
DENIED_TEXT = "Approval denied. The request will not continue."


@attrs.frozen
class Outcome:
    """A run's result as the journal settles it and the user is answered."""

    state: str
    """The operation's new state."""
    error_code: str | None
    counter: str | None
    """The diagnostics counter it moves (``None``: none)."""
    kind: str
    """The reply's kind: ``final`` (the agent's answer) or ``notice``."""
    text: str | None
    """The reply's text, already redacted; ``None`` for ``suspended``, whose notice (with
    its approval controls) is built by the approvals module."""


def outcome_of(core: Core, result: RunResult) -> Outcome:
    """The table from a run's result to terminal state, counter and reply (§9.1, §10.4)."""
    status = result.status
    if status == "succeeded":
        text = core.redact(result.text)
        if text.strip():
            return Outcome("succeeded", None, "completed", "final", text)
        return Outcome("succeeded", None, "completed", "notice", EMPTY_ANSWER_TEXT)
    if status == "aborted":
        return Outcome("cancelled", None, "cancelled", "notice", CANCELLED_TEXT)
    if status == "suspended":
        return Outcome("suspended", None, "suspended", "notice", None)
    if status == "denied":
        return Outcome("failed", "denied", None, "notice", DENIED_TEXT)
    error = result.error
    code = str(error.code) if error is not None and error.code else "run_failed"
    message = error.message if error is not None else None
    return Outcome("failed", code, "failed", "notice", core.failure_text(message))


def preview_sink(core: Core, route: Route, active: ActiveTurn) -> EventSink | None:
    """Previews (§9.3): cumulative redacted text of the current assistant message."""
    on_preview = core.on_preview
    if on_preview is None:
        return None
    acc: list[str] = []
    current: list[str] = [""]

    def sink(event: StreamEvent) -> None:
        if event.kind == "message_started":
            acc.clear()
            current[0] = event.run_id
            return
        if event.kind != "message_delta":
            return
        if current[0] and event.run_id and event.run_id != current[0]:
            return
        acc.append(event.text)
        text = core.redact("".join(acc))
        if not text.strip() or active.cancelled or core.stopped:
            return
        try:
            on_preview(
                Preview(
                    connection_id=route.connection_id,
                    external_conversation_id=route.conversation_id,
                    text=text,
                    thread_id=route.thread_id,
                )
            )
        except Exception:
            # The host's preview callback must never break a turn.
            pass

    return sink
