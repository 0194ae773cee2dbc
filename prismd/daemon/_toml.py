"""Reading the config's TOML: one table at a time, every key used or refused, every error a
:class:`ConfigError` naming the file and the key (``prismd.toml: [[connections]][1].mode:
…``), and no value of a key that would hold a secret inline ever in a message.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Collection, Mapping
from typing import Any, TypeVar

import attrs

from adapters.toolkit import parse_host_port

__all__ = [
    "INLINE_SECRET_KEYS",
    "ConfigError",
    "Table",
    "array_of_tables",
    "check_address",
    "check_env_name",
    "default_of",
    "type_name",
    "unknown_key",
]

# Keys that would hold a secret inline. Their values never appear in an error message.
INLINE_SECRET_KEYS = frozenset(
    {
        "token",
        "bot_token",
        "access_token",
        "webhook_secret",
        "secret",
        "password",
        "api_key",
    }
)


class ConfigError(Exception):
    """A configuration problem; ``str(e)`` is ``"<file>: <key>: <message>"``.

    ``file`` is the path as given (``None`` for the built-in defaults or secrets read at
    start-up), ``key`` the TOML location such as ``[[connections]][2].kind`` or
    ``[limits].max_routes`` (``None`` when the whole file is at fault).
    """

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None):
        self.file = file
        self.key = key
        self.message = message
        super().__init__(": ".join(part for part in (file, key, message) if part))


_T = TypeVar("_T")


def default_of(cls: type, name: str) -> Any:
    return getattr(attrs.fields(cls), name).default


_TOML_TYPES: tuple[tuple[type, str], ...] = (
    (bool, "boolean"),  # before int: a bool is an int
    (int, "integer"),
    (float, "float"),
    (str, "string"),
    (list, "array"),
    (dict, "table"),
)


def type_name(value: object) -> str:
    """The TOML name of ``value``'s type (a Python name for anything else)."""
    return next((name for t, name in _TOML_TYPES if isinstance(value, t)), type(value).__name__)


@attrs.define(eq=False)
class Table:
    """One TOML table being read: remembers which keys were used, names its location."""

    file: str | None
    where: str
    """``[control]``, ``[[connections]][2]`` …"""
    data: Mapping[str, Any]
    used: set[str] = attrs.field(factory=set)

    def key(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def error(self, name: str | None, message: str) -> ConfigError:
        return ConfigError(message, file=self.file, key=self.key(name) if name else self.where)

    def _get(self, name: str, kind: type[_T], what: str, default: Any) -> Any:
        self.used.add(name)
        if name not in self.data:
            return default
        value = self.data[name]
        if isinstance(value, bool) and kind is not bool:
            raise self.error(name, f"must be {what}, got boolean")
        if not isinstance(value, kind):
            raise self.error(name, f"must be {what}, got {type_name(value)}")
        return value

    def get_str(self, name: str, default: Any = None, *, required: bool = False) -> Any:
        if required and name not in self.data:
            unread = [key for key in self.data if key not in self.used and key != name]
            typo = difflib.get_close_matches(name, unread, n=1, cutoff=0.75)
            hint = f" (this table has {typo[0]!r}: a typo of it?)" if typo else ""
            raise self.error(name, f"is required{hint}")
        value = self._get(name, str, "a string", default)
        if isinstance(value, str) and not value:
            raise self.error(name, "must not be empty")
        return value

    def get_int(self, name: str, default: Any = None, *, low: int = 0, high: int = 2**53) -> Any:
        value = self._get(name, int, "an integer", default)
        if isinstance(value, int) and not low <= value <= high:
            raise self.error(name, f"must be between {low} and {high}, got {value}")
        return value

    def get_bool(self, name: str, default: bool = False) -> bool:
        value: bool = self._get(name, bool, "true or false", default)
        return value

    def str_list(self, name: str) -> tuple[str, ...] | None:
        value = self._get(name, list, "an array of strings", None)
        if value is None:
            return None
        for item in value:
            if not isinstance(item, str) or not item:
                raise self.error(name, "must be an array of non-empty strings")
        return tuple(value)

    def table(self, name: str) -> Table:
        value = self._get(name, dict, "a table", {})
        return Table(self.file, f"[{name}]" if self.where == "" else self.key(name), value)

    def choice(self, name: str, choices: tuple[str, ...], default: str | None) -> Any:
        value = self.get_str(name, default, required=default is None)
        if value not in choices:
            allowed = " or ".join(repr(c) for c in choices)
            if len(choices) > 2:
                allowed = ", ".join(repr(c) for c in choices[:-1]) + f" or {choices[-1]!r}"
            raise self.error(name, f"must be {allowed}")
        return value

    def get_address(self, name: str, default: str | None = None) -> Any:
        value = self.get_str(name, default)
        if value is not None:
            check_address(self, name, value)
        return value

    def get_env_name(self, name: str) -> str | None:
        value: str | None = self.get_str(name)
        check_env_name(self, name, value)
        return value

    def reject_inline_secrets(self) -> None:
        """An inline secret is named as such (its value is never shown)."""
        for name in self.data:
            if name in INLINE_SECRET_KEYS:
                raise self.error(
                    name,
                    "secrets are never inline in the config; use token_env or token_file "
                    "(or an *_env key naming an environment variable)",
                )

    def finish(self) -> None:
        """Reject every key that was not read (and any inline secret, value unseen); the
        error suggests the closest key this table knows (:func:`unknown_key`)."""
        self.reject_inline_secrets()
        for name in self.data:
            if name not in self.used:
                raise self.error(name, unknown_key(name, self.used))


def unknown_key(name: str, known: Collection[str]) -> str:
    """``"unknown key"``, with ``"; did you mean 'x'?"`` when one of ``known`` is close."""
    close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f"unknown key; did you mean {close[0]!r}?" if close else "unknown key"


def check_address(table: Table, name: str, value: str) -> None:
    try:
        parse_host_port(value)
    except ValueError as exc:
        raise table.error(name, str(exc)) from None


def check_env_name(table: Table, name: str, value: str | None) -> None:
    if value is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        raise table.error(name, "must be an environment variable name")


def array_of_tables(root: Table, name: str) -> list[Table]:
    raw = root._get(name, list, "an array of tables ([[" + name + "]])", [])
    tables = []
    for index, item in enumerate(raw, start=1):
        where = f"[[{name}]][{index}]"
        if not isinstance(item, dict):
            raise ConfigError(f"must be a table, got {type_name(item)}", file=root.file, key=where)
        tables.append(Table(root.file, where, item))
    return tables
