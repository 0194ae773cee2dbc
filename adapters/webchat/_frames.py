"""The web chat's WebSocket frames, sans I/O: a client frame read into a hello or an
:class:`~prismd.channel.InboundEvent`, and the server's frames written as JSON text.

The frames and their fields: docs/webchat-protocol.md.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any, Literal

from prismd.channel import (
    Admission,
    ApprovalInput,
    InboundEvent,
    OutboundFile,
    PastReply,
    Reply,
    replace_surrogates,
    utf8_len,
)

__all__ = [
    "MAX_HISTORY_FRAME_BYTES",
    "BadFrame",
    "admission_frame",
    "decode_frame",
    "error_frame",
    "event_from",
    "file_frame",
    "hello_from",
    "history_frame",
    "reply_frame",
]

ACTOR_RE = re.compile(r"^[A-Za-z0-9_-]{8,64}$")
CLIENT_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
APPROVAL_RE = re.compile(r"^p:([ad]):([A-Za-z0-9_-]{32,64})$")
RESUME_RE = re.compile(r"^[A-Za-z0-9_-]{43}$")
MAX_HISTORY_FRAME_BYTES = 256 * 1024


class BadFrame(Exception):
    """A client frame we refuse; ``args[0]`` is the fixed text sent back."""


def decode_frame(message: str | bytes, max_bytes: int) -> dict[str, Any]:
    """The JSON object of a text frame; :class:`BadFrame` for anything else."""
    if isinstance(message, bytes):
        raise BadFrame("binary frames are not supported")
    if utf8_len(message) > max_bytes:
        raise BadFrame("frame too large")
    try:
        frame = json.loads(message)
    except (ValueError, RecursionError):  # RecursionError: nesting past the parser's limit
        raise BadFrame("frame is not valid JSON") from None
    if not isinstance(frame, dict):
        raise BadFrame("frame must be a JSON object")
    return frame


def hello_from(frame: dict[str, Any]) -> tuple[str, str | None]:
    """``(actor, presented resume token or None)`` of a valid hello; :class:`BadFrame`."""
    if frame.get("type") != "hello":
        raise BadFrame("the first frame must be a hello")
    actor = frame.get("actor")
    if not isinstance(actor, str) or not ACTOR_RE.match(actor):
        raise BadFrame("invalid actor id")
    presented = frame.get("resume")
    if presented is not None and (not isinstance(presented, str) or not RESUME_RE.match(presented)):
        raise BadFrame("invalid resume token")
    return actor, presented


def event_from(
    connection_id: str, actor: str, frame: dict[str, Any], now_ms: int
) -> tuple[InboundEvent, str | None]:
    """The event of a ``message`` or ``approve`` frame and the client's id for it;
    :class:`BadFrame` for anything else."""
    kind = frame.get("type")
    if kind == "message":
        client_id = frame.get("id")
        if not isinstance(client_id, str) or not CLIENT_ID_RE.match(client_id):
            raise BadFrame("invalid message id")
        text = frame.get("text")
        if not isinstance(text, str) or not text.strip():
            raise BadFrame("message text must be a non-empty string")
        # ``json.loads`` joins escaped pairs, so a surrogate left is unpaired; the journal
        # cannot store it (as UTF-8), and a store refusal reads as retryable.
        text = replace_surrogates(text)
        event = _event(connection_id, actor, f"{actor}:{client_id}", text, None, now_ms)
        return event, client_id
    if kind == "approve":
        client_id = frame.get("id")
        if client_id is not None and (
            not isinstance(client_id, str) or not CLIENT_ID_RE.match(client_id)
        ):
            raise BadFrame("invalid message id")
        value = frame.get("value")
        match = APPROVAL_RE.match(value) if isinstance(value, str) else None
        if match is None:
            raise BadFrame("invalid approval value")
        approval = ApprovalInput(
            token=match.group(2),
            outcome="allow_once" if match.group(1) == "a" else "reject_once",
        )
        # the raw token must never become part of a journaled id
        digest = hashlib.sha256(match.group(0).encode("ascii")).hexdigest()[:32]
        event = _event(connection_id, actor, f"{actor}:approve-{digest}", "", approval, now_ms)
        return event, client_id
    if kind == "hello":
        raise BadFrame("hello was already received")
    raise BadFrame("unknown frame type")


def _event(
    connection_id: str,
    actor: str,
    event_id: str,
    text: str,
    approval: ApprovalInput | None,
    now_ms: int,
) -> InboundEvent:
    return InboundEvent(
        connection_id=connection_id,
        external_conversation_id=actor,
        external_actor_id=actor,
        event_id=event_id,
        text=text,
        approval=approval,
        received_at_ms=now_ms,
        claims={"platform": "webchat"},
    )


def reply_frame(reply: Reply) -> str:
    return json.dumps(
        {
            "type": "reply",
            "replyId": reply.operation_id,
            "kind": reply.kind,
            "text": reply.text,
            "controls": [{"label": c.label, "value": c.value} for c in reply.buttons],
            "inReplyTo": _client_id_of(reply.in_reply_to, reply.external_conversation_id),
        },
        # ASCII escapes: a lone surrogate in a reply must not make the WebSocket layer's
        # UTF-8 encoding raise (a raising send reads as an ambiguous delivery).
        ensure_ascii=True,
    )


def file_frame(reply: Reply, file: OutboundFile) -> str:
    """A ``file`` frame: one file that goes with the reply ``replyId`` (base64 ``data``)."""
    return json.dumps(
        {
            "type": "file",
            "replyId": reply.operation_id,
            "name": file.name,
            "mediaType": file.media_type,
            "size": len(file.data),
            "data": base64.b64encode(file.data).decode("ascii"),
        },
        ensure_ascii=True,
    )


def history_frame(actor: str, past: Sequence[PastReply]) -> str:
    """The ``history`` frame: the newest replies that fit :data:`MAX_HISTORY_FRAME_BYTES`
    (clients bound a frame's size; prismctl chat's library closes the socket above 1 MiB),
    oldest first."""
    kept: list[str] = []
    size = 0
    for p in reversed(past):
        entry = json.dumps(
            {
                "replyId": p.operation_id,
                "kind": p.kind,
                "text": p.text,
                "inReplyTo": _client_id_of(p.in_reply_to, actor),
                "at": p.created_at_ms,
            },
            ensure_ascii=True,
        )
        size += len(entry) + 1
        if size > MAX_HISTORY_FRAME_BYTES:
            break
        kept.append(entry)
    return '{"type": "history", "replies": [' + ", ".join(reversed(kept)) + "]}"


def admission_frame(client_id: str | None, admission: Admission) -> str:
    frame: dict[str, Any] = {
        "type": "admission",
        "id": client_id,
        "status": admission.status,
        "reason": admission.reason,
        "duplicate": admission.duplicate,
    }
    if admission.hint is not None:
        frame["hint"] = admission.hint  # the runtime's fixed text: a limit, or "send /help"
    return json.dumps(frame)


def error_frame(message: str, code: Literal["resume_refused", "unavailable"] | None = None) -> str:
    frame = {"type": "error", "message": message}
    if code is not None:
        frame["code"] = code
    return json.dumps(frame)


def _client_id_of(in_reply_to: str | None, actor: str) -> str | None:
    if in_reply_to is None:
        return None
    prefix = actor + ":"
    return in_reply_to[len(prefix) :] if in_reply_to.startswith(prefix) else in_reply_to
