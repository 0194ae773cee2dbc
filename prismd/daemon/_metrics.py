"""Prometheus metrics: ``[metrics] listen = "127.0.0.1:9464"`` serves ``GET /metrics``.

The exposition format is ``prometheus_client``'s (text 0.0.4 by default, OpenMetrics when
the scraper's ``Accept`` asks for it), from a private :class:`CollectorRegistry` per daemon
(never the process-global default one). Apart from the store latency histogram, every value
is read live from its owner at scrape time by a custom collector, so nothing is counted twice:

* ``prismd_<counter>_total`` — each counter of ``prismctl diagnostics`` (``admitted``,
  ``denied``, ``duplicates``, ``lease_losses``…);
* ``prismd_queue_depth`` (turns waiting) and ``prismd_active_sessions`` (runs holding a slot);
* ``prismd_child_state{child, state}`` — 1 for the state each supervised child is in (one
  sample per possible state, so a missing 1 is never ambiguous); ``child`` is
  ``control``, ``watchdog``, ``metrics`` or ``<kind>:<connection id>``;
* ``prismd_child_health{child, key, value}`` — 1 per entry of an adapter's own bounded
  ``health()`` (``adapterState="polling"``, ``listener="listening"``, ``mode``…; not the
  times and causes of :data:`HEALTH_DETAILS`, which ``prismctl health`` shows);
* ``prismd_child_health_time_seconds{child, key}`` — the times of :data:`HEALTH_TIMES` an
  adapter's ``health()`` gives (a gateway's ``lastEventAt`` and ``sessionStartedAt``), as
  Unix seconds: ``time() - …`` is the age;
* ``prismd_child_restarts_total{child}``;
* ``prismd_leases_held{kind}`` — ``binding`` leases of the runtime, ``receiver`` leases of
  the Telegram adapters;
* ``prismd_store_call_seconds{operation}`` — a histogram of every store call, measured in one
  place: :meth:`DaemonMetrics.timed_store` wraps the store object the daemon opened.

No label carries text, a user, chat or actor id, or a token. The endpoint has no
authentication: it listens on loopback unless ``allow_non_loopback`` says otherwise.

HTTP is served by the shared pieces of :mod:`adapters.toolkit`: one request per connection,
at most :data:`MAX_CONNECTIONS` at once (:func:`~adapters.toolkit.serve_limited`: a
newcomer pushes out the oldest, so stuck or silent clients cannot keep the scraper out; out
of file descriptors, accept backs off and logs once a minute), the whole head within
:data:`HEAD_TIMEOUT_S` (408), at most :data:`MAX_HEAD_BYTES` (431); ``/metrics`` answers
``GET``/``HEAD``, another method 405, another path 404.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, cast

import attrs
import trio
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import choose_encoder

from adapters.toolkit import (
    ACTIVITY_FIELDS,
    Budget,
    ConnectionLimiter,
    Slot,
    open_listeners,
    read_request_head,
    respond,
    serve_limited,
    server_connection,
)
from stores import CheckpointStore, InboxStore, LeaseStore, Store

from ..runtime import Diagnostics
from ._config import is_loopback_host, parse_host_port

__all__ = ["DaemonMetrics", "MetricsServer", "TimedStore"]

log = logging.getLogger("prismd.metrics")

METRICS_PATH = "/metrics"
MAX_CONNECTIONS = 8
"""Concurrent connections; a scraper needs one, and the oldest gives way to a newcomer."""
_SCRAPES = "scrapes"
HEAD_TIMEOUT_S = 5.0
MAX_HEAD_BYTES = 4 * 1024
STORE_BUCKETS_S = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)
"""SQLite answers in well under a millisecond to a few; PostgreSQL over a network in tens."""
CHILD_STATES = ("starting", "running", "restarting", "failed", "stopped")

_GAUGES = {
    "queued": ("prismd_queue_depth", "Turns admitted and waiting for their route."),
    "active": ("prismd_active_sessions", "Agent runs holding a session slot."),
}
_COUNTER_HELP = {
    "admitted": "Events admitted (accepted, duplicates included).",
    "denied": "Events denied (any reason).",
    "unsupported": "Events of an unsupported kind.",
    "duplicates": "Events answered as duplicates of an admitted one.",
    "completed": "Turns that ended with a final answer.",
    "failed": "Turns that failed.",
    "cancelled": "Turns cancelled (stop, /cancel).",
    "suspended": "Turns suspended for an operator decision.",
    "deliveries": "Replies delivered.",
    "delivery_failures": "Replies the channel refused or could not confirm.",
    "truncated": "Replies truncated to the reply cap.",
    "storage_failures": "Store calls that failed in the runtime.",
    "lease_losses": "Binding leases found lost at renewal.",
}


HEALTH_TIMES = frozenset({"lastEventAt", "sessionStartedAt"})
"""Health times exported as values: when a gateway (Discord) last sent anything, when its
session began."""
HEALTH_DETAILS = ACTIVITY_FIELDS | HEALTH_TIMES
"""Adapter health entries that are no enum (a time, a cause with numbers): never labels."""


def _health_time(key: str, value: str) -> float | None:
    """Unix seconds of a health entry of :data:`HEALTH_TIMES`, else ``None``."""
    if key not in HEALTH_TIMES:
        return None
    try:
        return datetime.datetime.fromisoformat(value).timestamp()
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------- store timing


class _TimedCalls:
    """Forwards every attribute of ``inner``; its coroutine methods are timed into
    ``histogram`` labelled with the method name (a bounded set: the store protocol)."""

    def __init__(self, inner: object, histogram: Histogram) -> None:
        self._inner = inner
        self._histogram = histogram

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if not inspect.iscoroutinefunction(value):
            return value
        observe = self._histogram.labels(operation=name).observe

        @functools.wraps(value)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await value(*args, **kwargs)
            finally:
                observe(time.perf_counter() - started)

        # Cached on the instance: later look-ups skip __getattr__ (one wrapper per method).
        setattr(self, name, timed)
        return timed


@attrs.define(eq=False)
class TimedStore:
    """A :class:`~stores.Store` whose checkpoint, lease and inbox calls are timed; everything else
    (``url``, ``aclose``, backend extras) is the inner store's."""

    inner: Store
    histogram: Histogram
    _checkpoints: _TimedCalls = attrs.field(init=False)
    _leases: _TimedCalls = attrs.field(init=False)
    _inbox: _TimedCalls = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._checkpoints = _TimedCalls(self.inner.checkpoints, self.histogram)
        self._leases = _TimedCalls(self.inner.leases, self.histogram)
        self._inbox = _TimedCalls(self.inner.inbox, self.histogram)

    @property
    def url(self) -> str:
        return self.inner.url

    @property
    def checkpoints(self) -> CheckpointStore:
        return cast(CheckpointStore, self._checkpoints)

    @property
    def leases(self) -> LeaseStore:
        return cast(LeaseStore, self._leases)

    @property
    def inbox(self) -> InboxStore:
        return cast(InboxStore, self._inbox)

    async def aclose(self) -> None:
        await self.inner.aclose()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


# --------------------------------------------------------------------------- collectors


def _by_label(family: CounterMetricFamily | GaugeMetricFamily, values: Mapping[str, int]) -> Metric:
    """``family`` (of one label) with a sample per entry of ``values``, in label order."""
    for label, value in sorted(values.items()):
        family.add_metric([label], value)
    return family


@attrs.frozen
class _Sources:
    diagnostics: Callable[[], Diagnostics]
    health: Callable[[], Mapping[str, Mapping[str, str]]]
    restarts: Callable[[], Mapping[str, int]]
    leases: Callable[[], Mapping[str, int]]
    a2a: Callable[[], Mapping[str, int]] | None = None


@attrs.define(eq=False)
class _LiveCollector:
    """Reads the daemon's live values at each scrape (a ``prometheus_client`` collector)."""

    sources: _Sources

    def collect(self) -> Iterable[Metric]:
        diagnostics = self.sources.diagnostics()
        for field in attrs.fields(Diagnostics):
            value = getattr(diagnostics, field.name)
            if field.name in _GAUGES:
                name, doc = _GAUGES[field.name]
                yield GaugeMetricFamily(name, doc, value=value)
            else:
                doc = _COUNTER_HELP.get(field.name, f"Runtime counter {field.name}.")
                yield CounterMetricFamily(f"prismd_{field.name}", doc, value=value)
        health = self.sources.health()
        states = GaugeMetricFamily(
            "prismd_child_state",
            "1 for the state each supervised child is in.",
            labels=["child", "state"],
        )
        entries = GaugeMetricFamily(
            "prismd_child_health",
            "1 per bounded entry of a child's own health (adapter state, listener, mode).",
            labels=["child", "key", "value"],
        )
        times = GaugeMetricFamily(
            "prismd_child_health_time_seconds",
            "The times a child's health gives (last update, last gateway event, session"
            " start), as Unix seconds.",
            labels=["child", "key"],
        )
        for child, entry in sorted(health.items()):
            for state in CHILD_STATES:
                states.add_metric([child, state], 1.0 if entry.get("state") == state else 0.0)
            for key, value in sorted(entry.items()):
                when = _health_time(key, value)
                if when is not None:
                    times.add_metric([child, key], when)
                elif key != "state" and key not in HEALTH_DETAILS:
                    entries.add_metric([child, key, value], 1.0)
        yield states
        yield entries
        yield times
        yield _by_label(
            CounterMetricFamily(
                "prismd_child_restarts",
                "Restarts of a supervised child after a crash.",
                labels=["child"],
            ),
            self.sources.restarts(),
        )
        yield _by_label(
            GaugeMetricFamily(
                "prismd_leases_held",
                "Leases held now: binding (runtime routes) and receiver (Telegram).",
                labels=["kind"],
            ),
            self.sources.leases(),
        )
        if self.sources.a2a is not None:
            figures = self.sources.a2a()
            yield GaugeMetricFamily(
                "prismd_a2a_following",
                "Remote A2A tasks followed by this instance now.",
                value=figures.get("following", 0),
            )
            for name, value in sorted(figures.items()):
                if name != "following":
                    yield CounterMetricFamily(
                        f"prismd_a2a_{name}", f"A2A counter {name}.", value=value
                    )


@attrs.define(eq=False)
class DaemonMetrics:
    """One daemon's metrics: its private registry, the store latency histogram and (after
    :meth:`watch`) the live collector."""

    registry: CollectorRegistry = attrs.field(factory=CollectorRegistry)
    store_latency: Histogram = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.store_latency = Histogram(
            "prismd_store_call_seconds",
            "Duration of store calls, by store method.",
            ["operation"],
            registry=self.registry,
            buckets=STORE_BUCKETS_S,
        )

    def timed_store(self, store: Store) -> Store:
        """``store`` with every checkpoint and lease call timed into ``store_latency``."""
        return TimedStore(store, self.store_latency)

    def watch(
        self,
        *,
        diagnostics: Callable[[], Diagnostics],
        health: Callable[[], Mapping[str, Mapping[str, str]]],
        restarts: Callable[[], Mapping[str, int]],
        leases: Callable[[], Mapping[str, int]],
        a2a: Callable[[], Mapping[str, int]] | None = None,
    ) -> None:
        """Expose these live sources (called once, when the runtime and children exist).

        ``health`` is the supervisor's per-child health (``state`` plus the adapter's own
        entries), ``restarts`` per-child restart counts, ``leases`` counts by kind.
        """
        sources = _Sources(
            diagnostics=diagnostics, health=health, restarts=restarts, leases=leases, a2a=a2a
        )
        self.registry.register(_LiveCollector(sources))

    def exposition(self, accept: str = "") -> tuple[bytes, str]:
        """``(body, content type)`` for a scrape with this ``Accept`` header."""
        encoder, content_type = choose_encoder(accept)
        return encoder(self.registry), content_type


# --------------------------------------------------------------------------- server


@attrs.define(eq=False)
class MetricsServer:
    """Serves :meth:`DaemonMetrics.exposition` at ``/metrics`` on ``listen`` (a supervised
    child of the daemon). ``run`` reports started once listening; :attr:`bound` then holds
    the address (port 0 resolved)."""

    listen: str
    metrics: DaemonMetrics
    allow_non_loopback: bool = False
    max_connections: int = MAX_CONNECTIONS
    bound: tuple[str, int] | None = attrs.field(default=None, init=False)
    limiter: ConnectionLimiter = attrs.field(init=False)
    _listening: bool = attrs.field(default=False, init=False)

    def __attrs_post_init__(self) -> None:
        self.limiter = ConnectionLimiter(
            "metrics",
            {_SCRAPES: Budget(self.max_connections, "evict", "connections")},
            logger=log,
        )

    @property
    def url(self) -> str:
        """``http://host:port/metrics`` (the bound port once listening)."""
        host, port = self.bound if self.bound is not None else parse_host_port(self.listen)
        shown = f"[{host}]" if ":" in host else host
        return f"http://{shown}:{port}{METRICS_PATH}"

    def health(self) -> Mapping[str, str]:
        return {"listener": "listening" if self._listening else "stopped"}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled. Raises ``ValueError`` for a non-loopback ``listen`` without
        ``allow_non_loopback`` (the config refuses it first) and ``OSError`` when the port
        cannot be bound."""
        host, port = parse_host_port(self.listen)
        if not is_loopback_host(host) and not self.allow_non_loopback:
            raise ValueError("metrics on a non-loopback address needs allow_non_loopback")
        async with open_listeners(host, port) as (listeners, self.bound):
            try:
                async with trio.open_nursery() as nursery:
                    serve = functools.partial(serve_limited, budget=_SCRAPES)
                    await nursery.start(serve, self._handle, listeners, self.limiter)
                    self._listening = True
                    log.info("metrics on %s", self.url)
                    task_status.started()
            finally:
                self._listening = False

    async def _handle(self, stream: trio.SocketStream, _slot: Slot) -> None:
        try:
            await self._serve(stream)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the scraper went away
        except Exception as exc:
            log.warning("metrics request failed: %s", type(exc).__name__)
        finally:
            await trio.aclose_forcefully(stream)

    async def _serve(self, stream: trio.SocketStream) -> None:
        conn = server_connection(MAX_HEAD_BYTES)
        head = await read_request_head(
            stream, conn, max_head_bytes=MAX_HEAD_BYTES, timeout_s=HEAD_TIMEOUT_S
        )
        if head is None:
            return  # answered (400/408/431) or closed
        if head.path != METRICS_PATH:
            await respond(stream, conn, head.method, 404, b"not found\n")
            return
        if head.method not in ("GET", "HEAD"):
            await respond(stream, conn, head.method, 405, b"method not allowed\n")
            return
        try:
            body, content_type = self.metrics.exposition(head.headers.get("accept", ""))
        except Exception as exc:
            # A source that raised (a bug): say so to the scraper, keep serving.
            log.warning("collecting metrics failed: %s", type(exc).__name__)
            await respond(stream, conn, head.method, 500, b"collecting metrics failed\n")
            return
        await respond(stream, conn, head.method, 200, body, content_type)
