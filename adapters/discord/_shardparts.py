"""What the steps outside the gateway loop (:mod:`._identify`, :mod:`._backfill`) use of a
shard (:class:`._gateway.Shard`), named as a protocol so they need not import the loop that
calls them."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Protocol

from stores import Clock

from ..toolkit import ReceiverLease
from ._cursor import ShardCursor
from ._rest import DiscordRest
from ._status import ShardStatus

__all__ = ["ShardParts"]


class ShardParts(Protocol):
    shard: tuple[int, int]
    rest: DiscordRest
    lease: ReceiverLease
    cursor: ShardCursor
    status: ShardStatus
    clock: Clock
    identifies_per_day: int
    identify_spacing_ms: int
    gateway: str | None
    staggered: bool
    identify_key: int

    @property
    def label(self) -> str: ...

    @property
    def handle_message(self) -> Callable[[Mapping[str, Any], Any], Awaitable[bool]]: ...
