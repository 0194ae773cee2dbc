"""The two A2A wire dialects (v1.0 and v0.3), sans-IO: requests built from plain values,
answers read leniently into small records (``reference/a2a-protocol.md`` §2–§3).

Reading never trusts a field to be there: unknown fields are ignored, a missing state is
``"unknown"``, a part that is neither text nor file is skipped. Both dialects read into the
same records, and task states are normalized to the v0.3 spelling (``"input-required"``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypeAlias

import attrs

Dialect: TypeAlias = Literal["1.0", "0.3"]

ACTIVE_STATES = frozenset({"submitted", "working", "unknown"})
INTERRUPTED_STATES = frozenset({"input-required", "auth-required"})
TERMINAL_STATES = frozenset({"completed", "canceled", "failed", "rejected"})

METHODS: Mapping[Dialect, Mapping[str, str]] = {
    "1.0": {
        "send": "SendMessage",
        "get": "GetTask",
        "cancel": "CancelTask",
        "list": "ListTasks",
        "subscribe": "SubscribeToTask",
    },
    "0.3": {
        "send": "message/send",
        "get": "tasks/get",
        "cancel": "tasks/cancel",
        "subscribe": "tasks/resubscribe",
    },
}

# JSON-RPC error codes the client tells apart (§5).
TASK_NOT_FOUND = -32001
TASK_NOT_CANCELABLE = -32002
PUSH_NOT_SUPPORTED = -32003
UNSUPPORTED_OPERATION = -32004
VERSION_NOT_SUPPORTED = -32009
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602


@attrs.frozen
class FilePart:
    name: str | None
    media_type: str | None
    uri: str | None
    data_b64: str | None = attrs.field(default=None, repr=False)


@attrs.frozen
class Artifact:
    artifact_id: str
    texts: tuple[str, ...] = ()
    files: tuple[FilePart, ...] = ()


@attrs.frozen
class Task:
    """A task as the peer last showed it; ``state`` in the v0.3 spelling."""

    id: str
    context_id: str | None
    state: str
    status_text: str | None = attrs.field(default=None, repr=False)
    artifacts: tuple[Artifact, ...] = attrs.field(default=(), repr=False)
    timestamp: str | None = None
    message_ids: tuple[str, ...] = ()

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES

    @property
    def interrupted(self) -> bool:
        return self.state in INTERRUPTED_STATES


@attrs.frozen
class Message:
    """A bare agent message: an answer with no task to follow."""

    message_id: str
    context_id: str | None
    task_id: str | None
    texts: tuple[str, ...] = attrs.field(default=(), repr=False)


@attrs.frozen
class StatusUpdate:
    task_id: str
    context_id: str | None
    state: str
    status_text: str | None = attrs.field(default=None, repr=False)
    final: bool = False


@attrs.frozen
class ArtifactUpdate:
    task_id: str
    context_id: str | None
    artifact: Artifact
    append: bool = False
    last_chunk: bool = False


Observation: TypeAlias = Task | Message | StatusUpdate | ArtifactUpdate
"""One thing the peer said about a task: a send's answer, a poll, a stream item or a push."""


@attrs.frozen
class PushConfig:
    """The per-task push registration: where to POST and the two random secrets."""

    url: str
    token: str = attrs.field(repr=False)
    credentials: str = attrs.field(repr=False)


# --------------------------------------------------------------------------- requests


def envelope(method: str, params: Mapping[str, Any], request_id: str) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": request_id, "method": method, "params": dict(params)}


def send_params(
    dialect: Dialect,
    *,
    message_id: str,
    text: str,
    context_id: str | None,
    task_id: str | None,
    push: PushConfig | None,
    tenant: str | None = None,
) -> dict[str, Any]:
    """``SendMessage`` / ``message/send`` params asking for immediate acceptance."""
    message: dict[str, Any] = {"messageId": message_id}
    config: dict[str, Any]
    if dialect == "1.0":
        message["role"] = "ROLE_USER"
        # No ``mediaType``: a text part is text, and a peer checking input modes against
        # its card (which may say ``"text"``) checks only a media type that was stated.
        message["parts"] = [{"text": text}]
        config = {
            "returnImmediately": True,
            "acceptedOutputModes": ["text/plain", "text/markdown"],
        }
        if push is not None:
            config["taskPushNotificationConfig"] = {
                "url": push.url,
                "token": push.token,
                "authentication": {"scheme": "Bearer", "credentials": push.credentials},
            }
    else:
        message["kind"] = "message"
        message["role"] = "user"
        message["parts"] = [{"kind": "text", "text": text}]
        config = {"blocking": False, "acceptedOutputModes": ["text/plain", "text/markdown"]}
        if push is not None:
            config["pushNotificationConfig"] = {
                "url": push.url,
                "token": push.token,
                "authentication": {"schemes": ["Bearer"], "credentials": push.credentials},
            }
    if context_id is not None:
        message["contextId"] = context_id
    if task_id is not None:
        message["taskId"] = task_id
    params: dict[str, Any] = {"message": message, "configuration": config}
    if tenant is not None and dialect == "1.0":
        params["tenant"] = tenant
    return params


def task_params(dialect: Dialect, task_id: str, tenant: str | None = None) -> dict[str, Any]:
    params: dict[str, Any] = {"id": task_id}
    if tenant is not None and dialect == "1.0":
        params["tenant"] = tenant
    return params


# --------------------------------------------------------------------------- reading


def _str(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


PROTO_STATES = (
    "unknown",
    "submitted",
    "working",
    "completed",
    "failed",
    "canceled",
    "input-required",
    "rejected",
    "auth-required",
)
"""``TaskState`` by its number in ``a2a.proto`` (ProtoJSON may print an enum's number)."""


def normalize_state(value: object) -> str:
    """``TASK_STATE_INPUT_REQUIRED`` / ``input-required`` / ``6`` → ``input-required``."""
    if type(value) is int and 0 <= value < len(PROTO_STATES):
        return PROTO_STATES[value]
    if not isinstance(value, str) or not value:
        return "unknown"
    name = value.strip()
    if name.upper().startswith("TASK_STATE_"):
        name = name[len("TASK_STATE_") :]
    name = name.lower().replace("_", "-")
    if name == "cancelled":
        name = "canceled"
    if name == "unspecified":
        return "unknown"
    known = ACTIVE_STATES | INTERRUPTED_STATES | TERMINAL_STATES
    return name if name in known else "unknown"


def _parts(raw: object) -> tuple[tuple[str, ...], tuple[FilePart, ...]]:
    texts: list[str] = []
    files: list[FilePart] = []
    if not isinstance(raw, list):
        return (), ()
    for part in raw:
        if not isinstance(part, Mapping):
            continue
        kind = part.get("kind")
        text = part.get("text")
        if isinstance(text, str) and kind in (None, "text"):
            texts.append(text)
            continue
        file = part.get("file")
        if kind in (None, "file") and isinstance(file, Mapping):  # v0.3, ``kind`` or not
            files.append(_file_part(file, _FILE_KEYS_V03))
        elif kind is None and ("url" in part or "raw" in part):
            files.append(_file_part(part, _FILE_KEYS_V10))
    return tuple(texts), tuple(files)


_FILE_KEYS_V03 = ("name", "mimeType", "uri", "bytes")
"""A v0.3 file part's keys (inside its ``file``) for :class:`FilePart`'s fields, in order."""
_FILE_KEYS_V10 = ("filename", "mediaType", "url", "raw")
"""The same keys of a v1.0 file part (on the part itself)."""


def _file_part(raw: Mapping[str, Any], keys: tuple[str, str, str, str]) -> FilePart:
    return FilePart(*(_str(raw.get(key)) for key in keys))


def _message_texts(raw: object) -> str | None:
    if not isinstance(raw, Mapping):
        return None
    texts, _ = _parts(raw.get("parts"))
    joined = "\n\n".join(t for t in texts if t.strip())
    return joined or None


def read_artifact(raw: object) -> Artifact | None:
    if not isinstance(raw, Mapping):
        return None
    texts, files = _parts(raw.get("parts"))
    return Artifact(_str(raw.get("artifactId")) or "", texts, files)


def read_task(raw: object) -> Task | None:
    """A Task (either dialect), or ``None`` when ``raw`` has no task id."""
    if not isinstance(raw, Mapping):
        return None
    task_id = _str(raw.get("id"))
    if task_id is None:
        return None
    status = raw.get("status")
    status = status if isinstance(status, Mapping) else {}
    artifacts = raw.get("artifacts")
    read = [read_artifact(a) for a in artifacts] if isinstance(artifacts, list) else []
    history = raw.get("history")
    ids: list[str] = []
    if isinstance(history, list):
        for item in history:
            if isinstance(item, Mapping) and isinstance(item.get("messageId"), str):
                ids.append(item["messageId"])
    return Task(
        id=task_id,
        context_id=_str(raw.get("contextId")),
        state=normalize_state(status.get("state")),
        status_text=_message_texts(status.get("message")),
        artifacts=tuple(a for a in read if a is not None),
        timestamp=_str(status.get("timestamp")),
        message_ids=tuple(ids),
    )


def read_message(raw: object) -> Message | None:
    if not isinstance(raw, Mapping) or "parts" not in raw:
        return None
    texts, _ = _parts(raw.get("parts"))
    return Message(
        message_id=_str(raw.get("messageId")) or "",
        context_id=_str(raw.get("contextId")),
        task_id=_str(raw.get("taskId")),
        texts=texts,
    )


def _status_update(raw: Mapping[str, Any]) -> StatusUpdate | None:
    task_id = _str(raw.get("taskId"))
    if task_id is None:
        return None
    status = raw.get("status")
    status = status if isinstance(status, Mapping) else {}
    return StatusUpdate(
        task_id,
        _str(raw.get("contextId")),
        normalize_state(status.get("state")),
        _message_texts(status.get("message")),
        raw.get("final") is True,
    )


def _artifact_update(raw: Mapping[str, Any]) -> ArtifactUpdate | None:
    task_id = _str(raw.get("taskId"))
    artifact = read_artifact(raw.get("artifact"))
    if task_id is None or artifact is None:
        return None
    return ArtifactUpdate(
        task_id,
        _str(raw.get("contextId")),
        artifact,
        raw.get("append") is True,
        raw.get("lastChunk") is True,
    )


def read_observation(raw: object) -> Observation | None:
    """A send result, stream item or push body in either dialect; ``None`` if unreadable.

    v1.0 wraps (``{"task": …}``, ``{"statusUpdate": …}``); v0.3 says ``kind``; a peer that
    says neither is read by the members it has.
    """
    if not isinstance(raw, Mapping):
        return None
    for member, reader in (
        ("task", read_task),
        ("message", read_message),
        ("statusUpdate", _status_update),
        ("artifactUpdate", _artifact_update),
    ):
        inner = raw.get(member)
        if isinstance(inner, Mapping):
            return reader(inner)
    kind = raw.get("kind")
    if kind == "task":
        return read_task(raw)
    if kind == "message":
        return read_message(raw)
    if kind == "status-update":
        return _status_update(raw)
    if kind == "artifact-update":
        return _artifact_update(raw)
    if "status" in raw and "id" in raw:
        return read_task(raw)
    if "taskId" in raw and "status" in raw:
        return _status_update(raw)
    if "messageId" in raw and "parts" in raw:
        return read_message(raw)
    return None


def observed_task_id(observation: Observation) -> str | None:
    if isinstance(observation, Task):
        return observation.id
    if isinstance(observation, Message):
        return observation.task_id
    return observation.task_id


def observed_state(observation: Observation) -> str | None:
    if isinstance(observation, Task | StatusUpdate):
        return observation.state
    return None


# --------------------------------------------------------------------------- the card


@attrs.frozen
class AgentCard:
    """What the client needs of a card: the JSON-RPC interface, its dialect, capabilities."""

    url: str
    dialect: Dialect
    streaming: bool = False
    push: bool = False
    tenant: str | None = None
    name: str | None = None


def _dialect_of(version: object) -> Dialect:
    if isinstance(version, str) and version.strip().startswith("0."):
        return "0.3"
    return "1.0"


def read_card(raw: object) -> AgentCard | None:
    """The preferred JSON-RPC interface of a v1.0 or v0.3 card; ``None`` when it has none
    (only gRPC or REST offered, or no URL at all)."""
    if not isinstance(raw, Mapping):
        return None
    caps = raw.get("capabilities")
    caps = caps if isinstance(caps, Mapping) else {}
    streaming = caps.get("streaming") is True
    push = caps.get("pushNotifications") is True
    name = _str(raw.get("name"))
    interfaces = raw.get("supportedInterfaces")
    if isinstance(interfaces, list) and interfaces:
        for iface in interfaces:
            if not isinstance(iface, Mapping):
                continue
            binding = str(iface.get("protocolBinding") or "JSONRPC").upper()
            url = _str(iface.get("url"))
            if binding == "JSONRPC" and url is not None:
                return AgentCard(
                    url,
                    _dialect_of(iface.get("protocolVersion") or "1.0"),
                    streaming,
                    push,
                    _str(iface.get("tenant")),
                    name,
                )
        return None
    # v0.3: url + preferredTransport, then additionalInterfaces.
    version = raw.get("protocolVersion") or "0.3.0"
    candidates: list[tuple[object, object]] = [
        (raw.get("url"), raw.get("preferredTransport") or "JSONRPC")
    ]
    extra = raw.get("additionalInterfaces")
    if isinstance(extra, list):
        for iface in extra:
            if isinstance(iface, Mapping):
                candidates.append((iface.get("url"), iface.get("transport")))
    for url_value, transport in candidates:
        if isinstance(url_value, str) and url_value and str(transport).upper() == "JSONRPC":
            return AgentCard(url_value, _dialect_of(version), streaming, push, None, name)
    return None


STATE_RANK = {
    "unknown": 0,
    "submitted": 1,
    "working": 2,
    "auth-required": 3,
    "input-required": 3,
    "completed": 4,
    "canceled": 4,
    "failed": 4,
    "rejected": 4,
}


def moves_forward(old: str | None, new: str | None) -> bool:
    """``new`` is a later state than ``old`` (an out-of-order push never moves back)."""
    if new is None:
        return False
    return STATE_RANK.get(new, 0) > STATE_RANK.get(old or "unknown", 0)
