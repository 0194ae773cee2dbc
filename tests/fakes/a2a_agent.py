"""A fake remote A2A agent on loopback (h11 over Trio), in either wire dialect.

Follows ``reference/a2a-protocol.md`` (copied facts: §1–§6):

* ``GET /.well-known/agent-card.json`` (or only the legacy ``agent.json`` with
  ``legacy_card=True``) answers a v1.0 card (``supportedInterfaces``) or a v0.3 card
  (``url``, ``preferredTransport``, ``protocolVersion``), with ``capabilities.streaming``
  and ``capabilities.pushNotifications``.
* ``POST <path>`` is JSON-RPC. The v1.0 dialect answers ``SendMessage``, ``GetTask``,
  ``CancelTask``, ``ListTasks``, ``SubscribeToTask`` (-32009 without ``A2A-Version: 1.0``, as
  the a2a-sdk server does; -32602 for a v0.3 spelling such as ``role: "user"``), wraps send
  results (``{"task": …}``) and spells states ``TASK_STATE_*``. The v0.3 dialect answers
  ``message/send``, ``tasks/get``, ``tasks/cancel``, ``tasks/resubscribe``, puts ``kind``
  on everything, spells states lowercase, and answers -32601 to a v1.0 method name.
* Tasks follow a :class:`Plan` per send, in order (:meth:`FakeA2A.plan`): answered at once
  with a bare message, completed at once, or left ``working`` until the test moves them
  (:meth:`FakeA2A.move`): completed with artifacts (chunked on streams), input-required,
  failed, canceled, rejected. ``CancelTask`` cancels a working task. ``forget`` loses a
  task (then -32001, as after a remote restart with an in-memory store).
* Push: a task sent with a push config gets one POST per state change (no retry, like the
  official SDKs) with both ``X-A2A-Notification-Token`` and ``Authorization: <scheme>
  <credentials>``; v1.0 posts a ``StreamResponse`` (``{"statusUpdate": …}``), v0.3 the bare
  Task. :meth:`FakeA2A.push_again` re-sends any body (duplicates, late ``working``).
* A POST to the interface path without its trailing slash gets a 307 to the path.
* Friction, one per request in order (:meth:`FakeA2A.friction`): ``"429"`` (bare, empty
  body, ``Retry-After: 1``), ``"503"``, ``"-32601"``, ``"-32009"``, ``"cut"`` (the
  request is processed, then the connection is closed without an answer: the client
  cannot know; on a stream, it is cut after its first event), ``"drop"`` (closed unread).
* A completed task may carry file parts (:class:`FakeFile`: inline base64, v1.0 ``raw`` /
  v0.3 ``file.bytes``, or a URL, v1.0 ``url`` / v0.3 ``file.uri``) in an artifact of their
  own; :meth:`FakeA2A.offer_download` serves a URL's bytes (``GET``, recorded in
  :attr:`FakeA2A.fetched`). Each status change gets its own ``timestamp``.
* Every JSON-RPC request is recorded (:attr:`FakeA2A.requests`); :meth:`sends_of` counts
  the sends of one ``messageId``.
"""

from __future__ import annotations

import base64
import itertools
import json
from collections.abc import Mapping
from typing import Any, Literal

import attrs
import h11
import httpx
import trio

Dialect = Literal["1.0", "0.3"]
V1_METHODS = {
    "SendMessage": "send",
    "GetTask": "get",
    "CancelTask": "cancel",
    "ListTasks": "list",
    "SubscribeToTask": "subscribe",
}
V03_METHODS = {
    "message/send": "send",
    "tasks/get": "get",
    "tasks/cancel": "cancel",
    "tasks/resubscribe": "subscribe",
}
TERMINAL = {"completed", "canceled", "failed", "rejected"}


@attrs.frozen
class Plan:
    """What the next send does: ``"message"`` (a bare answer, no task), ``"complete"`` (the
    task is completed before the answer), ``"work"`` (``working`` until moved),
    ``"input-required"`` (asks ``text`` at once)."""

    kind: Literal["message", "complete", "work", "input-required"] = "work"
    text: str = "done"


@attrs.frozen
class FakeFile:
    """A file part of a completed task's answer: inline (``data``, base64 on the wire) or
    by ``url`` (serve its bytes with :meth:`FakeA2A.offer_download`)."""

    name: str | None
    media_type: str | None = None
    data: bytes | None = None
    url: str | None = None


@attrs.define
class FakeTask:
    id: str
    context_id: str
    state: str
    history: list[dict[str, Any]]
    artifacts: list[dict[str, Any]] = attrs.Factory(list)
    status_text: str | None = None
    push: dict[str, Any] | None = None
    timestamp: str = "2026-12-05T10:00:00.000Z"
    chunks: int = 1


@attrs.define(eq=False)
class FakeA2A:
    dialect: Dialect = "1.0"
    streaming: bool = True
    push_capable: bool = True
    legacy_card: bool = False
    path: str = "/a2a/"
    bearer: str | None = None
    port: int = 0
    tasks: dict[str, FakeTask] = attrs.Factory(dict)
    requests: list[dict[str, Any]] = attrs.Factory(list)
    pushes_sent: list[tuple[str, dict[str, Any]]] = attrs.Factory(list)
    downloads: dict[str, tuple[bytes, str]] = attrs.Factory(dict)
    """``GET <path>`` → (body, content type): what file URLs point at."""
    fetched: list[str] = attrs.Factory(list)
    """The download paths requested, in order."""
    stall: trio.Event | None = None
    """While set to an unset event, every task read (``GetTask``/``tasks/get``) is held
    until it is set: a poll in flight, for as long as a test wants."""
    _plans: list[Plan] = attrs.Factory(list)
    _friction: list[str] = attrs.Factory(list)
    _ids: itertools.count[int] = attrs.Factory(lambda: itertools.count(1))
    _changed: trio.Event = attrs.Factory(trio.Event)
    _scope: trio.CancelScope | None = None
    _down: trio.Event = attrs.Factory(trio.Event)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.path}"

    # ------------------------------------------------------------------ scripting

    def plan(self, *plans: Plan) -> None:
        self._plans.extend(plans)

    def friction(self, *kinds: str) -> None:
        self._friction.extend(kinds)

    @property
    def friction_left(self) -> int:
        """Frictions not yet applied to a request."""
        return len(self._friction)

    def sends_of(self, message_id: str) -> int:
        """Sends of ``message_id`` the agent processed (not those refused before it)."""
        return sum(
            1
            for r in self.sends()
            if r["processed"] and r["params"].get("message", {}).get("messageId") == message_id
        )

    def sends(self) -> list[dict[str, Any]]:
        return [
            r
            for r in self.requests
            if V1_METHODS.get(r["method"], V03_METHODS.get(r["method"])) == "send"
        ]

    def forget(self, task_id: str) -> None:
        self.tasks.pop(task_id, None)

    async def move(
        self,
        task_id: str,
        state: str,
        text: str | None = None,
        *,
        chunks: int = 1,
        push: bool = True,
        files: tuple[FakeFile, ...] = (),
    ) -> None:
        """Move a task to ``state`` (``completed`` with ``text`` as its artifact, else
        ``text`` as the status message) and push once when it has a push config. A stream
        sends the artifact in ``chunks`` artifact-update events (``append`` after the
        first, ``lastChunk`` on the last), and ``GetTask`` shows those chunks as the
        artifact's parts, as the official SDKs store an artifact built by ``append`` (one
        part per chunk; ``chunks=1``: one part per paragraph). A v1.0 task with a push
        config gets a push per chunk too, before its status push (as a2a-sdk 1.x pushes
        every event)."""
        task = self.tasks[task_id]
        task.chunks = chunks
        task.state = state
        # Each status change gets its own time, as a server stamps each (a new status).
        tick = next(self._ids)
        task.timestamp = f"2026-12-05T10:{tick // 60 % 60:02d}:{tick % 60:02d}.000Z"
        if state == "completed" and (text is not None or files):
            task.artifacts = [] if text is None else [_artifact(text, self.dialect)]
            if chunks > 1 and task.artifacts:
                pieces = [piece for piece, _, _ in _chunks(task.artifacts[0], chunks)]
                task.artifacts[0] = {
                    "artifactId": task.artifacts[0]["artifactId"],
                    "parts": [p for piece in pieces for p in piece["parts"]],
                }
            if files:
                task.artifacts.append(_file_artifact(files, self.dialect))
        else:
            task.status_text = text
        self._wake()
        if push and task.push is not None:
            if chunks > 1 and self.dialect == "1.0" and state == "completed":
                for art in task.artifacts:
                    for chunk in _chunks(art, chunks):
                        await self.send_push(task.push, self._artifact_event(task, chunk))
            await self.send_push(task.push, self._push_body(task))

    def offer_download(self, path: str, data: bytes, content_type: str) -> str:
        """Serve ``data`` at ``GET <path>``; the URL."""
        self.downloads[path] = (data, content_type)
        return f"http://127.0.0.1:{self.port}{path}"

    async def send_push(self, config: Mapping[str, Any], body: Mapping[str, Any]) -> int:
        """POST ``body`` to a task's push URL once, as the SDKs do; the status or 0."""
        auth = config.get("authentication") or {}
        scheme = auth.get("scheme") or (auth.get("schemes") or ["Bearer"])[0]
        headers = {"Content-Type": "application/json"}
        if config.get("token"):
            headers["X-A2A-Notification-Token"] = config["token"]
        if auth.get("credentials"):
            headers["Authorization"] = f"{scheme} {auth['credentials']}"
        self.pushes_sent.append((str(config.get("url")), dict(body)))
        try:
            async with httpx.AsyncClient() as client:
                response = await client.post(
                    str(config["url"]), json=dict(body), headers=headers, timeout=5
                )
            return response.status_code
        except httpx.HTTPError:
            return 0

    async def push_again(self, task_id: str, state: str | None = None) -> int:
        """Re-send a task's push (``state`` overrides the state in the body: a late
        ``working`` after ``completed``)."""
        task = self.tasks[task_id]
        assert task.push is not None
        body = self._push_body(task, state)
        return await self.send_push(task.push, body)

    def _push_body(self, task: FakeTask, state: str | None = None) -> dict[str, Any]:
        if self.dialect == "0.3":
            out = self._task_json(task)
            if state is not None:
                out["status"]["state"] = state
            return out
        status = self._status(task)
        if state is not None:
            status["state"] = _v1_state(state)
        return {"statusUpdate": {"taskId": task.id, "contextId": task.context_id, "status": status}}

    async def wait_requests(self, count: int) -> None:
        while len(self.requests) < count:
            await self._changed.wait()

    async def wait_state(self, predicate: Any) -> None:
        while not predicate():
            await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # ------------------------------------------------------------------ shapes

    def _status(self, task: FakeTask) -> dict[str, Any]:
        status: dict[str, Any] = {
            "state": _v1_state(task.state) if self.dialect == "1.0" else task.state,
            "timestamp": task.timestamp,
        }
        if task.status_text is not None:
            message: dict[str, Any] = {
                "messageId": f"status-{task.id}-{task.state}",
                "role": "ROLE_AGENT" if self.dialect == "1.0" else "agent",
                "parts": [_text_part(task.status_text, self.dialect)],
            }
            if self.dialect == "0.3":
                message["kind"] = "message"
            status["message"] = message
        return status

    def _task_json(self, task: FakeTask) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": task.id,
            "contextId": task.context_id,
            "status": self._status(task),
            "history": task.history,
            "unknownFieldFromTheFuture": {"x": 1},
        }
        if task.artifacts:
            out["artifacts"] = task.artifacts
        if self.dialect == "0.3":
            out["kind"] = "task"
        return out

    def card(self) -> dict[str, Any]:
        caps = {"streaming": self.streaming, "pushNotifications": self.push_capable}
        if self.dialect == "1.0":
            return {
                "name": "fake",
                "description": "a fake A2A agent",
                "version": "1",
                "supportedInterfaces": [
                    {"url": self.base_url, "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}
                ],
                "capabilities": caps,
                "defaultInputModes": ["text/plain"],
                "defaultOutputModes": ["text/plain"],
                "skills": [],
            }
        return {
            "name": "fake",
            "description": "a fake A2A agent",
            "version": "1",
            "protocolVersion": "0.3.0",
            "url": self.base_url,
            "preferredTransport": "JSONRPC",
            "capabilities": caps,
            "defaultInputModes": ["text/plain"],
            "defaultOutputModes": ["text/plain"],
            "skills": [],
        }

    # ------------------------------------------------------------------ server

    async def serve(self, *, task_status: trio.TaskStatus[str] = trio.TASK_STATUS_IGNORED) -> None:
        """Listen on ``port`` (0: any) until :meth:`stop` (the remote going down)."""
        listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        self._down = trio.Event()
        try:
            with trio.CancelScope() as scope:
                self._scope = scope
                async with trio.open_nursery() as nursery:
                    await nursery.start(trio.serve_listeners, self._connection, listeners)
                    task_status.started(self.base_url)
        finally:
            self._down.set()

    async def stop(self) -> None:
        """The remote goes down: listener and open connections closed, then returns."""
        if self._scope is not None:
            self._scope.cancel()
            await self._down.wait()

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request = await _next(conn, stream)
                if not isinstance(request, h11.Request):
                    return
                body = b""
                while True:
                    part = await _next(conn, stream)
                    if isinstance(part, h11.Data):
                        body += part.data
                    elif isinstance(part, h11.EndOfMessage):
                        break
                    else:
                        return
                if not await self._respond(conn, stream, request, body):
                    return
                if conn.our_state is h11.MUST_CLOSE:
                    return
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return
        finally:
            with trio.move_on_after(1, shield=True):
                await stream.aclose()

    async def _respond(
        self, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request, raw: bytes
    ) -> bool:
        target = request.target.decode("latin-1").split("?", 1)[0]
        headers = {k.decode().lower(): v.decode("latin-1") for k, v in request.headers}
        method = request.method.decode()
        if method == "GET":
            wanted = (
                "/.well-known/agent.json" if self.legacy_card else ("/.well-known/agent-card.json")
            )
            if target == self.path.rstrip("/") + wanted or target == wanted:
                await _send(conn, stream, 200, self.card())
            elif target in self.downloads:
                self.fetched.append(target)
                data, kind = self.downloads[target]
                head = [("content-length", str(len(data))), ("content-type", kind)]
                out = conn.send(h11.Response(status_code=200, headers=head)) or b""
                out += conn.send(h11.Data(data=data)) or b""
                out += conn.send(h11.EndOfMessage()) or b""
                await stream.send_all(out)
            else:
                await _send(conn, stream, 404, {"error": "not found"})
            return True
        friction = self._friction.pop(0) if self._friction else None
        if friction == "drop":
            return False
        if friction == "429":
            await _send(conn, stream, 429, None, [("retry-after", "1")])
            return True
        if friction == "503":
            await _send(conn, stream, 503, None)
            return True
        if target != self.path:
            if target == self.path.rstrip("/"):
                # A missing trailing slash: a 307 to the real path (a2a-bridge's "failure layer").
                await _send(conn, stream, 307, None, [("location", self.path)])
            else:
                await _send(conn, stream, 404, None)
            return True
        try:
            body = json.loads(raw)
        except ValueError:
            await _send(conn, stream, 200, _error(None, -32700))
            return True
        rid = body.get("id")
        name = body.get("method", "")
        params = body.get("params") or {}
        record = {
            "method": name, "params": params, "headers": headers, "processed": False,
            "at": trio.current_time(), "id": rid,
        }  # fmt: skip
        self.requests.append(record)
        self._wake()
        stall = self.stall
        if stall is not None and name in ("GetTask", "tasks/get"):
            await stall.wait()
        if friction in ("-32601", "-32009"):
            await _send(conn, stream, 200, _error(rid, int(friction)))
            return True
        table = V1_METHODS if self.dialect == "1.0" else V03_METHODS
        op = table.get(name)
        if op is None:
            await _send(conn, stream, 200, _error(rid, -32601))
            return True
        if self.dialect == "1.0" and headers.get("a2a-version") != "1.0":
            await _send(conn, stream, 200, _error(rid, -32009))
            return True
        if self.bearer is not None and headers.get("authorization") != f"Bearer {self.bearer}":
            await _send(conn, stream, 401, None)
            return True
        if op == "subscribe":
            return await self._subscribe(conn, stream, rid, params, cut=friction == "cut")
        record["processed"] = True
        answer = self._handle(op, rid, params)
        if friction == "cut":
            return False
        await _send(conn, stream, 200, answer)
        return True

    def _handle(self, op: str, rid: Any, params: Mapping[str, Any]) -> dict[str, Any]:
        if op == "send":
            return self._send_message(rid, params)
        if op == "list":
            tasks = [self._task_json(t) for t in self.tasks.values()]
            if params.get("contextId"):
                tasks = [t for t in tasks if t["contextId"] == params["contextId"]]
            return {"jsonrpc": "2.0", "id": rid, "result": {"tasks": tasks[::-1]}}
        task = self.tasks.get(str(params.get("id")))
        if task is None:
            return _error(rid, -32001)
        if op == "cancel":
            if task.state in TERMINAL:
                return _error(rid, -32002)
            task.state = "canceled"
            self._wake()
        return {"jsonrpc": "2.0", "id": rid, "result": self._task_json(task)}

    def _send_message(self, rid: Any, params: Mapping[str, Any]) -> dict[str, Any]:
        message = params.get("message") or {}
        config = params.get("configuration") or {}
        if self.dialect == "1.0" and (message.get("role") != "ROLE_USER" or "kind" in message):
            return _error(rid, -32602)
        if self.dialect == "0.3" and (
            message.get("role") != "user" or message.get("kind") != ("message")
        ):
            return _error(rid, -32602)
        plan = self._plans.pop(0) if self._plans else Plan("complete", "done")
        context_id = message.get("contextId") or f"ctx-{next(self._ids)}"
        if plan.kind == "message":
            reply: dict[str, Any] = {
                "messageId": f"m-{next(self._ids)}",
                "role": "ROLE_AGENT" if self.dialect == "1.0" else "agent",
                "parts": [_text_part(plan.text, self.dialect)],
                "contextId": context_id,
            }
            if self.dialect == "0.3":
                reply["kind"] = "message"
                return {"jsonrpc": "2.0", "id": rid, "result": reply}
            return {"jsonrpc": "2.0", "id": rid, "result": {"message": reply}}
        push = config.get("taskPushNotificationConfig") or config.get("pushNotificationConfig")
        existing = message.get("taskId")
        if existing:
            task = self.tasks.get(str(existing))
            if task is None:
                return _error(rid, -32001)
            if task.state in TERMINAL:
                return _error(rid, -32004)
            task.history.append(message)
        else:
            task = FakeTask(f"task-{next(self._ids)}", context_id, "submitted", [message])
            self.tasks[task.id] = task
        if push and self.push_capable:
            task.push = dict(push)
        if plan.kind == "complete":
            task.state = "completed"
            task.artifacts = [_artifact(plan.text, self.dialect)]
        elif plan.kind == "input-required":
            task.state = "input-required"
            task.status_text = plan.text
        else:
            task.state = "working"
        self._wake()
        result = self._task_json(task)
        if self.dialect == "1.0":
            return {"jsonrpc": "2.0", "id": rid, "result": {"task": result}}
        return {"jsonrpc": "2.0", "id": rid, "result": result}

    async def _subscribe(
        self,
        conn: h11.Connection,
        stream: trio.SocketStream,
        rid: Any,
        params: Mapping[str, Any],
        *,
        cut: bool = False,
    ) -> bool:
        task = self.tasks.get(str(params.get("id")))
        if task is None or not self.streaming:
            await _send(conn, stream, 200, _error(rid, -32001 if task is None else -32004))
            return True
        if task.state in TERMINAL:
            await _send(conn, stream, 200, _error(rid, -32004 if self.dialect == "1.0" else -32602))
            return True
        # The stream ends with the connection (as uvicorn/starlette do for a finished SSE
        # response that the server closes): said in the head, so no client pools it.
        head = [
            ("content-type", "text/event-stream"),
            ("cache-control", "no-cache"),
            ("connection", "close"),
        ]
        await stream.send_all(conn.send(h11.Response(status_code=200, headers=head)) or b"")

        async def event(result: Mapping[str, Any]) -> None:
            frame = {"jsonrpc": "2.0", "id": rid, "result": result}
            data = f"data: {json.dumps(frame)}\n\n".encode()
            await stream.send_all(conn.send(h11.Data(data=data)) or b"")

        # What the snapshot shows is what this stream has sent: taken with it, before the
        # send yields, so a change made while a frame is on its way is the next event (a
        # server subscribes the stream to the task's events as it takes the snapshot).
        snapshot = self._task_json(task)
        seen = (task.state, task.status_text)
        await event({"task": snapshot} if self.dialect == "1.0" else snapshot)
        if cut:
            return False  # the stream is cut after its first event (no end of message)
        while task.state not in TERMINAL and task.id in self.tasks:
            if (task.state, task.status_text) != seen:
                seen = (task.state, task.status_text)
                await event(self._update(task))
                if task.state == "input-required":
                    break
                continue  # look again: the task may have moved while the frame was sent
            await self._changed.wait()  # no checkpoint since the look: no change missed
        if task.id not in self.tasks:
            return False  # a lost task: the stream is cut
        if task.state in TERMINAL:
            for art in task.artifacts:
                for chunk in _chunks(art, task.chunks):
                    await event(self._artifact_event(task, chunk))
            await event(self._update(task))
        await stream.send_all(conn.send(h11.EndOfMessage()) or b"")
        return False

    def _update(self, task: FakeTask) -> dict[str, Any]:
        body: dict[str, Any] = {
            "taskId": task.id,
            "contextId": task.context_id,
            "status": self._status(task),
        }
        if self.dialect == "0.3":
            body["kind"] = "status-update"
            body["final"] = task.state in TERMINAL or task.state == "input-required"
            return body
        return {"statusUpdate": body}

    def _artifact_event(
        self, task: FakeTask, chunk: tuple[Mapping[str, Any], bool, bool]
    ) -> dict[str, Any]:
        artifact, append, last = chunk
        body: dict[str, Any] = {
            "taskId": task.id,
            "contextId": task.context_id,
            "artifact": dict(artifact),
            "append": append,
            "lastChunk": last,
        }
        if self.dialect == "0.3":
            body["kind"] = "artifact-update"
            return body
        return {"artifactUpdate": body}


def _chunks(artifact: Mapping[str, Any], count: int) -> list[tuple[Mapping[str, Any], bool, bool]]:
    """The artifact's text split into ``count`` artifact-update pieces: (piece, append, last)."""
    text = "".join(str(p.get("text", "")) for p in artifact.get("parts", []))
    size = max(1, -(-len(text) // max(1, count)))
    pieces = [text[i : i + size] for i in range(0, len(text), size)] or [""]
    out: list[tuple[Mapping[str, Any], bool, bool]] = []
    for n, piece in enumerate(pieces):
        part = (
            {"text": piece}
            if "kind" not in artifact["parts"][0]
            else {"kind": "text", "text": piece}
        )
        piece_artifact = {"artifactId": artifact["artifactId"], "parts": [part]}
        out.append((piece_artifact, n > 0, n == len(pieces) - 1))
    return out


def _v1_state(state: str) -> str:
    return "TASK_STATE_" + state.upper().replace("-", "_")


def _text_part(text: str, dialect: Dialect) -> dict[str, Any]:
    return {"kind": "text", "text": text} if dialect == "0.3" else {"text": text}


def _artifact(text: str, dialect: Dialect) -> dict[str, Any]:
    parts = [_text_part(p, dialect) for p in text.split("\n\n")]
    return {"artifactId": "answer", "parts": parts}


def _file_artifact(files: tuple[FakeFile, ...], dialect: Dialect) -> dict[str, Any]:
    parts: list[dict[str, Any]] = []
    for f in files:
        raw = None if f.data is None else base64.b64encode(f.data).decode("ascii")
        if dialect == "0.3":
            inner: dict[str, Any] = {"name": f.name, "mimeType": f.media_type}
            inner.update({"bytes": raw} if raw is not None else {"uri": f.url})
            parts.append({"kind": "file", "file": inner})
        else:
            part: dict[str, Any] = {"filename": f.name, "mediaType": f.media_type}
            part.update({"raw": raw} if raw is not None else {"url": f.url})
            parts.append(part)
    return {"artifactId": "files", "parts": parts}


def _error(rid: Any, code: int) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": "remote said no"}}


async def _next(conn: h11.Connection, stream: trio.SocketStream) -> object:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        data = await stream.receive_some(65536)
        if not data:
            conn.receive_data(b"")
        else:
            conn.receive_data(data)


async def _send(
    conn: h11.Connection,
    stream: trio.SocketStream,
    status: int,
    payload: Any,
    headers: list[tuple[str, str]] | None = None,
) -> None:
    data = b"" if payload is None else json.dumps(payload).encode()
    head = [("content-length", str(len(data))), *(headers or [])]
    if payload is not None:
        head.append(("content-type", "application/json"))
    out = conn.send(h11.Response(status_code=status, headers=head)) or b""
    out += conn.send(h11.Data(data=data)) or b""
    out += conn.send(h11.EndOfMessage()) or b""
    await stream.send_all(out)
