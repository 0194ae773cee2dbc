"""The journal's records (contract §5): bindings, operations and their inputs, cursors and
replies, each with its JSON codec. The JSON of every record is the contract's: same keys,
same order, absent fields left out. What the journal does with them: :mod:`._journal`.
"""

from __future__ import annotations

import datetime
import operator
from collections.abc import Callable, Mapping
from json.encoder import encode_basestring as _json_str
from typing import Any, Self, cast

import attrs

from stores import compact_json, ms_to_iso

from ..channel import AttachmentKind, AttachmentRef

MAX_SAFE_INTEGER = 2**53 - 1


class JournalRecordTooLargeError(ValueError):
    """A record's JSON encoding exceeds ``max_journal_record_bytes``; nothing was written."""


class CorruptRecordError(ValueError):
    """A stored record does not parse as the record type its namespace holds."""


# --------------------------------------------------------------------------- codecs


def _req_str(raw: Mapping[str, Any], key: str) -> str:
    value = raw.get(key)
    if not isinstance(value, str):
        raise CorruptRecordError(key)
    return value


def _opt_str(raw: Mapping[str, Any], key: str) -> str | None:
    value = raw.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise CorruptRecordError(key)
    return value


def _iso_ms(value: object) -> int:
    """Milliseconds of an ISO-8601 UTC time (``ms_to_iso``'s form); 0 when it is not one."""
    if not isinstance(value, str):
        return 0
    try:
        stamp = datetime.datetime.fromisoformat(value)
    except ValueError:
        return 0
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=datetime.UTC)
    return max(0, min(round(stamp.timestamp() * 1000), MAX_SAFE_INTEGER))


def _req_int(raw: Mapping[str, Any], key: str, default: int | None = None) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SAFE_INTEGER:
        raise CorruptRecordError(key)
    return value


def _opt_int(raw: Mapping[str, Any], key: str) -> int | None:
    if raw.get(key) is None:
        return None
    return _req_int(raw, key)


def _req_bool(raw: Mapping[str, Any], key: str, default: bool | None = None) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise CorruptRecordError(key)
    return value


def _mapping(raw: object) -> Mapping[str, Any]:
    if not isinstance(raw, Mapping):
        raise CorruptRecordError("record")
    return raw


def _list(raw: Mapping[str, Any], key: str) -> list[Any]:
    """The list under ``key`` (empty when absent or null)."""
    value = raw.get(key) or []
    if not isinstance(value, list):
        raise CorruptRecordError(key)
    return value


def _put_times(out: dict[str, Any], created_at_ms: int, updated_at_ms: int) -> None:
    """A turn record's times, in the contract's order: ISO-8601 for readers, then the
    milliseconds the records are read back from."""
    out["createdAt"] = ms_to_iso(created_at_ms)
    out["updatedAt"] = ms_to_iso(updated_at_ms)
    out["createdAtMs"] = created_at_ms
    out["updatedAtMs"] = updated_at_ms


def _times_text(created_at_ms: int, updated_at_ms: int) -> str:
    """:func:`_put_times` as compact JSON text, with its leading comma."""
    return (
        f',"createdAt":"{ms_to_iso(created_at_ms)}","updatedAt":"{ms_to_iso(updated_at_ms)}"'
        f',"createdAtMs":{created_at_ms},"updatedAtMs":{updated_at_ms}'
    )


def _compact(value: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in value.items() if v is not None}


def _bool_json(value: bool) -> str:
    return "true" if value else "false"


_FIELDS: dict[type, tuple[Callable[[Any], tuple[Any, ...]], dict[str, int]]] = {}
"""Per record class: a getter of every field's value in ``__init__`` order, and each
field's place in it."""


class Replaceable:
    """``record.replace(**changes)``: :func:`attrs.evolve` for the journal's records, which
    are copied several times for every message. ``evolve`` walks the class's fields and
    asks each for its name on every call; this reads every value at once and calls
    ``__init__`` positionally (the records' fields are all positional ``__init__``
    arguments, checked on first use)."""

    __slots__ = ()

    def replace(self, **changes: Any) -> Self:
        cls = type(self)
        known = _FIELDS.get(cls)
        if known is None:
            fields = attrs.fields(cls)  # type: ignore[arg-type]
            assert len(fields) > 1
            assert all(f.init and not f.kw_only and f.alias == f.name for f in fields)
            names = [f.name for f in fields]
            known = _FIELDS[cls] = (
                operator.attrgetter(*names),
                {name: i for i, name in enumerate(names)},
            )
        values_of, place = known
        values = list(values_of(self))
        for name, value in changes.items():
            if name not in place:
                raise TypeError(f"{cls.__name__} has no field {name!r}")
            values[place[name]] = value
        return cls(*values)


@attrs.frozen
class SuspendedRun:
    operation_id: str
    run_id: str
    session_id: str


@attrs.frozen
class BindingRecord(Replaceable):
    """§5.1, plus the route's own ids (so a prefix listing can be filtered exactly) and
    ``selected_at_ms`` (SPEC difference 3: the actor's ``/agent`` choice is the binding
    with the newest selection stamp)."""

    session_id: str
    agent_alias: str
    generation: int = 0
    suspended: bool = False
    leaf_id: str | None = None
    suspended_run: SuspendedRun | None = None
    updated_at_ms: int = 0
    connection_id: str | None = None
    external_conversation_id: str | None = None
    external_actor_id: str | None = None
    thread_id: str | None = None
    selected_at_ms: int | None = None

    def to_json(self) -> dict[str, Any]:
        run = self.suspended_run
        return _compact(
            {
                "sessionId": self.session_id,
                "leafId": self.leaf_id,
                "agentAlias": self.agent_alias,
                "generation": self.generation,
                "suspended": self.suspended,
                "suspendedRun": None
                if run is None
                else {
                    "operationId": run.operation_id,
                    "runId": run.run_id,
                    "sessionId": run.session_id,
                },
                "updatedAt": ms_to_iso(self.updated_at_ms),
                "updatedAtMs": self.updated_at_ms,
                "connectionId": self.connection_id,
                "externalConversationId": self.external_conversation_id,
                "externalActorId": self.external_actor_id,
                "threadId": self.thread_id,
                "selectedAtMs": self.selected_at_ms,
            }
        )

    @classmethod
    def from_json(cls, value: object) -> BindingRecord:
        raw = _mapping(value)
        run_raw = raw.get("suspendedRun")
        run = None
        if run_raw is not None:
            r = _mapping(run_raw)
            run = SuspendedRun(
                _req_str(r, "operationId"), _req_str(r, "runId"), _req_str(r, "sessionId")
            )
        return cls(
            session_id=_req_str(raw, "sessionId"),
            agent_alias=_req_str(raw, "agentAlias"),
            generation=_req_int(raw, "generation"),
            suspended=_req_bool(raw, "suspended"),
            leaf_id=_opt_str(raw, "leafId"),
            suspended_run=run,
            updated_at_ms=_req_int(raw, "updatedAtMs", 0),
            connection_id=_opt_str(raw, "connectionId"),
            external_conversation_id=_opt_str(raw, "externalConversationId"),
            external_actor_id=_opt_str(raw, "externalActorId"),
            thread_id=_opt_str(raw, "threadId"),
            selected_at_ms=_opt_int(raw, "selectedAtMs"),
        )


MAX_CLAIM_CHARS = 64
CLAIM_KEYS = ("platform", "chatType", "isForum", "forwarded")


def bounded_claims(claims: Mapping[str, Any]) -> dict[str, str | bool]:
    """The few claims a turn may need later: string/bool values of :data:`CLAIM_KEYS`,
    strings cut to :data:`MAX_CLAIM_CHARS`. Anything else is dropped."""
    out: dict[str, str | bool] = {}
    for key in CLAIM_KEYS:
        value = claims.get(key)
        if isinstance(value, bool):
            out[key] = value
        elif isinstance(value, str):
            out[key] = value[:MAX_CLAIM_CHARS]
    return out


@attrs.frozen
class OperationInput:
    """What an ``accepted`` message turn needs to run later (after a restart).

    Journaled only inside an ``accepted`` operation record, never in save metadata, the
    store's event stream, diagnostics, logs or exception text.
    """

    text: str
    attachments: tuple[AttachmentRef, ...] = ()
    """Journaled without their ``connection_id`` (the operation's connection, given back by
    :mod:`prismd.runtime._resume`): the transport's file id, never a URL."""
    thread_id: str | None = None
    received_at_ms: int | None = None
    claims: Mapping[str, str | bool] = attrs.field(factory=dict)
    admitted_us: int | None = None
    """When it was admitted, in microseconds of the wall clock (a JSON-safe integer until
    the year 2255), strictly increasing within the process that admitted it: what orders
    a route's records of one millisecond when they are taken up after a restart
    (``created_at_ms`` alone ties, and the operation id is a hash)."""

    def to_json(self) -> dict[str, Any]:
        return _compact(
            {
                "text": self.text,
                "attachments": [
                    _compact(
                        {
                            "kind": a.kind,
                            "transportFileId": a.transport_file_id,
                            "byteLength": a.byte_length,
                            "mimeType": a.mime_type,
                            "fileName": a.file_name,
                        }
                    )
                    for a in self.attachments
                ]
                or None,
                "threadId": self.thread_id,
                "receivedAtMs": self.received_at_ms,
                "claims": dict(self.claims) or None,
                "admittedUs": self.admitted_us,
            }
        )

    @classmethod
    def from_json(cls, value: object) -> OperationInput:
        raw = _mapping(value)
        atts = []
        for a in _list(raw, "attachments"):
            am = _mapping(a)
            atts.append(
                AttachmentRef(
                    # As the adapter named it when it was admitted.
                    kind=cast(AttachmentKind, _req_str(am, "kind")),
                    transport_file_id=_req_str(am, "transportFileId"),
                    byte_length=_req_int(am, "byteLength", 0),
                    mime_type=_opt_str(am, "mimeType"),
                    file_name=_opt_str(am, "fileName"),
                )
            )
        claims_raw = raw.get("claims") or {}
        claims = bounded_claims(_mapping(claims_raw))
        return cls(
            text=_req_str(raw, "text"),
            attachments=tuple(atts),
            thread_id=_opt_str(raw, "threadId"),
            received_at_ms=_opt_int(raw, "receivedAtMs"),
            claims=claims,
            admitted_us=_opt_int(raw, "admittedUs"),
        )


@attrs.frozen
class OperationRecord(Replaceable):
    """§5.2: one admitted event. Carries inbound text only in ``input``, and only while
    ``accepted`` (see the module docstring)."""

    operation_id: str
    event_id: str
    kind: str
    connection_id: str
    external_conversation_id: str
    external_actor_id: str
    agent_alias: str
    state: str
    created_at_ms: int
    updated_at_ms: int
    thread_id: str | None = None
    session_id: str | None = None
    run_id: str | None = None
    reply_staged: bool = False
    attempts: int = 0
    error_code: str | None = None
    input: OperationInput | None = None

    def to_json(self) -> dict[str, Any]:
        # Written out, absent optional fields left out as they come (no dict of Nones to
        # filter): the journal encodes four of these for every message.
        out: dict[str, Any] = {
            "operationId": self.operation_id,
            "eventId": self.event_id,
            "kind": self.kind,
            "connectionId": self.connection_id,
            "externalConversationId": self.external_conversation_id,
            "externalActorId": self.external_actor_id,
        }
        if self.thread_id is not None:
            out["threadId"] = self.thread_id
        out["agentAlias"] = self.agent_alias
        if self.session_id is not None:
            out["sessionId"] = self.session_id
        if self.run_id is not None:
            out["runId"] = self.run_id
        out["state"] = self.state
        out["replyStaged"] = self.reply_staged
        out["attempts"] = self.attempts
        _put_times(out, self.created_at_ms, self.updated_at_ms)
        if self.error_code is not None:
            out["errorCode"] = self.error_code
        if self.input is not None:
            out["input"] = self.input.to_json()
        return out

    def to_json_text(self) -> str:
        """``compact_json(self.to_json())``, written out field by field: the same text
        (keys, order, escaping), built without the dict and the encoder's walk over it —
        the journal encodes three of these for every message."""
        parts = [
            '{"operationId":',
            _json_str(self.operation_id),
            ',"eventId":',
            _json_str(self.event_id),
            ',"kind":',
            _json_str(self.kind),
            ',"connectionId":',
            _json_str(self.connection_id),
            ',"externalConversationId":',
            _json_str(self.external_conversation_id),
            ',"externalActorId":',
            _json_str(self.external_actor_id),
        ]
        if self.thread_id is not None:
            parts += (',"threadId":', _json_str(self.thread_id))
        parts += (',"agentAlias":', _json_str(self.agent_alias))
        if self.session_id is not None:
            parts += (',"sessionId":', _json_str(self.session_id))
        if self.run_id is not None:
            parts += (',"runId":', _json_str(self.run_id))
        parts += (
            ',"state":',
            _json_str(self.state),
            ',"replyStaged":',
            _bool_json(self.reply_staged),
            ',"attempts":',
            str(self.attempts),
            _times_text(self.created_at_ms, self.updated_at_ms),
        )
        if self.error_code is not None:
            parts += (',"errorCode":', _json_str(self.error_code))
        if self.input is not None:
            parts += (',"input":', compact_json(self.input.to_json()))
        parts.append("}")
        return "".join(parts)

    @classmethod
    def from_json(cls, value: object) -> OperationRecord:
        raw = _mapping(value)
        input_raw = raw.get("input")
        return cls(
            operation_id=_req_str(raw, "operationId"),
            event_id=_req_str(raw, "eventId"),
            kind=_req_str(raw, "kind"),
            connection_id=_req_str(raw, "connectionId"),
            external_conversation_id=_req_str(raw, "externalConversationId"),
            external_actor_id=_req_str(raw, "externalActorId"),
            agent_alias=_req_str(raw, "agentAlias"),
            state=_req_str(raw, "state"),
            created_at_ms=_req_int(raw, "createdAtMs", 0),
            updated_at_ms=_req_int(raw, "updatedAtMs", 0),
            thread_id=_opt_str(raw, "threadId"),
            session_id=_opt_str(raw, "sessionId"),
            run_id=_opt_str(raw, "runId"),
            reply_staged=_req_bool(raw, "replyStaged", False),
            attempts=_req_int(raw, "attempts", 0),
            error_code=_opt_str(raw, "errorCode"),
            input=None if input_raw is None else OperationInput.from_json(input_raw),
        )


@attrs.frozen
class CursorRecord:
    """§5.3: ordering evidence only, never used for dedup."""

    admitted: int = 0
    last_event_id: str | None = None
    updated_at_ms: int = 0

    def to_json(self) -> dict[str, Any]:
        return _compact(
            {
                "admitted": self.admitted,
                "lastEventId": self.last_event_id,
                "updatedAt": ms_to_iso(self.updated_at_ms),
                "updatedAtMs": self.updated_at_ms,
            }
        )

    @classmethod
    def from_json(cls, value: object) -> CursorRecord:
        raw = _mapping(value)
        if "updatedAtMs" not in raw:
            # Forward migration: the Telegram poller wrote its offset under this namespace
            # in its own JSON before issue 40, with the time only as ``updatedAt``.
            raw = {**raw, "updatedAtMs": _iso_ms(raw.get("updatedAt"))}
        return cls(
            admitted=_req_int(raw, "admitted", 0),
            last_event_id=_opt_str(raw, "lastEventId"),
            updated_at_ms=_req_int(raw, "updatedAtMs", 0),
        )


@attrs.frozen
class StoredFile:
    """A file that goes with a reply, as journaled: the reference its source fetches it by
    (never its bytes), its name, media type and size when known."""

    source: str
    ref: str
    name: str
    media_type: str | None = None
    size: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"source": self.source, "ref": self.ref, "name": self.name}
        if self.media_type is not None:
            out["mediaType"] = self.media_type
        if self.size is not None:
            out["size"] = self.size
        return out

    @classmethod
    def from_json(cls, value: object) -> StoredFile:
        raw = _mapping(value)
        return cls(
            _req_str(raw, "source"),
            _req_str(raw, "ref"),
            _req_str(raw, "name"),
            _opt_str(raw, "mediaType"),
            _opt_int(raw, "size"),
        )


@attrs.frozen
class StoredButton:
    """A control as journaled: label and kind only, never the token (SPEC difference 4)."""

    label: str
    kind: str
    """``allow_once`` or ``reject_once`` for approval controls, else ``other``."""


@attrs.frozen
class ReplyRecord(Replaceable):
    """§5.4: the only payload-bearing record (text already redacted and truncated).

    ``approval`` holds the non-secret approval target (run/session/approval ids and
    version) of an approval notice so a resend can issue fresh controls.
    """

    operation_id: str
    connection_id: str
    external_conversation_id: str
    kind: str
    text: str
    state: str
    created_at_ms: int
    updated_at_ms: int
    thread_id: str | None = None
    buttons: tuple[StoredButton, ...] = ()
    attempts: int = 0
    message_id: str | None = None
    reason: str | None = None
    approval: Mapping[str, Any] | None = None
    created_us: int | None = None
    """When it was staged, in microseconds, strictly increasing within the process: what
    orders a conversation's replies of one millisecond when they are sent again."""
    files: tuple[StoredFile, ...] = ()
    """Files that go with the reply, by reference (fetched at every delivery)."""

    def to_json(self) -> dict[str, Any]:
        # Written out as OperationRecord.to_json is (two of these for every message).
        out: dict[str, Any] = {
            "operationId": self.operation_id,
            "connectionId": self.connection_id,
            "externalConversationId": self.external_conversation_id,
        }
        if self.thread_id is not None:
            out["threadId"] = self.thread_id
        out["kind"] = self.kind
        out["text"] = self.text
        if self.buttons:
            out["controls"] = [{"label": c.label, "kind": c.kind} for c in self.buttons]
        out["state"] = self.state
        out["attempts"] = self.attempts
        if self.message_id is not None:
            out["messageId"] = self.message_id
        if self.reason is not None:
            out["reason"] = self.reason
        if self.approval is not None:
            out["approval"] = dict(self.approval)
        _put_times(out, self.created_at_ms, self.updated_at_ms)
        if self.created_us is not None:
            out["createdUs"] = self.created_us
        if self.files:
            out["files"] = [f.to_json() for f in self.files]
        return out

    def to_json_text(self) -> str:
        """``compact_json(self.to_json())``, written out as
        :meth:`OperationRecord.to_json_text` is."""
        parts = [
            '{"operationId":',
            _json_str(self.operation_id),
            ',"connectionId":',
            _json_str(self.connection_id),
            ',"externalConversationId":',
            _json_str(self.external_conversation_id),
        ]
        if self.thread_id is not None:
            parts += (',"threadId":', _json_str(self.thread_id))
        parts += (',"kind":', _json_str(self.kind), ',"text":', _json_str(self.text))
        if self.buttons:
            buttons = [{"label": c.label, "kind": c.kind} for c in self.buttons]
            parts += (',"controls":', compact_json(buttons))
        parts += (
            ',"state":',
            _json_str(self.state),
            ',"attempts":',
            str(self.attempts),
        )
        if self.message_id is not None:
            parts += (',"messageId":', _json_str(self.message_id))
        if self.reason is not None:
            parts += (',"reason":', _json_str(self.reason))
        if self.approval is not None:
            parts += (',"approval":', compact_json(dict(self.approval)))
        parts.append(_times_text(self.created_at_ms, self.updated_at_ms))
        if self.created_us is not None:
            parts += (',"createdUs":', str(self.created_us))
        if self.files:
            parts += (',"files":', compact_json([f.to_json() for f in self.files]))
        parts.append("}")
        return "".join(parts)

    @classmethod
    def from_json(cls, value: object) -> ReplyRecord:
        raw = _mapping(value)
        buttons = []
        for c in _list(raw, "controls"):
            cm = _mapping(c)
            buttons.append(StoredButton(_req_str(cm, "label"), _req_str(cm, "kind")))
        approval = raw.get("approval")
        files_raw = _list(raw, "files")
        return cls(
            operation_id=_req_str(raw, "operationId"),
            connection_id=_req_str(raw, "connectionId"),
            external_conversation_id=_req_str(raw, "externalConversationId"),
            kind=_req_str(raw, "kind"),
            text=_req_str(raw, "text"),
            state=_req_str(raw, "state"),
            created_at_ms=_req_int(raw, "createdAtMs", 0),
            updated_at_ms=_req_int(raw, "updatedAtMs", 0),
            thread_id=_opt_str(raw, "threadId"),
            buttons=tuple(buttons),
            attempts=_req_int(raw, "attempts", 0),
            message_id=_opt_str(raw, "messageId"),
            reason=_opt_str(raw, "reason"),
            approval=None if approval is None else dict(_mapping(approval)),
            created_us=_opt_int(raw, "createdUs"),
            files=tuple(StoredFile.from_json(f) for f in files_raw),
        )
