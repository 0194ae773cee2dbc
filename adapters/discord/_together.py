"""Sends that end while others are on their way return together (issue 39).

The runtime marks a reply's outcome in the journal as soon as ``send`` returns: while the
replies leave one at a time — as they do paced to Discord's global 50 requests a second —
each mark is a durable commit of its own, each its own trip through the scheduler. A send
that ends while other sends are still on their way (waiting for a place in the global
window, or for their answer) waits for them here, at most :data:`HOLD_S` and
:data:`MAX_TOGETHER` sends: the sends of one batch return in one scheduler pass, and the
runtime's marks of their replies share one commit. The last send on its way never waits:
nothing would join it.

Nothing is weakened. The wait comes after Discord answered: the reply is out, and only
its mark is later. A crash during the wait leaves the reply ``pending``, as a crash between
any send and its mark always did: listed for the operator, and resent by ``reconcile``
with the same nonce inside the window (Discord answers with the message already posted),
looked for outside it (:mod:`._send`). The wait is shielded: a graceful stop does not
leave a reply that was posted unmarked. A conversation's next reply waits at most
:data:`HOLD_S` longer to start (Discord lets a channel have five messages in five seconds).
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

import attrs
import trio

T = TypeVar("T")

HOLD_S = 0.025
"""The longest a finished send waits for the others of its batch: a little more than one
place of the global window (20 ms), so a paced send sees at least the next one leave."""
MAX_TOGETHER = 16
"""A batch returns at once when this many sends have finished."""


@attrs.define(eq=False)
class _Batch:
    deadline: float
    """When its first send has waited :data:`HOLD_S`."""
    done: trio.Event = attrs.field(factory=trio.Event)
    finished: int = 0


@attrs.define(eq=False)
class ReturnTogether:
    """Counts the sends on their way; :meth:`finished` holds a finished one for company."""

    hold_s: float = HOLD_S
    max_together: int = MAX_TOGETHER
    on_the_way: int = 0
    """Sends started and not finished (posting, or waiting for a place to post)."""
    _batch: _Batch | None = None

    async def send(self, sending: Awaitable[T]) -> T:
        """``await sending`` (a send) counted on its way, its outcome returned with its
        batch's."""
        self.started()
        try:
            outcome = await sending
        except BaseException:
            self.abandoned()
            raise
        await self.finished()
        return outcome

    def started(self) -> None:
        self.on_the_way += 1

    def abandoned(self) -> None:
        """A send ended without an outcome to mark soon (it raised): it waits for nobody,
        and a batch waiting only for it returns now."""
        self.on_the_way -= 1
        if self.on_the_way == 0:
            self._release()

    async def finished(self) -> None:
        """A send has its outcome: return now if no other send is on its way (with the
        batch that waited), else wait for the batch to fill, its time to pass, or the
        last send of it to finish."""
        self.on_the_way -= 1
        batch = self._batch
        if self.on_the_way == 0:
            if batch is not None:
                self._release()
                await trio.lowlevel.cancel_shielded_checkpoint()
            return
        if batch is None:
            batch = self._batch = _Batch(trio.current_time() + self.hold_s)
        batch.finished += 1
        if batch.finished >= self.max_together:
            self._release()
            # Return with the batch, not one scheduler pass ahead of it: its marks share
            # the commit that this one's would otherwise lead alone.
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        with trio.CancelScope(shield=True, deadline=batch.deadline):
            await batch.done.wait()
        if self._batch is batch:
            self._release()

    def _release(self) -> None:
        batch, self._batch = self._batch, None
        if batch is not None:
            batch.done.set()
