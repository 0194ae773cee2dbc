"""``prismd soak``: a long-running loop against a real store and the ``mock`` agent.

Contract behaviours 187–192, in Python. Each iteration ``i`` admits event ``soak-<i>``
(text ``iteration <i>``) on lane ``i % lanes`` (conversation ``chat-<lane>``, actor
``user-<lane>``) and drains with a 5 s deadline. Every ``prune_every``-th iteration it
re-admits the same event (which must be a duplicate), reconciles every unresolved entry
with the duplicate-risk acknowledgement and prunes. At the end it counts what is still
unresolved, prunes with ``now`` + 8 days (so even a short soak exercises deletion), stops
the runtime and prints exactly one JSON line; the exit code is 0 iff ``ok``.

No network, no accounts: the store is a temporary SQLite file (removed at the end) unless
``--store`` names another one, and replies are collected in memory.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any

import attrs
import trio
import trio.lowlevel

from stores import open_store

from ..channel import Reply, SendResult
from ..grants import GrantConfig, operator_identity
from ..limits import Limits
from ._benchrun import lane_event, open_bench_runtime, options_from_args
from ._collector import tune_collector

log = logging.getLogger("prismd.soak")

CONNECTION = "soak"
TENANT = "soak-tenant"
USER = "soak-user"
ALIAS = "mock"
DRAIN_DEADLINE_MS = 5_000
YIELD_EVERY = 16
FINAL_PRUNE_AHEAD_MS = 8 * 24 * 3600 * 1000
MAX_DURATION_MS = 7 * 24 * 3600 * 1000
GRANT = GrantConfig(
    CONNECTION, ("*",), tenant=TENANT, user=USER, aliases=(ALIAS,), default_alias=ALIAS
)
"""The one grant of the soak: everyone on ``soak``, all as one user."""


def _bounded_int(name: str, low: int, high: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{name} must be between {low} and {high}")
        return value

    return parse


_COUNTS: tuple[tuple[str, int, int, int, str], ...] = (
    # flag, lowest, highest, default, help
    (
        "--duration-ms",
        100,
        MAX_DURATION_MS,
        30_000,
        "how long to loop (100 ms … 7 days; default 30000)",
    ),
    (
        "--iterations",
        0,
        10_000_000,
        0,
        "stop after this many iterations (0 = only the duration bounds it)",
    ),
    ("--lanes", 1, 64, 4, "conversations (1…64)"),
    ("--prune-every", 1, 10_000, 25, "repeat/reconcile/prune every K iterations (default 25)"),
)
"""The soak's whole-number options, each checked within its bounds as it is parsed."""


def add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, low, high, default, help_text in _COUNTS:
        parser.add_argument(
            flag, type=_bounded_int(flag, low, high), default=default, help=help_text
        )
    parser.add_argument(
        "--store",
        metavar="URL",
        default=None,
        help="store URL (default: a temporary SQLite file, removed at the end)",
    )


@attrs.frozen
class SoakOptions:
    duration_ms: int = 30_000
    iterations: int = 0
    lanes: int = 4
    prune_every: int = 25
    store: str | None = None


@attrs.define(eq=False)
class _Collector:
    """The soak's ``deliver``: counts replies; never raises."""

    delivered: int = 0
    keys: set[tuple[str, str | None]] = attrs.field(factory=set)
    lanes: set[str] = attrs.field(factory=set)

    async def deliver(self, reply: Reply) -> SendResult:
        self.delivered += 1
        self.keys.add((reply.external_conversation_id, reply.in_reply_to))
        self.lanes.add(reply.external_conversation_id)
        return SendResult(delivered=True, message_id=str(self.delivered))


@attrs.frozen
class _SoakOperator:
    uid: int
    tenant: str = TENANT
    account: str | None = None
    user: str | None = None


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _wire(value: Any) -> dict[str, Any]:
    return {_camel(k): v for k, v in attrs.asdict(value).items()}


async def soak(
    options: SoakOptions,
    *,
    install_signals: bool = True,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> dict[str, Any]:
    """Run the soak and return the summary (``ok`` and the counters of behaviour 191).

    ``task_status.started()`` fires once the loop begins (after the store and runtime are
    open), so a caller can interrupt it deterministically. SIGINT/SIGTERM set
    ``interrupted`` and end the loop at the next iteration.
    """
    temp_dir = None
    url = options.store
    if url is None:
        temp_dir = tempfile.mkdtemp(prefix="prismd-soak-")
        url = "sqlite:///" + os.path.join(temp_dir, "soak.sqlite")
    try:
        return await _soak_on(url, options, install_signals, task_status)
    finally:
        if temp_dir is not None:
            shutil.rmtree(temp_dir, ignore_errors=True)


async def _soak_on(
    url: str,
    options: SoakOptions,
    install_signals: bool,
    task_status: trio.TaskStatus[None],
) -> dict[str, Any]:
    """The signal receiver first, so a SIGINT/SIGTERM at any point (even while the store
    opens) only sets ``interrupted``: the soak then skips the loop and still finishes."""
    from ..daemon import take_early_signal

    interrupted = trio.Event()
    async with trio.open_nursery() as nursery:
        if install_signals:
            await nursery.start(_watch_signals, interrupted)
            if take_early_signal() is not None:
                interrupted.set()
        summary = await _soak_loop(url, options, interrupted, task_status)
        nursery.cancel_scope.cancel()
    return summary


async def _watch_signals(
    interrupted: trio.Event, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        task_status.started()
        async for _ in signals:
            interrupted.set()


async def _soak_loop(
    url: str,
    options: SoakOptions,
    interrupted: trio.Event,
    task_status: trio.TaskStatus[None],
) -> dict[str, Any]:
    started = time.monotonic()
    deadline = trio.current_time() + options.duration_ms / 1000
    counts = {
        "iterations": 0,
        "admitted": 0,
        "repeatAttempts": 0,
        "duplicates": 0,
        "denied": 0,
        "unsettled": 0,
        "reconciled": 0,
        "unresolvedSeen": 0,
    }
    pruned = {"scanned": 0, "deleted": 0, "retained": 0}
    collector = _Collector()
    operator = operator_identity(_SoakOperator(uid=os.getuid()), now_ms=int(time.time() * 1000))
    async with (
        open_store(url) as store,
        open_bench_runtime(
            store,
            GRANT,
            collector.deliver,
            limits=Limits(retention_days=7),
            tool="soak",
        ) as runtime,
    ):
        task_status.started()
        i = 0
        while not interrupted.is_set() and trio.current_time() < deadline:
            if options.iterations and i >= options.iterations:
                break
            lane = i % options.lanes
            event = lane_event(CONNECTION, str(lane), f"soak-{i}", f"iteration {i}")
            admission = await runtime.admit(event)
            if admission.status == "accepted" and not admission.duplicate:
                counts["admitted"] += 1
            else:
                counts["denied"] += 1
            drained = await runtime.drain(deadline_ms=DRAIN_DEADLINE_MS)
            if not drained.settled:
                counts["unsettled"] += 1
            counts["iterations"] += 1
            i += 1
            if i % options.prune_every == 0:
                counts["repeatAttempts"] += 1
                again = await runtime.admit(event)
                if again.duplicate:
                    counts["duplicates"] += 1
                for entry in await runtime.list_unresolved(identity=operator):
                    counts["unresolvedSeen"] += 1
                    result = await runtime.reconcile(
                        identity=operator,
                        connection_id=entry.connection_id,
                        operation_id=entry.operation_id,
                        expected_version=entry.version,
                        acknowledge_duplicate_risk=True,
                    )
                    if result.status == "resolved":
                        counts["reconciled"] += 1
                result_prune = await runtime.prune(identity=operator)
                for key in pruned:
                    pruned[key] += getattr(result_prune, key)
            if i % YIELD_EVERY == 0:
                # Store calls already checkpoint; this makes signals prompt regardless.
                await trio.lowlevel.checkpoint()
        unresolved_at_end = len(await runtime.list_unresolved(identity=operator))
        final = await runtime.prune(
            identity=operator, now_ms=int(time.time() * 1000) + FINAL_PRUNE_AHEAD_MS
        )
        for key in pruned:
            pruned[key] += getattr(final, key)
        await runtime.stop()
        diagnostics = _wire(runtime.diagnostics())

    ok = (
        unresolved_at_end == 0
        and counts["unsettled"] == 0
        and counts["denied"] == 0
        and collector.delivered == counts["admitted"]
        and len(collector.keys) == collector.delivered
        and counts["duplicates"] == counts["repeatAttempts"]
        and diagnostics.get("admitted") == counts["admitted"] + counts["repeatAttempts"]
        and diagnostics.get("deliveries") == collector.delivered
        and diagnostics.get("failed") == 0
    )
    return {
        "ok": ok,
        "durationMs": int((time.monotonic() - started) * 1000),
        **counts,
        "delivered": collector.delivered,
        "uniqueReplies": len(collector.keys),
        "pruned": pruned,
        "lanes": options.lanes,
        "diagnostics": diagnostics,
        "unresolvedAtEnd": unresolved_at_end,
        "interrupted": interrupted.is_set(),
        "lanesSeen": len(collector.lanes),
    }


def summary_line(summary: Mapping[str, Any]) -> str:
    return json.dumps(summary, separators=(",", ":"), sort_keys=False)


def run_soak_command(args: argparse.Namespace) -> int:
    """``prismd soak``: print one JSON line; exit 0 iff ok (1 on any uncaught error)."""
    options = options_from_args(SoakOptions, args)
    # Imported here, not with the module: every ``prismd`` command's parser imports this
    # module, and ``prismd bench`` must not load the daemon. Then, before anything else:
    # a signal during startup must end the soak, not kill it.
    from ..daemon import describe_exception, install_early_signal_handlers

    restore_signals = install_early_signal_handlers()
    tune_collector()
    try:
        summary = trio.run(soak, options)
    except BaseException as exc:
        if isinstance(exc, SystemExit):
            raise
        # Types only (groups unwrapped): exception text can carry store URLs with passwords.
        print(
            summary_line({"ok": False, "uncaught": True, "error": describe_exception(exc)}),
            flush=True,
        )
        return 1
    finally:
        restore_signals()
    print(summary_line(summary), flush=True)
    if not summary["ok"]:
        print("prismd soak: not ok (see the summary)", file=sys.stderr)
    return 0 if summary["ok"] else 1
