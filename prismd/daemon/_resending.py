"""An adapter's child run that re-drives its unconfirmed replies when it is up (issue 39).

For a connection whose adapter declares ``features.idempotent_send`` (Discord), once the
adapter reports started (the daemon's start, a restart after a crash) and holds its
receiver lease, and each time it takes that lease (back) after standing by (a dead
instance's lease expired), the runtime is asked, in the background, to re-drive the
connection's replies left ``pending`` by a killed daemon
(:meth:`prismd.runtime.Runtime.resend_unconfirmed`); the re-drives end with the run. Nothing
is re-driven while another instance holds the lease: its replies are its own to send. The
adapter says when its lease is taken or lost (:meth:`~prismd.channel.ChannelAdapter.
wait_receiver_lease`, woken by the lease itself): no polling. Any other adapter's run is
returned unchanged: its pending replies stay listed for ``reconcile``.
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

    async def redrive_while_held() -> None:
        # Held at the start: this process's predecessor's replies (staged before the
        # runtime was opened); taken later: the previous holder's (staged before now).
        taken_over = not adapter.receiver_lease_held
        while True:
            await adapter.wait_receiver_lease(True)
            await redrive(taken_over)
            await adapter.wait_receiver_lease(False)
            taken_over = True

    async def run(*, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:

            class _Started:
                def started(self, value: Any = None) -> None:
                    task_status.started(value)
                    nursery.start_soon(redrive_while_held)

            await adapter.run(task_status=_Started())
            nursery.cancel_scope.cancel()

    return run
