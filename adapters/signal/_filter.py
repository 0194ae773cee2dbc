"""Which ``receive`` notifications count (contract §12.3): only the current subscription's,
only the configured account's, and then only what :mod:`._parse` makes an event of.

Everything else is counted (``statistics()``), never raised: a notification without a
subscription (signal-cli not in manual mode) is ignored with one warning; one naming another
account marks the receiver ``mismatched`` (health ``account: mismatch``), which stops it.
"""

from __future__ import annotations

import attrs

from prismd.channel import InboundEvent
from prismd.jsonrpc import Incoming
from stores import Clock

from ._parse import parse_envelope, read_notification
from ._status import SignalStatus, log

__all__ = ["MISMATCH", "NotificationFilter"]


class _Mismatch:
    """A notification for another account."""


MISMATCH = _Mismatch()


@attrs.define(eq=False, kw_only=True)
class NotificationFilter:
    connection_id: str
    account: str
    allow_groups: bool
    status: SignalStatus
    clock: Clock
    mismatched: bool = False
    """A notification named another account (sticky until the receiver runs again)."""
    _warned_unsubscribed: bool = attrs.field(default=False, init=False)

    def classify(self, note: Incoming, subscription: int) -> InboundEvent | _Mismatch | None:
        """The event in ``note``, :data:`MISMATCH`, or ``None`` (counted, ignored)."""
        status = self.status
        if note.method != "receive":
            status.ignored["other_notification"] += 1
            return None
        status.notifications += 1
        parsed = read_notification(note.params)
        if parsed is None:
            status.ignored["malformed"] += 1
            return None
        if parsed.shape == "automatic":
            status.unsubscribed += 1
            if not self._warned_unsubscribed:
                self._warned_unsubscribed = True
                log.warning(
                    "signal %s: signal-cli sends messages outside any subscription: it is "
                    "not in manual receive mode (run it with --receive-mode=manual); those "
                    "copies are ignored",
                    self.connection_id,
                )
            return None
        if parsed.subscription != subscription:
            status.foreign_subscription += 1
            return None
        if parsed.account is not None and parsed.account != self.account:
            if not self.mismatched:
                log.error(
                    "signal %s: signal-cli serves another account than the configured one; "
                    "receiving stopped (fix `account` or the signal-cli daemon, then restart)",
                    self.connection_id,
                )
            self.mismatched = True
            status.account = "mismatch"
            return MISMATCH
        result = parse_envelope(
            parsed,
            connection_id=self.connection_id,
            account=self.account,
            allow_groups=self.allow_groups,
            received_at_ms=self.clock.now_ms(),
        )
        if result.event is None:
            reason = result.ignored or "malformed"
            status.ignored[reason] += 1
            log.debug("signal %s: notification ignored (%s)", self.connection_id, reason)
            return None
        return result.event
