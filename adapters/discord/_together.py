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

A backlog holds longer (:data:`BACKLOG_HOLD_S`): with :data:`MAX_TOGETHER` sends or more
on their way when a batch begins, either the batch fills at once (answers come fast:
it returns then), or they are paced by the global window, 20 ms a send, and each send
still on its way waits longer for its own place than the hold lasts. Holding a finished
one then delays nothing that could leave sooner — the next reply of its conversation would
queue behind the others in the window all the same — and its mark shares a commit with
some five others instead of one or two.
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
BACKLOG_HOLD_S = 0.1
"""The hold of a batch begun while :data:`MAX_TOGETHER` sends or more were on their way."""


@attrs.define(eq=False)
class _Batch:
    deadline: float
    """When its first send has waited its hold."""
    done: trio.Event = attrs.field(factory=trio.Event)
    finished: int = 0
    held: list[trio.lowlevel.Task] = attrs.field(factory=list)
    """The sends after the first, parked until the batch returns."""


@attrs.define(eq=False)
class ReturnTogether:
    """Counts the sends on their way; :meth:`finished` holds a finished one for company."""

    hold_s: float = HOLD_S
    max_together: int = MAX_TOGETHER
    backlog_hold_s: float = BACKLOG_HOLD_S
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
            # (on_the_way + 1: this send, which was on its way until now)
            backlog = self.on_the_way + 1 >= self.max_together
            hold = self.backlog_hold_s if backlog else self.hold_s
            batch = self._batch = _Batch(trio.current_time() + hold)
        batch.finished += 1
        if batch.finished >= self.max_together:
            self._release()
            # Return with the batch, not one scheduler pass ahead of it: its marks share
            # the commit that this one's would otherwise lead alone.
            await trio.lowlevel.cancel_shielded_checkpoint()
            return
        if batch.finished > 1:
            # Only the batch's first send keeps its time: the others are parked until it
            # (or the send that fills or closes the batch) releases them, without a timer
            # or a cancel scope each; a cancellation cannot cut the wait short (it lands
            # at the caller's next checkpoint), which the first's time bounds.
            batch.held.append(trio.lowlevel.current_task())
            await trio.lowlevel.wait_task_rescheduled(_not_now)
            return
        with trio.CancelScope(shield=True, deadline=batch.deadline):
            await batch.done.wait()
        if self._batch is batch:
            self._release()
            await trio.lowlevel.cancel_shielded_checkpoint()  # with the batch, as above

    def _release(self) -> None:
        batch, self._batch = self._batch, None
        if batch is not None:
            batch.done.set()
            for task in batch.held:
                trio.lowlevel.reschedule(task)


def _not_now(_raise_cancel: object) -> trio.lowlevel.Abort:
    """A held send's wait is not cancelled: the batch's first send bounds it."""
    return trio.lowlevel.Abort.FAILED
