"""``postgresql://`` URLs and the pool settings, parsed without importing the driver.

``prismd check-config`` validates a store URL with :func:`parse_postgres_url` alone: nothing
here opens a socket or imports asyncpg.

Accepted: ``postgresql://[user[:password]@][host][:port][/database][?param=value&…]`` and the
same with ``postgres://``. Parameters: ``schema`` (where prismd's tables live, default
``public``; created by the first migration when missing), ``sslmode`` (``disable``,
``allow``, ``prefer``, ``require``, ``verify-ca``, ``verify-full``) and ``host`` (a Unix
socket directory, for a URL without a host). Anything else is refused by name, so a typo is
not silently ignored. Missing parts fall back to the driver's (libpq's) defaults:
``PGHOST``/``PGPORT``/``PGUSER``/``PGDATABASE``, the local Unix socket, port 5432.

A password may be in the URL, but :attr:`PostgresURL.display` never shows it; the daemon
reads it from ``[store] password_file`` or ``password_env`` instead (docs/postgresql.md).
"""

from __future__ import annotations

import re
import urllib.parse

import attrs

from .._types import InvalidStoreURLError

SCHEMES = ("postgresql", "postgres")
SSL_MODES = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
DEFAULT_SCHEMA = "public"
_SCHEMA_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
_PARAMS = ("schema", "sslmode", "host")

DEFAULT_STATEMENT_TIMEOUT_MS = 15_000
DEFAULT_CONNECT_TIMEOUT_MS = 5_000
MAX_POOL_SIZE = 100


def default_pool_size(cpus: int | None) -> int:
    """Twice the CPU count, at least 2 and at most 16: one connection writes (every write of
    the instance goes through one group-committed transaction at a time), the rest serve
    reads and lease calls. On a 2-core machine: 4."""
    return max(2, min(16, 2 * (cpus or 1)))


@attrs.frozen
class PostgresOptions:
    """What the daemon's ``[store]`` section adds to a ``postgresql://`` URL."""

    pool_size: int | None = None
    """Connections at most (default :func:`default_pool_size` of this machine)."""
    password: str | None = attrs.field(default=None, repr=False)
    """Overrides a password in the URL (read from ``password_file``/``password_env``)."""
    statement_timeout_ms: int = DEFAULT_STATEMENT_TIMEOUT_MS
    """The server cancels any statement running longer (PostgreSQL ``statement_timeout``)."""
    connect_timeout_ms: int = DEFAULT_CONNECT_TIMEOUT_MS
    """A new connection (TCP, TLS, authentication) must be up within this."""

    def __attrs_post_init__(self) -> None:
        if self.pool_size is not None and not 2 <= self.pool_size <= MAX_POOL_SIZE:
            raise ValueError(f"pool_size must be between 2 and {MAX_POOL_SIZE}")
        if not 1 <= self.statement_timeout_ms <= 3_600_000:
            raise ValueError("statement_timeout_ms must be between 1 and 3600000")
        if not 1 <= self.connect_timeout_ms <= 600_000:
            raise ValueError("connect_timeout_ms must be between 1 and 600000")


@attrs.frozen
class PostgresURL:
    """A parsed ``postgresql://`` URL (percent-escapes decoded)."""

    host: str | None
    """A host name or address, a Unix socket directory (from ``?host=``), or ``None``."""
    port: int | None
    user: str | None
    database: str | None
    schema: str
    sslmode: str | None
    password: str | None = attrs.field(default=None, repr=False)

    @property
    def where(self) -> str:
        """``host:port/database`` as far as the URL says (for messages)."""
        host = self.host or "default host"
        if self.host and ":" in self.host:
            host = f"[{self.host}]"
        port = f":{self.port}" if self.port is not None else ""
        return f"{host}{port}/{self.database or '(default database)'}"

    @property
    def display(self) -> str:
        """The URL without its password: the form that may be logged."""
        user = urllib.parse.quote(self.user, safe="") + "@" if self.user else ""
        host = ""
        params: list[tuple[str, str]] = []
        if self.host and self.host.startswith("/"):
            params.append(("host", self.host))
        elif self.host:
            host = f"[{self.host}]" if ":" in self.host else self.host
        port = f":{self.port}" if self.port is not None else ""
        database = "/" + urllib.parse.quote(self.database, safe="") if self.database else ""
        if self.schema != DEFAULT_SCHEMA:
            params.append(("schema", self.schema))
        if self.sslmode is not None:
            params.append(("sslmode", self.sslmode))
        query = "?" + urllib.parse.urlencode(params) if params else ""
        return f"postgresql://{user}{host}{port}{database}{query}"


def is_postgres_url(url: object) -> bool:
    return isinstance(url, str) and url.partition("://")[0] in SCHEMES and "://" in url


def parse_postgres_url(url: str) -> PostgresURL:
    """Parse ``url`` or raise :class:`InvalidStoreURLError` saying what is wrong with it
    (never quoting a password)."""
    if not is_postgres_url(url):
        raise InvalidStoreURLError("expected a postgresql://… URL")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise InvalidStoreURLError("postgresql URL must not contain spaces or control characters")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError:
        raise InvalidStoreURLError("postgresql URL has a malformed host or port") from None
    if parts.fragment:
        raise InvalidStoreURLError("postgresql URL must not have a #fragment")
    if "," in parts.netloc:
        raise InvalidStoreURLError("postgresql URL: several hosts are not supported")
    path = parts.path
    if path.count("/") > 1:
        raise InvalidStoreURLError("postgresql URL path must be /DATABASE")
    database = urllib.parse.unquote(path[1:]) if path.startswith("/") and path != "/" else None
    try:
        pairs = urllib.parse.parse_qsl(parts.query, keep_blank_values=True, strict_parsing=True)
    except ValueError:
        if parts.query:
            raise InvalidStoreURLError("postgresql URL has a malformed ?query") from None
        pairs = []
    params: dict[str, str] = {}
    for name, value in pairs:
        if name not in _PARAMS:
            raise InvalidStoreURLError(
                f"postgresql URL: unknown parameter {name!r} (known: {', '.join(_PARAMS)})"
            )
        if name in params:
            raise InvalidStoreURLError(f"postgresql URL: parameter {name!r} given twice")
        params[name] = value
    schema = params.get("schema", DEFAULT_SCHEMA)
    if not _SCHEMA_RE.match(schema):
        raise InvalidStoreURLError(
            "postgresql URL: schema must be a lower-case SQL identifier (a-z, 0-9, _;"
            " at most 63 characters)"
        )
    sslmode = params.get("sslmode")
    if sslmode is not None and sslmode not in SSL_MODES:
        raise InvalidStoreURLError(f"postgresql URL: sslmode must be one of {', '.join(SSL_MODES)}")
    host = urllib.parse.unquote(parts.hostname) if parts.hostname else None
    socket_dir = params.get("host")
    if socket_dir is not None:
        if host is not None:
            raise InvalidStoreURLError("postgresql URL: give the host once (netloc or ?host=)")
        if not socket_dir.startswith("/"):
            raise InvalidStoreURLError("postgresql URL: ?host= must be a socket directory path")
        host = socket_dir
    for text in (parts.username, parts.password, database):
        if text is not None and "\x00" in urllib.parse.unquote(text):
            raise InvalidStoreURLError("postgresql URL must not contain NUL characters")
    return PostgresURL(
        host=host,
        port=port,
        user=urllib.parse.unquote(parts.username) if parts.username else None,
        database=database,
        schema=schema,
        sslmode=sslmode,
        password=urllib.parse.unquote(parts.password) if parts.password else None,
    )
