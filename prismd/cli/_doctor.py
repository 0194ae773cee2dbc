"""``prismd doctor``: ``check-config`` plus what only a live look can tell.

One line per check, starting with the component (``Telegram tg-main``, ``model server
assistant (http://…)``, ``PostgreSQL db:5432/prismd``), then ``ok`` or what to do. Every
check runs even after another failed (a config that does not load skips only what needs
it), each within :data:`CHECK_TIMEOUT_S`; exit 1 when any failed. Nothing is changed: no
file or directory is created, no schema migrated, no webhook touched; a port is probed by
binding it and closing at once. A token, key or password is read to be used, never shown:
failures are described by status code or cause class, never by an exception's text.

Checks by connection kind live in :data:`CONNECTION_CHECKS` (one entry per kind, e.g. a
Discord kind adds its own there); the checks of the whole config in :data:`CONFIG_CHECKS`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import errno
import os
import socket
import sys
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

import attrs
import trio

from ..daemon import Config, ConfigError, check_runnable, load_config, read_secret
from ._finding import Finding, failed, ok

CHECK_TIMEOUT_S = 5.0
"""The longest one check may take (a silent server is reported as not answering)."""
EARLIEST_SANE_YEAR = 2024


@attrs.define(eq=False)
class Context:
    """What the checks share: the config, the environment, and whether this config's
    daemon answers on its control socket (then its ports being in use is no failure)."""

    config: Config
    env: Mapping[str, str]
    daemon: str | None = None
    """``None``, or how the running daemon of this config describes itself."""


Check = Callable[[Context], Awaitable[list[Finding]]]


# --------------------------------------------------------------------------- the config


def _config_finding(config: Config, env: Mapping[str, str]) -> Finding:
    name = f"config {config.source or '(built-in defaults)'}"
    try:
        check_runnable(config, env)
    except ConfigError as exc:
        return failed(name, exc.message if exc.key is None else f"{exc.key}: {exc.message}")
    from ..daemon import config_warnings

    warnings = config_warnings(config, env)
    if warnings:
        return Finding(name, "warning", warnings[0])
    return ok(name)


def _clock(now: _dt.datetime | None = None) -> Finding:
    """The wall clock is after the year :data:`EARLIEST_SANE_YEAR` began and after this
    installation's files were written (a clock behind them is wrong: leases, retention
    and TLS certificates depend on it)."""
    now = now or _dt.datetime.now(_dt.UTC)
    shown = now.strftime("%Y-%m-%d %H:%M:%S UTC")
    floor = _dt.datetime(EARLIEST_SANE_YEAR, 1, 1, tzinfo=_dt.UTC)
    built = _dt.datetime.fromtimestamp(Path(__file__).stat().st_mtime, _dt.UTC)
    if now < floor or now < built - _dt.timedelta(days=1):
        return failed(
            "clock",
            f"the system clock says {shown}, before this installation was written"
            f" ({built:%Y-%m-%d}); set the time (timedatectl, NTP)",
        )
    return ok("clock", shown)


# --------------------------------------------------------------------------- paths and ports


def _writable_dir(path: Path) -> str | None:
    """Why ``path`` cannot be a directory this process writes into, or ``None``. A missing
    directory is fine when its nearest existing parent is writable (prismd creates it)."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is not a directory"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by uid {os.getuid()}"
    return None


async def _state_dir(ctx: Context) -> list[Finding]:
    return await trio.to_thread.run_sync(_state_dir_findings, ctx)


def _state_dir_findings(ctx: Context) -> list[Finding]:
    path = Path(ctx.config.daemon.state_dir)
    name = f"state directory {path}"
    problem = _writable_dir(path)
    if problem is not None:
        return [failed(name, f"{problem}; change [daemon].state_dir or its owner")]
    return [ok(name, "writable" if path.is_dir() else "will be created")]


async def _control_socket(ctx: Context) -> list[Finding]:
    return await trio.to_thread.run_sync(_control_socket_findings, ctx)


def _control_socket_findings(ctx: Context) -> list[Finding]:
    path = Path(ctx.config.control.socket)
    name = f"control socket {path}"
    if ctx.daemon is not None:
        return [ok(name, f"prismd runs on it ({ctx.daemon})")]
    problem = _writable_dir(path.parent)
    if problem is not None:
        return [failed(name, f"{problem}; change [control].socket or its directory's owner")]
    problem = _socket_directory_problem(ctx.config, path)
    if problem is not None:
        return [failed(name, f"{problem}; change [control].socket")]
    return [ok(name, "stale socket file, replaced at start" if path.exists() else "free")]


def _socket_directory_problem(config: Config, path: Path) -> str | None:
    """What the control server would refuse about the socket's directory (it checks the
    same at start), including the state directory that `run` creates before it: its
    files and its mode 0750 keep the socket out of it unless a [control].group is set."""
    import grp

    from ..control import socket_directory_problem

    group = config.control.group
    try:
        gid = grp.getgrnam(group).gr_gid if group is not None else None
    except KeyError:
        gid = None  # check-config names the unknown group
    state_dir = Path(config.daemon.state_dir)
    if gid is None and not state_dir.exists() and path.parent.resolve() == state_dir.resolve():
        return (
            f"{path.parent} is the state directory, which will hold other files and be open"
            f" to its group (mode 750); put the control socket in its own directory, such"
            f" as {path.parent / 'run' / path.name}"
        )
    return socket_directory_problem(path.parent, gid, path.name)


async def _daemon_answers(path: str) -> str | None:
    """How the daemon on ``path`` describes itself (its ``health``), or ``None``."""
    from .prismctl import ControlClient, ControlClientError, RpcErrorResult

    def ask() -> Any:
        with ControlClient(path, timeout=CHECK_TIMEOUT_S) as client:
            return client.call("health", {})

    try:
        health = await trio.to_thread.run_sync(ask, abandon_on_cancel=True)
    except (ControlClientError, RpcErrorResult, OSError):
        return None
    if not isinstance(health, Mapping):
        return "it answers"
    instance = health.get("instance")
    return f"instance {instance}" if isinstance(instance, str) else "it answers"


def _port_finding(ctx: Context, name: str, listen: str) -> Finding:
    from adapters.toolkit import parse_host_port

    host, port = parse_host_port(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE and ctx.daemon is not None:
                return ok(name, f"in use by the running prismd of this config ({ctx.daemon})")
            if exc.errno == errno.EADDRINUSE:
                return failed(
                    name,
                    f"port {port} is in use by another program; stop it or choose another"
                    " address (ss -ltnp shows who holds it)",
                )
            if exc.errno == errno.EACCES:
                return failed(name, f"port {port} needs privileges; use a port above 1023")
            return failed(name, f"cannot bind {listen} ({errno.errorcode.get(exc.errno or 0)})")
    return ok(name, "free")


async def _metrics_port(ctx: Context) -> list[Finding]:
    metrics = ctx.config.metrics
    if metrics is None:
        return []
    await trio.lowlevel.checkpoint()
    return [_port_finding(ctx, f"metrics {metrics.listen}", metrics.listen)]


# --------------------------------------------------------------------------- connections


async def _listen_port(ctx: Context, conn: Any, label: str) -> list[Finding]:
    from adapters import kinds

    kind = kinds.connection_kind(conn.kind)
    listen = None if kind is None else kind.listen_address(conn)
    await trio.lowlevel.checkpoint()
    if listen is None:
        return []
    return [_port_finding(ctx, f"{label} {conn.id} {listen}", listen)]


async def _webchat(ctx: Context, conn: Any) -> list[Finding]:
    return await _listen_port(ctx, conn, "web chat")


async def _telegram(ctx: Context, conn: Any) -> list[Finding]:
    from adapters.telegram import TelegramApi, TelegramApiError, TelegramCredentialError

    name = f"Telegram {conn.id}"
    variable = conn.token_env or conn.token_file
    findings = await _listen_port(ctx, conn, "Telegram webhook")
    try:
        token = read_secret(env_name=conn.token_env, file_name=conn.token_file, env=ctx.env)
    except ConfigError as exc:
        return [failed(name, f"{exc.message}: put the bot token from @BotFather there"), *findings]
    api = TelegramApi(
        token=lambda: token, api_origin=conn.api_origin, read_timeout_s=CHECK_TIMEOUT_S
    )
    try:
        with trio.move_on_after(CHECK_TIMEOUT_S) as timer:
            me = await api.call("getMe", {})
            webhook = await api.call("getWebhookInfo", {})
    except TelegramCredentialError:
        return [
            failed(name, f"the token in {variable} is not a bot token (123456:ABC…)"),
            *findings,
        ]
    except TelegramApiError as exc:
        if exc.status in (401, 403, 404):
            what = f"Telegram refused the token (HTTP {exc.status}); check {variable}"
            return [failed(name, f"{what} (a token from @BotFather looks like 123456:ABC…)")]
        return [failed(name, f"Telegram answered HTTP {exc.status}; try again later"), *findings]
    except Exception as exc:
        return [
            failed(
                name,
                f"{conn.api_origin} not reachable ({type(exc).__name__}); check the"
                " network, a proxy or api_origin",
            ),
            *findings,
        ]
    finally:
        with trio.move_on_after(1, shield=True):
            await api.aclose()
    if timer.cancelled_caught:
        return [
            failed(name, f"{conn.api_origin} did not answer within {CHECK_TIMEOUT_S:g} s"),
            *findings,
        ]
    bot = me.get("username") if isinstance(me, Mapping) else None
    hooked = isinstance(webhook, Mapping) and bool(webhook.get("url"))
    if conn.mode == "polling" and hooked:
        return [
            failed(
                name,
                f"bot @{bot} has a webhook set, so polling gets nothing; run"
                f" prismd telegram delete-webhook --connection {conn.id}",
            ),
            *findings,
        ]
    return [ok(name, f"bot @{bot}, {conn.mode}"), *findings]


async def _discord(ctx: Context, conn: Any) -> list[Finding]:
    from ._doctor_remote import check_discord

    return [await check_discord(conn, ctx.env, CHECK_TIMEOUT_S)]


async def _signal(ctx: Context, conn: Any) -> list[Finding]:
    """signal-cli accepts a connection on its socket (nothing is sent)."""
    where = conn.socket or conn.tcp
    name = f"Signal {conn.id}"
    with trio.move_on_after(CHECK_TIMEOUT_S):
        try:
            if conn.socket is not None:
                stream = await trio.open_unix_socket(conn.socket)
            else:
                from adapters.toolkit import parse_host_port

                host, port = parse_host_port(conn.tcp)
                stream = await trio.open_tcp_stream(host, port)
        except OSError as exc:
            reason = "nothing listens there" if _refused(exc) else type(exc).__name__
            return [
                failed(
                    name,
                    f"signal-cli not reachable at {where} ({reason}); start"
                    f" signal-cli -a ACCOUNT daemon --receive-mode=manual there",
                ),
            ]
        await stream.aclose()
        return [ok(name, f"signal-cli answers at {where}")]
    return [failed(name, f"signal-cli at {where} did not answer within {CHECK_TIMEOUT_S:g} s")]


def _refused(exc: OSError) -> bool:
    causes = [exc, *getattr(exc.__cause__, "exceptions", ())]
    return any(isinstance(c, ConnectionRefusedError | FileNotFoundError) for c in causes)


CONNECTION_CHECKS: Mapping[str, Callable[[Context, Any], Awaitable[list[Finding]]]] = {
    "webchat": _webchat,
    "telegram": _telegram,
    "signal": _signal,
    "discord": _discord,
}
"""The live checks of each connection kind (a kind without an entry: its listen port)."""


async def _connections(ctx: Context) -> list[Finding]:
    findings: list[Finding] = []
    for conn in ctx.config.connections:
        check = CONNECTION_CHECKS.get(conn.kind)
        if check is None:
            findings += await _listen_port(ctx, conn, conn.kind)
        else:
            findings += await check(ctx, conn)
    return findings


# --------------------------------------------------------------------------- models and store


async def _model_servers(ctx: Context) -> list[Finding]:
    from ._doctor_model import check_model_server
    from ._doctor_remote import check_a2a_agent

    findings = []
    for alias, agent in ctx.config.agents.items():
        if agent.kind == "openai":
            findings.append(
                await check_model_server(alias, agent.options, ctx.env, CHECK_TIMEOUT_S)
            )
        elif agent.kind == "a2a":
            findings.append(await check_a2a_agent(alias, agent.options, ctx.env, CHECK_TIMEOUT_S))
    a2a = ctx.config.a2a
    if a2a is not None:
        findings.append(_port_finding(ctx, f"A2A push receiver {a2a.push_listen}", a2a.push_listen))
    return findings


async def _store(ctx: Context) -> list[Finding]:
    from stores import StoreError, is_postgres_url, migrate_store, parse_postgres_url

    store = ctx.config.store
    url = store.url
    if url.startswith("memory:"):
        return [ok("store memory://", "keeps nothing across restarts")]
    if is_postgres_url(url):
        parsed = parse_postgres_url(url)
        where = parsed.where + ("" if parsed.schema == "public" else f" schema {parsed.schema}")
        name = f"PostgreSQL {where}"
    else:
        name = f"SQLite {url.removeprefix('sqlite:///')}"
    try:
        postgres = store.postgres_options(ctx.env)
    except ConfigError as exc:
        return [failed(name, f"{exc.key}: {exc.message}")]
    with trio.move_on_after(CHECK_TIMEOUT_S) as timer:
        try:
            status = await migrate_store(url, apply=False, postgres=postgres)
        except StoreError as exc:
            text = str(exc)
            if postgres is not None and postgres.password:
                text = text.replace(postgres.password, "[REDACTED]")
            what = "the server and the password" if postgres is not None else "the file"
            return [failed(name, f"{text}; check [store] url and {what}")]
    if timer.cancelled_caught:
        return [failed(name, f"no answer within {CHECK_TIMEOUT_S:g} s; is the server up?")]
    if status.current > status.latest:
        return [
            failed(
                name,
                f"schema version {status.current} is newer than this prismd"
                f" ({status.latest}); upgrade prismd",
            )
        ]
    if status.current == 0:
        if postgres is None:
            blocked = _writable_dir(Path(url.removeprefix("sqlite:///")).parent)
            if blocked is not None:
                return [failed(name, f"the file cannot be created: {blocked}; change [store] url")]
        return [ok(name, "no schema yet: prismd run (or prismd migrate) creates it")]
    if status.pending:
        pending = ", ".join(map(str, status.pending))
        return [
            failed(
                name,
                f"schema at version {status.current} of {status.latest}"
                f" (pending: {pending}); run prismd migrate --config …",
            )
        ]
    return [ok(name, f"schema at version {status.current}, current")]


CONFIG_CHECKS: tuple[Check, ...] = (
    _store,
    _state_dir,
    _control_socket,
    _metrics_port,
    _connections,
    _model_servers,
)
"""The checks that need a loaded config, in the order of the report."""


# --------------------------------------------------------------------------- driver


async def _guarded(check: Check, ctx: Context) -> list[Finding]:
    """``check``'s findings; a bug in it is one failed line (its exception type only)."""
    try:
        with trio.fail_after(CHECK_TIMEOUT_S * 3):
            return await check(ctx)
    except Exception as exc:
        label = check.__name__.strip("_").replace("_", " ")
        return [failed(label, f"the check itself failed ({type(exc).__name__})")]


async def diagnose(path: str | None, env: Mapping[str, str] = os.environ) -> list[Finding]:
    """Every finding for the config at ``path`` (``None``: as ``prismd run`` would pick)."""
    try:
        config = load_config(path, env=env)
    except ConfigError as exc:
        return [failed(f"config {exc.file or path or 'prismd.toml'}", _short(exc)), _clock()]
    ctx = Context(config=config, env=env)
    ctx.daemon = await _daemon_answers(config.control.socket)
    results: list[list[Finding]] = [[] for _ in CONFIG_CHECKS]

    async def run(index: int, check: Check) -> None:
        results[index] = await _guarded(check, ctx)

    async with trio.open_nursery() as nursery:
        for index, check in enumerate(CONFIG_CHECKS):
            nursery.start_soon(run, index, check)
    return [_config_finding(config, env), *(f for found in results for f in found), _clock()]


def _short(exc: ConfigError) -> str:
    return exc.message if exc.key is None else f"{exc.key}: {exc.message}"


def run_doctor_command(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    """Print one line per finding and a summary; 1 when any failed."""
    findings = trio.run(diagnose, args.config)
    for finding in findings:
        out.write(finding.line() + "\n")
    problems = sum(f.failed for f in findings)
    if problems:
        out.write(f"doctor: {problems} problem(s) of {len(findings)} checks\n")
        return 1
    out.write(f"doctor: all {len(findings)} checks ok\n")
    return 0
