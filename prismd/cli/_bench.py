"""``prismd bench``: throughput and latency of the journal on a real store, beside the disk's.

Every scenario runs the real runtime on a real store (a temporary SQLite file in the
working directory's filesystem unless ``--store`` names one) with the ``mock`` agent
answering at once, and no network. Latencies are wall-clock (``time.perf_counter``);
``cpu_ms_per_message`` is process CPU time (every thread) per message (for ``webchat``
the daemon's, read from ``/proc``: the clients' CPU is not in it);
``commits_per_message`` is the store's own count of durable transactions per message,
where the store keeps one (SQLite); so are ``slow_commits`` and ``slow_commit_ms`` beside
the admission and pipeline series: the commits of 10 ms or more while the series was
measured, and their time in all (the disk's stalls, which a latency's tail follows).

An ``fsync`` baseline — a 100-byte append plus ``fsync`` on the same filesystem — is
measured before every scenario and reported as one series, so a noisy machine moves
both the scenario and its baseline.

Scenarios (``--scenario``, repeatable; default all in-process ones):

* ``admission``: ``admit`` of new events until the operation record is durable, first one
  route at a time, then 64 routes concurrently (``admission_64``); no turn runs while
  admissions are measured (the turns of each round run between rounds);
* ``duplicate``: re-admission of events already admitted;
* ``pipeline``: admit → claim → run → terminal → reply staged → delivered over ``--routes``
  routes: closed loop (each route sends its next message once its answer arrived) for
  throughput, then open loop at half that rate for latency admit → delivered
  (``pipeline_latency``);
* ``memory``: resident set size with 10,000 idle routes and their bindings, measured in a
  fresh ``prismd bench`` process (``rss_before_mb``: the same process before the routes);
* ``webchat``, ``telegram``, ``discord``, ``stop``: a real ``prismd run`` process (see
  :mod:`prismd.cli._bench_live`, :mod:`prismd.cli._bench_discord`): 20 web chat sockets, 20
  Telegram chats against a loopback Bot API, 20 Discord DMs against a loopback gateway and
  REST, and SIGTERM with 100 turns in flight (``--store`` does not apply: each runs on its
  own SQLite journal);
* ``scale`` (with ``--store postgresql://…``; in the default set then): the ``pipeline``
  run by 1, 2 and 3 ``prismd bench`` processes at once on the one database, each its own
  runtime and routes; ``scale_N`` sums their throughput and takes the worst p95;
* ``postgres-bridge`` (with ``--store postgresql://…``; in the default set then): the same
  single-row write — one create-only save, one call of the store's write function — three
  ways in one run, alternating: through the store (``postgres_bridge_store``), the bare
  statement through the trio-asyncio bridge (``postgres_bridge_trio``) and the bare
  statement from plain asyncio on its own loop and connection (``postgres_bridge_asyncio``).
  The difference of the last two is what the bridge costs.

Event ids carry a per-run nonce, so ``--store`` may name a store that earlier runs used.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from stores import is_postgres_url, open_store

from ._bench_store import (
    MAX_ROUTES,
    MEMORY_ROUTES,
    admission,
    duplicate,
    fsync_baseline,
    memory,
    pipeline,
)
from ._benchrun import options_from_args
from ._collector import tune_collector
from ._figures import figures

SCENARIOS = (
    "admission",
    "duplicate",
    "pipeline",
    "memory",
    "webchat",
    "telegram",
    "discord",
    "stop",
    "postgres-bridge",
    "scale",
    "a2a",
)
DEFAULT_SCENARIOS = SCENARIOS[:-3]
"""``a2a`` (remote tasks followed, pushes ingested) runs only when asked for."""
POSTGRES_SCENARIOS = ("postgres-bridge", "scale")
"""Only with ``--store postgresql://…`` (and then in the default set)."""
SCALE_PROCESSES = (1, 2, 3)
BRIDGE_ROUND = 50
"""Writes per leg in one round of ``postgres-bridge`` (rounds repeat until the duration)."""


async def _memory_process(url: str, routes: int, workdir: str) -> dict[str, Any]:
    """``memory`` in a process of its own: what the routes cost, not what the scenarios
    before them left on this process's heap."""
    args = ["--scenario", "memory", "--in-process", "--memory-routes", str(routes)]
    figures_: dict[str, Any] = (await _bench_process(url, args, workdir))["memory"]
    figures_["process"] = "fresh"
    return figures_


async def _bench_process(url: str, args: list[str], workdir: str) -> dict[str, Any]:
    """The scenarios' figures of a child ``prismd bench --json --store url *args``, whose
    own working directory (its fsync baseline) is made in ``workdir``."""
    argv = [
        sys.executable,
        "-m",
        "prismd",
        "bench",
        "--store",
        url,
        "--json",
        "--dir",
        workdir,
        *args,
    ]
    done = await trio.run_process(argv, capture_stdout=True, stderr=sys.stderr)
    scenarios: dict[str, Any] = json.loads(done.stdout)["scenarios"]
    return scenarios


async def postgres_bridge(url: str, duration_s: float) -> dict[str, Any]:
    """The same single-row write through the store, the bare bridge and plain asyncio."""
    from stores.postgres import measure_bridge

    legs: dict[str, list[float]] = {"store": [], "trio": [], "asyncio": []}
    async with open_store(url) as store:
        start = time.perf_counter()
        end = start + duration_s
        while time.perf_counter() < end:
            round_ = await measure_bridge(store, BRIDGE_ROUND)
            legs["store"] += round_.store
            legs["trio"] += round_.bridge
            legs["asyncio"] += round_.asyncio
        elapsed = time.perf_counter() - start
    out = {f"postgres_bridge_{leg}": figures(samples, elapsed) for leg, samples in legs.items()}
    trio_p50, asyncio_p50 = out["postgres_bridge_trio"], out["postgres_bridge_asyncio"]
    if "p50_ms" in trio_p50 and "p50_ms" in asyncio_p50:
        trio_p50["bridge_cost_p50_ms"] = round(
            float(trio_p50["p50_ms"]) - float(asyncio_p50["p50_ms"]), 3
        )
    return out


async def scale(url: str, duration_s: float, routes: int, workdir: str) -> dict[str, Any]:
    """``pipeline`` in 1, 2 and 3 processes at once on one PostgreSQL database."""
    out: dict[str, Any] = {}
    args = ["--scenario", "pipeline", "--routes", str(routes), "--duration-s", str(duration_s)]
    for n in SCALE_PROCESSES:
        reports: list[dict[str, Any]] = []

        async with trio.open_nursery() as nursery:
            for _ in range(n):
                nursery.start_soon(_pipeline_process, url, args, reports, workdir)
        out[f"scale_{n}"] = {
            "processes": n,
            "count": sum(int(r["count"]) for r in reports),
            "per_s": round(sum(float(r["per_s"]) for r in reports), 1),
            "p95_ms": max(float(r["p95_ms"]) for r in reports),
            "per_process_per_s": [float(r["per_s"]) for r in reports],
            "cpu_ms_per_message": max(float(r["cpu_ms_per_message"]) for r in reports),
        }
    return out


async def _pipeline_process(
    url: str, args: list[str], reports: list[dict[str, Any]], workdir: str
) -> None:
    reports.append((await _bench_process(url, args, workdir))["pipeline"])


def _peak_rss_mb() -> float:
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


async def _live(name: str, workdir: Path, duration_s: float) -> dict[str, Any]:
    # Imported here: the in-process scenarios (``memory`` above all) run in a process that
    # holds only the runtime and the store, not the web chat client and the fake Bot API.
    from . import _bench_live

    scenario: Callable[[Path, float], Awaitable[dict[str, Any]]] = getattr(_bench_live, name)
    return await scenario(workdir, duration_s)


LIVE = ("webchat", "telegram", "stop")
"""The scenarios of :mod:`prismd.cli._bench_live`, by their function names there."""


@attrs.frozen
class BenchOptions:
    store: str | None = None
    scenarios: tuple[str, ...] = DEFAULT_SCENARIOS
    routes: int = 100
    duration_s: float = 5.0
    json: bool = False
    in_process: bool = False
    """Run ``memory`` here instead of in a fresh child process (the child's own flag)."""
    memory_routes: int = MEMORY_ROUTES
    """Routes of ``memory`` (hidden flag: the tests use fewer)."""
    a2a_tasks: int = 1_000
    """Remote tasks followed at once in ``a2a``."""


def _progress(options: BenchOptions, text: str) -> None:
    if not options.json:
        print(f"  … {text}", file=sys.stderr, flush=True)


async def run_bench(options: BenchOptions, workdir: str) -> dict[str, Any]:
    """Run the chosen scenarios in order, each on a fresh store unless ``--store`` is set."""
    results: dict[str, Any] = {}
    fsync_samples: list[float] = []
    fsync_elapsed = 0.0
    counter = 0

    def fresh_url() -> str:
        nonlocal counter
        if options.store is not None:
            return options.store
        counter += 1
        return "sqlite:///" + os.path.join(workdir, f"bench-{counter}.sqlite")

    def baseline() -> None:
        nonlocal fsync_elapsed
        start = time.perf_counter()
        fsync_samples.extend(fsync_baseline(workdir))
        fsync_elapsed += time.perf_counter() - start

    for name in options.scenarios:
        baseline()
        _progress(options, f"{name} ({options.duration_s:g} s)")
        if name == "admission":
            results["admission"] = await admission(fresh_url(), options.duration_s, 1)
            baseline()
            results["admission_64"] = await admission(fresh_url(), options.duration_s, 64)
        elif name == "duplicate":
            results["duplicate"] = await duplicate(fresh_url(), options.duration_s)
        elif name == "pipeline":
            results.update(await pipeline(fresh_url(), options.duration_s, options.routes))
        elif name == "memory":
            url = fresh_url()
            results["memory"] = (
                await memory(url, options.memory_routes)
                if options.in_process
                else await _memory_process(url, options.memory_routes, workdir)
            )
        elif name == "discord":
            from ._bench_discord import discord

            live_dir = Path(workdir) / name
            live_dir.mkdir()
            results.update(await discord(live_dir, options.duration_s))
        elif name in LIVE:
            live_dir = Path(workdir) / name
            live_dir.mkdir()
            results.update(await _live(name, live_dir, options.duration_s))
        elif name == "postgres-bridge":
            results.update(await postgres_bridge(fresh_url(), options.duration_s))
        elif name == "scale":
            results.update(await scale(fresh_url(), options.duration_s, options.routes, workdir))
        elif name == "a2a":
            from ._bench_a2a import a2a

            results.update(await a2a(fresh_url(), options.a2a_tasks, options.duration_s))
    baseline()
    fsync = figures(fsync_samples, fsync_elapsed)
    return {
        "store": _shown(options.store) if options.store else "sqlite (temporary file)",
        "scenarios": results,
        "fsync": {k: fsync[k] for k in ("count", "p50_ms", "p95_ms", "per_s") if k in fsync},
        "peak_rss_mb": _peak_rss_mb(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
    }


def _shown(url: str) -> str:
    """A store URL as it may be printed: a PostgreSQL password left out."""
    from stores import InvalidStoreURLError, parse_postgres_url

    if not is_postgres_url(url):
        return url
    try:
        return parse_postgres_url(url).display
    except InvalidStoreURLError:
        return "postgresql://…"


def render_table(summary: dict[str, Any]) -> str:
    """The readable form: one row per series, the fsync baseline last."""
    cols = ("count", "per_s", "p50_ms", "p95_ms", "p99_ms", "max_ms")
    lines = [f"{'series':<24}" + "".join(f"{c:>11}" for c in cols) + "  extra"]
    for name, fig in summary["scenarios"].items():
        extra = ", ".join(f"{k}={v}" for k, v in fig.items() if k not in cols)
        lines.append(f"{name:<24}" + "".join(f"{fig.get(c, ''):>11}" for c in cols) + f"  {extra}")
    fs = summary["fsync"]
    lines.append(f"{'fsync (baseline)':<24}" + "".join(f"{fs.get(c, ''):>11}" for c in cols))
    lines.append(f"peak RSS {summary['peak_rss_mb']} MB; store {summary['store']}")
    return "\n".join(lines)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--store", metavar="URL", default=None, help="store URL (default: temp SQLite)"
    )
    parser.add_argument(
        "--scenario",
        action="append",
        choices=SCENARIOS,
        help="run only this scenario (repeatable; default: all but postgres-bridge and"
        " scale, and those too with a postgresql:// store)",
    )
    parser.add_argument(
        "--routes", type=int, default=100, help="routes of the pipeline (default 100)"
    )
    parser.add_argument(
        "--duration-s", type=float, default=5.0, help="seconds per series (default 5)"
    )
    parser.add_argument(
        "--dir",
        metavar="PATH",
        default=None,
        help="directory on the disk to measure: the temporary store, the daemons' state and"
        " the fsync baseline live there (default: the current directory)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--in-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--memory-routes", type=int, default=MEMORY_ROUTES, help=argparse.SUPPRESS)
    parser.add_argument(
        "--a2a-tasks", type=int, default=1_000, help="remote tasks followed at once in a2a"
    )


def run_bench_command(args: argparse.Namespace) -> int:
    if not 1 <= args.routes <= MAX_ROUTES:
        print(f"prismd bench: --routes must be between 1 and {MAX_ROUTES}", file=sys.stderr)
        return 2
    if not 1 <= args.memory_routes <= 100_000:
        print("prismd bench: --memory-routes must be between 1 and 100000", file=sys.stderr)
        return 2
    if not 1 <= args.a2a_tasks <= 10_000:
        print("prismd bench: --a2a-tasks must be between 1 and 10000", file=sys.stderr)
        return 2
    if not 0.1 <= args.duration_s <= 3600:
        print("prismd bench: --duration-s must be between 0.1 and 3600", file=sys.stderr)
        return 2
    scenarios = tuple(args.scenario or DEFAULT_SCENARIOS)
    is_postgres = args.store is not None and is_postgres_url(args.store)
    if args.scenario is None and is_postgres:
        scenarios += POSTGRES_SCENARIOS
    for name in POSTGRES_SCENARIOS:
        if name in scenarios and not is_postgres:
            print(f"prismd bench: {name} needs --store postgresql://…", file=sys.stderr)
            return 2
    options = options_from_args(BenchOptions, args, scenarios=scenarios)
    # Not the system's temporary directory by default: often a tmpfs, where an fsync
    # costs nothing and the figures would say nothing about the disk.
    try:
        parent = os.path.abspath(args.dir if args.dir is not None else os.getcwd())
        workdir = tempfile.mkdtemp(prefix="prismd-bench-", dir=parent)
    except OSError as exc:
        where = args.dir if args.dir is not None else "the current directory"
        print(
            f"prismd bench: cannot create a working directory in {where}"
            f" ({exc.strerror or type(exc).__name__}); run it from a writable directory"
            " on the disk to measure, or name one with --dir",
            file=sys.stderr,
        )
        return 2
    tune_collector()
    try:
        summary = trio.run(run_bench, options, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if options.json:
        print(json.dumps(summary, separators=(",", ":")))
    else:
        print(render_table(summary))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="prismd bench")
    add_bench_arguments(parser)
    return run_bench_command(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
