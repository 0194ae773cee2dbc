"""The receiving side's health state and the retry lines every Bot API caller logs."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

import attrs

from prismd.channel import AdapterFatalError

from ..toolkit import Activity
from ._api import TelegramApiError, TelegramCredentialError, TelegramError, describe_failure

log = logging.getLogger("prismd.telegram")
_E = TypeVar("_E")
_R = TypeVar("_R")

STATES = (
    "idle",
    "starting",
    "standby",
    "polling",
    "serving",
    "backoff",
    "rate_limited",
    "conflict",
    "unauthorized",
    "webhook_active",
    "stopped",
)
FATAL_STATES = frozenset({"unauthorized", "webhook_active"})
"""States that say why the adapter stopped: they stay visible after ``run`` ends."""


def log_retry(
    connection_id: str, method: str, error: TelegramError, delay_s: float, attempt: int
) -> None:
    """One WARNING per retried call: cause class, delay and attempt (never a URL or text)."""
    log.warning(
        "telegram %s: %s failed: %s; retry in %.1f s (attempt %d)",
        connection_id,
        method,
        describe_failure(error),
        delay_s,
        attempt,
    )


@attrs.define(eq=False)
class ReceiverStatus:
    """``state`` for ``health()`` (one of :data:`STATES`), and the count of consecutive
    failed receiving calls behind the "reachable again" line. Shared by the poller, the
    webhook server and the update handler of one adapter."""

    connection_id: str
    state: str = "idle"
    failed_calls: int = 0
    activity: Activity = attrs.field(factory=Activity)
    """When an update last reached the adapter (polled, posted or from the inbox), and the
    last failed receiving call's cause class."""

    def health_fields(self) -> Mapping[str, str]:
        return self.activity.health_fields()

    def seeing(self, admit: Callable[[_E], Awaitable[_R]]) -> Callable[[_E], Awaitable[_R]]:
        return self.activity.seeing(admit)

    def _note_error(self, cause: str) -> None:
        self.activity.note_error(cause)

    def fatal(self, error: TelegramError) -> AdapterFatalError | None:
        """The fatal error for 401/403 or an unusable credential (state ``unauthorized``),
        else ``None``."""
        if isinstance(error, TelegramCredentialError) or (
            isinstance(error, TelegramApiError) and error.status in (401, 403)
        ):
            self.state = "unauthorized"
            self._note_error("Telegram rejected the bot credentials")
            return AdapterFatalError("Telegram rejected the bot credentials")
        return None

    def log_retry(self, method: str, error: TelegramError, delay_s: float) -> None:
        """A retried receiving call (counts towards :meth:`log_reachable`)."""
        self.failed_calls += 1
        self._note_error(describe_failure(error))
        log_retry(self.connection_id, method, error, delay_s, self.failed_calls)

    def log_reachable(self) -> None:
        """After failed calls: one INFO line that the Bot API answers again (a reconnect)."""
        if self.failed_calls:
            log.info(
                "telegram %s: Bot API reachable again after %d failed call(s)",
                self.connection_id,
                self.failed_calls,
            )
            self.failed_calls = 0

    def stopped(self) -> None:
        if self.state not in FATAL_STATES:
            self.state = "stopped"
