"""The in-process scenarios of ``prismd bench`` (``admission``, ``duplicate``, ``pipeline``,
``memory``): the real runtime on a real store with the ``mock`` agent answering at once, and
the ``fsync`` baseline beside them. What each measures: :mod:`prismd.cli._bench`.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import attrs
import trio

from stores import Store, open_store

from ..channel import InboundEvent, Reply, SendResult
from ..grants import GrantConfig
from ..limits import LIMIT_TABLE, Limits
from ._benchrun import lane_event, open_bench_runtime
from ._figures import figures

CONNECTION = "bench"
TENANT = "bench-tenant"
ALIAS = "mock"
FSYNC_SAMPLES = 200
MEMORY_ROUTES = 10_000

GRANT = GrantConfig(CONNECTION, ("*",), tenant=TENANT, aliases=(ALIAS,), default_alias=ALIAS)
"""The one grant of the bench: everyone on ``bench``, each actor its own scope."""


def fsync_baseline(directory: str, samples: int = FSYNC_SAMPLES) -> list[float]:
    """Seconds per 100-byte append + ``fsync`` of a file in ``directory``."""
    fd, path = tempfile.mkstemp(prefix="prismd-bench-fsync-", dir=directory)
    out: list[float] = []
    try:
        payload = b"x" * 99 + b"\n"
        for _ in range(samples):
            start = time.perf_counter()
            os.write(fd, payload)
            os.fsync(fd)
            out.append(time.perf_counter() - start)
    finally:
        os.close(fd)
        os.unlink(path)
    return out


def _statistics(store: Store) -> Any:
    """The store's own write-path counters where it keeps them (SQLite, PostgreSQL), else
    ``None``."""
    stats = getattr(store, "statistics", None)
    return None if stats is None else stats()


def _commits(store: Store) -> int | None:
    stats = _statistics(store)
    return None if stats is None else int(stats.commits)


@attrs.define(eq=False)
class _SlowCommits:
    """The store's commits of 10 ms or more while a series was measured (SQLite
    counts them: the disk's stalls, which every write waiting for one shares), reported
    as ``slow_commits`` and ``slow_commit_ms`` (their time in all) beside a latency."""

    store: Store
    count: int = 0
    seconds: float = 0.0

    @property
    def counted(self) -> bool:
        return hasattr(_statistics(self.store), "slow_commits")

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        before = _statistics(self.store)
        yield
        after = _statistics(self.store)
        if hasattr(after, "slow_commits"):
            self.count += after.slow_commits - before.slow_commits
            self.seconds += after.slow_commit_s - before.slow_commit_s

    def report(self, fig: dict[str, Any]) -> None:
        if self.counted:
            fig["slow_commits"] = self.count
            fig["slow_commit_ms"] = round(self.seconds * 1000, 1)


@attrs.define(eq=False)
class _Answers:
    """The bench's ``deliver``: wakes whoever waits for the answer to an event."""

    waiting: dict[str, trio.Event] = attrs.Factory(dict)
    delivered: int = 0

    def expect(self, event_id: str) -> trio.Event:
        event = trio.Event()
        self.waiting[event_id] = event
        return event

    async def deliver(self, reply: Reply) -> SendResult:
        self.delivered += 1
        key = reply.in_reply_to or ""
        waiter = self.waiting.pop(key, None)
        if waiter is not None:
            waiter.set()
        return SendResult(delivered=True, message_id=str(self.delivered))


@attrs.define(eq=False)
class _Bench:
    store: Store
    answers: _Answers
    runtime: Any
    limits: Limits
    serial: int = 0
    gate: trio.Event | None = None
    """Set by ``admission``: turns wait for it before they claim (the agent's resolution)."""
    nonce: str = attrs.Factory(lambda: f"{os.getpid()}-{time.time_ns()}")
    """In every event id and route: a store used by an earlier run (or by another process
    at the same time) holds no duplicate of this run's events and none of its routes."""

    def event_id(self, serial: int) -> str:
        return f"ev-{self.nonce}-{serial}"

    def event(self, route: int, event_id: str | None = None) -> InboundEvent:
        self.serial += 1
        # Routes are this run's own too: processes sharing a store (``scale``) do not
        # compete for each other's route leases.
        lane = f"{self.nonce}-{route}"
        return lane_event(
            CONNECTION, lane, event_id or self.event_id(self.serial), f"message {self.serial}"
        )


MAX_ROUTES = LIMIT_TABLE["max_pending_per_process"][1]
"""The most routes ``pipeline`` may have: each keeps one message pending, and a process
holds at most this many (the contract's cap of ``max_pending_per_process``); more would be
refused "capacity"."""


async def _with_runtime(url: str, body: Callable[[_Bench], Awaitable[dict[str, Any]]]) -> Any:
    answers = _Answers()
    bench: _Bench | None = None

    async def gate() -> None:
        if bench is not None and bench.gate is not None:
            await bench.gate.wait()

    limits = Limits(
        max_pending_per_process=MAX_ROUTES,
        max_active_sessions=16,
        max_routes=10_000,
        max_pending_per_binding=32,
    )
    async with (
        open_store(url) as store,
        open_bench_runtime(
            store, GRANT, answers.deliver, limits=limits, tool="bench", before_run=gate
        ) as runtime,
    ):
        bench = _Bench(store, answers, runtime, limits)
        return await body(bench)


async def _admit_timed(bench: _Bench, route: int, samples: list[float]) -> str:
    event = bench.event(route)
    start = time.perf_counter()
    admission = await bench.runtime.admit(event)
    samples.append(time.perf_counter() - start)
    if admission.status != "accepted":
        raise RuntimeError(f"bench admission refused: {admission.reason}")
    return event.event_id


ADMISSION_SAMPLES = 2_000
"""At most this many admissions per ``admission`` figure (the turns they start are run
afterwards, unmeasured, at pipeline speed)."""


async def admission(url: str, duration_s: float, routes: int) -> dict[str, Any]:
    """Admissions alone: while they are measured, no turn runs.

    The turns wait for the agent (a gate in ``resolve_agent``, before their claim), so the
    store and the core do nothing but admit. In rounds: each route admits as many events as
    its pending limits allow, one at a time, all routes at once; then the gate opens, every
    turn of the round runs and is answered (not measured), and the gate closes again.
    """

    async def body(bench: _Bench) -> dict[str, Any]:
        limits = bench.limits
        per_route = min(limits.max_pending_per_binding, limits.max_pending_per_process // routes)
        per_route -= 1
        samples: list[float] = []
        measured = 0.0
        answered = 0
        waiters: list[trio.Event] = []
        slow = _SlowCommits(bench.store)

        async def lane(r: int) -> None:
            for _ in range(per_route):
                waiters.append(bench.answers.expect(bench.event_id(bench.serial + 1)))
                await _admit_timed(bench, r, samples)

        while measured < duration_s and len(samples) < ADMISSION_SAMPLES:
            bench.gate = trio.Event()
            waiters.clear()

            start, delivered = time.perf_counter(), bench.answers.delivered
            with slow.measuring():
                async with trio.open_nursery() as nursery:
                    for r in range(routes):
                        nursery.start_soon(lane, r)
            measured += time.perf_counter() - start
            answered += bench.answers.delivered - delivered
            bench.gate.set()
            for waiter in waiters:
                await waiter.wait()
        out = {**figures(samples, measured), "answered_while_measured": answered}
        slow.report(out)
        return out

    result: dict[str, Any] = await _with_runtime(url, body)
    return result


async def duplicate(url: str, duration_s: float) -> dict[str, Any]:
    async def body(bench: _Bench) -> dict[str, Any]:
        known = [bench.event(r % 50) for r in range(200)]
        for event in known:
            waiter = bench.answers.expect(event.event_id)
            await bench.runtime.admit(event)
            await waiter.wait()
        samples: list[float] = []
        end = time.perf_counter() + duration_s
        start = time.perf_counter()
        i = 0
        while time.perf_counter() < end:
            event = known[i % len(known)]
            t0 = time.perf_counter()
            admission = await bench.runtime.admit(event)
            samples.append(time.perf_counter() - t0)
            if not admission.duplicate:
                raise RuntimeError("bench: a known event was not answered as a duplicate")
            i += 1
        return figures(samples, time.perf_counter() - start)

    result: dict[str, Any] = await _with_runtime(url, body)
    return result


async def pipeline(url: str, duration_s: float, routes: int) -> dict[str, Any]:
    async def body(bench: _Bench) -> dict[str, Any]:
        store = bench.store
        # Closed loop: every route keeps exactly one message in flight.
        samples: list[float] = []
        commits0, cpu0 = _commits(store), time.process_time()
        slow = _SlowCommits(store)
        end = time.perf_counter() + duration_s
        start = time.perf_counter()

        async def lane(r: int) -> None:
            while time.perf_counter() < end:
                event = bench.event(r)
                waiter = bench.answers.expect(event.event_id)
                t0 = time.perf_counter()
                admission = await bench.runtime.admit(event)
                if admission.status != "accepted":
                    raise RuntimeError(f"bench admission refused: {admission.reason}")
                await waiter.wait()
                samples.append(time.perf_counter() - t0)

        with slow.measuring():
            async with trio.open_nursery() as nursery:
                for r in range(routes):
                    nursery.start_soon(lane, r)
        elapsed = time.perf_counter() - start
        closed = figures(samples, elapsed)
        slow.report(closed)
        commits1 = _commits(store)
        if commits0 is not None and commits1 is not None and samples:
            closed["commits_per_message"] = round((commits1 - commits0) / len(samples), 2)
        closed["cpu_ms_per_message"] = round(
            (time.process_time() - cpu0) * 1000 / max(1, len(samples)), 3
        )
        # Open loop at half the measured rate: arrivals on a fixed schedule, each timed
        # from its admission to its answer.
        rate = max(1.0, float(closed["per_s"]) / 2)
        interval = 1 / rate
        latencies: list[float] = []
        open_end = time.perf_counter() + duration_s

        async def one(r: int) -> None:
            event = bench.event(r)
            waiter = bench.answers.expect(event.event_id)
            t0 = time.perf_counter()
            admission = await bench.runtime.admit(event)
            if admission.status != "accepted":
                return
            await waiter.wait()
            latencies.append(time.perf_counter() - t0)

        open_start = time.perf_counter()
        slow = _SlowCommits(store)
        with slow.measuring():
            async with trio.open_nursery() as nursery:
                i = 0
                next_at = time.perf_counter()
                while next_at < open_end:
                    nursery.start_soon(one, i % routes)
                    i += 1
                    next_at += interval
                    await trio.sleep(max(0.0, next_at - time.perf_counter()))
        opened = figures(latencies, time.perf_counter() - open_start)
        opened["offered_per_s"] = round(rate, 1)
        slow.report(opened)
        return {"pipeline": closed, "pipeline_latency": opened}

    result: dict[str, Any] = await _with_runtime(url, body)
    return result


async def memory(url: str, routes: int = MEMORY_ROUTES) -> dict[str, Any]:
    async def body(bench: _Bench) -> dict[str, Any]:
        before = _rss_mb()
        for r in range(routes):
            waiter = bench.answers.expect(bench.event_id(bench.serial + 1))
            await bench.runtime.admit(bench.event(r))
            await waiter.wait()
        await bench.runtime.drain(deadline_ms=30_000)
        return {"routes": routes, "rss_mb": _rss_mb(), "rss_before_mb": before}

    result: dict[str, Any] = await _with_runtime(url, body)
    return result


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0
