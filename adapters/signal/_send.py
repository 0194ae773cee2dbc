"""Sending a reply through signal-cli's ``send`` (contract §12.5, SPEC difference 5).

:meth:`SignalSender.send` is the runtime's ``deliver`` for a Signal connection. Its outcome
is exact: ``delivered`` (``message_id`` = the last chunk's ``timestamp``), a known failure
(nothing went out: the reason says why), or :class:`~prismd.channel.DeliveryOutcomeUnknownError`
when something may have gone out — the runtime then records ``delivery_unknown`` for an
operator instead of resending behind anyone's back.

* **Its own connection.** Each reply opens a short connection to signal-cli, so a send
  never shares fate with the receiving connection (which pauses, unsubscribes and
  reconnects on its own) and works on a daemon standing by for the receiver lease. signal-cli
  must run with ``--receive-mode=manual``: a connection that does not subscribe then
  receives nothing.
* **Chunks.** Text is cut at 2,000 UTF-16 code units, never inside a surrogate pair, and
  sent in order, one ``send`` each. Approval controls become lines (``Reply /approve
  TOKEN to allow once.`` / ``Reply /deny TOKEN to deny.``) after a blank line on the last
  chunk, or as a chunk of their own when they do not fit.
* **Results by code, not by wording.** The JSON-RPC error code says what happened when no
  recipient got it (-5 rate limit, -4 untrusted identity, -1 user error, -6 captcha), and
  each recipient's ``type`` says it otherwise (:func:`result_outcome`). A rate limit with
  a challenge ``token`` asks for a captcha. Ambiguous — the message may be out — are: no
  answer within the deadline or a lost connection after the request was written, a
  ``NETWORK_FAILURE``, an I/O or internal error (-3, -32603), an unknown result type, and
  any failure after a first chunk went out.

Reasons: ``invalid_destination``, ``invalid_controls``, ``empty_reply``,
``signal_unavailable`` (no connection, or the request never left), ``signal_rate_limited``,
``signal_captcha_required``, ``signal_identity_changed`` (the contact's safety number
changed: ``signal-cli trust`` it; health ``account`` shows ``identity_changed``),
``signal_recipient_unregistered``, ``signal_invalid_pre_key``, ``signal_rejected`` (-1
otherwise), ``signal_rpc_error`` (signal-cli refused the request itself).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, TypeAlias

import attrs

from prismd.channel import (
    Button,
    DeliveryOutcomeUnknownError,
    Reply,
    SendResult,
    replace_surrogates,
)
from prismd.jsonrpc import INVALID_PARAMS, INVALID_REQUEST, METHOD_NOT_FOUND, PARSE_ERROR

from ..toolkit import (
    JsonRpcClient,
    JsonRpcConnectionError,
    JsonRpcTimeoutError,
    RpcError,
    button_lines,
    chunk_text,
    utf16_units,
)
from ._client import Endpoint, SignalUnreachableError, open_request_client
from ._parse import GROUP_PREFIX
from ._status import SignalStatus, log

__all__ = ["MAX_CHUNK_UNITS", "SignalSender", "render", "result_outcome"]

MAX_CHUNK_UNITS = 2_000
USER_ERROR = -1
IO_ERROR = -3
UNTRUSTED_KEY = -4
RATE_LIMIT = -5
CAPTCHA_REJECTED = -6
REFUSED_REQUEST = frozenset({PARSE_ERROR, INVALID_REQUEST, METHOD_NOT_FOUND, INVALID_PARAMS})
"""signal-cli refused the request before acting on it."""
UNKNOWN = "unknown"
"""A :func:`result_outcome` meaning the message may or may not be out."""
UNKNOWN_TEXT = "Signal delivery outcome unknown"

_UUID_RE = re.compile(r"^[0-9a-f]{8}-(?:[0-9a-f]{4}-){3}[0-9a-f]{12}$")
_NUMBER_RE = re.compile(r"^\+[0-9]{3,20}$")
_GROUP_ID_RE = re.compile(r"^[A-Za-z0-9+/=_-]{1,128}$")

Outcome: TypeAlias = str
"""``"delivered"``, a failure reason (``signal_…``), or :data:`UNKNOWN`."""


def render(text: str, buttons: Sequence[Button]) -> list[str] | None:
    """The chunks to send, in order; ``None`` for a control set that cannot be rendered.

    >>> render("Approval required.", [Button("Allow", "p:a:" + "t" * 32)])
    ['Approval required.\\n\\nReply /approve tttttttttttttttttttttttttttttttt to allow once.']
    """
    lines = button_lines(buttons)
    if lines is None:
        return None
    chunks = chunk_text(replace_surrogates(text), MAX_CHUNK_UNITS) if text.strip() else []
    if lines:
        block = "\n".join(lines)
        if chunks and utf16_units(chunks[-1]) + 2 + utf16_units(block) <= MAX_CHUNK_UNITS:
            chunks[-1] = f"{chunks[-1]}\n\n{block}"
        else:
            chunks.extend(chunk_text(block, MAX_CHUNK_UNITS))
    return chunks


def _destination(conversation: object) -> dict[str, Any] | None:
    """The ``send`` params naming the conversation, or ``None`` when it is not one."""
    if not isinstance(conversation, str):
        return None
    if conversation.startswith(GROUP_PREFIX):
        group_id = conversation[len(GROUP_PREFIX) :]
        return {"groupId": group_id} if _GROUP_ID_RE.fullmatch(group_id) else None
    if _UUID_RE.fullmatch(conversation) or _NUMBER_RE.fullmatch(conversation):
        return {"recipient": [conversation]}
    return None


def result_outcome(result: object) -> Outcome:
    """``delivered``, a failure reason, or :data:`UNKNOWN` for a ``send`` result (or an
    error's ``data.response``): the per-recipient ``type`` values decide.

    One recipient that got it is enough (a group send reaches members one by one; sending
    again would repeat it to those who have it). A result without ``results`` (older
    signal-cli) is a success.
    """
    if not isinstance(result, Mapping):
        return UNKNOWN
    results = result.get("results")
    if results is None:
        return "delivered" if "timestamp" in result else UNKNOWN
    if not isinstance(results, list):
        return UNKNOWN
    types: list[str] = []
    captcha = False
    for entry in results:
        kind = entry.get("type") if isinstance(entry, Mapping) else None
        types.append(kind if isinstance(kind, str) else "")
        if kind == "RATE_LIMIT_FAILURE" and isinstance(entry, Mapping) and entry.get("token"):
            captcha = True
    if not types or "SUCCESS" in types:
        return "delivered"
    known = {
        "RATE_LIMIT_FAILURE",
        "IDENTITY_FAILURE",
        "UNREGISTERED_FAILURE",
        "INVALID_PRE_KEY_FAILURE",
    }
    if "NETWORK_FAILURE" in types or not set(types) <= known:
        return UNKNOWN
    if "IDENTITY_FAILURE" in types:
        return "signal_identity_changed"
    if "RATE_LIMIT_FAILURE" in types:
        return "signal_captcha_required" if captcha else "signal_rate_limited"
    if "UNREGISTERED_FAILURE" in types:
        return "signal_recipient_unregistered"
    return "signal_invalid_pre_key"


def error_outcome(error: RpcError) -> Outcome:
    """The outcome of an error answer to ``send`` (the first chunk's)."""
    data = error.data
    response = data.get("response") if isinstance(data, Mapping) else None
    detailed = result_outcome(response) if response is not None else None
    if error.code == RATE_LIMIT:
        # A rate limit with a challenge token is Signal asking for a captcha.
        if detailed == "signal_captcha_required":
            return detailed
        return "signal_rate_limited"
    if error.code == UNTRUSTED_KEY:
        return "signal_identity_changed"
    if error.code == CAPTCHA_REJECTED:
        return "signal_captcha_required"
    if error.code == USER_ERROR:
        if detailed == UNKNOWN:
            return UNKNOWN  # a network failure among the recipients: it may be out
        if detailed is not None and detailed != "delivered":
            return detailed
        return "signal_rejected"
    if error.code in REFUSED_REQUEST:
        return "signal_rpc_error"
    return UNKNOWN  # -3 I/O error, -32603 internal error, anything else


@attrs.define(eq=False, kw_only=True)
class SignalSender:
    connection_id: str
    endpoint: Endpoint
    status: SignalStatus
    timeout_s: float
    max_frame_bytes: int

    async def send(self, reply: Reply) -> SendResult:
        """Deliver ``reply`` (see the module docstring for every outcome)."""
        target = _destination(reply.external_conversation_id)
        if reply.connection_id != self.connection_id or target is None:
            return SendResult(delivered=False, reason="invalid_destination")
        chunks = render(reply.text, reply.buttons)
        if chunks is None:
            return SendResult(delivered=False, reason="invalid_controls")
        if not chunks:
            return SendResult(delivered=False, reason="empty_reply")
        try:
            async with open_request_client(
                self.endpoint, timeout_s=self.timeout_s, max_frame_bytes=self.max_frame_bytes
            ) as client:
                outcome, message_id = await self._send_chunks(client, target, chunks)
        except SignalUnreachableError as exc:
            log.warning("signal %s: send failed: %s", self.connection_id, exc)
            return SendResult(delivered=False, reason="signal_unavailable")
        if outcome == UNKNOWN:
            raise DeliveryOutcomeUnknownError(UNKNOWN_TEXT)
        if outcome == "signal_identity_changed":
            self.status.identity_changed()
        if outcome != "delivered":
            return SendResult(delivered=False, reason=outcome)
        return SendResult(delivered=True, message_id=message_id)

    async def _send_chunks(
        self, client: JsonRpcClient, target: Mapping[str, Any], chunks: list[str]
    ) -> tuple[Outcome, str | None]:
        """Send each chunk in order; the first failure ends it. Never raises ``Exception``
        (an exception leaving the client's context would come wrapped in a group)."""
        message_id: str | None = None
        for index, chunk in enumerate(chunks):
            try:
                result = await client.call("send", {**target, "message": chunk})
            except RpcError as error:
                outcome = error_outcome(error)
                log.warning(
                    "signal %s: send refused (code %d, chunk %d of %d): %s",
                    self.connection_id,
                    error.code,
                    index + 1,
                    len(chunks),
                    outcome,
                )
                return (outcome if index == 0 else UNKNOWN), None
            except (JsonRpcTimeoutError, JsonRpcConnectionError) as exc:
                log.warning(
                    "signal %s: send %s (chunk %d of %d)",
                    self.connection_id,
                    "timed out" if isinstance(exc, JsonRpcTimeoutError) else "lost its connection",
                    index + 1,
                    len(chunks),
                )
                if index == 0 and not exc.sent:
                    return "signal_unavailable", None
                return UNKNOWN, None
            outcome = result_outcome(result)
            if outcome != "delivered":
                return (outcome if index == 0 else UNKNOWN), None
            timestamp = result.get("timestamp") if isinstance(result, Mapping) else None
            if isinstance(timestamp, int) and not isinstance(timestamp, bool):
                message_id = str(timestamp)
        return "delivered", message_id
