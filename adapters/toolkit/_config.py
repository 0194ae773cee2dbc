"""The ``[[connections]]`` keys that several connection kinds read alike: a bot token
(``token_env`` or ``token_file``: :class:`TokenConnection`), the platform's ``api_origin``
and ``typing_delay_ms``."""

from __future__ import annotations

from typing import Any

import attrs

from prismd.channel import (
    DEFAULT_TYPING_DELAY_MS,
    MAX_TYPING_DELAY_MS,
    BuildContext,
    ConfigTable,
    SecretSource,
)

from ._net import origin_problem

__all__ = [
    "TokenConnection",
    "api_origin",
    "bounded_field",
    "check_connection_id",
    "token_keys",
    "typing_delay_ms",
]


@attrs.frozen
class TokenConnection:
    """A connection that signs in with a bot token: its ``id`` and exactly one of
    ``token_env`` and ``token_file`` (the kind's own keys follow)."""

    id: str
    token_env: str | None = None
    token_file: str | None = None

    @property
    def token_source(self) -> SecretSource:
        """The token's secret as ``secrets`` lists it, named by the key that was set."""
        key = "token_env" if self.token_env is not None else "token_file"
        return SecretSource(key, self.token_env, self.token_file)

    def read_token(self, context: BuildContext) -> str:
        """The token, read at build time: a missing one fails the start, not the first
        request."""
        return context.secret("token", self.token_env, self.token_file)


def token_keys(table: ConfigTable) -> tuple[str | None, str | None]:
    """``(token_env, token_file)``: exactly one of them set."""
    token_env = table.get_env_name("token_env")
    token_file = table.get_str("token_file")
    if (token_env is None) == (token_file is None):
        raise table.error("token_env", "set exactly one of token_env and token_file")
    return token_env, token_file


def api_origin(table: ConfigTable, default: str) -> str:
    """``api_origin`` (``default``, the platform's own, when absent): a bare origin
    (:func:`origin_problem`), returned without a trailing slash."""
    origin: str = table.get_str("api_origin", default)
    problem = origin_problem(origin, default)
    if problem is not None:
        raise table.error("api_origin", problem)
    return origin.rstrip("/")


def typing_delay_ms(table: ConfigTable) -> int:
    """``typing_delay_ms``: how long a turn runs before its typing indicator starts (the
    runtime's one rule; 0..60,000, default 1,000)."""
    delay: int = table.get_int(
        "typing_delay_ms", DEFAULT_TYPING_DELAY_MS, low=0, high=MAX_TYPING_DELAY_MS
    )
    return delay


# --------------------------------------------------------------------------- adapter fields


def check_connection_id(_instance: object, _attribute: attrs.Attribute[str], value: Any) -> None:
    """The validator of an adapter's ``connection_id``."""
    if not isinstance(value, str) or not value or len(value.encode()) > 256:
        raise ValueError("connection_id must be a non-empty string of at most 256 bytes")


def bounded_field(default: float, low: float, high: float, on_setattr: Any = None) -> Any:
    """A field of ``default`` that must stay in ``low..high``: a whole number when the
    default is one, else any number; the error names the field. ``on_setattr`` as
    :func:`attrs.field`'s."""
    integer = isinstance(default, int)

    def check(_instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
        what = attribute.name
        if isinstance(value, bool) or not isinstance(value, int if integer else int | float):
            raise ValueError(f"{what} must be {'an integer' if integer else 'a number'}")
        if not low <= value <= high:
            raise ValueError(f"{what} must be in {_number(low)}..{_number(high)}")

    return attrs.field(default=default, validator=check, on_setattr=on_setattr)


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:g}"
