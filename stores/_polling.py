"""Due polls shared by several instances (:class:`PollStore`): one row per polled thing (a
followed remote A2A task), its next due time, and a time-bounded lease whoever polls it now
holds — so each due poll is made by one instance, a dead poller's lease expires and is taken
over, and the old poller, fenced, cannot apply what it read late.

Only the PostgreSQL store has one (several instances share it); SQLite and memory serve one
instance, whose poller needs no gate (their ``polls`` is ``None``).
"""

from __future__ import annotations

from typing import Protocol

import attrs


@attrs.frozen
class PollLease:
    """The right to poll ``key`` now, until ``expires_at_ms``; ``fence`` grows with every
    reservation, so a lease taken over answers ``False`` to its old holder."""

    key: str
    owner_id: str
    fence: int
    expires_at_ms: int


@attrs.frozen
class PollWait:
    """Not now: ask again in ``wait_ms`` (the key's next due time, the end of another
    poller's lease, or a moment when its row was being reserved)."""

    wait_ms: int


class PollStore(Protocol):
    """Due polls with leases (see the module docstring). Times are the store clock's; the
    callers give durations, so their clocks need not agree with it."""

    async def track(self, key: str) -> None:
        """Create ``key``'s row, due now, unless it exists (then unchanged)."""
        ...

    async def reserve(
        self, key: str, *, owner_id: str, ttl_ms: int, hurry: bool = False
    ) -> PollLease | PollWait | None:
        """The lease on ``key`` (fence + 1, until now + ``ttl_ms``) when it is due — or
        ``hurry`` (a push said the task moved) — and no unexpired lease is held on it; else
        when to ask again; ``None`` when ``key`` is not tracked (finished)."""
        ...

    async def renew(self, lease: PollLease, *, ttl_ms: int) -> PollLease | None:
        """Move the lease's expiry to now + ``ttl_ms`` (a poll still in flight); ``None``
        when the lease is no longer the key's (taken over)."""
        ...

    async def settle(self, lease: PollLease, *, delay_ms: int) -> bool:
        """Release the lease and make the key due in ``delay_ms``; ``False`` (nothing
        changed) when the lease was taken over — what its holder read must not be applied."""
        ...

    async def finish(self, lease: PollLease) -> bool:
        """Delete the key's row (the task is over); ``False`` when the lease was taken over."""
        ...

    async def forget(self, key: str) -> None:
        """Delete ``key``'s row whoever holds it (the task was settled otherwise)."""
        ...
