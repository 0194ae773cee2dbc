"""What a reconnecting page is shown of its conversation's past (the ``history`` frame).

The journal keeps no inbound text after a run, so the past is the agent's side only: the
last delivered replies (``recent_replies``) and, merged in by time, the notices for messages
an operator settled unanswered after a crash (``unanswered_notices``, see
:mod:`prismd.runtime._unanswered`): a user who was away when it was settled learns it on the
next visit. Both are read under the actor's current grant; either failing leaves it out.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import trio

from prismd.channel import PastReply

log = logging.getLogger("prismd.webchat")


class PastReader(Protocol):
    """A read of one conversation's past as the actor's current grant allows it: the
    runtime's ``recent_replies`` and ``unanswered_notices``."""

    async def __call__(
        self,
        *,
        connection_id: str,
        external_conversation_id: str,
        external_actor_id: str,
        limit: int,
    ) -> Sequence[PastReply]: ...


class Conversations(Protocol):
    """What the adapter asks of the runtime when an actor's socket (re)connects
    (:class:`prismd.runtime.Runtime` satisfies it)."""

    async def redeliver_pending(
        self, *, connection_id: str, external_conversation_id: str, external_actor_id: str
    ) -> int: ...

    @property
    def recent_replies(self) -> PastReader: ...

    @property
    def unanswered_notices(self) -> PastReader: ...


async def conversation_past(
    conversations: Conversations, connection_id: str, actor: str, limit: int, timeout_s: float
) -> list[PastReply]:
    """The newest ``limit`` past replies and unanswered notices, oldest first; never raises
    (a part that fails or takes longer than ``timeout_s`` is left out, logged by type)."""
    merged: list[PastReply] = []
    for ask in (conversations.recent_replies, conversations.unanswered_notices):
        try:
            with trio.fail_after(timeout_s):
                merged.extend(
                    await ask(
                        connection_id=connection_id,
                        external_conversation_id=actor,
                        external_actor_id=actor,
                        limit=limit,
                    )
                )
        except Exception as exc:
            log.warning("web chat history failed: %s", type(exc).__name__)
    merged.sort(key=lambda p: p.created_at_ms)  # stable: replies keep their order
    return merged[-limit:]
