"""signal-cli ``receive`` notification → :class:`~prismd.channel.InboundEvent` (contract §12.3).

Pure functions, no I/O. :func:`read_notification` reads the three shapes signal-cli has
used for ``params`` (``protocols-telegram-signal.md`` §2):

* ``manual`` (0.12.0 and later, a ``subscribeReceive`` subscription):
  ``{"subscription": N, "result": {"envelope": …, "account": "+X"}}``;
* ``legacy`` (before 0.12.0): ``{"envelope": …, "account": …, "subscription": N}``;
* ``automatic`` (``--receive-mode=on-start|on-connection``): ``{"envelope": …, "account": …}``
  — no subscription; the receiver drops these (it only takes its own subscription's).

A decryption failure carries ``exception`` (``error`` before 0.10.4) beside the envelope.

:func:`parse_envelope` then gives an event or a deliberate ignore with a bounded reason
(:data:`IGNORE_REASONS`), never an exception, whatever the envelope holds. The policy:

* **Direct text messages** become events: conversation = actor = the sender, by its ACI
  (``sourceUuid``, lower-cased) when that is a UUID, else its number (``sourceNumber``,
  else ``source``); event id per contract §4 (:func:`event_id_for`); text with lone
  surrogates replaced; claims ``{"platform": "signal", "messageType": "direct_text"}``.
* **Groups** are refused (``group``) unless ``allow_groups``: then a group text is an event
  in conversation ``group:<groupId>`` (replies go to the group), actor = the sender,
  ``messageType`` ``group_text``. Group updates (``type`` ``UPDATE``) are always ignored.
* **Attachments** (files, voice notes, images) and shared contacts are refused
  (``attachment``, ``contact``), also when the message has text: the files live on
  signal-cli's disk, which prismd does not read, and answering the text alone would answer
  something the user did not send.
* Receipts, typing, sync messages (our own other devices), calls, stories, edits,
  reactions, remote deletes, stickers, expiration-timer updates and decryption failures
  are ignored; so are messages without text (``no_text``) or with only whitespace
  (``empty``, unlike the reference, which admitted ``""``).
"""

from __future__ import annotations

import base64
import hashlib
import re
from collections.abc import Mapping
from typing import Any, Literal, TypeAlias

import attrs

from prismd.channel import InboundEvent, replace_surrogates

__all__ = [
    "IGNORE_REASONS",
    "Notification",
    "Parsed",
    "event_id_for",
    "parse_envelope",
    "read_notification",
    "sender_of",
]

MAX_SAFE_INTEGER = 2**53 - 1
GROUP_PREFIX = "group:"

Shape: TypeAlias = Literal["manual", "legacy", "automatic"]

IGNORE_REASONS: tuple[str, ...] = (
    "decryption_failure",
    "receipt",
    "typing",
    "sync",
    "call",
    "story",
    "edit",
    "reaction",
    "remote_delete",
    "sticker",
    "expiration_update",
    "group_update",
    "group",
    "attachment",
    "contact",
    "no_text",
    "empty",
    "no_content",
    "malformed",
)
"""Why a notification was not admitted (the counter keys of ``statistics().ignored``)."""

_OTHER_CONTENT = (
    ("receiptMessage", "receipt"),
    ("typingMessage", "typing"),
    ("syncMessage", "sync"),
    ("callMessage", "call"),
    ("storyMessage", "story"),
    ("editMessage", "edit"),
)
_UUID_RE = re.compile(r"^[0-9a-fA-F]{8}-(?:[0-9a-fA-F]{4}-){3}[0-9a-fA-F]{12}$")
_NUMBER_RE = re.compile(r"^\+[0-9]{3,20}$")
_GROUP_ID_RE = re.compile(r"^[A-Za-z0-9+/=_-]{1,128}$")


@attrs.frozen
class Notification:
    """The parts of one ``receive`` notification's ``params`` the receiver looks at."""

    shape: Shape
    subscription: int | None
    account: str | None
    """``None`` when the notification does not name one (older single-account daemons)."""
    envelope: Mapping[str, Any]
    decryption_failed: bool = False


@attrs.frozen
class Parsed:
    """An event to admit, or ``ignored`` with one of :data:`IGNORE_REASONS`."""

    event: InboundEvent | None = None
    ignored: str | None = None


def _count(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_SAFE_INTEGER:
        return None
    return value


def read_notification(params: object) -> Notification | None:
    """The notification in ``params``, or ``None`` when it has no readable envelope."""
    if not isinstance(params, Mapping):
        return None
    subscription = params.get("subscription")
    result = params.get("result")
    if "result" in params and isinstance(result, Mapping):
        body: Mapping[str, Any] = result
        shape: Shape = "manual"
    else:
        body = params
        shape = "legacy" if "subscription" in params else "automatic"
    if shape != "automatic" and _count(subscription) is None:
        return None
    envelope = body.get("envelope")
    if not isinstance(envelope, Mapping):
        return None
    account = body.get("account")
    failed = isinstance(body.get("exception"), Mapping) or isinstance(body.get("error"), Mapping)
    return Notification(
        shape=shape,
        subscription=subscription if shape != "automatic" else None,
        account=account if isinstance(account, str) else None,
        envelope=envelope,
        decryption_failed=failed,
    )


def _uuid(value: object) -> str | None:
    return value.lower() if isinstance(value, str) and _UUID_RE.fullmatch(value) else None


def _number(value: object) -> str | None:
    return value if isinstance(value, str) and _NUMBER_RE.fullmatch(value) else None


def sender_of(envelope: Mapping[str, Any]) -> str | None:
    """The sender's ACI (a lower-cased UUID) when known, else its number, else ``None``.

    ``source`` is the deprecated field: it holds the number, or the UUID when no number is
    known, so it is the last resort for both.
    """
    uuid = _uuid(envelope.get("sourceUuid")) or _uuid(envelope.get("source"))
    if uuid is not None:
        return uuid
    return _number(envelope.get("sourceNumber")) or _number(envelope.get("source"))


def event_id_for(
    *,
    connection_id: str,
    account: str,
    sender: str,
    device: int,
    envelope_timestamp: int,
    message_timestamp: int | None,
) -> str:
    """Contract §4: base64url (no padding) of SHA-256 over ``connection NUL account NUL
    sender NUL device NUL envelope timestamp NUL (message timestamp ?? envelope timestamp)``
    — 43 characters. A redelivered envelope gets the same id (the journal's dedup)."""
    data_ts = envelope_timestamp if message_timestamp is None else message_timestamp
    parts = (connection_id, account, sender, str(device), str(envelope_timestamp), str(data_ts))
    digest = hashlib.sha256("\0".join(parts).encode("utf-8", "surrogatepass")).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def _nonempty_list(value: object) -> bool:
    return isinstance(value, list) and len(value) > 0


def parse_envelope(
    note: Notification,
    *,
    connection_id: str,
    account: str,
    allow_groups: bool,
    received_at_ms: int,
) -> Parsed:
    """The event for ``note`` or why it is ignored (see the module docstring)."""
    if note.decryption_failed:
        return Parsed(ignored="decryption_failure")
    envelope = note.envelope
    data = envelope.get("dataMessage")
    if not isinstance(data, Mapping):
        for field, reason in _OTHER_CONTENT:
            if envelope.get(field) is not None:
                return Parsed(ignored=reason)
        return Parsed(ignored="no_content")
    if data.get("reaction") is not None:
        return Parsed(ignored="reaction")
    if data.get("remoteDelete") is not None:
        return Parsed(ignored="remote_delete")
    if data.get("sticker") is not None:
        return Parsed(ignored="sticker")
    if data.get("isExpirationUpdate") is True:
        return Parsed(ignored="expiration_update")
    group = data.get("groupInfo")
    group_id: str | None = None
    if group is not None:
        if not isinstance(group, Mapping):
            return Parsed(ignored="malformed")
        if group.get("type") not in (None, "DELIVER"):
            return Parsed(ignored="group_update")
        if not allow_groups:
            return Parsed(ignored="group")
        raw_id = group.get("groupId")
        if not isinstance(raw_id, str) or not _GROUP_ID_RE.fullmatch(raw_id):
            return Parsed(ignored="malformed")
        group_id = raw_id
    attachments = data.get("attachments")
    if attachments is not None and attachments != []:
        return Parsed(ignored="attachment" if isinstance(attachments, list) else "malformed")
    if _nonempty_list(data.get("contacts")):
        return Parsed(ignored="contact")
    message = data.get("message")
    if not isinstance(message, str):
        return Parsed(ignored="no_text")
    if not message.strip():
        return Parsed(ignored="empty")
    sender = sender_of(envelope)
    device = _count(envelope.get("sourceDevice"))
    timestamp = _count(envelope.get("timestamp"))
    if sender is None or device is None or timestamp is None:
        return Parsed(ignored="malformed")
    message_ts = data.get("timestamp")
    event_id = event_id_for(
        connection_id=connection_id,
        account=account,
        sender=sender,
        device=device,
        envelope_timestamp=timestamp,
        message_timestamp=_count(message_ts),
    )
    conversation = sender if group_id is None else GROUP_PREFIX + group_id
    return Parsed(
        event=InboundEvent(
            connection_id=connection_id,
            external_conversation_id=conversation,
            external_actor_id=sender,
            event_id=event_id,
            text=replace_surrogates(message),
            received_at_ms=received_at_ms,
            claims={
                "platform": "signal",
                "messageType": "direct_text" if group_id is None else "group_text",
            },
        )
    )
