"""``[agents.<alias>] kind = "a2a"`` options, checked by :func:`validate_a2a_options`.

* ``url`` (the card is ``<url>/.well-known/agent-card.json``, ``agent.json`` as fallback) or
  ``card_url`` (fetched as written, a query included): exactly one; ``https://``, or
  ``http://`` for a loopback host only; no fragment, and no query in ``url``;
* ``bearer_token_env`` or ``bearer_token_file`` (at most one; neither for an open agent);
* ``protocol``: ``"auto"`` (from the card, default), ``"1.0"`` or ``"0.3"``;
* ``push`` (default true): ask for push when the card allows and ``[a2a]`` is set;
* ``stream`` (default true): follow by streaming when the card allows;
* ``poll_interval_ms`` (default 2000) doubling with jitter up to ``max_poll_interval_ms``
  (default 60000); ``task_timeout_ms`` (default 3600000): a task not terminal by then is
  cancelled remotely and the user told.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from .. import AgentOptionError
from ._client import CardError, check_url

_KEYS = frozenset(
    {
        "url",
        "card_url",
        "bearer_token_env",
        "bearer_token_file",
        "protocol",
        "push",
        "stream",
        "poll_interval_ms",
        "max_poll_interval_ms",
        "task_timeout_ms",
    }
)
_ENV_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")
DAY_MS = 24 * 3600 * 1000


@attrs.frozen
class A2AOptions:
    url: str | None = None
    card_url: str | None = None
    bearer_token_env: str | None = None
    bearer_token_file: str | None = None
    protocol: Literal["auto", "1.0", "0.3"] = "auto"
    push: bool = True
    stream: bool = True
    poll_interval_ms: int = 2000
    max_poll_interval_ms: int = 60000
    task_timeout_ms: int = 3_600_000
    poll_s: float = attrs.field(
        init=False,
        eq=False,
        repr=False,
        default=attrs.Factory(lambda self: self.poll_interval_ms / 1000, takes_self=True),
    )
    """``poll_interval_ms`` in seconds, one float every followed task's delay shares."""
    max_poll_s: float = attrs.field(
        init=False,
        eq=False,
        repr=False,
        default=attrs.Factory(lambda self: self.max_poll_interval_ms / 1000, takes_self=True),
    )
    """``max_poll_interval_ms`` in seconds, shared as ``poll_s`` is."""


def _text(key: str, value: Any, limit: int = 4096) -> str:
    if not isinstance(value, str) or not value.strip():
        raise AgentOptionError(key, "must be a non-empty string")
    if len(value) > limit:
        raise AgentOptionError(key, f"must be at most {limit} characters")
    return value.strip()


def _int(key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise AgentOptionError(key, f"must be an integer from {low} to {high}")
    return value


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise AgentOptionError(key, "must be true or false")
    return value


def _url(key: str, value: Any) -> str:
    raw = _text(key, value)
    try:
        parsed = check_url(raw, key)
    except CardError as exc:
        message = str(exc).removeprefix(f"{key}: ").removeprefix(f"{key} ")
        raise AgentOptionError(key, message) from None
    if parsed.fragment or (parsed.query and key == "url"):
        # ``card_url`` may carry a query (LangGraph: ``…/agent-card.json?assistant_id=…``,
        # reference §1); ``url`` has the card's path appended to it.
        raise AgentOptionError(key, "must not carry a query or a fragment")
    return raw


def validate_a2a_options(options: Mapping[str, Any]) -> A2AOptions:
    """Parse ``a2a`` options; raises :class:`AgentOptionError` naming the bad key."""
    for key in options:
        if key not in _KEYS:
            raise AgentOptionError(key, "unknown option for agent kind 'a2a'")
    values: dict[str, Any] = {}
    if ("url" in options) == ("card_url" in options):
        raise AgentOptionError("url", "give url or card_url (exactly one) for agent kind 'a2a'")
    for key in ("url", "card_url"):
        if key in options:
            values[key] = _url(key, options[key])
    if "bearer_token_env" in options and "bearer_token_file" in options:
        raise AgentOptionError(
            "bearer_token_file", "give bearer_token_env or bearer_token_file, not both"
        )
    if "bearer_token_env" in options:
        name = _text("bearer_token_env", options["bearer_token_env"], 256)
        if not set(name) <= _ENV_CHARS or name[0].isdigit():
            raise AgentOptionError("bearer_token_env", "must name an environment variable")
        values["bearer_token_env"] = name
    if "bearer_token_file" in options:
        values["bearer_token_file"] = _text("bearer_token_file", options["bearer_token_file"])
    if "protocol" in options:
        if options["protocol"] not in ("auto", "1.0", "0.3"):
            raise AgentOptionError("protocol", 'must be "auto", "1.0" or "0.3"')
        values["protocol"] = options["protocol"]
    for key in ("push", "stream"):
        if key in options:
            values[key] = _bool(key, options[key])
    if "poll_interval_ms" in options:
        values["poll_interval_ms"] = _int(
            "poll_interval_ms", options["poll_interval_ms"], 10, DAY_MS
        )
    if "max_poll_interval_ms" in options:
        values["max_poll_interval_ms"] = _int(
            "max_poll_interval_ms", options["max_poll_interval_ms"], 10, DAY_MS
        )
    if "task_timeout_ms" in options:
        values["task_timeout_ms"] = _int(
            "task_timeout_ms", options["task_timeout_ms"], 1000, 30 * DAY_MS
        )
    result = A2AOptions(**values)
    if result.max_poll_interval_ms < result.poll_interval_ms:
        raise AgentOptionError("max_poll_interval_ms", "must be at least poll_interval_ms")
    return result
