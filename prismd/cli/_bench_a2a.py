"""``prismd bench --scenario a2a``: remote A2A tasks followed at once, and pushes ingested.

A minimal A2A peer runs beside prismd in a process of its own on loopback (v1.0 JSON-RPC:
``SendMessage`` answers ``working``, ``GetTask`` the task as it stands; a completed task is
pushed once, as the SDKs do), so its memory and CPU are not prismd's. The real ``a2a``
agent, runtime, store and push receiver do the rest:

1. ``tasks`` messages on as many conversations are admitted and sent; once every task is
   followed (parked): resident memory per followed task (the process's RSS once every task
   is followed minus its RSS before the runtime started, both after a collection, divided
   by ``tasks``: everything the runtime, the journal's SQLite connections and the agent
   hold for them; ``of_which_sqlite_bytes_per_task`` is SQLite's own share of it — its page
   caches, bounded — when the store is SQLite); ``marginal_rss_bytes_per_task``, what the
   second half of the tasks added (RSS, after a collection, once every task is followed
   less once the first half was, the sending paused then, divided by the second half:
   what a task costs beyond the process's fixed growth); then, once the polls flow (the
   first tasks' first poll after their first read), for ``duration_s``, the CPU per poll
   (every task polled every ``max(1 s, tasks / 100 s)``: about 100 polls a second in all);
2. *ingest*: every task is pushed a ``working`` status update with a new timestamp (64
   pushes in flight) while the inbox worker is not started yet, so that nothing but the
   receiver runs beside the polls: pushes ingested per second (POST → durable inbox
   commit → 2xx, timed by the peer) and prismd's CPU per push over that window;
3. *apply*: the worker is started on that backlog: observations applied per second (each
   reserved, applied, acknowledged after its commit, and the task read once more by its
   follower, which the push woke) and the CPU per observation;
4. *completions*, the worker running: every task is completed and pushed once: completions
   per second (push → inbox → observation applied → ``GetTask`` → reply delivered), and the
   CPU a push costs end to end beside a poll.

The CPU figures of 2–4 include the background polls (about 100 a second) of the tasks
still followed, and the bench's own requests to the peer for its counters;
``cpu_ms_per_push_less_polls`` subtracts the polls counted in the window beyond the
phase's own reads (``background_polls``), at ``cpu_ms_per_poll`` each: an estimate. Write
jobs and commits per push are the store's group-commit counters: every write on SQLite; on
PostgreSQL the checkpoint writer's only (its inbox statements are not counted).
"""

from __future__ import annotations

import gc
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import attrs
import h11
import httpx
import trio

from stores import open_store

from ..agents import AgentContext, build_agent
from ..channel import Reply, SendResult
from ..grants import GrantConfig
from ..limits import Limits
from ._benchrun import lane_event, open_bench_runtime

CONNECTION = "bench"
ALIAS = "remote"
GRANT = GrantConfig(
    CONNECTION, ("*",), tenant="bench-tenant", aliases=(ALIAS,), default_alias=ALIAS
)
PUSHES_IN_FLIGHT = 64
MAX_QUEUED = 400


def _rss_bytes() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _sqlite_bytes() -> int:
    """What SQLite holds in this process (its page caches above all: bounded, 2 MiB per
    connection by default), when the SQLite driver is loaded; else 0."""
    apsw = sys.modules.get("apsw")
    return int(apsw.memory_used()) if apsw is not None else 0


@attrs.define(eq=False)
class BenchPeer:
    """The loopback A2A peer (v1.0 JSON-RPC, push once per completion)."""

    port: int = 0
    tasks: dict[str, dict[str, Any]] = attrs.Factory(dict)
    gets: int = 0
    _ids: itertools.count[int] = attrs.Factory(lambda: itertools.count(1))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(trio.serve_listeners, self._connection, listeners)
            task_status.started()

    def _card(self) -> dict[str, Any]:
        return {
            "name": "bench",
            "supportedInterfaces": [
                {"url": self.url, "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}
            ],
            "capabilities": {"streaming": False, "pushNotifications": True},
        }

    def _task(self, task: dict[str, Any]) -> dict[str, Any]:
        out = {"id": task["id"], "contextId": task["ctx"], "status": {"state": task["state"]}}
        if task["state"] == "TASK_STATE_COMPLETED":
            out["artifacts"] = [{"artifactId": "a", "parts": [{"text": "done"}]}]
        return out

    def _answer(self, body: dict[str, Any]) -> dict[str, Any]:
        method, params, rid = body.get("method"), body.get("params") or {}, body.get("id")
        if method == "SendMessage":
            n = next(self._ids)
            push = (params.get("configuration") or {}).get("taskPushNotificationConfig")
            task_id = f"t{n}"
            task: dict[str, Any] = {
                "id": task_id,
                "ctx": f"c{n}",
                "state": "TASK_STATE_WORKING",
                "push": push,
            }
            self.tasks[task_id] = task
            return {"jsonrpc": "2.0", "id": rid, "result": {"task": self._task(task)}}
        found = self.tasks.get(str(params.get("id")))
        if found is None:
            return {"jsonrpc": "2.0", "id": rid, "error": {"code": -32001, "message": "gone"}}
        if method == "CancelTask":
            found["state"] = "TASK_STATE_CANCELED"
        self.gets += 1
        return {"jsonrpc": "2.0", "id": rid, "result": self._task(found)}

    async def _connection(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                request, body = None, b""
                while True:
                    event = conn.next_event()
                    if event is h11.NEED_DATA:
                        conn.receive_data(await stream.receive_some(65536))
                    elif isinstance(event, h11.Request):
                        request = event
                    elif isinstance(event, h11.Data):
                        body += event.data
                    elif isinstance(event, h11.EndOfMessage):
                        break
                    else:
                        return
                assert request is not None
                if request.target == b"/bench/stats":
                    payload: dict[str, Any] = {"gets": self.gets}
                elif request.target in (b"/bench/complete", b"/bench/working"):
                    start = time.perf_counter()
                    accepted: list[float] = []
                    await self.push_all(accepted, complete=request.target == b"/bench/complete")
                    payload = {"accepted": [t - start for t in accepted]}
                elif request.method == b"GET":
                    payload = self._card()
                else:
                    payload = self._answer(json.loads(body))
                data = json.dumps(payload).encode()
                head = [("content-type", "application/json"), ("content-length", str(len(data)))]
                out = conn.send(h11.Response(status_code=200, headers=head)) or b""
                out += conn.send(h11.Data(data=data)) or b""
                out += conn.send(h11.EndOfMessage()) or b""
                await stream.send_all(out)
                conn.start_next_cycle()
        except (trio.BrokenResourceError, trio.ClosedResourceError, h11.ProtocolError):
            return

    async def push_all(self, accepted: list[float], *, complete: bool) -> None:
        """Push every task once: completed (``complete``), else a ``working`` update with a
        new timestamp; ``accepted`` gets each 2xx's time. Over :data:`PUSHES_IN_FLIGHT`
        keep-alive connections written with h11 (lighter than an HTTP client: the peer
        shares the machine's cores with prismd)."""
        stamp = f"2026-01-01T00:00:{next(self._ids) % 60:02d}.{time.time_ns() % 10**6:06d}Z"
        todo = list(self.tasks.values())
        todo.reverse()

        def request(task: dict[str, Any]) -> tuple[str, bytes]:
            status: dict[str, Any] = {"state": "TASK_STATE_WORKING", "timestamp": stamp}
            if complete:
                task["state"] = status["state"] = "TASK_STATE_COMPLETED"
            body = {
                "statusUpdate": {"taskId": task["id"], "contextId": task["ctx"], "status": status}
            }
            return task["push"]["url"], json.dumps(body).encode()

        async def connection() -> None:
            stream: trio.SocketStream | None = None
            conn = h11.Connection(h11.CLIENT)
            while todo:
                task = todo.pop()
                url, data = request(task)
                target = httpx.URL(url)
                try:
                    if stream is None or conn.our_state is not h11.IDLE:
                        if stream is not None:
                            await stream.aclose()
                        stream = await trio.open_tcp_stream(target.host, target.port or 80)
                        conn = h11.Connection(h11.CLIENT)
                    head = [
                        ("host", target.host),
                        ("content-type", "application/json"),
                        ("content-length", str(len(data))),
                        ("x-a2a-notification-token", task["push"]["token"]),
                    ]
                    out = conn.send(
                        h11.Request(method="POST", target=target.raw_path, headers=head)
                    )
                    out = (out or b"") + (conn.send(h11.Data(data=data)) or b"")
                    await stream.send_all(out + (conn.send(h11.EndOfMessage()) or b""))
                    status = 0
                    while True:
                        event = conn.next_event()
                        if event is h11.NEED_DATA:
                            conn.receive_data(await stream.receive_some(65536))
                        elif isinstance(event, h11.Response):
                            status = event.status_code
                        elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                            break
                    if status == 200:
                        accepted.append(time.perf_counter())
                    if conn.our_state is h11.DONE and conn.their_state is h11.DONE:
                        conn.start_next_cycle()
                except (OSError, trio.BrokenResourceError, h11.ProtocolError):
                    # Sent once, as the SDKs do: polling finds the task.
                    if stream is not None:
                        await stream.aclose()
                    stream = None
            if stream is not None:
                await stream.aclose()

        async with trio.open_nursery() as nursery:
            for _ in range(PUSHES_IN_FLIGHT):
                nursery.start_soon(connection)


async def _peer_main() -> None:
    """The peer's process: serve, say the port on stdout, until killed."""
    peer = BenchPeer()
    async with trio.open_nursery() as nursery:
        await nursery.start(peer.serve)
        print(peer.port, flush=True)


@asynccontextmanager
async def _peer_process() -> AsyncIterator[str]:
    """The peer in a process of its own; yields its base URL."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "prismd.cli._bench_a2a"], stdout=subprocess.PIPE
    )
    try:
        assert process.stdout is not None
        line = b""
        with trio.fail_after(30):
            while not line.endswith(b"\n"):
                chunk = await process.stdout.receive_some(64)
                if not chunk:
                    raise RuntimeError("the bench peer did not start")
                line += chunk
        yield f"http://127.0.0.1:{int(line)}/"
    finally:
        process.kill()
        with trio.move_on_after(10, shield=True):
            await process.wait()


async def a2a(
    url: str, tasks: int, duration_s: float, on_phase: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """The scenario (see the module docstring); figures as in the other scenarios.
    ``on_phase`` is told ``ingest``, ``apply``, ``completions`` and ``end`` as each
    measured window begins (a profiler's hook)."""
    phase = on_phase or (lambda _name: None)
    from ..agents.a2a import PUSH_SOURCE, A2AAgent, PushReceiver

    delivered = 0
    all_done = trio.Event()
    # About 100 polls a second in all, whatever the number of tasks (at least 1 s apart).
    poll_ms = max(1000, tasks * 10)

    async def deliver(_reply: Reply) -> SendResult:
        nonlocal delivered
        delivered += 1
        if delivered >= tasks:
            all_done.set()
        return SendResult(delivered=True, message_id=str(delivered))

    async with (
        open_store(url) as store,
        _peer_process() as peer_url,
        httpx.AsyncClient(base_url=peer_url, timeout=600) as control,
        trio.open_nursery() as nursery,
    ):

        def writes() -> tuple[int, int]:
            """Write jobs and commits so far (the store's group-commit counters)."""
            stats = getattr(store, "statistics", None)
            if stats is None:
                return 0, 0
            figures = stats()
            return int(getattr(figures, "writes", 0)), int(getattr(figures, "commits", 0))

        def per(n: int, before: tuple[int, int]) -> dict[str, float]:
            now = writes()
            return {
                "writes_per_push": round((now[0] - before[0]) / max(1, n), 2),
                "commits_per_push": round((now[1] - before[1]) / max(1, n), 2),
            }

        async def gets() -> int:
            return int((await control.get("bench/stats")).json()["gets"])

        async def pushed(what: str) -> tuple[list[float], float]:
            """The peer pushes every task (``what``: working or complete): the 2xx times
            and the CPU prismd spent, in ms per task, until the peer saw the last."""
            cpu = time.process_time()
            accepted: list[float] = (await control.post(f"bench/{what}")).json()["accepted"]
            return accepted, (time.process_time() - cpu) * 1000 / tasks

        agents: dict[str, A2AAgent] = {}
        receiver = PushReceiver("127.0.0.1:0", agents, store.inbox)
        await nursery.start(receiver.serve)
        assert receiver.address is not None
        agent = build_agent(
            "a2a",
            AgentContext(
                alias=ALIAS,
                options={
                    "url": peer_url,
                    "poll_interval_ms": poll_ms,
                    "max_poll_interval_ms": poll_ms,
                    "stream": False,
                },
                checkpoints=store.checkpoints,
                push_base_url=f"http://127.0.0.1:{receiver.address[1]}",
                max_remote_tasks_per_tenant=100_000,
            ),
        )
        assert isinstance(agent, A2AAgent)
        agents[ALIAS] = agent
        limits = Limits(max_routes=10_000, max_pending_per_process=500, max_active_sessions=16)
        gc.collect()
        rss0, sqlite0 = _rss_bytes(), _sqlite_bytes()
        nonce = f"{os.getpid()}-{time.time_ns()}"
        async with open_bench_runtime(
            store, GRANT, deliver, limits=limits, tool="bench-a2a", agent=agent
        ) as runtime:
            start = time.perf_counter()
            half, rss_half, paused_s = tasks // 2, 0, 0.0
            for n in range(tasks):
                if n == half and half:
                    # The marginal figure's first point: half the tasks followed (the pause
                    # is not counted in the sending rate).
                    pause = time.perf_counter()
                    while agent.following_now + delivered < half:  # noqa: ASYNC110
                        await trio.sleep(0.05)
                    gc.collect()
                    rss_half = _rss_bytes()
                    paused_s = time.perf_counter() - pause
                while runtime.diagnostics().queued >= MAX_QUEUED:  # noqa: ASYNC110
                    await trio.sleep(0.01)  # (back-pressure on admission: a counter)
                event = lane_event(CONNECTION, f"{nonce}-{n}", f"ev-{nonce}-{n}", f"task {n}")
                admission = await runtime.admit(event)
                if admission.status != "accepted":
                    raise RuntimeError(f"bench admission refused: {admission.reason}")
            # Every task followed, or answered already (a send that failed is told).
            while agent.following_now + delivered < tasks:  # noqa: ASYNC110 (counters)
                await trio.sleep(0.05)
            sent_s = time.perf_counter() - start - paused_s
            gc.collect()
            rss_full = _rss_bytes()
            rss_per_task = (rss_full - rss0) / tasks
            marginal = (rss_full - rss_half) / (tasks - half) if half else float("nan")
            sqlite_per_task = (_sqlite_bytes() - sqlite0) / tasks
            # Polls flowing before the CPU is counted: beyond each task's first read, the
            # first tasks' next reads (one poll interval after they were sent, -20 %) —
            # a sending phase shorter than that leaves nothing to count yet.
            with trio.move_on_after(poll_ms / 1000 * 1.25 + 10):
                while await gets() < tasks + min(tasks, 100):  # noqa: ASYNC110 (the peer's)
                    await trio.sleep(0.25)
            gets0 = await gets()
            cpu0 = time.process_time()
            await trio.sleep(duration_s)
            cpu_s = time.process_time() - cpu0
            polls = await gets() - gets0
            cpu_per_poll_ms = cpu_s * 1000 / max(1, polls)
            # 2. Ingest alone: the worker is not started, the rows wait in the inbox.
            phase("ingest")
            w_ingest, g_ingest = writes(), await gets()
            ingested, cpu_ingest_ms = await pushed("working")
            ingest_writes = per(len(ingested), w_ingest)
            ingest_polls = await gets() - g_ingest
            ingest_s = max(ingested) if ingested else float("nan")
            # 3. The worker applies that backlog (and each woken task is read once more).
            gets1 = await gets()
            phase("apply")
            cpu1, apply_start, w_apply = time.process_time(), time.perf_counter(), writes()
            nursery.start_soon(receiver.apply_pushes, f"bench-{os.getpid()}")
            while True:
                depth = await store.inbox.depth(sources=(PUSH_SOURCE,))
                if depth.pending + depth.claimed == 0:
                    break
                await trio.sleep(0.02)
            while await gets() - gets1 < len(ingested):  # noqa: ASYNC110 (the peer's count)
                await trio.sleep(0.1)  # every woken task read once more
            apply_s = time.perf_counter() - apply_start
            cpu_apply_ms = (time.process_time() - cpu1) * 1000 / max(1, len(ingested))
            apply_writes = per(len(ingested), w_apply)
            apply_polls = await gets() - gets1 - len(ingested)
            # 4. Completions: push → inbox → observation → GetTask → reply delivered.
            phase("completions")
            g_done = await gets()
            cpu2, push_start, w_done = time.process_time(), time.perf_counter(), writes()
            accepted, _ = await pushed("complete")
            await all_done.wait()
            done_s = time.perf_counter() - push_start
            cpu_push_ms = (time.process_time() - cpu2) * 1000 / tasks
            done_writes = per(tasks, w_done)
            done_polls = await gets() - g_done - tasks
            phase("end")

        def less_polls(cpu_ms: float, n: int, background: int) -> dict[str, float]:
            """The CPU per push less the background polls of the window (an estimate:
            those polls at ``cpu_ms_per_poll`` each), and how many there were."""
            net = cpu_ms - max(0, background) * cpu_per_poll_ms / max(1, n)
            return {"background_polls": background, "cpu_ms_per_push_less_polls": round(net, 3)}

        push_s = max(accepted) if accepted else float("nan")

        await agent.aclose()
        nursery.cancel_scope.cancel()
    return {
        "a2a_followed": {
            "count": tasks,
            "per_s": round(tasks / sent_s, 1),
            "rss_bytes_per_task": round(rss_per_task),
            "marginal_rss_bytes_per_task": round(marginal) if half else None,
            "of_which_sqlite_bytes_per_task": round(sqlite_per_task),
            "cpu_ms_per_poll": round(cpu_per_poll_ms, 3),
            "polls": polls,
        },
        "a2a_push_ingest": {
            "count": len(ingested),
            "per_s": round(len(ingested) / ingest_s, 1),
            "cpu_ms_per_push": round(cpu_ingest_ms, 3),
            **less_polls(cpu_ingest_ms, len(ingested), ingest_polls),
            **ingest_writes,
        },
        "a2a_push_apply": {
            "count": len(ingested),
            "per_s": round(len(ingested) / apply_s, 1),
            "cpu_ms_per_push": round(cpu_apply_ms, 3),
            **less_polls(cpu_apply_ms, len(ingested), apply_polls),
            **apply_writes,
        },
        "a2a_completions": {
            "count": tasks,
            "per_s": round(tasks / done_s, 1),
            "pushes_per_s": round(len(accepted) / push_s, 1),
            "cpu_ms_per_push_end_to_end": round(cpu_push_ms, 3),
            **less_polls(cpu_push_ms, tasks, done_polls),
            **done_writes,
        },
    }


if __name__ == "__main__":
    trio.run(_peer_main)
