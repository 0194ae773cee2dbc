"""What the Signal adapter shows of itself: ``health()`` enums and counters.

Health is four bounded enums (contract §12.4, plus the receiver's own ``state``): no
numbers, paths, ids or text. Counters (:class:`SignalStatistics`) say what the adapter did
with every notification — admitted, ignored and why, refused by policy — so "nothing
crashes, nothing vanishes silently" can be checked from outside.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping
from typing import Literal, TypeAlias, get_args

import attrs

log = logging.getLogger("prismd.signal")

Bridge: TypeAlias = Literal["unavailable", "connected"]
Subscription: TypeAlias = Literal["inactive", "active", "paused"]
Account: TypeAlias = Literal["unverified", "ready", "mismatch", "identity_changed"]
State: TypeAlias = Literal[
    "idle",
    "starting",
    "standby",
    "probing",
    "connecting",
    "receiving",
    "paused",
    "backoff",
    "account_mismatch",
    "stopped",
]

STATES: tuple[State, ...] = get_args(State)
"""``state``: what the receiver does now. ``standby`` — another daemon holds the receiver
lease; ``probing`` — rewriting the readiness record; ``paused`` — not subscribed while
messages already received are admitted; ``backoff`` — waiting to reconnect;
``account_mismatch`` — signal-cli serves another account (the receiver stopped)."""


@attrs.frozen
class SignalStatistics:
    """A snapshot of the counters (all start at 0)."""

    notifications: int
    """``receive`` notifications read from signal-cli."""
    admitted: int
    """Events ``admit`` gave a final answer (accepted, duplicate or a final refusal)."""
    retried: int
    """Admissions answered retryably (capacity, unavailable, stopped) or that raised."""
    held: int
    """Events now waiting for a final admission (each also in the inbox when possible)."""
    replayed: int
    """Events taken back from the durable inbox at a start."""
    ignored: Mapping[str, int]
    """Deliberately ignored notifications by reason (``receipt``, ``typing``, ``group``…)."""
    foreign_subscription: int
    """Notifications for a subscription id that is not ours (dropped)."""
    unsubscribed: int
    """Notifications without a subscription id (signal-cli not in manual mode; dropped)."""
    connects: int
    """Connections opened to signal-cli for receiving."""
    subscriptions: int
    """Successful ``subscribeReceive`` calls."""
    bad_frames: int
    """Connections closed because of a malformed or oversized frame."""
    probes: int
    """Readiness records written."""


@attrs.define(eq=False)
class SignalStatus:
    """The mutable health and counters one adapter shares between its receiver and sender."""

    connection_id: str
    state: State = "idle"
    bridge: Bridge = "unavailable"
    subscription: Subscription = "inactive"
    account: Account = "unverified"
    notifications: int = 0
    admitted: int = 0
    retried: int = 0
    held: int = 0
    replayed: int = 0
    ignored: collections.Counter[str] = attrs.field(factory=collections.Counter)
    foreign_subscription: int = 0
    unsubscribed: int = 0
    connects: int = 0
    subscriptions: int = 0
    bad_frames: int = 0
    probes: int = 0

    def health(self) -> dict[str, str]:
        return {
            "state": self.state,
            "bridge": self.bridge,
            "subscription": self.subscription,
            "account": self.account,
        }

    def identity_changed(self) -> None:
        """A contact's safety number changed (a send said so): shown until a restart, so
        the operator sees that ``signal-cli trust`` is needed. A mismatch stays shown."""
        if self.account != "mismatch":
            self.account = "identity_changed"

    def statistics(self) -> SignalStatistics:
        """Each counter of :class:`SignalStatistics` as it stands now (so a new counter is
        declared there and here, and copied without a third list)."""
        counters = {f.name: getattr(self, f.name) for f in attrs.fields(SignalStatistics)}
        counters["ignored"] = dict(self.ignored)
        return SignalStatistics(**counters)
