"""A fake ``signal-cli -a ACCOUNT daemon --receive-mode=manual`` on loopback (Trio), faithful
to ``reference/protocols-telegram-signal.md`` §2 and signal-cli's JSON-RPC sources
(``JsonRpcReader``, ``SignalJsonRpcDispatcherHandler``, ``SignalJsonRpcCommandHandler``).

* **Transport.** A Unix socket (``--socket PATH``) and/or TCP on 127.0.0.1 (``--tcp``), both
  at once if asked. One JSON value per line, compact, UTF-8; requests of one connection are
  handled concurrently (signal-cli runs each in a virtual thread), so answers may come out of
  order; a notification may precede the answer to the ``subscribeReceive`` that caused it.
* **Framing errors** as signal-cli answers them: an empty line ``-32700 "Empty input
  line"``, unparsable JSON ``-32700``, a value that is neither object nor array ``-32600
  "unexpected type: …"``, an empty array ``-32600 "invalid request"``, ``jsonrpc`` not
  ``"2.0"`` ``-32600 "only jsonrpc version 2.0 is supported"``, no method ``-32600 "method
  field must be set"``, an unknown method ``-32601 "Method not implemented"``; all with
  ``"data": null`` and the request's id (``null`` when unreadable). A request without an id
  is run and never answered. Batches are answered with one array.
* **Manual receive mode.** Messages pushed with :meth:`FakeSignalCli.push` wait on "the
  server" while nobody is subscribed and are handed out once: each to every subscription
  present (in subscription order), as ``{"jsonrpc":"2.0","method":"receive","params":
  {"subscription":N,"result":{"envelope":…,"account":"+X"}}}``, then forgotten. A write that
  fails drops that subscription (and the message is gone anyway: signal-cli deleted its
  cache entry). Writes block while the client does not read (backpressure).
* **Subscriptions.** ``subscribeReceive`` answers ids from one counter per process, shared
  by every connection and by ``subscribeCallEvents``, starting at 0 (a restarted process
  starts at 0 again). A subscription belongs to its connection: ``unsubscribeReceive``
  ``{"subscription": N}`` answers ``{}``, or ``-1 "Unknown subscription id"`` for an id this
  connection does not hold; a closed connection drops its subscriptions.
* **send** ``{"recipient": [...] | "...", "message": ...}`` or ``{"groupId": ..., ...}``
  answers ``{"timestamp": ms, "results": [{"recipientAddress": {"uuid", "number",
  "username"}, "type": "SUCCESS"}]}``; when no recipient succeeded, an error -4 (untrusted
  identities only), -5 (rate limits only) or -1, with ``data: {"response": <the result>}``.
  Empty message → -1; no recipient → -1. Outcomes are scripted with
  :meth:`FakeSignalCli.script_send` (per-recipient types, an error, no answer, a connection
  dropped before or after the message went out).
* **sendTyping** (signal-cli's ``sendTyping``: ``recipient`` or ``groupId``, optional
  ``stop``) answers ``{"timestamp": ms, "results": [...]}`` like a send, and is recorded in
  :attr:`FakeSignalCli.typing`; no recipient → -1.
* **A process.** :meth:`FakeSignalCli.kill` ends it like SIGKILL: every connection reset,
  the listeners gone, a Unix socket file left behind; :meth:`FakeSignalCli.start` again is a
  new process on the same path and port (the stale socket file replaced, the counter at 0,
  queued messages still on "the server").
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import json
import os
import socket
import struct
import uuid as _uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

ACCOUNT = "+15550000000"
SENDER_UUID = "0f0f0f0f-1111-2222-3333-444444444444"
SENDER_NUMBER = "+15551234567"
VERSION = "0.14.6"

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
USER_ERROR = -1
UNTRUSTED_KEY = -4
RATE_LIMIT = -5
EMPTY_MESSAGE = (
    "Sending empty message is not allowed, either a message, attachment or sticker must be given."
)
RESULT_TYPES = frozenset(
    {
        "SUCCESS",
        "NETWORK_FAILURE",
        "UNREGISTERED_FAILURE",
        "IDENTITY_FAILURE",
        "RATE_LIMIT_FAILURE",
        "INVALID_PRE_KEY_FAILURE",
    }
)


def encode(message: Any) -> bytes:
    """One line as signal-cli's Jackson writes it: compact JSON, UTF-8, ``\\n``."""
    return json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


def text_envelope(
    text: str | None,
    *,
    uuid: str | None = SENDER_UUID,
    number: str | None = SENDER_NUMBER,
    device: int = 1,
    timestamp: int = 1_768_839_400_000,
    name: str | None = "Alice",
    **data: Any,
) -> dict[str, Any]:
    """A 0.14 ``JsonMessageEnvelope`` carrying a ``dataMessage`` (explicit nulls as signal-cli
    writes them); ``data`` adds or overrides dataMessage fields."""
    return {
        "source": number if number is not None else uuid,
        "sourceNumber": number,
        "sourceUuid": uuid,
        "sourceName": name,
        "sourceDevice": device,
        "timestamp": timestamp,
        "serverReceivedTimestamp": timestamp + 120,
        "serverDeliveredTimestamp": timestamp + 150,
        "dataMessage": {
            "timestamp": timestamp,
            "message": text,
            "expiresInSeconds": 0,
            "isExpirationUpdate": False,
            "viewOnce": False,
            **data,
        },
    }


def other_envelope(
    field: str, body: Mapping[str, Any], *, timestamp: int = 1_768_839_500_000
) -> dict[str, Any]:
    """An envelope with a non-data content (``receiptMessage``, ``typingMessage``…)."""
    return {
        "source": SENDER_NUMBER,
        "sourceNumber": SENDER_NUMBER,
        "sourceUuid": SENDER_UUID,
        "sourceName": "Alice",
        "sourceDevice": 1,
        "timestamp": timestamp,
        "serverReceivedTimestamp": timestamp + 100,
        "serverDeliveredTimestamp": timestamp + 101,
        field: dict(body),
    }


def manual_notification(
    subscription: int, envelope: Mapping[str, Any], account: str
) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "method": "receive",
        "params": {
            "subscription": subscription,
            "result": {"envelope": envelope, "account": account},
        },
    }


@attrs.frozen
class SendOutcome:
    """What the next ``send`` does: ``results`` (per-recipient types, or ``None`` for all
    ``SUCCESS``), ``error`` (code, message, data) answered instead, ``hang`` (never
    answered: the message went out), ``close_before`` / ``close_after`` (the connection is
    dropped before acting, or after the message went out, without an answer)."""

    types: tuple[str, ...] | None = None
    token: str | None = None
    error: tuple[int, str, Any] | None = None
    hang: bool = False
    close_before: bool = False
    close_after: bool = False

    @classmethod
    def results(cls, *types: str, token: str | None = None) -> SendOutcome:
        assert set(types) <= RESULT_TYPES, types
        return cls(types=types, token=token)

    @classmethod
    def fail(cls, code: int, message: str, data: Any = None) -> SendOutcome:
        return cls(error=(code, message, data))


@attrs.define(eq=False)
class Connection:
    id: int
    stream: trio.SocketStream
    kind: str
    subscriptions: list[int] = attrs.field(factory=list)
    lock: trio.Lock = attrs.field(factory=trio.Lock)
    closed: bool = False

    async def write(self, data: bytes) -> None:
        async with self.lock:
            await self.stream.send_all(data)


@attrs.define(eq=False)
class Delivery:
    """One message handed to one subscription (the write returned)."""

    subscription: int
    connection: int
    envelope: Mapping[str, Any]
    at: float


@attrs.define(eq=False)
class FakeSignalCli:
    socket_path: str | None = None
    tcp: bool = False
    account: str = ACCOUNT
    port: int = 0
    """The TCP port (0: chosen at the first start, kept across restarts)."""
    group_members: tuple[str, ...] = (
        "aaaaaaaa-0000-4000-8000-000000000001",
        "aaaaaaaa-0000-4000-8000-000000000002",
    )
    queue: collections.deque[dict[str, Any]] = attrs.field(factory=collections.deque)
    """Messages waiting on the Signal server (nobody subscribed yet)."""
    deliveries: list[Delivery] = attrs.field(factory=list)
    lost_in_write: list[dict[str, Any]] = attrs.field(factory=list)
    requests: list[tuple[int, Any]] = attrs.field(factory=list)
    """``(connection id, parsed request)`` for every request object read."""
    sends: list[dict[str, Any]] = attrs.field(factory=list)
    """Params of every ``send`` whose message went out, in order."""
    typing: list[tuple[float, dict[str, Any]]] = attrs.field(factory=list)
    """``(time, params)`` of every ``sendTyping``."""
    subscribe_log: list[tuple[float, int, int]] = attrs.field(factory=list)
    """``(time, connection id, subscription id)`` for every ``subscribeReceive``."""
    max_concurrent_subscriptions: int = 0
    connections_opened: int = 0
    starts: int = 0
    close_on_subscribe: int = 0
    """The next this many ``subscribeReceive`` calls close the connection instead."""
    slow_subscribe_s: float = 0.0
    """The next ``subscribeReceive`` subscribes at once but answers this much later."""
    automatic_on_send: int = 0
    """Before answering a ``send``, write this many automatic-mode notifications to its
    connection (what ``--receive-mode=on-connection`` hands every connection)."""
    _outcomes: collections.deque[SendOutcome] = attrs.field(factory=collections.deque)
    _counter: itertools.count[int] = attrs.field(factory=itertools.count)
    _timestamps: itertools.count[int] = attrs.field(
        factory=lambda: itertools.count(1_768_900_000_000)
    )
    _connections: dict[int, Connection] = attrs.field(factory=dict)
    _subscriptions: dict[int, Connection] = attrs.field(factory=dict)
    _conn_ids: itertools.count[int] = attrs.field(factory=lambda: itertools.count(1))
    _changed: trio.Event = attrs.field(factory=trio.Event)
    _process: trio.CancelScope | None = None
    _stopped: trio.Event | None = None

    # ------------------------------------------------------------------ control

    @property
    def running(self) -> bool:
        return self._process is not None

    @property
    def subscriptions(self) -> dict[int, int]:
        """Live subscription id → connection id."""
        return {sub: conn.id for sub, conn in self._subscriptions.items()}

    @property
    def tcp_address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def push(self, envelope: Mapping[str, Any]) -> None:
        """A message arrives at the Signal server for this account."""
        self.queue.append(dict(envelope))
        self._wake()

    def script_send(self, *outcomes: SendOutcome) -> None:
        self._outcomes.extend(outcomes)

    def requests_for(self, method: str) -> list[tuple[int, Any]]:
        return [
            (c, r) for c, r in self.requests if isinstance(r, dict) and r.get("method") == method
        ]

    async def wait_until(self, predicate: Callable[[], bool]) -> None:
        """Return once ``predicate()`` holds, checked after every change of state."""
        while not predicate():
            await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def inject(
        self, data: bytes | Mapping[str, Any], *, connection: int | None = None
    ) -> None:
        """Write a crafted line (or raw bytes, sent as they are) to a connection: by default
        the one holding the newest subscription."""
        conn = self._target(connection)
        raw = data if isinstance(data, bytes) else encode(data)
        await conn.write(raw)

    def drop_connection(self, connection: int | None = None) -> None:
        """Reset one connection (by default the newest subscriber's), as a crashed peer or a
        proxy would; the process keeps running."""
        _reset(self._target(connection).stream)

    def _target(self, connection: int | None) -> Connection:
        if connection is not None:
            return self._connections[connection]
        if self._subscriptions:
            return self._subscriptions[max(self._subscriptions)]
        return self._connections[max(self._connections)]

    # ------------------------------------------------------------------ process

    async def start(self, nursery: trio.Nursery) -> None:
        """Start the daemon process (again, after :meth:`kill`)."""
        assert self._process is None, "already running"
        await nursery.start(self._run)

    async def _run(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._counter = itertools.count()
        listeners: list[trio.SocketListener] = []
        if self.socket_path is not None:
            # Bound in this thread, not in trio's worker thread: the thread hop would let an
            # autojump clock leap over the restart, and both are quick syscalls here.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)  # a stale socket of a killed process
            raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            raw.bind(self.socket_path)
            raw.listen(64)
            listeners.append(trio.SocketListener(trio.socket.from_stdlib_socket(raw)))
        if self.tcp:
            tcp = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
            self.port = tcp[0].socket.getsockname()[1]
            listeners.extend(tcp)
        assert listeners, "give socket_path and/or tcp=True"
        self.starts += 1
        stopped = self._stopped = trio.Event()
        try:
            with trio.CancelScope() as scope:
                self._process = scope
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(self._deliver)
                    for listener in listeners:
                        nursery.start_soon(self._accept, listener, nursery)
                    task_status.started()
        finally:
            self._process = None
            for listener in listeners:
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(listener)
            for conn in list(self._connections.values()):
                _reset(conn.stream)
                conn.closed = True
            self._connections.clear()
            self._subscriptions.clear()
            stopped.set()
            self._wake()

    async def kill(self) -> None:
        """End the process abruptly (connections reset, the socket file left behind)."""
        if self._process is None or self._stopped is None:
            return
        stopped = self._stopped
        self._process.cancel()
        await stopped.wait()

    async def _accept(self, listener: trio.SocketListener, nursery: trio.Nursery) -> None:
        while True:
            stream = await listener.accept()
            conn = Connection(
                id=next(self._conn_ids),
                stream=stream,
                kind="unix" if stream.socket.family == socket.AF_UNIX else "tcp",
            )
            self._connections[conn.id] = conn
            self.connections_opened += 1
            self._wake()
            nursery.start_soon(self._serve, conn)

    async def _serve(self, conn: Connection) -> None:
        buffer = bytearray()
        try:
            async with trio.open_nursery() as handlers:
                while True:
                    try:
                        data = await conn.stream.receive_some(65536)
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        break
                    if not data:
                        break
                    buffer += data
                    while (end := buffer.find(b"\n")) >= 0:
                        line = bytes(buffer[:end])
                        del buffer[: end + 1]
                        handlers.start_soon(self._line, conn, line)
                handlers.cancel_scope.cancel()
        finally:
            self._drop(conn)
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(conn.stream)

    def _drop(self, conn: Connection) -> None:
        conn.closed = True
        for sub in conn.subscriptions:
            self._subscriptions.pop(sub, None)
        conn.subscriptions.clear()
        self._connections.pop(conn.id, None)
        self._wake()

    # ------------------------------------------------------------------ reading requests

    async def _reply(self, conn: Connection, message: Any) -> None:
        if conn.closed:
            return
        try:
            await conn.write(encode(message))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

    async def _line(self, conn: Connection, raw: bytes) -> None:
        text = raw.decode("utf-8", "replace").removesuffix("\r")
        if not text.strip():
            await self._reply(conn, _error(None, PARSE_ERROR, "Empty input line"))
            return
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            await self._reply(conn, _error(None, PARSE_ERROR, f"Unexpected character: {exc.msg}"))
            return
        if isinstance(value, list):
            if not value:
                await self._reply(conn, _error(None, INVALID_REQUEST, "invalid request"))
                return
            responses: list[Any] = []
            async with trio.open_nursery() as nursery:
                for item in value:
                    nursery.start_soon(self._collect, conn, item, responses)
            if responses:
                await self._reply(conn, responses)
            return
        if not isinstance(value, dict):
            kind = {str: "STRING", bool: "BOOLEAN", int: "NUMBER", float: "NUMBER"}.get(
                type(value), "NULL"
            )
            await self._reply(conn, _error(None, INVALID_REQUEST, f"unexpected type: {kind}"))
            return
        if "result" in value or "error" in value:
            return  # a response from the client: signal-cli only logs it
        response = await self._request(conn, value)
        if response is not None:
            await self._reply(conn, response)

    async def _collect(self, conn: Connection, item: Any, out: list[Any]) -> None:
        if not isinstance(item, dict):
            out.append(_error(None, INVALID_REQUEST, "invalid request"))
            return
        response = await self._request(conn, item)
        if response is not None:
            out.append(response)

    async def _request(self, conn: Connection, request: dict[str, Any]) -> Any:
        """The response to one request object (``None`` for a notification)."""
        self.requests.append((conn.id, request))
        self._wake()
        request_id = request.get("id")
        if request_id is not None and not isinstance(request_id, str | int):
            request_id = None
        if request.get("params", 0) is None:
            request.pop("params")
        # Errors in the request itself are always answered (id null when it has none);
        # a method's result or error only when the request has an id.
        if request.get("jsonrpc") != "2.0":
            return _error(request_id, INVALID_REQUEST, "only jsonrpc version 2.0 is supported")
        if not isinstance(request.get("method"), str):
            return _error(request_id, INVALID_REQUEST, "method field must be set")
        try:
            result = await self._method(conn, request["method"], request.get("params"))
        except _RpcError as exc:
            return (
                None if request_id is None else _error(request_id, exc.code, exc.message, exc.data)
            )
        except _NoAnswer:
            return None
        return (
            None if request_id is None else {"jsonrpc": "2.0", "result": result, "id": request_id}
        )

    # ------------------------------------------------------------------ methods

    async def _method(self, conn: Connection, method: str, params: Any) -> Any:
        if method == "subscribeReceive":
            if self.close_on_subscribe > 0:
                self.close_on_subscribe -= 1
                _reset(conn.stream)
                raise _NoAnswer()
            sub = next(self._counter)
            conn.subscriptions.append(sub)
            self._subscriptions[sub] = conn
            self.subscribe_log.append((trio.current_time(), conn.id, sub))
            self.max_concurrent_subscriptions = max(
                self.max_concurrent_subscriptions, len({c.id for c in self._subscriptions.values()})
            )
            self._wake()
            if self.slow_subscribe_s:
                delay, self.slow_subscribe_s = self.slow_subscribe_s, 0.0
                await trio.sleep(delay)
            return sub
        if method == "unsubscribeReceive":
            wanted = _subscription_param(params)
            if wanted is None:
                # single-account mode: the connection's own subscription, if any
                if conn.subscriptions:
                    self._unsubscribe(conn, conn.subscriptions[0])
                return {}
            if wanted not in conn.subscriptions:
                raise _RpcError(USER_ERROR, "Unknown subscription id")
            self._unsubscribe(conn, wanted)
            return {}
        if method == "subscribeCallEvents":
            return next(self._counter)
        if method == "send":
            return await self._send(conn, params)
        if method == "sendTyping":
            params = params if isinstance(params, dict) else {}
            recipients = params.get("recipient")
            if not recipients and not isinstance(params.get("groupId"), str):
                raise _RpcError(USER_ERROR, "No recipients given")
            self.typing.append((trio.current_time(), dict(params)))
            return {"timestamp": next(self._timestamps), "results": []}
        if method == "version":
            return {"version": VERSION}
        raise _RpcError(METHOD_NOT_FOUND, "Method not implemented")

    def _unsubscribe(self, conn: Connection, sub: int) -> None:
        conn.subscriptions.remove(sub)
        self._subscriptions.pop(sub, None)
        self._wake()

    async def _send(self, conn: Connection, params: Any) -> Any:
        if not isinstance(params, dict):
            params = {}
        outcome = self._outcomes.popleft() if self._outcomes else SendOutcome()
        if outcome.close_before:
            _reset(conn.stream)
            raise _NoAnswer()
        recipients = params.get("recipient")
        if isinstance(recipients, str):
            recipients = [recipients]
        group = params.get("groupId")
        if not recipients and not isinstance(group, str):
            raise _RpcError(USER_ERROR, "No recipients given")
        message = params.get("message")
        attached = params.get("attachment") or params.get("attachments")
        if (not isinstance(message, str) or not message) and not attached:
            raise _RpcError(USER_ERROR, EMPTY_MESSAGE)
        if outcome.error is not None:
            code, text, data = outcome.error
            raise _RpcError(code, text, data)
        for n in range(self.automatic_on_send):
            note = {
                "envelope": text_envelope("to every connection", timestamp=n),
                "account": self.account,
            }
            await conn.write(encode({"jsonrpc": "2.0", "method": "receive", "params": note}))
        addresses = (
            [_address(r) for r in recipients]
            if recipients
            else [_address(member) for member in self.group_members]
        )
        types: Sequence[str] = outcome.types or ("SUCCESS",) * len(addresses)
        results = []
        for address, kind in zip(itertools.cycle(addresses), types, strict=False):
            entry: dict[str, Any] = {"recipientAddress": address, "type": kind}
            if isinstance(group, str):
                entry["groupId"] = group
            if kind == "RATE_LIMIT_FAILURE":
                entry["retryAfterSeconds"] = 60
                if outcome.token is not None:
                    entry["token"] = outcome.token
            results.append(entry)
        result = {"timestamp": next(self._timestamps), "results": results}
        went_out = "SUCCESS" in types or "NETWORK_FAILURE" in types
        if went_out or outcome.hang or outcome.close_after:
            self.sends.append(dict(params))
            self._wake()
        if outcome.close_after:
            _reset(conn.stream)
            raise _NoAnswer()
        if outcome.hang:
            await trio.sleep_forever()
        if "SUCCESS" not in types:
            if set(types) == {"IDENTITY_FAILURE"}:
                raise _RpcError(
                    UNTRUSTED_KEY,
                    "Failed to send message due to untrusted identities",
                    {"response": result},
                )
            if set(types) == {"RATE_LIMIT_FAILURE"}:
                raise _RpcError(
                    RATE_LIMIT, "Failed to send message due to rate limiting", {"response": result}
                )
            raise _RpcError(USER_ERROR, "Failed to send message", {"response": result})
        return result

    # ------------------------------------------------------------------ delivering

    async def _deliver(self) -> None:
        """The receive loop of manual mode: runs while a subscription exists."""
        while True:
            if not self.queue or not self._subscriptions:
                await self._changed.wait()
                continue
            envelope = self.queue.popleft()
            handed = False
            for sub, conn in sorted(self._subscriptions.items()):
                if conn.closed:
                    continue
                line = encode(manual_notification(sub, envelope, self.account))
                try:
                    await conn.write(line)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    self._drop(conn)
                    continue
                handed = True
                self.deliveries.append(Delivery(sub, conn.id, envelope, trio.current_time()))
            if not handed:
                self.lost_in_write.append(envelope)
            self._wake()


class _RpcError(Exception):
    def __init__(self, code: int, message: str, data: Any = None) -> None:
        super().__init__(message)
        self.code, self.message, self.data = code, message, data


class _NoAnswer(Exception):
    """The connection was dropped instead of answering."""


def _error(request_id: Any, code: int, message: str, data: Any = None) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "error": {"code": code, "message": message, "data": data},
        "id": request_id,
    }


def _subscription_param(params: Any) -> int | None:
    if isinstance(params, list) and params:
        value = params[0]
    elif isinstance(params, dict):
        value = params.get("subscription")
    else:
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _address(recipient: str) -> dict[str, Any]:
    if recipient.startswith("+"):
        return {
            "uuid": str(_uuid.uuid5(_uuid.NAMESPACE_URL, recipient)),
            "number": recipient,
            "username": None,
        }
    return {"uuid": recipient, "number": None, "username": None}


def _reset(stream: trio.SocketStream) -> None:
    """Close so the peer sees a reset, as when a process dies (SO_LINGER 0 on TCP)."""
    try:
        if stream.socket.family != socket.AF_UNIX:
            stream.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        stream.socket.close()
    except OSError:
        pass


async def start_fake(
    nursery: trio.Nursery, tmp: Path | None = None, **kwargs: Any
) -> FakeSignalCli:
    """A running fake; with ``tmp`` its Unix socket is ``tmp/signal-cli.sock``."""
    if tmp is not None and "socket_path" not in kwargs:
        kwargs["socket_path"] = os.fspath(tmp / "signal-cli.sock")
    fake = FakeSignalCli(**kwargs)
    await fake.start(nursery)
    return fake
