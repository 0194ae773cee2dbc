"""Whether a valid config can run here: the second half of ``prismd check-config`` and
``prismd run`` — what a parsed file still needs from this machine and this build (secrets
present, ``python`` factories importable, connection kinds and store schemes built, the
control group existing), checked without opening a socket, the store or the network — and
the warnings for what it silently leaves unused.
"""

from __future__ import annotations

import grp
import os
from collections.abc import Callable, Mapping
from typing import Any

from adapters import kinds

from . import _config
from ._config import Config, ConfigError, StoreConfig, read_secret

__all__ = ["check_runnable", "config_warnings", "relative_paths_warning"]


def check_runnable(config: Config, env: Mapping[str, str] = os.environ) -> None:
    """Raise :class:`ConfigError` (file and key named) for what ``config`` cannot run with here.

    The checks ``prismd run`` needs before it opens anything, and all ``prismd check-config``
    adds to :func:`load_config`, so the two cannot disagree: the store scheme and every
    connection kind are built (:data:`~prismd.daemon._config.STORE_SCHEMES`,
    :data:`adapters.kinds.CONNECTION_KINDS`),
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

    if not config.connections:
        # A daemon without a connection starts, says ready and answers nobody.
        raise error("[[connections]]", NO_CONNECTION)
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


NO_CONNECTION = (
    "no connection: nothing could reach an agent; add one, e.g. a [[connections]] block with"
    ' id = "web" and kind = "webchat" (and a [[grants]] entry for it),'
    " or write a starter config with prismd init"
)

ENV_CONNECTIONS: tuple[tuple[str, str], ...] = (
    ("TELEGRAM_BOT_TOKEN", "telegram"),
    ("SIGNAL_CLI_SOCKET", "signal"),
)
"""The variables that add a connection to the built-in defaults (:func:`default_config`),
with the kind each adds: set beside a config file that has no such connection, they are
ignored, which :func:`config_warnings` says."""


def config_warnings(config: Config, env: Mapping[str, str] = os.environ) -> list[str]:
    """What ``check-config`` and ``run`` warn about (on stderr) but accept: a connection no
    ``[[grants]]`` entry names (every message on it is refused: a daemon that starts,
    says ready and answers nobody there), and a variable of :data:`ENV_CONNECTIONS` set
    while the config file has no connection of its kind."""
    if config.source is None:
        if env.get("SIGNAL_ACCOUNT", "").strip() and not env.get("SIGNAL_CLI_SOCKET", "").strip():
            # The defaults add Signal only with both (default_config).
            return [
                "SIGNAL_ACCOUNT is set but SIGNAL_CLI_SOCKET is not, so no Signal connection"
                " is added; set SIGNAL_CLI_SOCKET to signal-cli's socket path (docs/signal.md)"
            ]
        return []
    granted = {grant.connection for grant in config.grants}
    alias = next(iter(config.agents), None)
    aliases = (
        f'aliases = ["{alias}"]' if alias else 'aliases = ["echo"] and [agents.echo] kind = "echo"'
    )
    ungranted = [
        f"connection {conn.id!r} has no [[grants]] entry, so every message on it is refused;"
        f' add one: [[grants]] connection = "{conn.id}", actors = ["*"] (or pairing = true),'
        f" {aliases}"
        for conn in config.connections
        if conn.id not in granted
    ]
    present = {conn.kind for conn in config.connections}
    return ungranted + [
        f"{variable} is set but {config.source} has no {kind} connection, so it is not used;"
        f' add a [[connections]] block with kind = "{kind}"'
        + (f' and token_env = "{variable}"' if kind == "telegram" else "")
        + (" (prismd init --telegram writes one)" if kind == "telegram" else "")
        for variable, kind in ENV_CONNECTIONS
        if env.get(variable, "").strip() and kind not in present
    ]


def relative_paths_warning(config: Config) -> list[str]:
    """What ``run`` says (one line, or none) when it runs outside the config file's directory
    and the file's paths are relative: they are relative to where prismd runs, so a run
    from elsewhere starts an empty journal there (pairings, history and unresolved work
    stay behind, unseen). ``check-config`` and ``doctor`` may run from anywhere: not theirs."""
    if config.source is None:
        return []
    home = os.path.dirname(os.path.abspath(config.source))
    here = os.getcwd()
    if os.path.realpath(home) == os.path.realpath(here):
        return []
    paths = [config.daemon.state_dir, config.control.socket]
    if config.store.url.startswith("sqlite:///") and not config.store.url.startswith("sqlite:////"):
        paths.insert(1, config.store.url.removeprefix("sqlite:///"))
    relative = [path for path in paths if not os.path.isabs(path)]
    if not relative:
        return []
    return [
        f"{config.source} names relative paths ({', '.join(relative)}): they are relative to"
        f" where prismd runs ({here}), not to the file's directory ({home}), so this journal"
        f" and state are not that directory's; run prismd from {home}, or make them absolute"
    ]


def _check_store_runnable(
    store: StoreConfig, env: Mapping[str, str], error: Callable[[str, str], ConfigError]
) -> None:
    url = store.url
    scheme = url.partition("://")[0]
    # Read through the module: a test turns a scheme off there.
    if not _config.STORE_SCHEMES.get(scheme, False):
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
