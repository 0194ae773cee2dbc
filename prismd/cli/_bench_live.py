"""The bench scenarios that drive a real ``prismd run`` process: ``webchat``, ``telegram``
and ``stop``.

Each starts the daemon as a subprocess of the current interpreter with a config written to
a temporary directory (its SQLite journal beside it), waits until it is ready (its control
socket answers), drives it over loopback sockets only, and stops it with SIGTERM. For
``telegram`` the bench serves the few Bot API methods polling uses on loopback — the daemon
knows nothing of it: it is its ``api_origin``.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, TypeAlias, TypeVar

import attrs
import h11
import trio
import trio_websocket

from adapters.toolkit import (
    HttpError,
    RequestHead,
    read_body,
    read_request_head,
    respond,
    server_connection,
)

from ._figures import figures

READY_WITHIN_S = 30.0
CLIENTS = 20
BOT_TOKEN = "123456:" + "b" * 35


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_config(
    workdir: Path,
    *,
    port: int,
    agent: str = 'kind = "echo"',
    extra: str = "",
    stop_deadline_ms: int = 10_000,
) -> Path:
    state = workdir / "state"
    config = workdir / "prismd.toml"
    # A Unix socket path is at most 107 bytes: its directory is a short one of its own
    # (removed with the work directory's link to it, see Daemon.kill).
    run_dir = Path(tempfile.mkdtemp(prefix="prismd-bench-"))
    (workdir / "run").symlink_to(run_dir)
    web = bench_connection("web", f'kind = "webchat"\nlisten = "127.0.0.1:{port}"')
    config.write_text(
        f"""
[daemon]
state_dir = "{state}"

[store]
url = "sqlite:///{workdir}/journal.sqlite"

[limits]
stop_deadline_ms = {stop_deadline_ms}
max_pending_per_process = 500
max_pending_per_binding = 32
max_active_sessions = 16

[control]
socket = "{run_dir}/control.sock"

[agents.bench]
{agent}
{web}
{extra}
""",
        encoding="utf-8",
    )
    return config


@asynccontextmanager
async def bot_daemon(
    workdir: Path, kind: str, token: str, api_origin: str, keys: str = ""
) -> AsyncIterator[Daemon]:
    """``prismd run`` (:meth:`Daemon.running`) with one connection of a bot ``kind``: its
    ``token`` in the environment, the bench's loopback platform its ``api_origin``, then
    ``keys`` (TOML lines)."""
    env_name = f"PRISMD_BENCH_{kind.upper()}_TOKEN"
    table = f'kind = "{kind}"\ntoken_env = "{env_name}"\napi_origin = "{api_origin}"\n{keys}'
    port = free_port()
    config = write_config(workdir, port=port, extra=bench_connection(kind, table))
    async with Daemon.running(workdir, config, port, {env_name: token}) as daemon:
        yield daemon


def bench_connection(connection_id: str, keys: str) -> str:
    """A ``[[connections]]`` table of ``keys`` (TOML lines) and its grant to every actor,
    for the ``bench`` agent."""
    return f"""
[[connections]]
id = "{connection_id}"
{keys}

[[grants]]
connection = "{connection_id}"
actors = ["*"]
aliases = ["bench"]
"""


@attrs.define(eq=False)
class Daemon:
    process: trio.Process
    workdir: Path

    @classmethod
    async def start(cls, workdir: Path, config: Path, env: dict[str, str] | None = None) -> Daemon:
        with (workdir / "prismd.log").open("wb") as log:
            process = await trio.lowlevel.open_process(
                [sys.executable, "-m", "prismd", "run", "--config", str(config)],
                stdout=subprocess.DEVNULL,
                stderr=log,
                env={**os.environ, **(env or {})},
            )
        return cls(process, workdir)

    @classmethod
    @asynccontextmanager
    async def running(
        cls, workdir: Path, config: Path, port: int, env: dict[str, str] | None = None
    ) -> AsyncIterator[Daemon]:
        """``prismd run`` for the block, once ready on ``port``; stopped with SIGTERM after
        it (an exit code but 0 raises, with the log's tail), killed if the block raised."""
        daemon = await cls.start(workdir, config, env)
        try:
            await daemon.ready(port)
            yield daemon
            code, _took = await daemon.stop()
            if code != 0:
                raise RuntimeError(f"prismd exited {code}: {daemon.log_tail()}")
        finally:
            await daemon.kill()

    async def ready(self, port: int) -> None:
        """Until the web chat answers on ``port`` (the last child up)."""
        with trio.fail_after(READY_WITHIN_S):
            while True:
                if self.process.returncode is not None:
                    raise RuntimeError(f"prismd exited early: {self.log_tail()}")
                try:
                    stream = await trio.open_tcp_stream("127.0.0.1", port)
                except OSError:
                    await trio.sleep(0.05)
                    continue
                await stream.aclose()
                return

    def log_tail(self) -> str:
        return (self.workdir / "prismd.log").read_text(errors="replace")[-2000:]

    async def stop(self) -> tuple[int, float]:
        """SIGTERM; ``(exit code, seconds until it exited)``."""
        started = time.perf_counter()
        self.process.send_signal(signal.SIGTERM)
        with trio.fail_after(120):
            code = await self.process.wait()
        return code, time.perf_counter() - started

    async def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()
            with trio.move_on_after(10, shield=True):
                await self.process.wait()
        link = self.workdir / "run"
        if link.is_symlink():
            shutil.rmtree(link.resolve(), ignore_errors=True)
            link.unlink()


def process_cpu_s(pid: int) -> float | None:
    """CPU time (user + system, every thread) of process ``pid`` so far, from
    ``/proc/PID/stat``; ``None`` where there is no such file (not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces, parentheses and
    # bytes of any encoding: read as bytes, and count the fields after its last ")".
    fields = stat[stat.rindex(b")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def operation_states(workdir: Path) -> dict[str, int]:
    with sqlite3.connect(workdir / "journal.sqlite") as conn:
        rows = conn.execute(
            "SELECT json_extract(value, '$.state'), count(*) FROM prism_checkpoints"
            " WHERE namespace = 'prism.channels.v1.operation' GROUP BY 1"
        ).fetchall()
    return {str(state): int(n) for state, n in rows}


# --------------------------------------------------------------------------- web chat


@attrs.define(eq=False)
class ChatClient:
    """One browser: a WebSocket, its actor id, and the send time of each message."""

    ws: trio_websocket.WebSocketConnection
    sent: dict[str, float] = attrs.Factory(dict)
    waiting: dict[str, trio.Event] = attrs.Factory(dict)
    latencies: list[float] = attrs.Factory(list)
    answered: trio.Event = attrs.Factory(trio.Event)

    async def all_answered(self) -> None:
        while self.sent:
            self.answered = trio.Event()
            await self.answered.wait()

    async def read(self) -> None:
        while True:
            try:
                message = await self.ws.get_message()
            except trio_websocket.ConnectionClosed:
                return
            frame = json.loads(message)
            if frame.get("type") == "reply":
                key = frame.get("inReplyTo")
                started = self.sent.pop(key, None)
                if started is not None:
                    self.latencies.append(time.perf_counter() - started)
                    event = self.waiting.pop(key, None)
                    if event is not None:
                        event.set()
                    self.answered.set()

    async def send(self, text: str) -> trio.Event:
        client_id = secrets.token_urlsafe(12)
        done = trio.Event()
        self.waiting[client_id] = done
        self.sent[client_id] = time.perf_counter()
        await self.ws.send_message(json.dumps({"type": "message", "id": client_id, "text": text}))
        return done


async def _with_clients(
    port: int, count: int, body: Callable[[list[ChatClient]], Awaitable[None]]
) -> None:
    async with trio.open_nursery() as nursery:
        clients = []
        for i in range(count):
            ws = await trio_websocket.connect_websocket_url(
                nursery, f"ws://127.0.0.1:{port}/ws", message_queue_size=64
            )
            await ws.send_message(
                json.dumps({"type": "hello", "actor": f"bench-{i:04d}-{secrets.token_hex(4)}"})
            )
            while json.loads(await ws.get_message()).get("type") != "ready":
                pass
            client = ChatClient(ws)
            clients.append(client)
            nursery.start_soon(client.read)
        try:
            await body(clients)
        finally:
            for client in clients:
                await client.ws.aclose()
            nursery.cancel_scope.cancel()


async def webchat(workdir: Path, duration_s: float) -> dict[str, Any]:
    """20 sockets on a real ``prismd run`` with the echo agent: closed loop (each client
    sends its next message when its answer arrived) for throughput, then an open loop at
    half that rate for the send → reply latency."""
    port = free_port()
    async with Daemon.running(workdir, write_config(workdir, port=port), port) as daemon:
        closed: dict[str, Any] = {}
        opened: dict[str, Any] = {}

        async def closed_loop(clients: list[ChatClient]) -> None:
            end = time.perf_counter() + duration_s
            start = time.perf_counter()
            cpu0 = process_cpu_s(daemon.process.pid)

            async def lane(client: ChatClient) -> None:
                while time.perf_counter() < end:
                    done = await client.send("ping")
                    with trio.fail_after(30):
                        await done.wait()

            async with trio.open_nursery() as nursery:
                for client in clients:
                    nursery.start_soon(lane, client)
            samples = [s for c in clients for s in c.latencies]
            closed.update(figures(samples, time.perf_counter() - start))
            cpu1 = process_cpu_s(daemon.process.pid)
            if cpu0 is not None and cpu1 is not None and samples:
                # The daemon's CPU (not the clients'): what the machine spends per message.
                closed["cpu_ms_per_message"] = round((cpu1 - cpu0) * 1000 / len(samples), 3)
            for client in clients:
                client.latencies.clear()

        async def open_loop(clients: list[ChatClient]) -> None:
            rate = max(1.0, float(closed.get("per_s", 1.0)) / 2)
            interval = 1 / rate
            end = time.perf_counter() + duration_s
            start = time.perf_counter()
            i = 0
            next_at = start
            while next_at < end:
                await clients[i % len(clients)].send("ping")
                i += 1
                next_at += interval
                await trio.sleep(max(0.0, next_at - time.perf_counter()))
            with trio.move_on_after(10):
                for client in clients:
                    await client.all_answered()
            samples = [s for c in clients for s in c.latencies]
            opened.update(figures(samples, time.perf_counter() - start))
            opened["offered_per_s"] = round(rate, 1)

        await _with_clients(port, CLIENTS, closed_loop)
        await _with_clients(port, CLIENTS, open_loop)
    return {"webchat": closed, "webchat_latency": opened}


# --------------------------------------------------------------------------- stop


async def stop(workdir: Path, _duration_s: float = 0.0) -> dict[str, Any]:
    """SIGTERM with 100 turns in flight (16 running in a slow ``mock`` agent, the rest
    queued): seconds until ``prismd run`` exited 0, and that nothing is left ``executing``
    (the duration does not apply: the scenario ends when the process does)."""
    port = free_port()
    config = write_config(
        workdir, port=port, agent='kind = "mock"\ndelay_ms = 60000', stop_deadline_ms=5_000
    )
    daemon = await Daemon.start(workdir, config)
    try:
        await daemon.ready(port)
        result: dict[str, Any] = {}

        async def body(clients: list[ChatClient]) -> None:
            for i in range(100):
                await clients[i % len(clients)].send(f"turn {i}")
            # Every message admitted (and as many runs started as there are slots).
            with trio.fail_after(30):
                # The journal is another process's file: poll it.
                while sum(operation_states(workdir).values()) < 100:  # noqa: ASYNC110
                    await trio.sleep(0.05)
            code, took = await daemon.stop()
            result.update({"exit_code": code, "seconds_to_exit": round(took, 3), "deadline_s": 5.0})

        await _with_clients(port, CLIENTS, body)
        states = operation_states(workdir)
        result["left_executing"] = states.get("executing", 0)
        result["states"] = states
        return {"stop": result}
    finally:
        await daemon.kill()


# --------------------------------------------------------------------------- telegram


C = TypeVar("C", bound=Hashable)


@attrs.define(eq=False)
class ClosedLoop:
    """The answers a live bench's loopback platform sees: when each conversation's pending
    message was offered, each answer's latency, how many came (``sent`` is set at each),
    and the requests it served, by name."""

    offered_at: dict[Any, float] = attrs.Factory(dict)
    latencies: list[float] = attrs.Factory(list)
    answered: int = 0
    sent: trio.Event = attrs.Factory(trio.Event)
    requests: dict[str, int] = attrs.Factory(dict)

    def offered(self, conversation: Hashable) -> None:
        self.offered_at[conversation] = time.perf_counter()

    def answer(self, conversation: Hashable) -> None:
        """The daemon answered ``conversation``."""
        started = self.offered_at.pop(conversation, None)
        if started is not None:
            self.latencies.append(time.perf_counter() - started)
        self.answered += 1
        self.sent.set()
        self.sent = trio.Event()

    async def run(
        self,
        daemon: Daemon,
        conversations: Sequence[C],
        offer: Callable[[C], Awaitable[None]],
        duration_s: float,
        *,
        per: str,
    ) -> dict[str, Any]:
        """Each conversation sends its next message once its answer came, for
        ``duration_s``; then the last answers come in (the CPU they cost is counted, so are
        they). Throughput and latency (:func:`figures`), the daemon's CPU and the requests
        per answer (``cpu_ms_per_<per>``, ``requests_per_<per>``; by name in
        ``requests``)."""
        self.requests.clear()
        start = time.perf_counter()
        end = start + duration_s
        cpu0 = process_cpu_s(daemon.process.pid)
        for conversation in conversations:
            await offer(conversation)
        with trio.fail_after(duration_s + 30):
            while time.perf_counter() < end:
                for conversation in conversations:
                    if conversation not in self.offered_at and time.perf_counter() < end:
                        await offer(conversation)
                await self.sent.wait()
            while self.offered_at:
                await self.sent.wait()
        result: dict[str, Any] = figures(self.latencies, time.perf_counter() - start)
        cpu1 = process_cpu_s(daemon.process.pid)
        requests = dict(sorted(self.requests.items()))
        if self.answered:
            if cpu0 is not None and cpu1 is not None:
                result[f"cpu_ms_per_{per}"] = round((cpu1 - cpu0) * 1000 / self.answered, 3)
            result[f"requests_per_{per}"] = round(sum(requests.values()) / self.answered, 3)
        result["requests"] = requests
        return result


@attrs.define(eq=False)
class BotApi(ClosedLoop):
    """The Bot API methods long polling uses, on loopback (Bot API shapes: ``ok``/``result``,
    ``getUpdates`` long-polls on ``offset`` and ``timeout``); ``requests`` by method."""

    updates: list[dict[str, Any]] = attrs.Factory(list)
    changed: trio.Event = attrs.Factory(trio.Event)
    next_id: int = 1
    next_message_id: int = 1

    async def offer(self, chat: int) -> None:
        """Chat ``chat`` sends "ping"."""
        update_id = self.next_id
        self.next_id += 1
        self.offered(chat)
        self.updates.append(
            {
                "update_id": update_id,
                "message": {
                    "message_id": update_id,
                    "date": int(time.time()),
                    "chat": {"id": chat, "type": "private", "first_name": "Bench"},
                    "from": {"id": chat, "is_bot": False, "first_name": "Bench"},
                    "text": "ping",
                },
            }
        )
        self.changed.set()
        self.changed = trio.Event()

    async def method(self, name: str, params: dict[str, Any]) -> Any:
        self.requests[name] = self.requests.get(name, 0) + 1
        if name == "getMe":
            return {"id": 1, "is_bot": True, "first_name": "bench", "username": "bench_bot"}
        if name == "getWebhookInfo":
            return {"url": "", "has_custom_certificate": False, "pending_update_count": 0}
        if name == "getUpdates":
            offset = int(params.get("offset") or 0)
            self.updates = [u for u in self.updates if u["update_id"] >= offset]
            if not self.updates:
                with trio.move_on_after(min(float(params.get("timeout") or 0), 30.0)):
                    await self.changed.wait()
            return self.updates[: int(params.get("limit") or 100)]
        if name == "sendMessage":
            chat = int(params["chat_id"])
            self.answer(chat)
            message_id = self.next_message_id
            self.next_message_id += 1
            return {
                "message_id": message_id,
                "date": int(time.time()),
                "chat": {"id": chat, "type": "private"},
                "text": str(params.get("text", "")),
            }
        if name in ("sendChatAction", "answerCallbackQuery", "deleteWebhook"):
            return True
        raise LookupError(name)

    async def serve(self, stream: trio.SocketStream) -> None:
        await serve_json(stream, self._answer)

    async def _answer(self, head: RequestHead, body: bytes) -> JsonAnswer:
        name = head.path.rsplit("/", 1)[-1]
        params = json.loads(body or b"{}")
        try:
            return 200, {"ok": True, "result": await self.method(name, params)}, ()
        except LookupError:
            return 404, {"ok": False, "error_code": 404, "description": "Not Found"}, ()


JsonAnswer: TypeAlias = tuple[int, Any, Sequence[tuple[str, str]]]
"""A loopback platform's answer to a request: status, the JSON payload (``None``: no body)
and extra headers."""


async def serve_json(
    stream: trio.SocketStream, answer: Callable[[RequestHead, bytes], Awaitable[JsonAnswer]]
) -> None:
    """Answer each request on ``stream`` (kept alive) with what ``answer`` says, until the
    daemon drops the connection (it stops, or restarts a long poll)."""
    connection = server_connection()
    try:
        async with stream:
            while True:
                head = await read_request_head(stream, connection, timeout_s=60)
                if head is None:
                    return
                body = await read_body(stream, connection, head, max_bytes=1 << 20)
                status, payload, headers = await answer(head, body)
                await respond(
                    stream,
                    connection,
                    head.method,
                    status,
                    b"" if payload is None else json.dumps(payload).encode(),
                    content_type="application/json",
                    extra=headers,
                    close=False,
                )
                if connection.our_state is h11.MUST_CLOSE:
                    return
                connection.start_next_cycle()
    except (trio.BrokenResourceError, trio.ClosedResourceError, HttpError):
        pass


async def telegram(workdir: Path, duration_s: float) -> dict[str, Any]:
    """A real ``prismd run`` polling the loopback Bot API, the echo agent, 20 chats each
    sending its next message when the answer came: updates/s and latency from an update
    becoming available to its ``sendMessage``; the daemon's CPU per update
    (``cpu_ms_per_update``) and its Bot API requests per update, ``getUpdates`` and
    ``sendChatAction`` included (``requests_per_update``; by method in ``requests``)."""
    api = BotApi()
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, api.serve, 0, host="127.0.0.1")
        )
        api_port = listeners[0].socket.getsockname()[1]
        origin = f"http://127.0.0.1:{api_port}"
        polling = "poll_timeout_s = 5"
        async with bot_daemon(workdir, "telegram", BOT_TOKEN, origin, polling) as daemon:
            chats = list(range(1000, 1000 + CLIENTS))
            result = await api.run(daemon, chats, api.offer, duration_s, per="update")
        nursery.cancel_scope.cancel()
    return {"telegram": result}
