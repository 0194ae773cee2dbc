"""Sending a staged reply: deliver it and mark its outcome (the one send of a staged reply;
its resends go through :mod:`._delivery`, which reopens the record first), and a route's
outbox, which sends its turns' replies in order while the route goes on with its next turn.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import attrs
import trio

from ..channel import DeliveryOutcomeUnknownError, Reply, bound_detail
from ..journal import Loaded, OwnershipScope, ReplyRecord, mark
from ._core import Core
from ._routes import Route

JOURNAL_BUDGET_S = 10.0
"""Bound of the shielded journal writes of the reply path: the operation may already be
settled, so a cancellation there (runtime torn down) would lose the answer unlisted."""


MARK_LINGER_S = 0.05
"""How long a route's outbox lets a reply's delivery mark wait for another journal write to
share a commit with (the next message's admission, another reply's mark), when none is in
flight. The reply is out already; what waits is the route's next reply, at most this long.
A crash before the mark is durable leaves the reply ``pending``, as a crash between a send
and its mark always could: re-driven where the channel can prove or repeat it safely
(Discord's nonce), else listed for ``reconcile``."""


HELD_REASON = "held"
"""The ``reason`` of a ``pending`` reply whose channel answered ``SendResult.hold()``: proven
not sent (no live connection took it), so it may be re-driven automatically when its
conversation reconnects (:mod:`prismd.runtime._delivery`). Every other ``pending`` reply
may have been sent (staged, then the daemon died) and waits for an operator."""


def is_held(record: ReplyRecord) -> bool:
    """``record`` is ``pending`` because its channel held it (see :data:`HELD_REASON`)."""
    return record.state == "pending" and record.reason == HELD_REASON


async def send_staged(
    core: Core,
    reply: Reply,
    staged: Loaded[ReplyRecord] | None,
    scope: OwnershipScope | None,
    fence: int | None,
) -> None:
    """:func:`deliver_and_mark`, for a task of its own (``answer(send_later=True)``)."""
    await deliver_and_mark(core, reply, staged, scope, fence)


@attrs.frozen
class Outgoing:
    """A staged reply waiting in its route's outbox (what :func:`deliver_and_mark` takes)."""

    reply: Reply
    staged: Loaded[ReplyRecord] | None
    scope: OwnershipScope | None
    fence: int | None
    fenced: Callable[[], bool] | None


def send_from_route(core: Core, route: Route, outgoing: Outgoing) -> None:
    """Queue a staged reply in ``route``'s outbox; its sender task delivers and marks the
    outbox's replies one after another, in the order staged (started here when idle).

    The pump does not wait for the send: its next turn's claim commits while the reply
    is on its way, and the reply's mark commits with whatever the route writes next.
    While the outbox holds a reply the route is working (:attr:`Route.working`): its
    lease is kept and renewed, and the lease fence is checked right before each send as
    it would be in the pump. A crash before a mark leaves the reply ``pending`` (listed
    for ``reconcile``), as a crash between a send and its mark always did.
    """
    box = route.outbox
    if box is None:
        route.outbox = deque((outgoing,))
        core.spawn(_send_route_replies, core, route)
    else:
        box.append(outgoing)


async def _send_route_replies(core: Core, route: Route) -> None:
    box = route.outbox
    assert box is not None
    torn_down = False
    try:
        while box:
            item = box[0]
            if item.fenced is not None and not item.fenced():
                core.count("lease_losses")
            else:
                await deliver_and_mark(
                    core,
                    item.reply,
                    item.staged,
                    item.scope,
                    item.fence,
                    linger_s=MARK_LINGER_S,
                )
            box.popleft()
    except trio.Cancelled:
        # The runtime is torn down: what is left stays ``pending`` (listed).
        torn_down = True
        raise
    finally:
        route.outbox = None
        if not route.working:
            if torn_down or core.stopped:
                await core.leases.release_if_idle(route)
            else:
                await core.leases.release_when_idle(route)


async def deliver_once(core: Core, reply: Reply) -> tuple[str, str | None, str | None]:
    """Call ``deliver``: ``(state, message_id, reason)`` for :func:`mark_outcome`.

    A raise is ambiguous (``delivery_unknown``, neither counter moves; the reason is an
    adapter's :class:`DeliveryOutcomeUnknownError` words, fixed texts, else none). A hold
    (``SendResult.hold()``) is neither delivered nor failed: the reply stays ``pending``
    with reason :data:`HELD_REASON`, and no counter moves.
    """
    try:
        result = await core.deliver(reply)
    except DeliveryOutcomeUnknownError as unknown:
        return "delivery_unknown", None, bound_detail(str(unknown))
    except Exception:
        return "delivery_unknown", None, None
    if result.held:
        return "pending", None, HELD_REASON
    if result.delivered:
        core.count("deliveries")
        return "delivered", result.message_id, None
    core.count("delivery_failures")
    reason = None if result.reason is None else bound_detail(str(result.reason))
    return "delivery_failed", result.message_id, reason


async def deliver_and_mark(
    core: Core,
    reply: Reply,
    staged: Loaded[ReplyRecord] | None,
    scope: OwnershipScope | None,
    fence: int | None,
    *,
    linger_s: float = 0.0,
) -> str:
    """Deliver a staged reply and mark its record (when journaled); returns the state.

    Keeps the conversation's delivery lock across both, so a re-drive started by a
    reconnect meanwhile sees this reply's hold once it is marked. ``linger_s``: how long
    the mark may wait to share a commit (:data:`MARK_LINGER_S`).
    """
    async with core.delivery_locks.lock(reply.connection_id, reply.external_conversation_id):
        state, message_id, reason = await deliver_once(core, reply)
        if staged is not None and scope is not None:
            await mark_outcome(
                core, scope, staged, state, message_id, reason, fence, linger_s=linger_s
            )
    return state


async def mark_outcome(
    core: Core,
    scope: OwnershipScope,
    staged: Loaded[ReplyRecord],
    state: str,
    message_id: str | None,
    reason: str | None,
    fence: int | None,
    *,
    linger_s: float = 0.0,
) -> Loaded[ReplyRecord] | None:
    """Record a send's outcome (shielded, bounded); ``None`` and ``storage_failures`` when
    it could not be written. ``linger_s``: see :func:`deliver_and_mark`."""
    assert core.journal is not None
    saved = None
    with trio.CancelScope(shield=True, relative_deadline=JOURNAL_BUDGET_S):
        try:
            saved = await mark(
                core.journal,
                scope,
                staged,
                state,
                now_ms=core.now_ms(),
                message_id=message_id,
                reason=reason,
                fence=fence,
                linger_s=linger_s,
            )
        except Exception:
            saved = None
    if saved is None:
        core.count("storage_failures")
    return saved
