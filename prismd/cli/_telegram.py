"""``prismd telegram set-webhook|delete-webhook``: manage the bot's webhook registration.

The adapter never calls ``setWebhook`` itself (contract §11.7): registering the public URL is
an operator action. ``set_webhook`` registers ``url`` (argument, else the environment
variable ``PRISMD_TELEGRAM_WEBHOOK_URL``) with the connection's secret
(``webhook_secret_env``) and the update types the adapter handles; ``delete_webhook``
removes it (pending updates are kept unless ``drop_pending_updates``), after which polling
mode can start again.

Exit codes: 0 done, 1 Telegram refused or could not be reached, 2 a usage/config problem.
Messages name the connection and the HTTP status only — never the token or the URL path.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import Any, TextIO

import trio

from adapters.telegram import (
    ALLOWED_UPDATES,
    TelegramApi,
    TelegramApiError,
    TelegramCredentialError,
    TelegramError,
)

from ..daemon import Config, ConfigError, TelegramConnectionConfig, read_secret

URL_ENV = "PRISMD_TELEGRAM_WEBHOOK_URL"


def _connection(
    config: Config | TelegramConnectionConfig, connection_id: str | None
) -> TelegramConnectionConfig | None:
    if isinstance(config, TelegramConnectionConfig):
        return config if connection_id in (None, config.id) else None
    found = [
        c
        for c in config.connections
        if isinstance(c, TelegramConnectionConfig) and connection_id in (None, c.id)
    ]
    return found[0] if len(found) == 1 else None


def _describe(error: TelegramError) -> str:
    if isinstance(error, TelegramApiError):
        return f"Telegram answered HTTP {error.status}"
    if isinstance(error, TelegramCredentialError):
        return "the bot token is unusable"
    return "Telegram could not be reached"


class _Usage(Exception):
    """A usage or config problem of the command line: printed, exit code 2."""


_Request = tuple[str, str, dict[str, Any], str]
"""The token, the Bot API method, its params and what to say once it is done."""


async def _run(
    config: Config | TelegramConnectionConfig,
    connection_id: str | None,
    out: TextIO | None,
    request: Callable[[TelegramConnectionConfig], _Request],
) -> int:
    """Call the method ``request`` makes for the one telegram connection named; a usage or
    config problem (``request`` raises it) is printed and answers 2."""
    out = out or sys.stderr
    try:
        connection = _connection(config, connection_id)
        if connection is None:
            raise _Usage("name exactly one telegram connection")
        token, method, params, done = request(connection)
    except (_Usage, ConfigError) as error:
        print(f"prismd telegram: {error}", file=out)
        return 2
    return await _call(connection, token, method, params, out, done)


async def aset_webhook(
    config: Config | TelegramConnectionConfig,
    env: Mapping[str, str],
    *,
    connection_id: str | None = None,
    url: str | None = None,
    drop_pending_updates: bool = False,
    out: TextIO | None = None,
) -> int:
    """Register the webhook; see the module docstring for exit codes."""

    def request(connection: TelegramConnectionConfig) -> _Request:
        target = url or env.get(URL_ENV, "")
        if not target.startswith("https://"):
            raise _Usage(f"set {URL_ENV} (or --url) to the public https:// URL")
        token = _token(connection, env)
        secret = None
        if connection.webhook_secret_env:
            secret = read_secret(
                env_name=connection.webhook_secret_env,
                file_name=None,
                env=env,
                key=f"connections.{connection.id}.webhook_secret_env",
            )
        if secret is None:
            raise _Usage("webhook_secret_env is required for a webhook")
        params: dict[str, Any] = {
            "url": target,
            "secret_token": secret,
            "allowed_updates": list(ALLOWED_UPDATES),
            "drop_pending_updates": drop_pending_updates,
        }
        return token, "setWebhook", params, "webhook set"

    return await _run(config, connection_id, out, request)


async def adelete_webhook(
    config: Config | TelegramConnectionConfig,
    env: Mapping[str, str],
    *,
    connection_id: str | None = None,
    drop_pending_updates: bool = False,
    out: TextIO | None = None,
) -> int:
    """Remove the webhook so polling can run; see the module docstring for exit codes."""

    def request(connection: TelegramConnectionConfig) -> _Request:
        params: dict[str, Any] = {"drop_pending_updates": drop_pending_updates}
        return _token(connection, env), "deleteWebhook", params, "webhook deleted"

    return await _run(config, connection_id, out, request)


def _token(connection: TelegramConnectionConfig, env: Mapping[str, str]) -> str:
    return read_secret(
        env_name=connection.token_env,
        file_name=connection.token_file,
        env=env,
        key=f"connections.{connection.id}.token",
    )


async def _call(
    connection: TelegramConnectionConfig,
    token: str,
    method: str,
    params: Mapping[str, Any],
    out: TextIO,
    done: str,
) -> int:
    api = TelegramApi(token=lambda: token, api_origin=connection.api_origin)
    try:
        await api.call(method, params)
    except TelegramError as error:
        print(f"prismd telegram: {connection.id}: {_describe(error)}", file=out)
        return 1
    finally:
        await api.aclose()
    print(f"prismd telegram: {connection.id}: {done}", file=out)
    return 0


def set_webhook(
    config: Config | TelegramConnectionConfig,
    env: Mapping[str, str] = os.environ,
    **kwargs: Any,
) -> int:
    """Synchronous entry point for ``prismd telegram set-webhook``."""
    return trio.run(lambda: aset_webhook(config, env, **kwargs))


def delete_webhook(
    config: Config | TelegramConnectionConfig,
    env: Mapping[str, str] = os.environ,
    **kwargs: Any,
) -> int:
    """Synchronous entry point for ``prismd telegram delete-webhook``."""
    return trio.run(lambda: adelete_webhook(config, env, **kwargs))
