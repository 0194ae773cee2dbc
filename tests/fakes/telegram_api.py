"""A fake Telegram Bot API server on loopback (h11 over Trio), faithful to
``reference/protocols-telegram-signal.md`` §1.

* ``POST|GET /bot<token>/<method>`` with JSON, form-urlencoded, multipart or query bodies;
  a wrong token → 401 ``Unauthorized: invalid token specified``; an unknown method → 404
  ``Not Found: method not found``. Errors are ``{"ok":false,"error_code":N,"description":…,
  "parameters":{…}}`` with HTTP status N (``parameters`` only when non-empty); 429 adds a
  ``Retry-After`` header.
* getUpdates: updates with ``update_id < offset`` are confirmed and forgotten; a negative
  offset keeps the last ``-offset``; ``limit`` clamped to 1–100, ``timeout`` to 0–50; a long
  poll returns as soon as an update arrives; anti-spin (same offset again within 3 s with
  timeout < 3 → timeout 3; within 0.5 s → limit 1); a second poller terminates a pending one
  with 409 (at least 3 s between such 409s); 409 while a webhook is set; setWebhook
  terminates a pending poll with 409; ``allowed_updates`` filters updates pushed afterwards.
* sendMessage validates ``chat_id`` (known chat) and text (1–4096 UTF-16 units after
  entity parsing); ``parse_mode=HTML`` text is parsed as the Bot API does (its tags only,
  nested properly, escaped ``<``/``&``; else ``400 can't parse entities``, see
  :func:`parse_html`); migrated chats answer 400 with ``migrate_to_chat_id``. getFile +
  ``/file/bot<token>/<path>``, setWebhook/deleteWebhook/getWebhookInfo, answerCallbackQuery,
  sendChatAction, sendVoice, sendDocument and sendPhoto (multipart uploads), getMe.
* Every request is recorded in :attr:`FakeBotApi.calls` (method, params, virtual time).
* Failure injection: :meth:`FakeBotApi.fail_next`. :meth:`FakeBotApi.wait_until` with
  :attr:`FakeBotApi.pending_poll_at` lets a test send its competing getUpdates exactly while
  another poll is pending, so the 409 is certain rather than a matter of timing.
"""

from __future__ import annotations

import json
import re
import socket
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import h11
import trio

UNAUTHORIZED = "Unauthorized: invalid token specified"
NOT_FOUND = "Not Found: method not found"
CONFLICT_POLLER = (
    "Conflict: terminated by other getUpdates request; "
    "make sure that only one bot instance is running"
)
CONFLICT_WEBHOOK = (
    "Conflict: can't use getUpdates method while webhook is active; "
    "use deleteWebhook to delete the webhook first"
)
CONFLICT_SET_WEBHOOK = "Conflict: terminated by setWebhook request"
CHAT_ACTIONS = frozenset(
    {
        "typing",
        "upload_photo",
        "record_video",
        "upload_video",
        "record_voice",
        "upload_voice",
        "upload_document",
        "choose_sticker",
        "find_location",
        "record_video_note",
        "upload_video_note",
    }
)
UPDATE_TYPES = (
    "message",
    "edited_message",
    "channel_post",
    "edited_channel_post",
    "callback_query",
    "my_chat_member",
    "chat_member",
    "message_reaction",
    "message_reaction_count",
    "inline_query",
)
_SECRET_RE = re.compile(r"^[A-Za-z0-9_-]*$")
MAX_DOWNLOAD = 20 << 20


@attrs.frozen
class Call:
    method: str
    params: Mapping[str, Any]
    at: float
    token_ok: bool = True


@attrs.frozen
class Failure:
    status: int
    description: str
    parameters: Mapping[str, Any] | None = None
    retry_after_header: int | None = None
    raw_body: bytes | None = None


class ApiError(Exception):
    def __init__(self, status: int, description: str, parameters: Mapping[str, Any] | None = None):
        super().__init__(description)
        self.status = status
        self.description = description
        self.parameters = dict(parameters or {})


@attrs.define(eq=False)
class _Poll:
    started_at: float
    conflict: str | None = None


def _utf16(text: str) -> int:
    return len(text.encode("utf-16-le")) // 2


@attrs.define(eq=False)
class FakeBotApi:
    token: str = "123456:secret-token"
    bot_id: int = 123456
    username: str = "prism_test_bot"
    calls: list[Call] = attrs.field(factory=list)
    updates: list[dict[str, Any]] = attrs.field(factory=list)
    """Unconfirmed updates, in id order."""
    sent: list[dict[str, Any]] = attrs.field(factory=list)
    """Accepted sendMessage / sendVoice parameters."""
    chats: set[str] = attrs.field(factory=set)
    migrated: dict[str, int] = attrs.field(factory=dict)
    files: dict[str, tuple[str, bytes, int | None]] = attrs.field(factory=dict)
    redirect_paths: set[str] = attrs.field(factory=set)
    webhook_url: str = ""
    webhook_secret: str | None = None
    allowed_updates: list[str] | None = None
    conflicts: int = 0
    port: int = 0
    nodelay: bool = True
    """Trio's default for its sockets; ``False`` turns Nagle's algorithm back on for each
    accepted connection (the default socket behaviour of most HTTP servers; benchmarks)."""
    _failures: dict[str, list[Failure | None]] = attrs.field(factory=dict)
    _next_update_id: int = 1
    _next_message_id: int = 1
    _changed: trio.Event = attrs.field(factory=trio.Event)
    _pending_poll: _Poll | None = None
    _last_conflict_at: float | None = None
    _last_poll: tuple[int, float] | None = None
    _delays: dict[str, float] = attrs.field(factory=dict)

    # ------------------------------------------------------------------ control API

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def push_update(self, payload: Mapping[str, Any], *, update_id: int | None = None) -> int:
        """Queue an update (``update_id`` assigned when absent) and wake long polls."""
        update = dict(payload)
        if update_id is None:
            update_id = update.get("update_id", self._next_update_id)
        update["update_id"] = update_id
        self._next_update_id = max(self._next_update_id, update_id + 1)
        for value in update.values():
            if isinstance(value, Mapping):
                for holder in (value, value.get("message")):
                    if isinstance(holder, Mapping) and isinstance(holder.get("chat"), Mapping):
                        self.chats.add(str(holder["chat"].get("id")))
        kind = next((k for k in UPDATE_TYPES if k in update), None)
        allowed = self.allowed_updates
        if allowed is not None:
            excluded = {"chat_member", "message_reaction", "message_reaction_count"}
            if (allowed and kind not in allowed) or (not allowed and kind in excluded):
                return update_id
        self.updates.append(update)
        self.updates.sort(key=lambda u: u["update_id"])
        self._wake()
        return update_id

    def fail_next(
        self,
        method: str,
        *,
        status: int,
        description: str,
        parameters: Mapping[str, Any] | None = None,
        retry_after_header: int | None = None,
        times: int = 1,
        raw_body: bytes | None = None,
        after: int = 0,
    ) -> None:
        """The next ``times`` calls of ``method`` fail (after ``after`` more successes)."""
        failure = Failure(status, description, parameters, retry_after_header, raw_body)
        queue = self._failures.setdefault(method, [])
        queue.extend([None] * after)
        queue.extend([failure] * times)

    def rate_limit(self, method: str, retry_after: int, *, times: int = 1) -> None:
        self.fail_next(
            method,
            status=429,
            description=f"Too Many Requests: retry after {retry_after}",
            parameters={"retry_after": retry_after},
            retry_after_header=retry_after,
            times=times,
        )

    def delay(self, method: str, seconds: float) -> None:
        """Answer ``method`` only after ``seconds`` (virtual time under autojump)."""
        self._delays[method] = seconds

    def add_file(
        self, file_id: str, data: bytes, *, file_path: str | None = None, size: int | None = None
    ) -> None:
        path = file_path or f"documents/{file_id}.bin"
        self.files[file_id] = (path, data, len(data) if size is None else size)

    def calls_to(self, method: str) -> list[Call]:
        return [c for c in self.calls if c.method == method]

    @property
    def pending_poll_at(self) -> float | None:
        """When the pending long poll began; ``None`` when no getUpdates is waiting.

        While one is pending, any other getUpdates terminates it with 409.
        """
        return None if self._pending_poll is None else self._pending_poll.started_at

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds, checked again after every change of state
        (an update pushed, a long poll begun or terminated)."""
        while not predicate():
            await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # ------------------------------------------------------------------ server

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._connection, listeners)
            task_status.started(self.origin)

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        if not self.nodelay:
            stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, False)
        try:
            while True:
                event = await self._next(conn, stream)
                if not isinstance(event, h11.Request):
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
                status, headers, payload = await self._dispatch(event, body)
                headers = [*headers, ("content-length", str(len(payload)))]
                out = conn.send(h11.Response(status_code=status, headers=headers)) or b""
                out += conn.send(h11.Data(data=payload)) or b""
                out += conn.send(h11.EndOfMessage()) or b""
                await stream.send_all(out)
                if conn.our_state is h11.MUST_CLOSE:
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
            conn.receive_data(await stream.receive_some(65536))

    async def _dispatch(
        self, request: h11.Request, body: bytes
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        target = request.target.decode("latin-1")
        path, _, query = target.partition("?")
        match = re.fullmatch(r"/(file/)?bot([^/]*)/(.+)", path)
        if match is None:
            return 404, [("content-type", "text/plain")], b"Not Found"
        is_file, token, rest = match.group(1), match.group(2), match.group(3)
        if is_file:
            self.calls.append(
                Call("<download>", {"path": rest}, trio.current_time(), token == self.token)
            )
            if token != self.token:
                return 401, [("content-type", "text/plain")], b"Unauthorized"
            if rest in self.redirect_paths:
                return 302, [("location", "http://127.0.0.1:9/elsewhere")], b""
            for file_path, data, _size in self.files.values():
                if file_path == rest:
                    return 200, [("content-type", "application/octet-stream")], data
            return 404, [("content-type", "text/plain")], b"Not Found"
        method = rest
        headers = {k.lower(): v for k, v in request.headers}
        params = self._params(query, headers.get(b"content-type", b"").decode(), body)
        self.calls.append(Call(method, params, trio.current_time(), token == self.token))
        if token != self.token:
            return self._error(401, UNAUTHORIZED)
        delay = self._delays.get(method)
        if delay:
            await trio.sleep(delay)
        queued = self._failures.get(method)
        failure = queued.pop(0) if queued else None
        if failure is not None:
            if failure.raw_body is not None:
                return failure.status, [("content-type", "text/html")], failure.raw_body
            extra = []
            if failure.retry_after_header is not None:
                extra.append(("retry-after", str(failure.retry_after_header)))
            return self._error(failure.status, failure.description, failure.parameters, extra)
        handler = getattr(self, f"_m_{method}", None)
        if handler is None:
            return self._error(404, NOT_FOUND)
        try:
            result = await handler(params)
        except ApiError as error:
            return self._error(error.status, error.description, error.parameters)
        envelope: dict[str, Any] = {"ok": True, "result": result}
        if isinstance(result, tuple):
            envelope = {"ok": True, "result": result[0], "description": result[1]}
        return 200, [("content-type", "application/json")], json.dumps(envelope).encode()

    @staticmethod
    def _error(
        status: int,
        description: str,
        parameters: Mapping[str, Any] | None = None,
        extra: list[tuple[str, str]] | None = None,
    ) -> tuple[int, list[tuple[str, str]], bytes]:
        body: dict[str, Any] = {"ok": False, "error_code": status, "description": description}
        if parameters:
            body["parameters"] = dict(parameters)
        headers = [("content-type", "application/json"), *(extra or [])]
        return status, headers, json.dumps(body).encode()

    @staticmethod
    def _params(query: str, content_type: str, body: bytes) -> dict[str, Any]:
        params: dict[str, Any] = {}

        def put(key: str, value: str) -> None:
            if value[:1] in ("[", "{"):
                try:
                    params[key] = json.loads(value)
                    return
                except ValueError:
                    pass
            params[key] = value

        for key, value in urllib.parse.parse_qsl(query):
            put(key, value)
        kind = content_type.split(";")[0].strip().lower()
        if kind == "application/json" and body:
            loaded = json.loads(body)
            if isinstance(loaded, dict):
                params.update(loaded)
        elif kind == "application/x-www-form-urlencoded":
            for key, value in urllib.parse.parse_qsl(body.decode()):
                put(key, value)
        elif kind == "multipart/form-data":
            boundary = re.search(r'boundary="?([^";]+)"?', content_type)
            assert boundary is not None
            for part in body.split(b"--" + boundary.group(1).encode())[1:]:
                if part.startswith(b"--"):
                    break
                # Exactly the CRLF after the boundary line and the one before the next:
                # a file's own bytes may begin or end with CR or LF.
                part = part.removeprefix(b"\r\n").removesuffix(b"\r\n")
                head, _, content = part.partition(b"\r\n\r\n")
                head_text = head.decode()
                name = re.search(r'name="([^"]*)"', head_text)
                if name is None:
                    continue
                filename = re.search(r'filename="([^"]*)"', head_text)
                if filename is None:
                    put(name.group(1), content.decode())
                    continue
                mime = re.search(r"(?i)content-type:\s*([^\r\n]+)", head_text)
                params[name.group(1)] = {
                    "filename": filename.group(1),
                    "content_type": mime.group(1).strip() if mime else None,
                    "data": content,
                }
        return params

    # ------------------------------------------------------------------ methods

    async def _m_getMe(self, params: Mapping[str, Any]) -> Any:
        return {
            "id": self.bot_id,
            "is_bot": True,
            "first_name": "Prism Test",
            "username": self.username,
        }

    async def _m_getWebhookInfo(self, params: Mapping[str, Any]) -> Any:
        return {
            "url": self.webhook_url,
            "has_custom_certificate": False,
            "pending_update_count": len(self.updates),
        }

    async def _m_setWebhook(self, params: Mapping[str, Any]) -> Any:
        url = str(params.get("url", ""))
        secret = params.get("secret_token")
        if secret is not None:
            secret = str(secret)
            if len(secret) > 256:
                raise ApiError(400, "Bad Request: secret token is too long")
            if not _SECRET_RE.fullmatch(secret):
                raise ApiError(400, "Bad Request: secret token contains unallowed characters")
        if params.get("drop_pending_updates") in (True, "true", "True"):
            self.updates.clear()
        if url and self._pending_poll is not None:
            self._terminate_poll(CONFLICT_SET_WEBHOOK)
        already = url == self.webhook_url and secret == self.webhook_secret
        self.webhook_url, self.webhook_secret = url, secret
        if not url:
            return True, "Webhook is already deleted" if already else "Webhook was deleted"
        return True, "Webhook is already set" if already else "Webhook was set"

    async def _m_deleteWebhook(self, params: Mapping[str, Any]) -> Any:
        if params.get("drop_pending_updates") in (True, "true", "True"):
            self.updates.clear()
        was = bool(self.webhook_url)
        self.webhook_url, self.webhook_secret = "", None
        return True, "Webhook was deleted" if was else "Webhook is already deleted"

    def _terminate_poll(self, reason: str) -> None:
        poll = self._pending_poll
        if poll is not None:
            poll.conflict = reason
            self._pending_poll = None
        self._wake()

    async def _m_getUpdates(self, params: Mapping[str, Any]) -> Any:
        if self.webhook_url:
            raise ApiError(409, CONFLICT_WEBHOOK)
        offset = int(params.get("offset", 0) or 0)
        limit = max(1, min(100, int(params.get("limit", 100))))
        timeout = max(0, min(50, int(params.get("timeout", 0))))
        now = trio.current_time()
        if self._last_poll is not None and self._last_poll[0] == offset:
            since = now - self._last_poll[1]
            if since < 3 and timeout < 3:
                timeout = 3
            if since < 0.5:
                limit = 1
        self._last_poll = (offset, now)
        if "allowed_updates" in params:
            allowed = params["allowed_updates"]
            self.allowed_updates = list(allowed) if isinstance(allowed, list) else None
        if offset > 0:
            self.updates = [u for u in self.updates if u["update_id"] >= offset]
        elif offset < 0:
            self.updates = self.updates[offset:]
        if self._pending_poll is not None:
            if self._last_conflict_at is not None:
                wait = self._last_conflict_at + 3 - trio.current_time()
                if wait > 0:
                    await trio.sleep(wait)
            self.conflicts += 1
            self._last_conflict_at = trio.current_time()
            self._terminate_poll(CONFLICT_POLLER)
        poll = _Poll(started_at=trio.current_time())
        with trio.move_on_after(timeout):
            self._pending_poll = poll
            self._wake()
            while not self.updates and poll.conflict is None:
                await self._changed.wait()
        if self._pending_poll is poll:
            self._pending_poll = None
        if poll.conflict is not None:
            raise ApiError(409, poll.conflict)
        if offset > 0:
            self.updates = [u for u in self.updates if u["update_id"] >= offset]
        return self.updates[:limit]

    def _known_chat(self, params: Mapping[str, Any]) -> str:
        chat_id = str(params.get("chat_id", ""))
        if not chat_id:
            raise ApiError(400, "Bad Request: chat_id is empty")
        if chat_id in self.migrated:
            raise ApiError(
                400,
                "Bad Request: group chat was upgraded to a supergroup chat",
                {"migrate_to_chat_id": self.migrated[chat_id]},
            )
        if chat_id not in self.chats:
            raise ApiError(400, "Bad Request: chat not found")
        return chat_id

    def _message(self, chat_id: str, **extra: Any) -> dict[str, Any]:
        message_id = self._next_message_id
        self._next_message_id += 1
        chat_type = "private" if not chat_id.startswith("-") else "supergroup"
        return {
            "message_id": message_id,
            "from": {"id": self.bot_id, "is_bot": True, "first_name": "Prism Test"},
            "chat": {"id": int(chat_id), "type": chat_type},
            "date": 1_700_000_000,
            **extra,
        }

    async def _m_sendMessage(self, params: Mapping[str, Any]) -> Any:
        chat_id = self._known_chat(params)
        text = params.get("text")
        if isinstance(text, str) and params.get("parse_mode") == "HTML":
            text = parse_html(text)
        if not isinstance(text, str) or not text.strip():
            raise ApiError(400, "Bad Request: message text is empty")
        if _utf16(text) > 4096:
            raise ApiError(400, "Bad Request: message is too long")
        self.sent.append(dict(params))
        return self._message(chat_id, text=text)

    async def _m_sendVoice(self, params: Mapping[str, Any]) -> Any:
        chat_id = self._known_chat(params)
        voice = params.get("voice")
        if not isinstance(voice, Mapping):
            raise ApiError(400, "Bad Request: there is no voice in the request")
        self.sent.append(dict(params))
        return self._message(chat_id, voice={"file_id": "voice-out", "duration": 1})

    async def _m_sendDocument(self, params: Mapping[str, Any]) -> Any:
        return self._upload(params, "document", 50 << 20)

    async def _m_sendPhoto(self, params: Mapping[str, Any]) -> Any:
        return self._upload(params, "photo", 10 << 20)

    def _upload(self, params: Mapping[str, Any], field: str, limit: int) -> Any:
        """sendDocument / sendPhoto with an uploaded file (multipart/form-data); a string
        (a file_id or an HTTP URL to fetch) is not something this fake serves."""
        chat_id = self._known_chat(params)
        upload = params.get(field)
        if not isinstance(upload, Mapping):
            raise ApiError(400, f"Bad Request: there is no {field} in the request")
        data = upload.get("data", b"")
        if not data:
            raise ApiError(400, "Bad Request: file must be non-empty")
        if len(data) > limit:
            raise ApiError(413, "Request Entity Too Large")
        self.sent.append(dict(params))
        name = upload.get("filename") or "file"
        if field == "photo":
            size = {"file_id": f"photo-{len(self.sent)}", "width": 1, "height": 1}
            return self._message(chat_id, photo=[{**size, "file_size": len(data)}])
        document = {"file_id": f"doc-{len(self.sent)}", "file_name": name, "file_size": len(data)}
        return self._message(chat_id, document=document)

    async def _m_sendChatAction(self, params: Mapping[str, Any]) -> Any:
        self._known_chat(params)
        if params.get("action") not in CHAT_ACTIONS:
            raise ApiError(400, "Bad Request: Wrong parameter action in request")
        return True

    async def _m_sendMessageDraft(self, params: Mapping[str, Any]) -> Any:
        chat_id = self._known_chat(params)
        if chat_id.startswith("-"):
            raise ApiError(400, "Bad Request: chat_id must be a private chat")
        if str(params.get("draft_id", "0")) in ("0", ""):
            raise ApiError(400, "Bad Request: draft_id must be non-zero")
        text = params.get("text", "")
        if not isinstance(text, str) or _utf16(text) > 4096:
            raise ApiError(400, "Bad Request: message is too long")
        return True

    async def _m_answerCallbackQuery(self, params: Mapping[str, Any]) -> Any:
        if not params.get("callback_query_id"):
            raise ApiError(400, "Bad Request: query is too old and response timeout expired")
        return True

    async def _m_getFile(self, params: Mapping[str, Any]) -> Any:
        file_id = str(params.get("file_id", ""))
        if file_id not in self.files:
            raise ApiError(400, "Bad Request: invalid file_id")
        path, _data, size = self.files[file_id]
        if size is not None and size > MAX_DOWNLOAD:
            raise ApiError(400, "Bad Request: file is too big")
        result: dict[str, Any] = {
            "file_id": file_id,
            "file_unique_id": f"u-{file_id}",
            "file_path": path,
        }
        if size is not None:
            result["file_size"] = size
        return result


_HTML_TAGS = {
    "b": "b", "strong": "b", "i": "i", "em": "i", "u": "u", "ins": "u", "s": "s",
    "strike": "s", "del": "s", "tg-spoiler": "tg-spoiler", "span": "span", "a": "a",
    "code": "code", "pre": "pre", "blockquote": "blockquote", "tg-emoji": "tg-emoji",
}  # fmt: skip
_NAMED_ENTITIES = {"lt": "<", "gt": ">", "amp": "&", "quot": '"'}
_HTML_TOKEN_RE = re.compile(
    r"<(/?)([A-Za-z][A-Za-z0-9-]*)((?:\s[^<>]*)?)>|<|&(#x[0-9A-Fa-f]+|#[0-9]+|[A-Za-z]+);|&"
)


def parse_html(text: str) -> str:
    """The visible text of a ``parse_mode=HTML`` message, as the Bot API parses it: only its
    tags (``<span class="tg-spoiler">``, ``<a href>``, ``<pre><code class="language-…">``),
    properly nested; only ``&lt; &gt; &amp; &quot;`` and numeric entities; every other
    ``<`` or ``&`` is an error. Raises the API's ``400 Bad Request: can't parse entities``."""

    def fail(reason: str) -> ApiError:
        return ApiError(400, f"Bad Request: can't parse entities: {reason}")

    out: list[str] = []
    stack: list[str] = []
    position = 0
    for match in _HTML_TOKEN_RE.finditer(text):
        out.append(text[position : match.start()])
        position = match.end()
        offset = len(text[: match.start()].encode("utf-8"))
        token = match.group(0)
        if match.group(2) is not None:
            closing, name, attributes = match.group(1), match.group(2).lower(), match.group(3)
            if name not in _HTML_TAGS:
                kind = "end" if closing else "start"
                raise fail(f'Unsupported {kind} tag "{name}" at byte offset {offset}')
            if closing:
                if not stack:
                    raise fail(f"Unexpected end tag at byte offset {offset}")
                if stack[-1] != name:
                    raise fail(
                        f'Unmatched end tag at byte offset {offset}, expected "</{stack[-1]}>", '
                        f'found "</{name}>"'
                    )
                stack.pop()
            else:
                if name == "span" and 'class="tg-spoiler"' not in attributes:
                    raise fail(f'Tag "span" must have class "tg-spoiler" at byte offset {offset}')
                if name == "a" and "href=" not in attributes:
                    raise fail(f'Tag "a" must have attribute "href" at byte offset {offset}')
                stack.append(name)
        elif token == "<":
            raise fail(f'Unsupported start tag "" at byte offset {offset}')
        elif token == "&":
            raise fail(f"Character '&' is reserved and must be escaped at byte offset {offset}")
        else:
            entity = match.group(4)
            if entity.startswith("#x"):
                out.append(chr(int(entity[2:], 16)))
            elif entity.startswith("#"):
                out.append(chr(int(entity[1:])))
            elif entity in _NAMED_ENTITIES:
                out.append(_NAMED_ENTITIES[entity])
            else:
                raise fail(f'Unsupported HTML entity "&{entity};" at byte offset {offset}')
    out.append(text[position:])
    if stack:
        raise fail(f'Can\'t find end tag corresponding to start tag "{stack[-1]}"')
    return "".join(out)


async def start_fake(nursery: trio.Nursery, **kwargs: Any) -> FakeBotApi:
    fake = FakeBotApi(**kwargs)
    await nursery.start(fake.serve)
    return fake
