"""An adapter's child run that re-drives its unconfirmed replies each time it is up (issue 39).

For a connection whose adapter declares ``features.idempotent_send`` (Discord), each time
the adapter reports started (the daemon's start, a restart after a crash) the runtime is
asked, in the background, to re-drive the connection's replies left ``pending`` by a
killed daemon (:meth:`prismd.runtime.Runtime.resend_unconfirmed`); the re-drive ends with
the run. Any other adapter's run is returned unchanged: its pending replies stay listed.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from ..channel import ChannelAdapter
from ..runtime import Runtime
from ._supervisor import ChildRun

log = logging.getLogger("prismd.daemon")


def resending_run(adapter: ChannelAdapter, runtime: object) -> ChildRun:
    """``adapter.run``, followed by a re-drive each time it reports started, when the
    adapter declares ``idempotent_send`` and ``runtime`` is a :class:`Runtime`."""
    if not adapter.features.idempotent_send or not isinstance(runtime, Runtime):
        return adapter.run
    opened = runtime

    async def run(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:

            async def redrive() -> None:
                outcomes = await opened.resend_unconfirmed(adapter.connection_id)
                if outcomes:
                    log.info(
                        "%s: unconfirmed replies sent again: %s",
                        adapter.connection_id,
                        ", ".join(f"{n} {state}" for state, n in sorted(outcomes.items())),
                    )

            class _Started:
                def started(self, value: Any = None) -> None:
                    task_status.started(value)
                    nursery.start_soon(redrive)

            await adapter.run(task_status=_Started())
            nursery.cancel_scope.cancel()

    return run
