"""What the supervisor needs from a channel adapter (Telegram, Signal, web chat).

An adapter is built with an ``admit`` callable (``runtime.admit``) and whatever durable
state it needs. The supervisor starts ``run`` with ``nursery.start``; ``run`` calls
``task_status.started()`` once it is serving (lease held, socket bound, …) and then runs
until cancelled. A fatal condition (e.g. Telegram 401) is raised as
:class:`AdapterFatalError`: the supervisor does not restart the adapter after it. Any other
exception is a crash: the supervisor restarts ``run`` with bounded backoff.

``send`` is the runtime's ``deliver`` for replies on this connection: it returns a
:class:`~prismd.channel.SendResult` for a known outcome and raises for an ambiguous one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

import trio

from .channel import Admission, InboundEvent, Reply, SendResult

Admit = Callable[[InboundEvent], Awaitable[Admission]]


class AdapterFatalError(Exception):
    """The adapter cannot work with its configuration (bad credentials, webhook conflict)."""


class DeliveryOutcomeUnknownError(Exception):
    """The platform may or may not have accepted the message (ambiguous delivery)."""


class ChannelAdapter(Protocol):
    @property
    def connection_id(self) -> str: ...

    async def run(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None: ...

    async def send(self, reply: Reply) -> SendResult: ...

    def health(self) -> Mapping[str, str]:
        """Bounded enums only (no ids, numbers, paths or text)."""
        ...
