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

The TOML is read by :mod:`._toml`; :mod:`._runnable` (``check_runnable``) is the second
half, shared by ``prismd check-config`` and ``prismd run``.
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import tomllib
import types
import urllib.parse
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeAlias

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

from ..agents.registry import validate_agent_options
from ..channel import ConnectionKind, ConnectionSettings
from ..control import ControlConfig, Operator
from ..grants import GrantConfig as GrantConfig
from ..limits import LIMIT_TABLE, Limits
from ._toml import (
    INLINE_SECRET_KEYS,
    ConfigError,
    Table,
    array_of_tables,
    check_address,
    default_of,
    type_name,
    unknown_key,
)

__all__ = [
    "A2AConfig",
    "AgentConfig",
    "Config",
    "ConfigError",
    "ConnectionConfig",
    "DaemonConfig",
    "GrantConfig",
    "MetricsConfig",
    "SignalConnectionConfig",
    "StoreConfig",
    "TelegramConnectionConfig",
    "WebchatConnectionConfig",
    "default_config",
    "is_loopback_host",
    "load_config",
    "parse_host_port",
    "read_secret",
]

DEFAULT_CONFIG_FILE = "prismd.toml"
AGENT_KINDS = ("a2a", "echo", "mock", "openai", "python")
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

# What this build can run: every store scheme the config format knows, and whether it is
# built yet. A file may name a planned one (it parses); check_runnable refuses it. Connection
# kinds are registered by their adapter packages (adapters.kinds), availability included.
STORE_SCHEMES: Mapping[str, bool] = types.MappingProxyType(
    {"memory": True, "sqlite": True, "postgresql": True, "postgres": True}
)


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
def _parse_daemon(root: Table) -> DaemonConfig:
    table = root.table("daemon")
    result = DaemonConfig(
        state_dir=table.get_str("state_dir", default_of(DaemonConfig, "state_dir"))
    )
    table.finish()
    return result


_POSTGRES_STORE_KEYS = (
    "pool_size",
    "password_file",
    "password_env",
    "statement_timeout_ms",
    "connect_timeout_ms",
)


def _parse_store(root: Table) -> StoreConfig:
    table = root.table("store")
    url: str = table.get_str("url", default_of(StoreConfig, "url"))
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


def _parse_limits(root: Table) -> Limits:
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
    table.used.update(LIMIT_TABLE)  # every limit is a known key ("did you mean")
    table.finish()
    return Limits(**values)


_MAX_UNIX_SOCKET_PATH = 107
"""``sun_path`` holds 108 bytes including the terminating NUL on Linux."""


def _parse_control(root: Table) -> ControlConfig:
    table = root.table("control")
    socket: str = table.get_str("socket", default_of(ControlConfig, "socket"))
    if len(os.fsencode(socket)) > _MAX_UNIX_SOCKET_PATH:
        # bind() refuses it ("AF_UNIX path too long"): say so here, not at start-up.
        raise table.error("socket", f"must be at most {_MAX_UNIX_SOCKET_PATH} bytes long")
    group = table.get_str("group")
    max_request_bytes = table.get_int(
        "max_request_bytes",
        default_of(ControlConfig, "max_request_bytes"),
        low=1024,
        high=16 * 1024 * 1024,
    )
    idle_timeout_ms = table.get_int(
        "idle_timeout_ms",
        default_of(ControlConfig, "idle_timeout_ms"),
        low=100,
        high=24 * 3600 * 1000,
    )
    raw_operators = table._get("operators", list, "an array of tables", [])
    operators: list[Operator] = []
    seen: set[int] = set()
    for index, raw in enumerate(raw_operators, start=1):
        where = f"{table.where}.operators[{index}]"
        if not isinstance(raw, dict):
            raise ConfigError(f"must be a table, got {type_name(raw)}", file=root.file, key=where)
        op = Table(root.file, where, raw)
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


def _parse_metrics(root: Table) -> MetricsConfig | None:
    present = "metrics" in root.data
    table = root.table("metrics")
    if not present:
        return None
    listen: str = table.get_str("listen", default_of(MetricsConfig, "listen"))
    check_address(table, "listen", listen)
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


def _parse_a2a(root: Table) -> A2AConfig | None:
    present = "a2a" in root.data
    table = root.table("a2a")
    if not present:
        return None
    listen: str = table.get_str("push_listen", required=True)
    check_address(table, "push_listen", listen)
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


def _parse_connections(root: Table) -> tuple[ConnectionConfig, ...]:
    result: list[ConnectionConfig] = []
    seen: set[str] = set()
    for table in array_of_tables(root, "connections"):
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


def _parse_agents(root: Table) -> dict[str, AgentConfig]:
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
            raise ConfigError(f"must be a table, got {type_name(raw)}", file=root.file, key=where)
        agent = Table(root.file, where, raw)
        kind = agent.choice("kind", AGENT_KINDS, None)
        options = {k: v for k, v in raw.items() if k != "kind"}
        for name in options:
            if name in INLINE_SECRET_KEYS:
                raise agent.error(
                    name, "secrets are never inline in the config; name an environment variable"
                )
        checked = _validate_agent_options(agent, kind, options)
        agents[alias] = AgentConfig(
            alias=alias, kind=kind, options=types.MappingProxyType(dict(checked))
        )
    table.finish()
    return agents


def _validate_agent_options(agent: Table, kind: str, options: dict[str, Any]) -> Mapping[str, Any]:
    """Options are the agent registry's to judge; its error becomes a ConfigError here."""
    try:
        validate_agent_options(kind, options)
    except (ValueError, TypeError, KeyError) as exc:
        name = getattr(exc, "key", None)
        message = str(exc.args[0]) if exc.args else type(exc).__name__
        if name is None:
            match = re.match(r"^'?([A-Za-z_][A-Za-z0-9_]*)'?(?::| )", message)
            if match and match.group(1) in options:
                name = match.group(1)
        if isinstance(name, str) and message.startswith(f"{name}: "):
            message = message[len(name) + 2 :]
        if isinstance(name, str) and message.startswith("unknown option"):
            close = difflib.get_close_matches(name, _agent_option_names(kind), n=1)
            message += f"; did you mean {close[0]!r}?" if close else ""
        raise agent.error(name if isinstance(name, str) else None, message) from None
    return options


_AGENT_OPTION_RECORDS = {"openai": "OpenAIOptions", "mock": "MockOptions"}
"""The record of each agent kind with fixed options: its fields are the option names."""


def _agent_option_names(kind: str) -> list[str]:
    record = _AGENT_OPTION_RECORDS.get(kind)
    if record is None:
        return []
    return [
        field.name
        for field in attrs.fields(getattr(importlib.import_module("prismd.agents"), record))
    ]


def _parse_grants(
    root: Table,
    connections: tuple[ConnectionConfig, ...],
    agents: Mapping[str, AgentConfig],
) -> tuple[GrantConfig, ...]:
    conn_ids = {c.id for c in connections}
    grants: list[GrantConfig] = []
    for table in array_of_tables(root, "grants"):
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
    root = Table(source, "", data)
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
            if name in INLINE_SECRET_KEYS:
                raise ConfigError(
                    "secrets are never inline in the config; use token_env or token_file",
                    file=source,
                    key=name,
                )
            raise ConfigError(unknown_key(name, root.used), file=source, key=name)
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
