"""Helpers for daemon tests: real `prismd run` subprocesses, NOTIFY_SOCKET, web chat, prismctl.

Also ``counting_mock``, a ``python`` agent factory wrapping the ``mock`` agent that appends
one line to ``count_file`` when a run *starts* (O_APPEND, fsync'd), so a test can prove
across SIGKILL and restart that the agent ran exactly once in total.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio
import trio_websocket

from prismd.agents._base import AgentContext
from prismd.agents.mock import MockAgent
from prismd.daemon._config import Config, parse_config
from tests.fakes.killloop_agent import CountingMock, inner_mock
from tests.support import pgserver

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- agent


@attrs.define(eq=False)
class ShieldedCountingMock(CountingMock):
    shield_ms: int = 0

    async def pause(self) -> None:
        if self.shield_ms:
            # A stubborn agent: ignores cancellation for a while (forces a slow stop).
            with trio.CancelScope(shield=True):
                await trio.sleep(self.shield_ms / 1000)


def counting_mock(ctx: AgentContext) -> CountingMock:
    return ShieldedCountingMock(
        inner=inner_mock(ctx, "shield_ms"),
        count_file=str(ctx.options["count_file"]),
        shield_ms=int(ctx.options.get("shield_ms", 0)),
    )


def run_keys(path: Path) -> list[str]:
    """The idempotency keys of every run started, in order."""
    try:
        return path.read_text().splitlines()
    except FileNotFoundError:
        return []


def run_count(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except FileNotFoundError:
        return 0


async def wait_runs(layout: Layout, count: int) -> None:
    """Wait (bounded) until the agent has started ``count`` runs."""
    with trio.fail_after(30):
        for _ in range(100_000):
            if run_count(layout.runs) >= count:
                return
            await trio.sleep(0.05)


# --------------------------------------------------------------------------- config


def inprocess_config(tmp_path: Path, **overrides: Any) -> Config:
    """A webchat + echo config for an in-process ``Daemon`` under ``tmp_path``."""
    data: dict[str, Any] = {
        "daemon": {"state_dir": str(tmp_path / "state")},
        "store": {"url": "sqlite:///" + str(tmp_path / "journal.sqlite")},
        "control": {"socket": str(tmp_path / "run" / "control.sock")},
        "limits": {"stop_deadline_ms": 2000},
        "connections": [{"id": "web", "kind": "webchat", "listen": "127.0.0.1:0"}],
        "agents": {"echo": {"kind": "echo"}},
        "grants": [{"connection": "web", "actors": ["*"], "aliases": ["echo"]}],
    }
    data.update(overrides)
    return parse_config(data)


_PORT_PICKS = random.SystemRandom()
_HANDED_OUT: set[int] = set()
PICKED_PORTS = range(20_000, 32_768)
"""Where :func:`free_port` picks: below Linux's ephemeral range (32768-60999 by default),
from which every ``bind(port 0)`` listener of any process on the machine and every
outgoing connection take their port."""


def free_port() -> int:
    """A loopback port free now, for a server that binds it later (a daemon, from its
    config). Not the kernel's pick (``bind(0)``): that port is back in the ephemeral pool
    once closed, and any listener on port 0 started meanwhile (a fake, another suite's
    test) can take it before the daemon binds — seen as ``Address already in use`` under
    load. A random port of :data:`PICKED_PORTS` is taken only by another such pick."""
    while True:
        port = _PORT_PICKS.choice(PICKED_PORTS)
        if port in _HANDED_OUT:
            continue  # never twice in one process (``[free_port(), free_port()]``)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue  # in use (or lingering): another one
        _HANDED_OUT.add(port)
        return port


@attrs.frozen
class Layout:
    root: Path
    port: int
    store_url: str | None = None
    """A ``postgresql://`` store for the daemon; ``None``: the SQLite file :attr:`db`."""

    @property
    def config(self) -> Path:
        return self.root / "prismd.toml"

    @property
    def db(self) -> Path:
        return self.root / "journal.sqlite"

    @property
    def url(self) -> str:
        """The daemon's ``[store] url``."""
        return self.store_url or f"sqlite:///{self.db}"

    @property
    def control(self) -> Path:
        return self.root / "run" / "control.sock"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def runs(self) -> Path:
        return self.root / "runs.log"


def write_config(
    root: Path,
    *,
    delay_ms: int = 60_000,
    stop_deadline_ms: int = 3_000,
    lease_ttl_ms: int = 30_000,
    port: int | None = None,
    extra: str = "",
    agent_extra: str = "",
    store_url: str | None = None,
    store_extra: str = "",
) -> Layout:
    layout = Layout(root=root, port=port or free_port(), store_url=store_url)
    layout.config.write_text(
        f"""
[daemon]
state_dir = "{layout.state_dir}"

[store]
url = "{layout.url}"
{store_extra}

[limits]
stop_deadline_ms = {stop_deadline_ms}
lease_ttl_ms = {lease_ttl_ms}

[control]
socket = "{layout.control}"

[[connections]]
id = "web"
kind = "webchat"
listen = "127.0.0.1:{layout.port}"

[agents.slow]
kind = "python"
factory = "tests.daemon.helpers:counting_mock"
count_file = "{layout.runs}"
delay_ms = {delay_ms}
{agent_extra}

[[grants]]
connection = "web"
actors = ["*"]
aliases = ["slow"]
{extra}
"""
    )
    return layout


def live_leases(layout: Layout) -> list[str]:
    """The namespaces of the leases that have not expired (wall clock), read beside the
    daemon straight from its store's table (SQLite file or PostgreSQL schema)."""
    now_ms = int(time.time() * 1000)
    if layout.store_url is not None:
        table = f'"{pgserver.schema_of(layout.store_url)}".prism_leases'
        rows = pgserver.run_sql(
            layout.store_url, f"SELECT namespace FROM {table} WHERE expires_at > $1", now_ms
        )
        return [str(row[0]) for row in rows]
    if not layout.db.exists():
        return []
    with contextlib.closing(sqlite3.connect(layout.db)) as conn:
        found = conn.execute(
            "SELECT namespace FROM prism_leases WHERE expires_at > ?", (now_ms,)
        ).fetchall()
    return [str(row[0]) for row in found]


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "WATCHDOG_USEC")}
    env["PYTHONPATH"] = str(REPO)
    env.update(extra)
    return env


# --------------------------------------------------------------------------- daemon process


@attrs.define(eq=False)
class DaemonProcess:
    """A `prismd run` subprocess with its stderr in a file and a NOTIFY_SOCKET to listen on."""

    layout: Layout
    process: trio.Process
    notify: trio.socket.SocketType
    stderr_path: Path
    states: list[str] = attrs.field(factory=list)

    async def wait_state(self, wanted: str, limit_s: float = 30) -> None:
        with trio.fail_after(limit_s):
            while wanted not in self.states:
                exited = self.process.returncode is not None
                with trio.move_on_after(0.2) as idle:
                    data = await self.notify.recv(4096)
                    self.states.extend(data.decode().splitlines())
                if idle.cancelled_caught and exited:
                    raise AssertionError(f"daemon exited without {wanted}: {self.stderr()}")

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def send(self, signum: int) -> None:
        self.process.send_signal(signum)

    async def wait_exit(self, limit_s: float = 30) -> int:
        with trio.fail_after(limit_s):
            return await self.process.wait()


@asynccontextmanager
async def running_daemon(
    layout: Layout,
    *,
    tag: str = "run",
    extra_env: Mapping[str, str] | None = None,
    args: tuple[str, ...] = (),
    preexec: Callable[[], None] | None = None,
) -> AsyncIterator[DaemonProcess]:
    """`prismd run` on ``layout``; ``preexec`` runs in the child before it starts (to lower a
    resource limit, say)."""
    notify_path = layout.root / f"notify-{tag}.sock"
    sock = trio.socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    await sock.bind(str(notify_path))
    stderr_path = layout.root / f"stderr-{tag}.log"
    env = child_env(NOTIFY_SOCKET=str(notify_path), **(extra_env or {}))
    err = os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "prismd", "run", "--config", str(layout.config), *args],
            stdin=subprocess.DEVNULL,
            stdout=err,
            stderr=err,
            env=env,
            cwd=str(layout.root),
            preexec_fn=preexec,
        )
    finally:
        os.close(err)
    daemon = DaemonProcess(layout=layout, process=process, notify=sock, stderr_path=stderr_path)
    try:
        yield daemon
    finally:
        if process.returncode is None:
            process.send_signal(signal.SIGKILL)
            with trio.move_on_after(10, shield=True):
                await process.wait()
        sock.close()


# --------------------------------------------------------------------------- web chat client


@attrs.define(eq=False)
class ChatClient:
    ws: Any
    actor: str

    async def send_message(self, client_id: str, text: str) -> dict[str, Any]:
        await self.ws.send_message(json.dumps({"type": "message", "id": client_id, "text": text}))
        return await self.next_frame("admission")

    async def next_frame(self, kind: str, limit_s: float = 30) -> dict[str, Any]:
        with trio.fail_after(limit_s):
            while True:
                frame: dict[str, Any] = json.loads(await self.ws.get_message())
                if frame.get("type") == kind:
                    return frame


_RESUME_TOKENS: dict[tuple[int, str], str] = {}
"""The resume token each (port, actor) was issued, as a browser keeps it: a later hello for
the same actor must carry it. A stale entry (a new daemon on a reused port) is harmless: an
actor the journal does not know is simply issued a new token."""


@asynccontextmanager
async def chat(port: int, actor: str = "crash-actor-0001") -> AsyncIterator[ChatClient]:
    with trio.fail_after(30):
        async with trio_websocket.open_websocket_url(f"ws://127.0.0.1:{port}/ws") as ws:
            hello = {"type": "hello", "actor": actor}
            known = _RESUME_TOKENS.get((port, actor))
            if known is not None:
                hello["resume"] = known
            await ws.send_message(json.dumps(hello))
            client = ChatClient(ws=ws, actor=actor)
            ready = await client.next_frame("ready")
            if isinstance(ready.get("resume"), str):
                _RESUME_TOKENS[(port, actor)] = ready["resume"]
            yield client


# --------------------------------------------------------------------------- prismctl


async def prismctl(layout: Layout, *args: str, limit_s: float = 30) -> tuple[int, Any, str]:
    """Run `python -m prismd.ctl --socket … --json ARGS`; returns (code, parsed stdout, stderr)."""
    with trio.fail_after(limit_s):
        done = await trio.run_process(
            [
                sys.executable,
                "-m",
                "prismd.cli.prismctl",
                "--socket",
                str(layout.control),
                "--json",
                *args,
            ],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=child_env(),
            cwd=str(layout.root),
        )
    out = done.stdout.decode()
    try:
        parsed = json.loads(out) if out.strip() else None
    except ValueError:
        parsed = out
    return done.returncode, parsed, done.stderr.decode()


def slow_start_mock(ctx: AgentContext) -> MockAgent:
    """A ``python`` agent factory that blocks the start: it touches ``marker_file`` and then
    sleeps ``sleep_s`` (synchronously, as a slow import would), so a test can signal the
    daemon while it is still opening."""
    import time

    own = ("factory", "marker_file", "sleep_s")
    Path(str(ctx.options["marker_file"])).write_text("opening\n")
    time.sleep(float(ctx.options.get("sleep_s", 1.0)))
    options = {k: v for k, v in ctx.options.items() if k not in own}
    return MockAgent.from_context(attrs.evolve(ctx, options=options))


def failing_factory(ctx: AgentContext) -> MockAgent:
    """A ``python`` agent factory that raises an arbitrary error carrying a secret-like text."""
    raise RuntimeError(f"factory exploded with {ctx.options.get('secret_text', '')}")
