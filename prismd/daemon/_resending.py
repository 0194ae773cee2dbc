"""An adapter's child run that re-drives its unconfirmed replies when it is up (issue 39).

For a connection whose adapter declares ``features.idempotent_send`` (Discord), each time
the adapter reports started (the daemon's start, a restart after a crash), and each time
it takes its receiver lease over after standing by (a dead instance's lease expired), the
runtime is asked, in the background, to re-drive the connection's replies left
``pending`` by a killed daemon (:meth:`prismd.runtime.Runtime.resend_unconfirmed`); the
re-drives end with the run. Any other adapter's run is returned unchanged: its pending
replies stay listed for ``reconcile``.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from ..channel import ChannelAdapter
from ..runtime import Runtime
from ._supervisor import ChildRun

log = logging.getLogger("prismd.daemon")

TAKEOVER_POLL_S = 1.0
"""How often a started adapter's receiver lease is looked at (a takeover re-drives)."""


def resending_run(adapter: ChannelAdapter, runtime: object) -> ChildRun:
    """``adapter.run``, with the re-drives above, when the adapter declares
    ``idempotent_send`` and ``runtime`` is a :class:`Runtime`; else ``adapter.run``."""
    if not adapter.features.idempotent_send or not isinstance(runtime, Runtime):
        return adapter.run
    opened = runtime

    async def redrive(taken_over: bool) -> None:
        outcomes = await opened.resend_unconfirmed(adapter.connection_id, taken_over=taken_over)
        if outcomes:
            log.info(
                "%s: unconfirmed replies sent again: %s",
                adapter.connection_id,
                ", ".join(f"{n} {state}" for state, n in sorted(outcomes.items())),
            )

    async def watch_takeovers() -> None:
        held = adapter.receiver_lease_held
        while True:
            await trio.sleep(TAKEOVER_POLL_S)
            now = adapter.receiver_lease_held
            if now and not held:
                await redrive(taken_over=True)
            held = now

    async def run(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:

            class _Started:
                def started(self, value: Any = None) -> None:
                    task_status.started(value)
                    nursery.start_soon(redrive, False)
                    nursery.start_soon(watch_takeovers)

            await adapter.run(task_status=_Started())
            nursery.cancel_scope.cancel()

    return run
