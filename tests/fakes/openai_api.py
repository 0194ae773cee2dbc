"""A fake OpenAI-compatible chat completions server on loopback (h11 over Trio).

Faithful to what ``POST /v1/chat/completions`` sends and checks:

* ``stream: true`` → ``200`` ``text/event-stream`` with chunked transfer encoding, one
  ``data: {json}`` event per ``chat.completion.chunk`` (``id``, ``object``, ``created``,
  ``model``, ``system_fingerprint``, ``choices[0]`` with ``index``, ``delta``, ``logprobs``,
  ``finish_reason``), the first delta carrying ``role: "assistant"``, then ``data: [DONE]``.
  Tool calls stream as OpenAI streams them: the first part of each call has ``index``,
  ``id``, ``type`` and ``function.name`` with empty ``arguments``, later parts only
  ``index`` and an ``arguments`` fragment; the last chunk has an empty delta and
  ``finish_reason`` ``"tool_calls"`` (else ``"stop"``). ``stream: false`` answers one
  ``chat.completion`` object.
* A wrong or missing ``Authorization: Bearer`` → ``401`` with OpenAI's error body
  (``{"error": {"message": "Incorrect API key provided: sk-ab***wxyz. …", "type":
  "invalid_request_error", "param": null, "code": "invalid_api_key"}}``: the message quotes
  part of the key, which is why a client must never show it). Malformed requests → ``400``
  ``invalid_request_error`` (unknown role, a ``tool`` message that answers no preceding
  ``tool_calls``, an assistant ``tool_calls`` message not followed by a result per id,
  a malformed ``tools`` entry, no ``model``). Unknown paths → ``404``.
* Scripted behaviour per request, in order (:meth:`FakeOpenAI.push`): :class:`Answer`
  (text and/or tool calls, chunk size, delay between chunks, a connection dropped or a
  stream hung after N chunks), :class:`Failure` (``429`` with ``Retry-After`` and
  ``x-ratelimit-*`` headers, ``500``, ``503``, any status with OpenAI's body), :class:`Hang`
  (the request is read, nothing is ever answered). With nothing pushed the server answers
  on its own (:meth:`FakeOpenAI.default_answer`), so a test can drive it unshaped.
* Every request is recorded (:attr:`FakeOpenAI.requests`); every connection the *client*
  closed while a response was still under way is recorded in
  :attr:`FakeOpenAI.disconnects` (:meth:`FakeOpenAI.wait_disconnect` waits for one).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import h11
import trio

MODEL = "gpt-4o-mini"
ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@attrs.frozen
class Answer:
    """A streamed answer: ``text`` in pieces of ``chunk_chars``, then ``tool_calls``
    (``(name, arguments)``; the arguments' JSON is split into ``split`` fragments)."""

    text: str = ""
    tool_calls: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    chunk_chars: int = 4
    split: int = 3
    delay_s: float = 0.0
    """Pause before every content or tool chunk (a slow stream)."""
    drop_after: int | None = None
    """Close the connection (no terminating chunk) after this many content/tool chunks."""
    hang_after: int | None = None
    """Stop sending after this many content/tool chunks, keeping the connection open."""
    finish_reason: str | None = None


@attrs.frozen
class Failure:
    status: int
    retry_after: str | None = None
    retry_after_ms: str | None = None
    message: str | None = None


@attrs.frozen
class Hang:
    """Read the request and never answer (the response head never comes)."""


Behaviour = Answer | Failure | Hang


@attrs.frozen
class Recorded:
    path: str
    headers: Mapping[str, str]
    body: Any
    at: float


def masked(key: str) -> str:
    return f"{key[:5]}{'*' * 20}{key[-4:]}" if len(key) > 9 else "***"


def error_body(status: int, *, message: str | None = None, key: str = "") -> dict[str, Any]:
    """OpenAI's error object for ``status``."""
    if status == 401:
        return {
            "error": {
                "message": message
                or (
                    f"Incorrect API key provided: {masked(key)}. You can find your API key "
                    "at https://platform.openai.com/account/api-keys."
                ),
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
    if status == 429:
        return {
            "error": {
                "message": message
                or (
                    f"Rate limit reached for {MODEL} in organization org-fake on requests per "
                    "min (RPM): Limit 3, Used 3, Requested 1. Please try again in 1s."
                ),
                "type": "requests",
                "param": None,
                "code": "rate_limit_exceeded",
            }
        }
    if status >= 500:
        return {
            "error": {
                "message": message
                or "The server had an error while processing your request. Sorry about that!",
                "type": "server_error",
                "param": None,
                "code": None,
            }
        }
    if status == 404:
        return {
            "error": {
                "message": message or "The model does not exist or you do not have access to it.",
                "type": "invalid_request_error",
                "param": None,
                "code": "model_not_found",
            }
        }
    return {
        "error": {
            "message": message or "Invalid request.",
            "type": "invalid_request_error",
            "param": None,
            "code": None,
        }
    }


def check_messages(body: Any) -> str | None:
    """The 400 message OpenAI gives for a malformed request body, or None."""
    if not isinstance(body, Mapping):
        return "We could not parse the JSON body of your request."
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "you must provide a model parameter"
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return "[] is too short - 'messages'"
    open_ids: list[str] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or message.get("role") not in ROLES:
            return f"Invalid value for 'messages[{index}].role'."
        role = message["role"]
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in open_ids:
                return (
                    "Invalid parameter: messages with role 'tool' must be a response to a "
                    "preceeding message with 'tool_calls'."
                )
            open_ids.remove(call_id)
            if not isinstance(message.get("content"), str):
                return f"Invalid type for 'messages[{index}].content'."
            continue
        if open_ids:
            return (
                "An assistant message with 'tool_calls' must be followed by tool messages "
                "responding to each 'tool_call_id'. The following tool_call_ids did not have "
                f"response messages: {', '.join(open_ids)}"
            )
        if role == "assistant" and message.get("tool_calls"):
            for call in message["tool_calls"]:
                if (
                    not isinstance(call, Mapping)
                    or call.get("type") != "function"
                    or not isinstance(call.get("id"), str)
                    or not isinstance(call.get("function", {}).get("arguments"), str)
                ):
                    return f"Invalid value for 'messages[{index}].tool_calls'."
                open_ids.append(call["id"])
        elif not isinstance(message.get("content"), str):
            return f"Invalid type for 'messages[{index}].content'."
    if open_ids:
        return (
            "An assistant message with 'tool_calls' must be followed by tool messages "
            "responding to each 'tool_call_id'. The following tool_call_ids did not have "
            f"response messages: {', '.join(open_ids)}"
        )
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            return "Invalid type for 'tools'."
        for index, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, Mapping) else None
            if (
                not isinstance(function, Mapping)
                or tool.get("type") != "function"
                or not isinstance(function.get("name"), str)
                or not isinstance(function.get("parameters", {}), Mapping)
            ):
                return f"Invalid value for 'tools[{index}]'."
    return None


@attrs.define(eq=False)
class FakeOpenAI:
    api_key: str | None = "sk-test-FAKE-KEY-0123456789abcdef"
    base_path: str = "/v1"
    requests: list[Recorded] = attrs.field(factory=list)
    disconnects: list[float] = attrs.field(factory=list)
    connections: int = 0
    port: int = 0
    _script: list[Behaviour] = attrs.field(factory=list)
    _changed: trio.Event = attrs.field(factory=trio.Event)

    # ------------------------------------------------------------------ control

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.base_path}"

    def push(self, *behaviours: Behaviour) -> None:
        """Answer the next requests with these behaviours, in order."""
        self._script.extend(behaviours)

    @property
    def completions(self) -> list[Recorded]:
        return [r for r in self.requests if r.path.endswith("/chat/completions")]

    async def wait_requests(self, count: int) -> None:
        while len(self.completions) < count:
            await self._wait_change()

    async def wait_disconnect(self, count: int = 1) -> float:
        """When the ``count``-th client-side close of an unfinished response happened."""
        while len(self.disconnects) < count:
            await self._wait_change()
        return self.disconnects[count - 1]

    async def _wait_change(self) -> None:
        await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    @staticmethod
    def default_answer(body: Mapping[str, Any]) -> Answer:
        """Unscripted: names the last user message and how many earlier user messages
        (the history) came with it."""
        users = [m for m in body.get("messages", []) if m.get("role") == "user"]
        last = str(users[-1].get("content", "")) if users else ""
        return Answer(f"You said: {last} (I remember {len(users) - 1} earlier message(s).)")

    # ------------------------------------------------------------------ server

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._connection, listeners)
            task_status.started(self.base_url)

    async def _connection(self, stream: trio.SocketStream) -> None:
        self.connections += 1
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request = await self._next(conn, stream)
                if not isinstance(request, h11.Request):
                    return
                body = b""
                while True:
                    part = await self._next(conn, stream)
                    if isinstance(part, h11.Data):
                        body += part.data
                    elif isinstance(part, h11.EndOfMessage):
                        break
                    else:
                        return
                keep = await self._respond(conn, stream, request, body)
                if not keep or conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return
        finally:
            with trio.move_on_after(1, shield=True):
                await stream.aclose()

    @staticmethod
    async def _next(conn: h11.Connection, stream: trio.SocketStream) -> object:
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            data = await stream.receive_some(65536)
            conn.receive_data(data)

    async def _send_whole(
        self, conn: h11.Connection, stream: trio.SocketStream, status: int, payload: Any,
        headers: Sequence[tuple[str, str]] = (),
    ) -> None:  # fmt: skip
        data = json.dumps(payload).encode()
        head = [
            ("content-type", "application/json"),
            ("content-length", str(len(data))),
            ("x-request-id", f"req_{uuid.uuid4().hex[:24]}"),
            *headers,
        ]
        out = conn.send(h11.Response(status_code=status, headers=head)) or b""
        out += conn.send(h11.Data(data=data)) or b""
        out += conn.send(h11.EndOfMessage()) or b""
        await stream.send_all(out)

    async def _respond(
        self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request, raw: bytes
    ) -> bool:
        target = request.target.decode("latin-1").split("?", 1)[0]
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in request.headers}
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = None
        self.requests.append(Recorded(target, headers, body, trio.current_time()))
        self._wake()
        method = request.method.decode()
        if target == f"{self.base_path}/models" and method == "GET":
            if not self._authorized(headers):
                await self._send_whole(conn, stream, 401, self._unauthorized(headers))
                return True
            models = {"object": "list", "data": [{"id": MODEL, "object": "model",
                      "created": 1_700_000_000, "owned_by": "system"}]}  # fmt: skip
            await self._send_whole(conn, stream, 200, models)
            return True
        if target != f"{self.base_path}/chat/completions" or method != "POST":
            await self._send_whole(
                conn, stream, 404, error_body(404, message=f"Invalid URL ({method} {target})")
            )
            return True
        if not self._authorized(headers):
            await self._send_whole(conn, stream, 401, self._unauthorized(headers))
            return True
        problem = check_messages(body)
        if problem is not None:
            await self._send_whole(conn, stream, 400, error_body(400, message=problem))
            return True
        behaviour = self._script.pop(0) if self._script else self.default_answer(body)
        if isinstance(behaviour, Failure):
            extra: list[tuple[str, str]] = []
            if behaviour.retry_after is not None:
                extra.append(("retry-after", behaviour.retry_after))
            if behaviour.retry_after_ms is not None:
                extra.append(("retry-after-ms", behaviour.retry_after_ms))
            if behaviour.status == 429:
                extra += [
                    ("x-ratelimit-limit-requests", "3"),
                    ("x-ratelimit-remaining-requests", "0"),
                    ("x-ratelimit-reset-requests", "1s"),
                ]
            await self._send_whole(
                conn, stream, behaviour.status,
                error_body(behaviour.status, message=behaviour.message), extra,
            )  # fmt: skip
            return True
        if isinstance(behaviour, Hang):
            await self._watch(stream, trio.sleep_forever)
            return False
        if not body.get("stream"):
            await self._send_whole(conn, stream, 200, self._whole(body, behaviour))
            return True
        return await self._watch(stream, lambda: self._stream(conn, stream, body, behaviour))

    def _authorized(self, headers: Mapping[str, str]) -> bool:
        return self.api_key is None or headers.get("authorization") == f"Bearer {self.api_key}"

    @staticmethod
    def _unauthorized(headers: Mapping[str, str]) -> dict[str, Any]:
        given = headers.get("authorization", "").removeprefix("Bearer ")
        if not given:
            return error_body(
                401,
                message="You didn't provide an API key. You need to provide your API key in an "
                "Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
            )
        return error_body(401, key=given)

    async def _watch(self, stream: trio.SocketStream, respond: Any) -> bool:
        """Run ``respond`` while watching the socket: the client closing it mid-response is
        recorded and ends the response. True when the response completed (keep-alive)."""
        completed = False
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                try:
                    data = await stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    self.disconnects.append(trio.current_time())
                    self._wake()
                    nursery.cancel_scope.cancel()

            nursery.start_soon(watch)
            try:
                result = await respond()
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                result = False
            # A drop (False) closes the connection after the watcher stopped, so it is
            # not mistaken for the client's close.
            completed = result is not False
            nursery.cancel_scope.cancel()
        return completed

    # ------------------------------------------------------------------ bodies

    @staticmethod
    def _chunk(cid: str, model: str, delta: Mapping[str, Any], finish: str | None) -> bytes:
        chunk = {
            "id": cid,
            "object": "chat.completion.chunk",
            "created": 1_700_000_000,
            "model": model,
            "system_fingerprint": "fp_fake",
            "choices": [
                {"index": 0, "delta": dict(delta), "logprobs": None, "finish_reason": finish}
            ],
        }
        return b"data: " + json.dumps(chunk).encode() + b"\n\n"

    @staticmethod
    def _pieces(answer: Answer) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        step = max(1, answer.chunk_chars)
        for start in range(0, len(answer.text), step):
            deltas.append({"content": answer.text[start : start + step]})
        for index, (name, arguments) in enumerate(answer.tool_calls):
            call_id = f"call_{uuid.uuid4().hex[:24]}"
            deltas.append(
                {
                    "tool_calls": [
                        {
                            "index": index,
                            "id": call_id,
                            "type": "function",
                            "function": {"name": name, "arguments": ""},
                        }
                    ]
                }
            )
            encoded = json.dumps(dict(arguments))
            size = max(1, -(-len(encoded) // max(1, answer.split)))
            for start in range(0, len(encoded), size):
                deltas.append(
                    {
                        "tool_calls": [
                            {
                                "index": index,
                                "function": {"arguments": encoded[start : start + size]},
                            }
                        ]
                    }
                )
        return deltas

    async def _stream(
        self,
        conn: h11.Connection,
        stream: trio.SocketStream,
        body: Mapping[str, Any],
        answer: Answer,
    ) -> bool:
        cid = f"chatcmpl-{uuid.uuid4().hex[:29]}"
        model = str(body.get("model"))
        head = [
            ("content-type", "text/event-stream; charset=utf-8"),
            ("cache-control", "no-cache"),
            ("x-request-id", f"req_{uuid.uuid4().hex[:24]}"),
            ("openai-processing-ms", "42"),
        ]
        await stream.send_all(conn.send(h11.Response(status_code=200, headers=head)) or b"")
        first: dict[str, Any] = {"role": "assistant", "content": "", "refusal": None}
        if not answer.text and answer.tool_calls:
            first = {"role": "assistant", "content": None}
        await stream.send_all(conn.send(h11.Data(data=self._chunk(cid, model, first, None))) or b"")
        for sent, delta in enumerate(self._pieces(answer)):
            if answer.drop_after is not None and sent >= answer.drop_after:
                # An abrupt close mid-body (the caller closes the socket): the chunked
                # encoding never terminates.
                return False
            if answer.hang_after is not None and sent >= answer.hang_after:
                await trio.sleep_forever()
            if answer.delay_s:
                await trio.sleep(answer.delay_s)
            data = self._chunk(cid, model, delta, None)
            await stream.send_all(conn.send(h11.Data(data=data)) or b"")
        finish = answer.finish_reason or ("tool_calls" if answer.tool_calls else "stop")
        out = conn.send(h11.Data(data=self._chunk(cid, model, {}, finish))) or b""
        out += conn.send(h11.Data(data=b"data: [DONE]\n\n")) or b""
        out += conn.send(h11.EndOfMessage()) or b""
        await stream.send_all(out)
        return True

    def _whole(self, body: Mapping[str, Any], answer: Answer) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": answer.text or None}
        if answer.tool_calls:
            message["tool_calls"] = [
                {
                    "id": f"call_{uuid.uuid4().hex[:24]}",
                    "type": "function",
                    "function": {"name": name, "arguments": json.dumps(dict(arguments))},
                }
                for name, arguments in answer.tool_calls
            ]
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:29]}",
            "object": "chat.completion",
            "created": 1_700_000_000,
            "model": str(body.get("model")),
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "logprobs": None,
                    "finish_reason": "tool_calls" if answer.tool_calls else "stop",
                }
            ],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }


async def start_fake_openai(nursery: trio.Nursery, **kwargs: Any) -> FakeOpenAI:
    fake = FakeOpenAI(**kwargs)
    await nursery.start(fake.serve)
    return fake
