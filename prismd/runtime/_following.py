"""A turn whose agent hands its work to a remote peer (the ``a2a`` kind): the runtime's side
of :class:`~prismd.agents.RunHooks` (SPEC difference 9).

Once the agent has journaled the remote task, :meth:`TurnHooks.following` moves the
operation ``executing → following`` under the turn's lease fence. From then on:

* the turn stays the route's active turn (messages arriving meanwhile wait in order), but
  the typing indicator stops and the concurrency slot is given back — a remote task may run
  for hours and must not hold a local run's place;
* ``stop()`` cancels the run without settling it: the operation stays ``following`` and the
  turns queued behind it stay ``accepted``; the restart's recovery queues both again, oldest
  first, and the agent follows the same task instead of sending again;
* ``list-unresolved`` does not list it (nothing needs a decision) and prune keeps it.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from ..journal import FOLLOWING_STATE, OperationRecord, OperationRef, transition
from ._core import Core
from ._relay import relay
from ._routes import ActiveTurn, Turn


def _ref(turn: Turn) -> OperationRef:
    return OperationRef(turn.scope, turn.event.connection_id, turn.operation_id)


@attrs.define(eq=False)
class TurnHooks:
    core: Core
    turn: Turn
    active: ActiveTurn
    fence: int | None = None
    stop_typing: Callable[[], None] | None = None
    """Ends the turn's typing indicator (set while the agent runs)."""
    slot_held: bool = False

    async def following(self) -> bool:
        core, turn = self.core, self.turn
        if not turn.following:
            if core.journal is not None:
                saved = await transition(
                    core.journal,
                    _ref(turn),
                    FOLLOWING_STATE,
                    now_ms=core.now_ms(),
                    known=turn.op,
                    fence=self.fence,
                    allowed=lambda record: record.state == "executing",
                )
                if saved is None:
                    current = await core.journal.load_operation(
                        turn.scope, turn.event.connection_id, turn.operation_id
                    )
                    if current is None or current.record.state != FOLLOWING_STATE:
                        return False
                    saved = current
                turn.op = saved
            turn.following = True
        if self.stop_typing is not None:
            self.stop_typing()
        self.release_slot()
        return True

    def stopping(self) -> bool:
        return self.core.stopped or self.active.stopping

    @property
    def owner(self) -> str | None:
        return self.core.owner_id

    def waiting(self) -> None:
        self.release_slot()

    async def relay(self, key: str, text: str) -> bool:
        return await relay(self.core, self.turn, self.fence, key, text)

    def release_slot(self) -> None:
        if self.slot_held:
            self.slot_held = False
            self.core.slots.release()


async def claim_following(core: Core, turn: Turn, fence: int | None) -> bool:
    """The claim of a ``following`` operation recovered after a restart: the state is kept
    (the remote task is followed, not run again), ``attempts`` + 1, under the lease fence.
    False when the record is no longer ``following`` (settled meanwhile)."""
    if core.journal is None:
        return True

    def claimed(record: OperationRecord) -> dict[str, int]:
        return {"attempts": record.attempts + 1}

    saved = await transition(
        core.journal,
        _ref(turn),
        None,
        now_ms=core.now_ms(),
        known=turn.op,
        fence=fence,
        change=claimed,
        allowed=lambda record: record.state == FOLLOWING_STATE,
    )
    if saved is None:
        return False
    turn.op = saved
    turn.following = True
    return True


def left_for_restart(core: Core, turn: Turn, stopping: bool) -> bool:
    """A followed turn cancelled by a stop: leave its operation ``following``."""
    return turn.following and (core.stopped or stopping)
