"""The ``prismd`` console script: ``init``, ``run``, ``check-config``, ``doctor``, ``migrate``,
``soak``, ``bench`` and ``telegram``.

Exit codes: 0 success, 1 failure (bad config, startup error, failed soak, ``migrate --check``
finding migrations to apply), 2 usage error (argparse). ``run`` returns 128 + signal number
when a second SIGTERM/SIGINT forces the exit. A fatal error is one ``prismd: …`` line on
stderr, printed once.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import traceback
from collections.abc import Sequence
from typing import TYPE_CHECKING

import trio

from ._collector import tune_collector
from ._suggest import SuggestingParser
from ._version import version_text

if TYPE_CHECKING:
    from ..daemon import Config

# The daemon (its config, adapters and their HTTP stacks) is imported by the commands that
# use it: a ``prismd bench`` process holds only the runtime and the store.

log = logging.getLogger("prismd.cli")


def _parser() -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="prismd", description="Connect AI agents to chat platforms through a durable journal."
    )
    parser.add_argument("--version", action="version", version=version_text("prismd"))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    from ._init import add_init_arguments

    add_init_arguments(
        sub.add_parser("init", help="write a commented starter config (never over a file)")
    )
    run = sub.add_parser("run", help="run the daemon in the foreground")
    run.add_argument("--config", metavar="PATH", help="TOML config (default: ./prismd.toml)")
    run.add_argument("--log-level", choices=("debug", "info", "warning"), default="info")
    run.add_argument("--log-format", choices=("plain", "json"), default="plain")
    run.add_argument(
        "--accept-new-journal",
        action="store_true",
        help="start although the journal is not the one the state directory ran on before"
        " (a new or replaced journal: its dedup records are gone)",
    )

    check = sub.add_parser(
        "check-config",
        help="check a config file as `run` would, without starting anything; exit 0/1",
    )
    check.add_argument("path", nargs="?", metavar="PATH", help="the same as --config PATH")
    check.add_argument("--config", metavar="PATH", help="TOML config (default: ./prismd.toml)")

    doctor = sub.add_parser(
        "doctor",
        help="check-config plus live checks (tokens, model servers, store, ports, clock);"
        " changes nothing; exit 0/1",
    )
    doctor.add_argument("--config", metavar="PATH", help="TOML config (default: ./prismd.toml)")

    migrate = sub.add_parser(
        "migrate",
        help="apply the store's schema migrations (run does too); --check only reports",
    )
    migrate.add_argument("--config", metavar="PATH", help="TOML config (default: ./prismd.toml)")
    migrate.add_argument(
        "--check", action="store_true", help="change nothing; exit 1 when migrations are pending"
    )

    telegram = sub.add_parser("telegram", help="manage a Telegram connection's webhook")
    tg_sub = telegram.add_subparsers(dest="telegram_command", required=True, metavar="ACTION")
    for name, text in (
        ("set-webhook", "register the public https:// webhook URL with Telegram"),
        ("delete-webhook", "remove the webhook so polling can run"),
    ):
        action = tg_sub.add_parser(name, help=text)
        action.add_argument("--config", metavar="PATH", help="TOML config (default: ./prismd.toml)")
        action.add_argument("--connection", metavar="ID", help="telegram connection id")
        if name == "set-webhook":
            action.add_argument(
                "--url", help="public https:// URL (default: $PRISMD_TELEGRAM_WEBHOOK_URL)"
            )
        action.add_argument("--drop-pending-updates", action="store_true")

    from ._soak import add_soak_arguments

    soak = sub.add_parser(
        "soak", help="loop admit/drain/reconcile/prune against a real store and the mock agent"
    )
    add_soak_arguments(soak)
    from ._bench import add_bench_arguments

    bench = sub.add_parser(
        "bench", help="measure admission, duplicates and the pipeline on a real store"
    )
    add_bench_arguments(bench)
    return parser


def summarize(config: Config) -> str:
    """A one-line, secret-free summary of a valid config (for ``check-config``)."""
    connections = ", ".join(f"{c.kind} {c.id}" for c in config.connections) or "none"
    agents = ", ".join(f"{alias} ({a.kind})" for alias, a in config.agents.items()) or "none"
    backend = config.store.url.partition("://")[0]
    metrics = "" if config.metrics is None else f"; metrics on {config.metrics.listen}"
    return (
        f"{config.source or 'built-in defaults'}: connections: {connections}; "
        f"agents: {agents}; {len(config.grants)} grant(s); store: {backend}{metrics}"
    )


def print_warnings(config: Config) -> None:
    """What ``check-config`` and ``run`` accept but say (``prismd: warning: …`` on stderr)."""
    from ..daemon import config_warnings

    for warning in config_warnings(config):
        print(f"prismd: warning: {warning}", file=sys.stderr)


def _configure_logging(level: str, fmt: str) -> None:
    from ..daemon import configure_logging

    configure_logging(level, "json" if fmt == "json" else "plain")


def _cmd_check_config(args: argparse.Namespace) -> int:
    if args.path is not None and args.config is not None and args.path != args.config:
        print("prismd check-config: give the file once (PATH or --config PATH)", file=sys.stderr)
        return 2
    from ..daemon import ConfigError, check_runnable, load_config

    try:
        config = load_config(args.path or args.config)
        print_warnings(config)
        check_runnable(config)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    print(f"ok: {summarize(config)}")
    return 0


def _cmd_migrate(args: argparse.Namespace) -> int:
    """``prismd migrate [--check]``: one line saying where the schema stands."""
    from stores import StoreError, migrate_store

    from ..daemon import ConfigError, load_config

    try:
        config = load_config(args.config)
        postgres = config.store.postgres_options()
    except ConfigError as exc:
        print(f"prismd: {exc}", file=sys.stderr)
        return 1
    where = _store_display(config.store.url)
    try:
        status = trio.run(
            functools.partial(
                migrate_store, config.store.url, apply=not args.check, postgres=postgres
            )
        )
    except StoreError as exc:
        text = str(exc)
        if postgres is not None and postgres.password:
            text = text.replace(postgres.password, "[REDACTED]")
        print(f"prismd: {where}: {text}", file=sys.stderr)
        return 1
    state = f"{where}: schema {status.schema} at version {status.current} of {status.latest}"
    if status.applied:
        print(f"{state}; applied {', '.join(map(str, status.applied))}")
    elif status.up_to_date:
        print(f"{state}; up to date")
    else:
        pending = ", ".join(map(str, status.pending))
        print(f"{state}; pending: {pending} (prismd migrate, or prismd run, applies them)")
        return 1
    return 0


def _store_display(url: str) -> str:
    """The store URL as it may be shown (no password)."""
    from stores import InvalidStoreURLError, is_postgres_url, parse_postgres_url

    if is_postgres_url(url):
        try:
            return parse_postgres_url(url).display
        except InvalidStoreURLError:
            return "postgresql://…"
    return url


def _cmd_run(args: argparse.Namespace) -> int:
    from ..daemon import install_early_signal_handlers

    # First: from here on SIGTERM/SIGINT are stop requests, never a traceback or a kill
    # at an arbitrary point of the startup (the daemon honours them at a safe point).
    restore_signals = install_early_signal_handlers()
    try:
        return _run_with_early_signals(args)
    finally:
        restore_signals()


def _run_with_early_signals(args: argparse.Namespace) -> int:
    from ..daemon import ConfigError, describe_exception, load_config, run_daemon

    # The journal and state files hold message text and lease owner ids: never readable
    # by "other", whatever umask the shell had (group access stays as configured, for
    # an operators group). os.umask can only be read by setting it.
    os.umask(os.umask(0o027) | 0o027)
    _configure_logging(args.log_level, args.log_format)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"prismd: {exc}", file=sys.stderr)
        return 1
    print_warnings(config)
    from ..daemon import relative_paths_warning

    for warning in relative_paths_warning(config):
        print(f"prismd: warning: {warning}", file=sys.stderr)

    tune_collector()
    try:
        return trio.run(
            functools.partial(run_daemon, config, accept_new_journal=args.accept_new_journal)
        )
    except KeyboardInterrupt:  # pragma: no cover - SIGINT is handled, kept as a backstop
        print("prismd: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        # A bug: the frames are logged for the report, but no exception's own text, which
        # may quote a user's message or a URL (the log filter only knows token shapes).
        log.critical(
            "prismd failed: %s\n%s", describe_exception(exc), traceback_without_messages(exc)
        )
        return 1


def traceback_without_messages(exc: BaseException) -> str:
    """Like a Python traceback (causes, contexts, groups), with each message left out."""
    return "".join(_tb_lines(exc, set(), ""))


def _tb_lines(exc: BaseException, seen: set[int], indent: str) -> list[str]:
    seen.add(id(exc))
    lines: list[str] = []
    if exc.__cause__ is not None and id(exc.__cause__) not in seen:
        lines += _tb_lines(exc.__cause__, seen, indent)
        lines.append(f"{indent}The above exception was the direct cause of:\n")
    elif (
        exc.__context__ is not None
        and not exc.__suppress_context__
        and id(exc.__context__) not in seen
    ):
        lines += _tb_lines(exc.__context__, seen, indent)
        lines.append(f"{indent}During handling of the above exception, another occurred:\n")
    lines.append(f"{indent}Traceback (most recent call last):\n")
    for chunk in traceback.format_tb(exc.__traceback__):
        lines += [f"{indent}{line}\n" for line in chunk.rstrip("\n").split("\n")]
    name = f"{type(exc).__module__}.{type(exc).__qualname__}"
    lines.append(f"{indent}{name} (message not shown)\n")
    if isinstance(exc, BaseExceptionGroup):
        for number, inner in enumerate(exc.exceptions, 1):
            lines.append(f"{indent}+-- {number} --\n")
            if id(inner) not in seen:
                lines += _tb_lines(inner, seen, indent + "| ")
    return lines


def _cmd_telegram(args: argparse.Namespace) -> int:
    """``prismd telegram set-webhook|delete-webhook``: 0 done, 1 refused, 2 config/usage."""
    from ..daemon import ConfigError, load_config

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"prismd telegram: {exc}", file=sys.stderr)
        return 2
    from . import _telegram as telegram_cli

    if args.telegram_command == "set-webhook":
        return telegram_cli.set_webhook(
            config,
            connection_id=args.connection,
            url=args.url,
            drop_pending_updates=args.drop_pending_updates,
        )
    return telegram_cli.delete_webhook(
        config, connection_id=args.connection, drop_pending_updates=args.drop_pending_updates
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``prismd`` console script; returns the exit code."""
    args = _parser().parse_args(argv)
    if args.command == "init":
        from ._init import run_init_command

        return run_init_command(args)
    if args.command == "check-config":
        return _cmd_check_config(args)
    if args.command == "doctor":
        from ._doctor import run_doctor_command
        from ._quiet import run_quietly

        # `prismd doctor | head -3` and Ctrl-C end quietly (141, 130), as prismctl's do.
        return run_quietly(lambda: run_doctor_command(args))
    if args.command == "run":
        return _cmd_run(args)
    if args.command == "telegram":
        return _cmd_telegram(args)
    if args.command == "migrate":
        return _cmd_migrate(args)
    if args.command == "soak":
        from ._soak import run_soak_command

        return run_soak_command(args)
    if args.command == "bench":
        from ._bench import run_bench_command

        return run_bench_command(args)
    raise AssertionError(args.command)  # argparse rejects unknown commands
