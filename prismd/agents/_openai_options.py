"""The ``openai`` agent's options (see :mod:`prismd.agents.openai` for each key): their
record, their checks (:func:`validate_openai_options`, every error naming the key) and the
``tools`` factory's loading."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs
import httpx

from adapters.toolkit import is_loopback_host

from ._base import AgentContext
from ._session import AgentOptionError
from .python import FACTORY_RE, resolve_factory
from .tools import Tool, check_tools

__all__ = ["OpenAIOptions", "load_tools", "validate_openai_options"]

DEFAULT_TIMEOUT_MS = 60_000
MIN_TIMEOUT_MS = 1_000
MAX_TIMEOUT_MS = 600_000
DEFAULT_MAX_HISTORY = 40
MAX_HISTORY = 200
MAX_OUTPUT_TOKENS = 1_000_000
MAX_PROMPT_CHARS = 64 * 1024
_KEYS = frozenset(
    {
        "base_url",
        "model",
        "api_key_env",
        "api_key_file",
        "system_prompt",
        "timeout_ms",
        "max_history_messages",
        "max_output_tokens",
        "temperature",
        "tools",
    }
)
_INT_RANGES = {
    "timeout_ms": (MIN_TIMEOUT_MS, MAX_TIMEOUT_MS),
    "max_history_messages": (0, MAX_HISTORY),
    "max_output_tokens": (1, MAX_OUTPUT_TOKENS),
}
"""The integer options and their bounds (inclusive)."""
_ENV_NAME_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")


@attrs.frozen
class OpenAIOptions:
    base_url: str
    model: str
    api_key_env: str | None = None
    api_key_file: str | None = None
    system_prompt: str | None = None
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    max_history_messages: int = DEFAULT_MAX_HISTORY
    max_output_tokens: int | None = None
    temperature: float | None = None
    tools: str | None = None


def _int(key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise AgentOptionError(key, "must be an integer")
    if not low <= value <= high:
        raise AgentOptionError(key, f"must be between {low} and {high}")
    return value


def _text(key: str, value: Any, *, limit: int = 1024) -> str:
    if not isinstance(value, str) or not value.strip():
        raise AgentOptionError(key, "must be a non-empty string")
    if len(value) > limit:
        raise AgentOptionError(key, f"must be at most {limit} characters")
    return value


def check_base_url(value: Any) -> str:
    """``value`` without a trailing slash, or ``AgentOptionError("base_url", …)``."""
    raw = _text("base_url", value)
    try:
        url = httpx.URL(raw)
    except Exception:
        raise AgentOptionError("base_url", "is not a URL") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise AgentOptionError("base_url", "must be an http(s) URL like https://api.openai.com/v1")
    if url.userinfo or url.query or url.fragment or "#" in raw:
        raise AgentOptionError(
            "base_url", "must not carry credentials, a query or a fragment (use api_key_env)"
        )
    if url.scheme == "http" and not is_loopback_host(url.host):
        raise AgentOptionError(
            "base_url", "http:// is accepted only for loopback hosts; use https://"
        )
    return raw.rstrip("/")


def validate_openai_options(options: Mapping[str, Any]) -> OpenAIOptions:
    """Parse ``openai`` options; raises :class:`AgentOptionError` naming the bad key."""
    for key in options:
        if key not in _KEYS:
            raise AgentOptionError(key, "unknown option for agent kind 'openai'")
    values: dict[str, Any] = {}
    if "base_url" not in options:
        raise AgentOptionError("base_url", "is required for agent kind 'openai'")
    values["base_url"] = check_base_url(options["base_url"])
    if "model" not in options:
        raise AgentOptionError("model", "is required for agent kind 'openai'")
    values["model"] = _text("model", options["model"], limit=256)
    if "api_key_env" in options and "api_key_file" in options:
        raise AgentOptionError("api_key_file", "give api_key_env or api_key_file, not both")
    if "api_key_env" in options:
        name = _text("api_key_env", options["api_key_env"], limit=256)
        if not set(name) <= _ENV_NAME_CHARS or name[0].isdigit():
            raise AgentOptionError("api_key_env", "must name an environment variable")
        values["api_key_env"] = name
    if "api_key_file" in options:
        values["api_key_file"] = _text("api_key_file", options["api_key_file"], limit=4096)
    if "system_prompt" in options:
        prompt = options["system_prompt"]
        if not isinstance(prompt, str):
            raise AgentOptionError("system_prompt", "must be a string")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise AgentOptionError(
                "system_prompt", f"must be at most {MAX_PROMPT_CHARS} characters"
            )
        values["system_prompt"] = prompt or None
    for key, (low, high) in _INT_RANGES.items():
        if key in options:
            values[key] = _int(key, options[key], low, high)
    if "temperature" in options:
        temperature = options["temperature"]
        if isinstance(temperature, bool) or not isinstance(temperature, int | float):
            raise AgentOptionError("temperature", "must be a number")
        if not math.isfinite(temperature) or not 0 <= temperature <= 2:
            raise AgentOptionError("temperature", "must be between 0 and 2")
        values["temperature"] = float(temperature)
    if "tools" in options:
        spec = options["tools"]
        if not isinstance(spec, str) or not FACTORY_RE.match(spec):
            raise AgentOptionError("tools", "must be 'module:callable'")
        values["tools"] = spec
    return OpenAIOptions(**values)


def load_tools(spec: str, ctx: AgentContext) -> dict[str, Tool]:
    """Import and call the ``tools`` factory; errors name the key, never the factory's text."""
    factory = resolve_factory(spec, "tools")
    try:
        produced = factory(ctx)
    except Exception as exc:
        raise AgentOptionError(
            "tools", f"the tools factory {spec!r} failed ({type(exc).__name__})"
        ) from None
    return check_tools(produced, f"the tools factory {spec!r}")
