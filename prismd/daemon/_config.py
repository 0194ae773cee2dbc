"""The daemon's configuration: a TOML file loaded into frozen attrs records.

Guarantees of :func:`load_config`:

* every key is known (unknown keys are errors at every level, including the keys of one
  connection kind used on another kind) and has the right TOML type;
* every error is a :class:`ConfigError` whose text names the file and the key, for example
  ``prismd.toml: [[connections]][1].mode: must be 'polling' or 'webhook'``. Array entries
  are numbered from 1, as a person counts the ``[[connections]]`` blocks in the file;
* secrets are never inline: tokens come from the environment (``token_env``) or a file
  (``token_file``, looked up in systemd's ``$CREDENTIALS_DIRECTORY`` first) and are read
  by :func:`read_secret` only when a connection starts. A key such as ``token = "…"`` is
  an error that says so, and no error message ever contains a value of such a key; the
  same holds for a PostgreSQL password (``[store] password_file``/``password_env``; a
  password inside ``[store] url`` is refused);
* cross references hold: connection ids are unique, grants name existing connections and
  aliases from ``[agents]``, ``default_alias`` is one of the grant's ``aliases``.

:func:`check_runnable` is the second half, shared by ``prismd check-config`` and ``prismd
run``: what a valid file still needs from this machine and this build (secrets present,
``python`` factories importable, connection kinds and store schemes built, the control
group existing), checked without opening a socket, the store or the network.
"""

from __future__ import annotations

import grp
import importlib
import os
import re
import tomllib
import types
import urllib.parse
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeAlias, TypeVar

import attrs

from adapters import kinds
from adapters.signal import ACCOUNT_RE as SIGNAL_ACCOUNT_RE
from adapters.signal import SignalConnectionConfig
from adapters.telegram import TelegramConnectionConfig
from adapters.toolkit import is_loopback_host, parse_host_port
from adapters.webchat import WebchatConnectionConfig
from stores import (
    DEFAULT_CONNECT_TIMEOUT_MS,
    DEFAULT_STATEMENT_TIMEOUT_MS,
    MAX_POOL_SIZE,
    PostgresOptions,
    is_postgres_url,
)

from ..channel import ConnectionKind, ConnectionSettings
from ..grants import GrantConfig as GrantConfig
from ..limits import LIMIT_TABLE, Limits

__all__ = [
    "A2AConfig",
    "AgentConfig",
    "Config",
    "ConfigError",
    "ConnectionConfig",
    "ControlConfig",
    "DaemonConfig",
    "GrantConfig",
    "MetricsConfig",
    "Operator",
    "SignalConnectionConfig",
    "StoreConfig",
    "TelegramConnectionConfig",
    "WebchatConnectionConfig",
    "check_runnable",
    "default_config",
    "is_loopback_host",
    "load_config",
    "parse_host_port",
    "read_secret",
]

DEFAULT_CONFIG_FILE = "prismd.toml"
AGENT_KINDS = ("a2a", "echo", "mock", "openai", "python")
# Keys that would hold a secret inline. Their values never appear in an error message.
_INLINE_SECRET_KEYS = frozenset(
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
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

# What this build can run: every store scheme the config format knows, and whether it is
# built yet. A file may name a planned one (it parses); check_runnable refuses it. Connection
# kinds are registered by their adapter packages (adapters.kinds), availability included.
STORE_SCHEMES: Mapping[str, bool] = types.MappingProxyType(
    {"memory": True, "sqlite": True, "postgresql": True, "postgres": True}
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


# --------------------------------------------------------------------------- records


@attrs.frozen
class StoreConfig:
    url: str = "sqlite:///var/journal.sqlite"
    # PostgreSQL only (refused with another URL): see stores.PostgresOptions.
    pool_size: int | None = None
    """At most this many connections (default: twice the CPU count, 2..16)."""
    password_file: str | None = None
    password_env: str | None = None
    statement_timeout_ms: int = DEFAULT_STATEMENT_TIMEOUT_MS
    connect_timeout_ms: int = DEFAULT_CONNECT_TIMEOUT_MS

    @property
    def is_postgres(self) -> bool:
        return is_postgres_url(self.url)

    def postgres_options(self, env: Mapping[str, str] = os.environ) -> PostgresOptions | None:
        """The pool settings of a ``postgresql://`` store, its password read now (from
        ``password_file``/``password_env``; never shown); ``None`` for another store.
        Raises :class:`ConfigError` when the password source is missing or empty."""
        if not self.is_postgres:
            return None
        password = None
        if self.password_env is not None or self.password_file is not None:
            key = "[store].password_env" if self.password_env else "[store].password_file"
            password = read_secret(
                env_name=self.password_env, file_name=self.password_file, env=env, key=key
            )
        return PostgresOptions(
            pool_size=self.pool_size,
            password=password,
            statement_timeout_ms=self.statement_timeout_ms,
            connect_timeout_ms=self.connect_timeout_ms,
        )


@attrs.frozen
class DaemonConfig:
    state_dir: str = "var"
    """Holds the instance id and the lock file that makes it exclusive."""


@attrs.frozen
class Operator:
    """An operator identity for one local uid, scoped to a tenant (and optionally more)."""

    uid: int
    tenant: str = "default"
    account: str | None = None
    user: str | None = None


@attrs.frozen
class ControlConfig:
    socket: str = "var/run/control.sock"
    group: str | None = None
    operators: tuple[Operator, ...] = ()
    max_request_bytes: int = 65536
    idle_timeout_ms: int = 30000

    def operator_for(self, uid: int, *, daemon_uid: int | None = None) -> Operator | None:
        """The operator for ``uid``, or ``None`` when that uid may not use the socket.

        The uid running the daemon is always an operator for tenant ``"default"`` unless
        it is listed explicitly (then its listed scope wins).
        """
        for operator in self.operators:
            if operator.uid == uid:
                return operator
        if daemon_uid is not None and uid == daemon_uid:
            return Operator(uid=uid)
        return None


ConnectionConfig: TypeAlias = ConnectionSettings
"""A parsed ``[[connections]]`` entry: each kind's own record (:mod:`adapters.kinds`)."""


@attrs.frozen
class MetricsConfig:
    """``[metrics]``: Prometheus text exposition at ``http://<listen>/metrics``."""

    listen: str = "127.0.0.1:9464"
    allow_non_loopback: bool = False
    """A non-loopback ``listen`` must be meant: the endpoint has no authentication."""


@attrs.frozen
class A2AConfig:
    """``[a2a]``: the receiver of remote A2A agents' push notifications (one for every a2a
    agent). ``push_base_url`` is what remote agents are told to POST to (behind a proxy);
    default ``http://<push_listen>``. The path is ``/a2a/push/<alias>``."""

    push_listen: str
    push_base_url: str

    def push_url(self, alias: str) -> str:
        return f"{self.push_base_url.rstrip('/')}/a2a/push/{alias}"


@attrs.frozen
class AgentConfig:
    alias: str
    kind: Literal["a2a", "echo", "mock", "openai", "python"]
    options: Mapping[str, Any] = attrs.field(factory=lambda: types.MappingProxyType({}))


@attrs.frozen
class Config:
    source: str | None
    daemon: DaemonConfig
    store: StoreConfig
    limits: Limits
    control: ControlConfig
    connections: tuple[ConnectionConfig, ...]
    grants: tuple[GrantConfig, ...]
    agents: Mapping[str, AgentConfig]
    metrics: MetricsConfig | None = None
    """``None`` when the file has no ``[metrics]`` table (no endpoint)."""
    a2a: A2AConfig | None = None
    """``None`` when the file has no ``[a2a]`` table: a2a tasks are followed without push."""

    def connection(self, connection_id: str) -> ConnectionConfig | None:
        for conn in self.connections:
            if conn.id == connection_id:
                return conn
        return None


# --------------------------------------------------------------------------- helpers


def read_secret(
    *,
    env_name: str | None,
    file_name: str | None,
    env: Mapping[str, str] = os.environ,
    key: str | None = None,
) -> str:
    """Read a secret from the environment variable ``env_name`` or the file ``file_name``.

    A relative ``file_name`` is looked up in ``$CREDENTIALS_DIRECTORY`` (systemd's
    ``LoadCredential=``) first, then relative to the working directory. Surrounding
    whitespace (a trailing newline) is stripped. The value is never logged and never part
    of an error; a missing or empty secret raises :class:`ConfigError` naming ``key``
    (for example ``[[connections]][1].token_env``) or the source.
    """
    if env_name:
        value = env.get(env_name, "").strip()
        if not value:
            raise ConfigError(
                f"environment variable {env_name} is not set or empty",
                key=key or "token_env",
            )
        return value
    if file_name:
        candidates: list[Path] = []
        path = Path(file_name)
        credentials = env.get("CREDENTIALS_DIRECTORY")
        if not path.is_absolute() and credentials:
            candidates.append(Path(credentials) / path)
        candidates.append(path)
        for candidate in candidates:
            try:
                text = candidate.read_text(encoding="utf-8")
            except FileNotFoundError:
                continue
            except (OSError, UnicodeDecodeError) as exc:
                raise ConfigError(
                    f"cannot read secret file {file_name} ({type(exc).__name__})",
                    key=key or "token_file",
                ) from None
            value = text.strip()
            if not value:
                raise ConfigError(f"secret file {file_name} is empty", key=key or "token_file")
            return value
        looked = " or ".join(str(c) for c in candidates)
        hint = ""
        if not path.is_absolute() and not credentials:
            hint = "; $CREDENTIALS_DIRECTORY is not set (systemd's LoadCredential= sets it)"
        raise ConfigError(
            f"secret file {file_name} not found (looked for {looked}){hint}",
            key=key or "token_file",
        )
    raise ConfigError("no secret source: set token_env or token_file", key=key)


# --------------------------------------------------------------------------- parsing

_T = TypeVar("_T")


def _default(cls: type, name: str) -> Any:
    return getattr(attrs.fields(cls), name).default


def _type_name(value: object) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "table"
    return type(value).__name__


@attrs.define(eq=False)
class _Table:
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
            raise self.error(name, f"must be {what}, got {_type_name(value)}")
        return value

    def get_str(self, name: str, default: Any = None, *, required: bool = False) -> Any:
        if required and name not in self.data:
            raise self.error(name, "is required")
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

    def table(self, name: str) -> _Table:
        value = self._get(name, dict, "a table", {})
        return _Table(self.file, f"[{name}]" if self.where == "" else self.key(name), value)

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
            _check_address(self, name, value)
        return value

    def get_env_name(self, name: str) -> str | None:
        value: str | None = self.get_str(name)
        _check_env_name(self, name, value)
        return value

    def reject_inline_secrets(self) -> None:
        """An inline secret is named as such (its value is never shown)."""
        for name in self.data:
            if name in _INLINE_SECRET_KEYS:
                raise self.error(
                    name,
                    "secrets are never inline in the config; use token_env or token_file "
                    "(or an *_env key naming an environment variable)",
                )

    def finish(self) -> None:
        """Reject every key that was not read (and any inline secret, value unseen)."""
        self.reject_inline_secrets()
        for name in self.data:
            if name not in self.used:
                raise self.error(name, "unknown key")


def _check_address(table: _Table, name: str, value: str) -> None:
    try:
        parse_host_port(value)
    except ValueError as exc:
        raise table.error(name, str(exc)) from None


def _check_env_name(table: _Table, name: str, value: str | None) -> None:
    if value is not None and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        raise table.error(name, "must be an environment variable name")


def _parse_daemon(root: _Table) -> DaemonConfig:
    table = root.table("daemon")
    result = DaemonConfig(state_dir=table.get_str("state_dir", _default(DaemonConfig, "state_dir")))
    table.finish()
    return result


_POSTGRES_STORE_KEYS = (
    "pool_size",
    "password_file",
    "password_env",
    "statement_timeout_ms",
    "connect_timeout_ms",
)


def _parse_store(root: _Table) -> StoreConfig:
    table = root.table("store")
    url: str = table.get_str("url", _default(StoreConfig, "url"))
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in STORE_SCHEMES:
        raise table.error("url", "must be sqlite:///PATH, postgresql://… or memory://")
    if scheme == "sqlite" and not rest.lstrip("/"):
        raise table.error("url", "sqlite:/// needs a file path")
    if not is_postgres_url(url):
        for name in _POSTGRES_STORE_KEYS:
            if name in table.data:
                raise table.error(name, "is only for a postgresql:// store")
        table.finish()
        return StoreConfig(url=url)
    if _url_has_password(url):
        raise table.error(
            "url",
            "a password in the URL is a secret inline in the config;"
            " use password_file or password_env",
        )
    password_file = table.get_str("password_file")
    password_env = table.get_str("password_env")
    if password_file is not None and password_env is not None:
        raise table.error("password_env", "give password_file or password_env, not both")
    result = StoreConfig(
        url=url,
        pool_size=table.get_int("pool_size", None, low=2, high=MAX_POOL_SIZE),
        password_file=password_file,
        password_env=password_env,
        statement_timeout_ms=table.get_int(
            "statement_timeout_ms", DEFAULT_STATEMENT_TIMEOUT_MS, low=1, high=3_600_000
        ),
        connect_timeout_ms=table.get_int(
            "connect_timeout_ms", DEFAULT_CONNECT_TIMEOUT_MS, low=1, high=600_000
        ),
    )
    table.finish()
    return result


def _url_has_password(url: str) -> bool:
    netloc = url.partition("://")[2].partition("/")[0].partition("?")[0]
    userinfo, at, _host = netloc.rpartition("@")
    return bool(at) and ":" in userinfo


def _parse_limits(root: _Table) -> Limits:
    table = root.table("limits")
    values: dict[str, int] = {}
    for name in table.data:
        if name not in LIMIT_TABLE:
            continue
        table.used.add(name)
        value = table.data[name]
        try:
            Limits(**{name: value})
        except (TypeError, ValueError) as exc:
            raise table.error(name, str(exc).removeprefix(f"limit {name} ")) from None
        values[name] = value
    table.finish()
    return Limits(**values)


_MAX_UNIX_SOCKET_PATH = 107
"""``sun_path`` holds 108 bytes including the terminating NUL on Linux."""


def _parse_control(root: _Table) -> ControlConfig:
    table = root.table("control")
    socket: str = table.get_str("socket", _default(ControlConfig, "socket"))
    if len(os.fsencode(socket)) > _MAX_UNIX_SOCKET_PATH:
        # bind() refuses it ("AF_UNIX path too long"): say so here, not at start-up.
        raise table.error("socket", f"must be at most {_MAX_UNIX_SOCKET_PATH} bytes long")
    group = table.get_str("group")
    max_request_bytes = table.get_int(
        "max_request_bytes",
        _default(ControlConfig, "max_request_bytes"),
        low=1024,
        high=16 * 1024 * 1024,
    )
    idle_timeout_ms = table.get_int(
        "idle_timeout_ms",
        _default(ControlConfig, "idle_timeout_ms"),
        low=100,
        high=24 * 3600 * 1000,
    )
    raw_operators = table._get("operators", list, "an array of tables", [])
    operators: list[Operator] = []
    seen: set[int] = set()
    for index, raw in enumerate(raw_operators, start=1):
        where = f"{table.where}.operators[{index}]"
        if not isinstance(raw, dict):
            raise ConfigError(f"must be a table, got {_type_name(raw)}", file=root.file, key=where)
        op = _Table(root.file, where, raw)
        if "uid" not in raw:
            raise op.error("uid", "is required")
        uid: int = op.get_int("uid", low=0, high=2**32 - 1)
        if uid in seen:
            raise op.error("uid", f"uid {uid} is listed twice")
        seen.add(uid)
        operators.append(
            Operator(
                uid=uid,
                tenant=op.get_str("tenant", "default"),
                account=op.get_str("account"),
                user=op.get_str("user"),
            )
        )
        op.finish()
    table.finish()
    return ControlConfig(
        socket=socket,
        group=group,
        operators=tuple(operators),
        max_request_bytes=max_request_bytes,
        idle_timeout_ms=idle_timeout_ms,
    )


def _parse_metrics(root: _Table) -> MetricsConfig | None:
    present = "metrics" in root.data
    table = root.table("metrics")
    if not present:
        return None
    listen: str = table.get_str("listen", _default(MetricsConfig, "listen"))
    _check_address(table, "listen", listen)
    allow_non_loopback = table.get_bool("allow_non_loopback")
    host, _port = parse_host_port(listen)
    if not is_loopback_host(host) and not allow_non_loopback:
        # Like the web chat off loopback, exposure must be deliberate: the counters and
        # connection states are readable by anyone who reaches the port.
        raise table.error(
            "listen",
            "a non-loopback address serves metrics to anyone who reaches it; "
            "set allow_non_loopback = true to mean it",
        )
    table.finish()
    return MetricsConfig(listen=listen, allow_non_loopback=allow_non_loopback)


def _parse_a2a(root: _Table) -> A2AConfig | None:
    present = "a2a" in root.data
    table = root.table("a2a")
    if not present:
        return None
    listen: str = table.get_str("push_listen", required=True)
    _check_address(table, "push_listen", listen)
    host, _port = parse_host_port(listen)
    base: str | None = table.get_str("push_base_url")
    if base is None:
        if host.strip("[]") in ("0.0.0.0", "::", ""):
            raise table.error(
                "push_listen",
                "a wildcard address needs push_base_url (what remote agents POST to)",
            )
        base = f"http://{listen}"
    else:
        try:
            url = urllib.parse.urlsplit(base)
            url_host = url.hostname
        except ValueError:
            raise table.error("push_base_url", "is not a URL") from None
        if url.scheme not in ("http", "https") or not url_host:
            raise table.error("push_base_url", "must be an http(s) URL")
        if url.scheme == "http" and not is_loopback_host(url_host):
            raise table.error("push_base_url", "http:// is accepted only for loopback hosts")
        if "@" in url.netloc or url.query or url.fragment:
            raise table.error("push_base_url", "must not carry credentials, a query or a fragment")
    table.finish()
    return A2AConfig(push_listen=listen, push_base_url=base.rstrip("/"))


def _array_of_tables(root: _Table, name: str) -> list[_Table]:
    raw = root._get(name, list, "an array of tables ([[" + name + "]])", [])
    tables = []
    for index, item in enumerate(raw, start=1):
        where = f"[[{name}]][{index}]"
        if not isinstance(item, dict):
            raise ConfigError(f"must be a table, got {_type_name(item)}", file=root.file, key=where)
        tables.append(_Table(root.file, where, item))
    return tables


def _parse_connections(root: _Table) -> tuple[ConnectionConfig, ...]:
    result: list[ConnectionConfig] = []
    seen: set[str] = set()
    for table in _array_of_tables(root, "connections"):
        table.reject_inline_secrets()
        conn_id: str = table.get_str("id", required=True)
        if not _ID_RE.match(conn_id):
            raise table.error("id", "must be 1-64 letters, digits, '_', '.' or '-'")
        if conn_id in seen:
            raise table.error("id", f"duplicate connection id {conn_id!r}")
        seen.add(conn_id)
        name = table.choice("kind", tuple(kinds.CONNECTION_KINDS), None)
        kind = kinds.connection_kind(name)
        assert kind is not None
        result.append(kind.parse(table, conn_id))
        table.finish()
    return tuple(result)


def _parse_agents(root: _Table) -> dict[str, AgentConfig]:
    table = root.table("agents")
    agents: dict[str, AgentConfig] = {}
    for alias, raw in table.data.items():
        table.used.add(alias)
        where = f"[agents.{alias}]"
        if not _ID_RE.match(alias):
            raise ConfigError(
                "an agent alias must be 1-64 letters, digits, '_', '.' or '-'",
                file=root.file,
                key=where,
            )
        if not isinstance(raw, dict):
            raise ConfigError(f"must be a table, got {_type_name(raw)}", file=root.file, key=where)
        agent = _Table(root.file, where, raw)
        kind = agent.choice("kind", AGENT_KINDS, None)
        options = {k: v for k, v in raw.items() if k != "kind"}
        for name in options:
            if name in _INLINE_SECRET_KEYS:
                raise agent.error(
                    name, "secrets are never inline in the config; name an environment variable"
                )
        checked = _validate_agent_options(agent, kind, options)
        agents[alias] = AgentConfig(
            alias=alias, kind=kind, options=types.MappingProxyType(dict(checked))
        )
    table.finish()
    return agents


def _validate_agent_options(agent: _Table, kind: str, options: dict[str, Any]) -> Mapping[str, Any]:
    """Options are the agent registry's to judge; its error becomes a ConfigError here."""
    validator = _registry_validator()
    if validator is None:
        _fallback_agent_options(agent, kind, options)
        return options
    try:
        checked = validator(kind, options)
    except (ValueError, TypeError, KeyError) as exc:
        name = getattr(exc, "key", None)
        message = str(exc.args[0]) if exc.args else type(exc).__name__
        if name is None:
            match = re.match(r"^'?([A-Za-z_][A-Za-z0-9_]*)'?(?::| )", message)
            if match and match.group(1) in options:
                name = match.group(1)
        if isinstance(name, str) and message.startswith(f"{name}: "):
            message = message[len(name) + 2 :]
        raise agent.error(name if isinstance(name, str) else None, message) from None
    return checked if isinstance(checked, Mapping) else options


def _registry_validator() -> Callable[[str, Mapping[str, Any]], Any] | None:
    try:
        registry = importlib.import_module("prismd.agents.registry")
    except ModuleNotFoundError as exc:
        if exc.name not in ("prismd.agents.registry", "prismd.agents"):
            raise
        return None
    validator = getattr(registry, "validate_agent_options", None)
    return validator if callable(validator) else None


def _fallback_agent_options(agent: _Table, kind: str, options: Mapping[str, Any]) -> None:
    # Used only until prismd.agents.registry exists: the kinds pinned in SPEC.
    agent.used.update(options)
    if kind == "echo":
        for name in options:
            raise agent.error(name, "unknown key")
    elif kind == "mock":
        for name, value in options.items():
            if name == "delay_ms":
                agent.get_int("delay_ms", low=0, high=24 * 3600 * 1000)
            elif name == "fail":
                agent.get_bool("fail")
            elif name == "suspend_for_tool":
                agent.get_str("suspend_for_tool")
            else:
                raise agent.error(name, "unknown key")
            del value
    elif kind == "python":
        factory = agent.get_str("factory", required=True)
        if not re.fullmatch(r"[\w.]+:[\w.]+", factory):
            raise agent.error("factory", "must be 'module:callable'")


def _parse_grants(
    root: _Table,
    connections: tuple[ConnectionConfig, ...],
    agents: Mapping[str, AgentConfig],
) -> tuple[GrantConfig, ...]:
    conn_ids = {c.id for c in connections}
    grants: list[GrantConfig] = []
    for table in _array_of_tables(root, "grants"):
        connection: str = table.get_str("connection", required=True)
        if connection not in conn_ids:
            raise table.error("connection", f"no [[connections]] entry has id {connection!r}")
        actors = table.str_list("actors") or ()
        if "*" in actors and actors != ("*",):
            raise table.error("actors", "'*' must be the only entry when it is used")
        pairing = table.get_bool("pairing")
        if not actors and not pairing:
            raise table.error("actors", 'list actor ids, ["*"], or set pairing = true')
        aliases = table.str_list("aliases")
        if not aliases:
            raise table.error("aliases", "must list at least one agent alias from [agents]")
        for alias in aliases:
            if alias not in agents:
                raise table.error("aliases", f"{alias!r} is not an agent in [agents]")
        default_alias = table.get_str("default_alias")
        if default_alias is not None and default_alias not in aliases:
            raise table.error("default_alias", f"{default_alias!r} is not one of aliases")
        grants.append(
            GrantConfig(
                connection=connection,
                actors=actors,
                pairing=pairing,
                tenant=table.get_str("tenant", "default"),
                account=table.get_str("account"),
                user=table.get_str("user"),
                aliases=aliases,
                default_alias=default_alias,
                notifications=table.get_bool("notifications"),
            )
        )
        table.finish()
    return tuple(grants)


def _check_connection_grants(
    file: str | None,
    connections: tuple[ConnectionConfig, ...],
    grants: tuple[GrantConfig, ...],
) -> None:
    """Each kind's own rule for the grants of its connections (the web chat off loopback)."""
    for index, conn in enumerate(connections, start=1):
        kind = _kind_of(conn)
        problem = kind.check_grants(conn, [g for g in grants if g.connection == conn.id])
        if problem is not None:
            key, message = problem
            raise ConfigError(message, file=file, key=f"[[connections]][{index}].{key}")


def _kind_of(conn: ConnectionConfig) -> ConnectionKind:
    kind = kinds.connection_kind(conn.kind)
    if kind is None:
        raise ConfigError(f"unknown connection kind {conn.kind!r}")
    return kind


def parse_config(data: Mapping[str, Any], *, source: str | None = None) -> Config:
    """Validate an already-decoded TOML document; errors name ``source`` and the key."""
    root = _Table(source, "", data)
    daemon = _parse_daemon(root)
    store = _parse_store(root)
    limits = _parse_limits(root)
    control = _parse_control(root)
    connections = _parse_connections(root)
    agents = _parse_agents(root)
    grants = _parse_grants(root, connections, agents)
    metrics = _parse_metrics(root)
    a2a = _parse_a2a(root)
    for name in data:
        if name not in root.used:
            if name in _INLINE_SECRET_KEYS:
                raise ConfigError(
                    "secrets are never inline in the config; use token_env or token_file",
                    file=source,
                    key=name,
                )
            raise ConfigError("unknown key", file=source, key=name)
    _check_connection_grants(source, connections, grants)
    return Config(
        source=source,
        daemon=daemon,
        store=store,
        limits=limits,
        control=control,
        connections=connections,
        grants=grants,
        agents=types.MappingProxyType(agents),
        metrics=metrics,
        a2a=a2a,
    )


def load_config(
    path: str | os.PathLike[str] | None, *, env: Mapping[str, str] = os.environ
) -> Config:
    """Load and validate ``path``; ``None`` means ``./prismd.toml`` if present, else defaults.

    Raises :class:`ConfigError` (naming the file and key) for anything invalid, including
    a missing or unreadable file and TOML syntax errors.
    """
    if path is None:
        if not Path(DEFAULT_CONFIG_FILE).is_file():
            return default_config(env)
        path = DEFAULT_CONFIG_FILE
    source = os.fspath(path)
    try:
        raw = Path(source).read_bytes()
    except FileNotFoundError:
        raise ConfigError("file not found", file=source) from None
    except OSError as exc:
        raise ConfigError(f"cannot read file ({type(exc).__name__})", file=source) from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError("not UTF-8 text", file=source) from None
    except tomllib.TOMLDecodeError as exc:
        # The decoder's message carries line and column, never a value.
        raise ConfigError(f"invalid TOML: {exc}", file=source) from None
    return parse_config(data, source=source)


def default_config(env: Mapping[str, str] = os.environ) -> Config:
    """The ``make run`` defaults: SQLite under ``./var``, the echo agent, loopback web chat.

    Telegram (connection ``telegram``, pairing grant) is added when
    ``TELEGRAM_BOT_TOKEN`` is set in ``env``; the token itself is read only at start-up.
    Signal (connection ``signal``, pairing grant) is added when ``SIGNAL_CLI_SOCKET`` names
    the socket of a ``signal-cli -a ACCOUNT daemon --receive-mode=manual``; ``SIGNAL_ACCOUNT``
    must then name that account (:class:`ConfigError` otherwise).
    """
    connections: list[ConnectionConfig] = [WebchatConnectionConfig(id="web")]
    grants = [GrantConfig(connection="web", actors=("*",), aliases=("echo",))]
    if env.get("TELEGRAM_BOT_TOKEN", "").strip():
        connections.append(TelegramConnectionConfig(id="telegram", token_env="TELEGRAM_BOT_TOKEN"))
        grants.append(GrantConfig(connection="telegram", pairing=True, aliases=("echo",)))
    signal_socket = env.get("SIGNAL_CLI_SOCKET", "").strip()
    if signal_socket:
        account = env.get("SIGNAL_ACCOUNT", "").strip()
        if not SIGNAL_ACCOUNT_RE.fullmatch(account):
            raise ConfigError(
                "SIGNAL_CLI_SOCKET is set: SIGNAL_ACCOUNT must be the phone number signal-cli "
                "runs with, in international format (+…)",
                key="SIGNAL_ACCOUNT",
            )
        connections.append(
            SignalConnectionConfig(id="signal", account=account, socket=signal_socket)
        )
        grants.append(GrantConfig(connection="signal", pairing=True, aliases=("echo",)))
    return Config(
        source=None,
        daemon=DaemonConfig(),
        store=StoreConfig(),
        limits=Limits(),
        control=ControlConfig(),
        connections=tuple(connections),
        grants=tuple(grants),
        agents=types.MappingProxyType({"echo": AgentConfig(alias="echo", kind="echo")}),
    )


# --------------------------------------------------------------------------- runnable


def check_runnable(config: Config, env: Mapping[str, str] = os.environ) -> None:
    """Raise :class:`ConfigError` (file and key named) for what ``config`` cannot run with here.

    The checks ``prismd run`` needs before it opens anything, and all ``prismd check-config``
    adds to :func:`load_config`, so the two cannot disagree: the store scheme and every
    connection kind are built (:data:`STORE_SCHEMES`, :data:`adapters.kinds.CONNECTION_KINDS`),
    a SQLite or PostgreSQL URL is one the store accepts (its shape only: no server is
    contacted), every secret a connection or the store reads at start is present (values
    read and dropped, never shown), every ``python`` agent's factory module imports and has
    the attribute (it is not called), every ``openai`` agent's API key is present and its
    ``tools`` factory imports, every ``a2a`` agent's bearer token is present, and
    ``[control].group`` exists. Nothing is opened,
    bound or contacted.
    """
    source = config.source

    def error(key: str, message: str) -> ConfigError:
        return ConfigError(message, file=source, key=key)

    _check_store_runnable(config.store, env, error)
    for index, conn in enumerate(config.connections, start=1):
        where = f"[[connections]][{index}]"
        kind = kinds.connection_kind(conn.kind)
        if kind is None or not kind.available:
            raise error(
                f"{where}.kind",
                f"connection kind {conn.kind!r} is not available in this build yet",
            )
        for source_ in kind.secrets(conn):
            name = source_.key
            try:
                read_secret(
                    env_name=source_.env_name,
                    file_name=source_.file_name,
                    env=env,
                    key=f"{where}.{name}",
                )
            except ConfigError as exc:
                raise error(exc.key or f"{where}.{name}", exc.message) from None
    for alias, agent in config.agents.items():
        where = f"[agents.{alias}]"
        if agent.kind == "python":
            _check_factory(str(agent.options.get("factory", "")), where, error)
        elif agent.kind == "openai":
            _check_openai_runnable(agent.options, where, env, error)
        elif agent.kind == "a2a":
            _check_secret_keys(
                agent.options, ("bearer_token_env", "bearer_token_file"), where, env, error
            )
    group = config.control.group
    if group is not None:
        try:
            grp.getgrnam(group)
        except KeyError:
            raise error("[control].group", f"no such group {group!r}") from None


def _check_store_runnable(
    store: StoreConfig, env: Mapping[str, str], error: Callable[[str, str], ConfigError]
) -> None:
    url = store.url
    scheme = url.partition("://")[0]
    if not STORE_SCHEMES.get(scheme, False):
        raise error("[store].url", f"the {scheme}:// store is not available in this build yet")
    if store.is_postgres:
        # The URL's shape and the password's presence; nothing is contacted.
        from stores import InvalidStoreURLError, parse_postgres_url

        try:
            parse_postgres_url(url)
        except InvalidStoreURLError as exc:
            raise error("[store].url", str(exc)) from None
        try:
            store.postgres_options(env)
        except ConfigError as exc:
            raise error(exc.key or "[store].password_file", exc.message) from None
    if scheme == "sqlite":
        # The store's own URL rules (relative vs absolute, a file name), without opening it.
        from stores import InvalidStoreURLError
        from stores.sqlite import sqlite_path_from_url

        try:
            sqlite_path_from_url(url)
        except InvalidStoreURLError as exc:
            raise error("[store].url", str(exc)) from None


def _check_openai_runnable(
    options: Mapping[str, Any],
    where: str,
    env: Mapping[str, str],
    error: Callable[[str, str], ConfigError],
) -> None:
    """The API key is present (read and dropped) and the ``tools`` module imports."""
    for key in ("api_key_env", "api_key_file"):
        if key in options:
            try:
                read_secret(
                    env_name=options[key] if key == "api_key_env" else None,
                    file_name=options[key] if key == "api_key_file" else None,
                    env=env,
                    key=f"{where}.{key}",
                )
            except ConfigError as exc:
                raise error(exc.key or f"{where}.{key}", exc.message) from None
    if "tools" in options:
        _check_factory(str(options["tools"]), where, error, key="tools")


def _check_secret_keys(
    options: Mapping[str, Any],
    keys: tuple[str, str],
    where: str,
    env: Mapping[str, str],
    error: Callable[[str, str], ConfigError],
) -> None:
    """The secret ``keys`` (``*_env``, ``*_file``) name is present (read and dropped)."""
    env_key, file_key = keys
    for key in keys:
        if key in options:
            try:
                read_secret(
                    env_name=options[key] if key == env_key else None,
                    file_name=options[key] if key == file_key else None,
                    env=env,
                    key=f"{where}.{key}",
                )
            except ConfigError as exc:
                raise error(exc.key or f"{where}.{key}", exc.message) from None


def _check_factory(
    spec: str, where: str, error: Callable[[str, str], ConfigError], *, key: str = "factory"
) -> None:
    # The agent kind's own resolution (import + attribute), the step before the call.
    from ..agents import AgentOptionError, resolve_factory

    try:
        resolve_factory(spec, key)
    except AgentOptionError as exc:
        message = str(exc)
        named = exc.key or key
        raise error(f"{where}.{named}", message.removeprefix(f"{named}: ")) from None
