"""Newline-delimited JSON-RPC 2.0 framing, shared by the control socket (server), ``prismctl``
(client) and the signal-cli client of :mod:`adapters.toolkit`.

**Standard library only**, on purpose: ``prismctl`` imports this module and runs as any
operator, whose Python may not see the daemon's dependencies. The Trio client lives in
:mod:`adapters.toolkit` and builds on this.

One frame is one JSON value on one line (``\\n``-terminated, UTF-8). Guarantees:

* :func:`encode` writes ASCII only (every non-ASCII character, lone surrogates included, is
  escaped), so encoding never fails on text and each frame is valid UTF-8 with exactly one
  newline, at its end; ``NaN``/``Infinity`` are refused (``ValueError``), as JSON has none.
* :class:`FrameBuffer` splits received bytes into frames and bounds them: a frame (or an
  unterminated tail) longer than ``max_frame_bytes`` raises :class:`FrameTooLargeError`
  instead of buffering without end.
* :func:`parse_request` (server side) accepts only a request object with a string or
  integer ``id``, ``"jsonrpc": "2.0"``, a non-empty ``method`` and object ``params``
  (absent or ``null`` means ``{}``); anything else raises :class:`RequestError` with the
  standard code (``-32700`` not UTF-8 / not JSON, ``-32600`` not a request, ``-32602``
  params not an object) and the ``id`` to answer with when it could be read. It never
  raises anything else.
* :func:`parse_message` (client side) reads a response (``id`` with ``result`` or
  ``error``) or a message the server sent on its own (``method``, e.g. signal-cli's
  ``receive`` notifications); :class:`FrameError` for anything unreadable.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "INTERNAL_ERROR",
    "INVALID_PARAMS",
    "INVALID_REQUEST",
    "MAX_FRAME_BYTES",
    "METHOD_NOT_FOUND",
    "PARSE_ERROR",
    "FrameBuffer",
    "FrameError",
    "FrameTooLargeError",
    "Incoming",
    "Request",
    "RequestError",
    "Response",
    "RpcError",
    "encode",
    "encode_error",
    "encode_notification",
    "encode_request",
    "encode_result",
    "parse_message",
    "parse_request",
]

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603

MAX_FRAME_BYTES = 1024 * 1024
"""Default bound on one frame."""

RequestId = str | int


class RpcError(Exception):
    """A JSON-RPC error object: raised by a handler to answer with it, or by a client for
    an error response. ``message`` is fixed text (never user content or secrets)."""

    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.data = data

    def to_object(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": self.code, "message": self.message}
        if self.data is not None:
            error["data"] = self.data
        return error


class RequestError(RpcError):
    """A frame that is not an acceptable request; answer with ``request_id`` (``None``
    when the id could not be read)."""

    def __init__(self, code: int, message: str, request_id: RequestId | None = None) -> None:
        super().__init__(code, message)
        self.request_id = request_id


class FrameError(ValueError):
    """A frame that cannot be read as a JSON-RPC message (fixed text)."""


class FrameTooLargeError(FrameError):
    """A frame longer than the buffer's ``max_frame_bytes``."""

    def __init__(self) -> None:
        super().__init__("frame too large")


# --------------------------------------------------------------------------- encoding


def encode(message: Mapping[str, Any]) -> bytes:
    """One frame: compact ASCII JSON plus ``\\n``. ``ValueError``/``TypeError`` for a value
    JSON cannot carry."""
    return json.dumps(message, separators=(",", ":"), allow_nan=False).encode() + b"\n"


def encode_request(request_id: RequestId, method: str, params: Any = None) -> bytes:
    message: dict[str, Any] = {"jsonrpc": "2.0", "id": request_id, "method": method}
    if params is not None:
        message["params"] = params
    return encode(message)


def encode_notification(method: str, params: Any = None) -> bytes:
    message: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        message["params"] = params
    return encode(message)


def encode_result(request_id: RequestId | None, result: Any) -> bytes:
    return encode({"jsonrpc": "2.0", "id": request_id, "result": result})


def encode_error(request_id: RequestId | None, code: int, message: str, data: Any = None) -> bytes:
    return encode(
        {"jsonrpc": "2.0", "id": request_id, "error": RpcError(code, message, data).to_object()}
    )


# --------------------------------------------------------------------------- framing


class FrameBuffer:
    """Bytes in, frames out (without their newline), each at most ``max_frame_bytes``."""

    def __init__(self, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        if max_frame_bytes < 1:
            raise ValueError("max_frame_bytes must be positive")
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()

    def feed(self, data: bytes | bytearray) -> None:
        self._buffer += data

    def next_frame(self) -> bytes | None:
        """The next complete frame, ``None`` until one arrived whole. Raises
        :class:`FrameTooLargeError` for an oversized frame or unterminated tail (the
        buffer is then cleared: the stream cannot be trusted to resynchronise)."""
        end = self._buffer.find(b"\n")
        if end < 0:
            if len(self._buffer) > self.max_frame_bytes:
                self._buffer.clear()
                raise FrameTooLargeError()
            return None
        if end > self.max_frame_bytes:
            self._buffer.clear()
            raise FrameTooLargeError()
        frame = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return frame

    def __len__(self) -> int:
        return len(self._buffer)


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class Request:
    id: RequestId
    method: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Response:
    id: RequestId | None
    result: Any = None
    error: RpcError | None = None


@dataclass(frozen=True)
class Incoming:
    """A message the server sent on its own: a notification (``id`` None) or a request."""

    method: str
    params: Any = None
    id: RequestId | None = None


def _decode(frame: bytes) -> Any:
    try:
        text = frame.decode("utf-8")
    except UnicodeDecodeError:
        raise RequestError(PARSE_ERROR, "parse error: not UTF-8") from None
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nesting past the parser's limit
        raise RequestError(PARSE_ERROR, "parse error: not JSON") from None


def _is_id(value: object) -> bool:
    return isinstance(value, str | int) and not isinstance(value, bool)


def parse_request(frame: bytes) -> Request:
    """A request; :class:`RequestError` otherwise (see the module docstring)."""
    message = _decode(frame)
    if not isinstance(message, dict):
        raise RequestError(INVALID_REQUEST, "invalid request: expected one JSON object")
    request_id = message.get("id")
    if request_id is not None and not _is_id(request_id):
        raise RequestError(INVALID_REQUEST, "invalid request: id must be a string or integer")
    if request_id is None:
        raise RequestError(INVALID_REQUEST, "invalid request: id is required")
    if message.get("jsonrpc") != "2.0":
        raise RequestError(INVALID_REQUEST, "invalid request: jsonrpc must be '2.0'", request_id)
    method = message.get("method")
    if not isinstance(method, str) or not method:
        raise RequestError(INVALID_REQUEST, "invalid request: method must be a string", request_id)
    params = message.get("params", {})
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise RequestError(INVALID_PARAMS, "params must be an object", request_id)
    unexpected = sorted(set(message) - {"jsonrpc", "id", "method", "params"})
    if unexpected:
        raise RequestError(
            INVALID_REQUEST, f"invalid request: unknown member {unexpected[0]!r}", request_id
        )
    return Request(request_id, method, params)


def parse_message(frame: bytes, *, strict: bool = False) -> Response | Incoming:
    """A response or a server-initiated message; :class:`FrameError` when unreadable.

    ``strict``: a message without ``"jsonrpc": "2.0"`` is unreadable too (a peer that does
    not speak JSON-RPC 2.0 cannot be trusted with the rest of the stream)."""
    try:
        message = _decode(frame)
    except RequestError:
        raise FrameError("unreadable frame") from None
    if not isinstance(message, dict):
        raise FrameError("unreadable frame")
    if strict and message.get("jsonrpc") != "2.0":
        raise FrameError("unreadable frame")
    method = message.get("method")
    if isinstance(method, str):
        request_id = message.get("id")
        return Incoming(method, message.get("params"), request_id if _is_id(request_id) else None)
    request_id = message.get("id")
    if request_id is not None and not _is_id(request_id):
        raise FrameError("unreadable frame")
    error = message.get("error")
    if isinstance(error, dict):
        code = error.get("code")
        if isinstance(code, bool) or not isinstance(code, int):
            code = INTERNAL_ERROR
        text = error.get("message")
        return Response(
            request_id,
            error=RpcError(code, text if isinstance(text, str) else "", error.get("data")),
        )
    if "result" not in message:
        raise FrameError("unreadable frame")
    return Response(request_id, result=message["result"])
