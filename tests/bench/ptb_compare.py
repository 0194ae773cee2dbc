"""prismd beside python-telegram-bot on one loopback fake Bot API (issue 40), and httpx's own
cost per request on Trio and on asyncio.

Not a test (pytest does not collect it; ``make test`` never runs it). Run it from the
repository with the project's interpreter, naming an interpreter that has PTB::

    python3 -m venv /tmp/ptb-venv && /tmp/ptb-venv/bin/pip install python-telegram-bot==22.8
    .venv/bin/python -m tests.bench.ptb_compare --ptb-python /tmp/ptb-venv/bin/python

Without an interpreter that imports ``telegram`` 22.8 it prints why and exits 0.

One run: the fake (:mod:`tests.fakes.telegram_api`, in this process, so its CPU is not
counted) holds ``--updates`` private text messages from ``--chats`` chats, all queued before
the bot starts; the bot under test is a subprocess — ``prismd run`` (SQLite journal,
``synchronous=FULL``, the ``echo`` agent) or PTB (``ApplicationBuilder`` with
``PicklePersistence``, default ``concurrent_updates``, an echo handler calling
``reply_text``). Measured from the bot's first ``getUpdates`` to its last echo: updates/s,
the bot's CPU (user + system, every thread, from ``/proc``) per update, and its Bot API
requests per update (``getUpdates`` included). Each round runs both bots with the fake's
sockets on ``TCP_NODELAY`` and without it (Nagle on, the default of most servers),
alternating which bot goes first. ``--prismd-only`` / ``--ptb-only`` run one of them (to
alternate two builds of prismd with PTB between them, each run from its own checkout).

``--httpx N``: also N sequential ``POST sendMessage`` through one ``httpx.AsyncClient`` in
a subprocess on Trio and in one on asyncio (the same library, the same fake): the client
process's CPU per request, so what Trio costs beside asyncio is known, not guessed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from prismd.cli._bench_live import Daemon, free_port, process_cpu_s, write_config
from tests.fakes.telegram_api import FakeBotApi

TOKEN = "123456:" + "b" * 35
PTB_VERSION = "22.8"
PTB_BOT = r"""
import sys

from telegram.ext import ApplicationBuilder, MessageHandler, PicklePersistence, filters


async def echo(update, context):
    await update.message.reply_text(update.message.text)


token, origin, path = sys.argv[1:4]
app = (
    ApplicationBuilder()
    .token(token)
    .base_url(f"{origin}/bot")
    .base_file_url(f"{origin}/file/bot")
    .persistence(PicklePersistence(path))
    .build()
)
app.add_handler(MessageHandler(filters.TEXT & ~filters.COMMAND, echo))
app.run_polling()
"""
HTTPX_CLIENT = r"""
import json, sys, time
import httpx

backend, origin, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
url = f"{origin}/bot{sys.argv[4]}/sendMessage"


async def main():
    async with httpx.AsyncClient(trust_env=False) as client:
        for i in range(20):
            (await client.post(url, json={"chat_id": "1000", "text": "warm"})).read()
        cpu = time.process_time()
        wall = time.perf_counter()
        for i in range(count):
            response = await client.post(url, json={"chat_id": "1000", "text": "ping"})
            json.loads(response.content)
        print(json.dumps({
            "cpu_ms_per_request": (time.process_time() - cpu) * 1000 / count,
            "requests_per_s": count / (time.perf_counter() - wall),
        }))


if backend == "trio":
    import trio
    trio.run(main)
else:
    import asyncio
    asyncio.run(main())
"""
PRISMD_TELEGRAM = """
[[connections]]
id = "tg"
kind = "telegram"
token_env = "PRISMD_BENCH_TOKEN"
api_origin = "{origin}"

[[grants]]
connection = "tg"
actors = ["*"]
aliases = ["bench"]
"""


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}


def ptb_available(python: str | None) -> str | None:
    """``None`` when ``python`` imports PTB 22.8, else why not."""
    if not python:
        return "no --ptb-python given"
    try:
        out = subprocess.run(
            [python, "-c", "import telegram; print(telegram.__version__)"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    except OSError as exc:
        return f"{python} cannot run ({type(exc).__name__})"
    version = out.stdout.strip()
    if out.returncode != 0:
        return f"{python} does not import telegram"
    if version != PTB_VERSION:
        return f"{python} has python-telegram-bot {version}, not {PTB_VERSION}"
    return None


def _message(update: int, chat: int) -> dict[str, Any]:
    return {
        "message": {
            "message_id": update,
            "from": {"id": chat, "is_bot": False, "first_name": "Bench"},
            "chat": {"id": chat, "type": "private", "first_name": "Bench"},
            "date": 1_700_000_000,
            "text": f"ping {update}",
        }
    }


async def run_one(
    system: str,
    *,
    nodelay: bool,
    updates: int,
    chats: int,
    ptb_python: str | None,
    profile: str | None = None,
) -> dict[str, Any]:
    """One bot against a fresh fake holding ``updates`` queued messages (see the module)."""
    fake = FakeBotApi(token=TOKEN, nodelay=nodelay)
    workdir = Path(tempfile.mkdtemp(prefix=f"tg-compare-{system}-"))
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        for i in range(updates):
            fake.push_update(_message(i + 1, 1000 + i % chats))
        daemon: Daemon | None = None
        process: trio.Process | None = None
        if system == "prismd":
            port = free_port()
            extra = PRISMD_TELEGRAM.format(origin=fake.origin)
            config = write_config(workdir, port=port, extra=extra)
            env = {**_clean_env(), "PRISMD_BENCH_TOKEN": TOKEN}
            daemon = await Daemon.start(workdir, config, env=env)
            process = daemon.process
        else:
            assert ptb_python is not None
            script = workdir / "ptb_echo.py"
            script.write_text(PTB_BOT)
            with (workdir / "bot.log").open("wb") as log:
                process = await trio.lowlevel.open_process(
                    [ptb_python, str(script), TOKEN, fake.origin, str(workdir / "ptb.pickle")],
                    stdout=log,
                    stderr=log,
                    env=_clean_env(),
                )
        try:
            with trio.fail_after(60):
                while not any(c.method == "getUpdates" for c in fake.calls):
                    if process.returncode is not None:
                        raise RuntimeError(f"{system} exited early ({workdir})")
                    await trio.sleep(0.002)
            spy = None
            if profile:
                out = f"{profile}-{system}-{'nodelay' if nodelay else 'nagle'}.txt"
                spy = subprocess.Popen(  # noqa: ASYNC220 (it runs beside the bot, not awaited)
                    [
                        *("py-spy", "record", "-p", str(process.pid), "-r", "200"),
                        *("-f", "raw", "--gil", "-o", out, "--nonblocking"),
                    ],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
            cpu0 = process_cpu_s(process.pid)
            start = time.perf_counter()
            first = next(i for i, c in enumerate(fake.calls) if c.method == "getUpdates")
            with trio.fail_after(600):
                while len(fake.sent) < updates:
                    if process.returncode is not None:
                        raise RuntimeError(f"{system} exited early ({workdir})")
                    await trio.sleep(0.002)
            cpu1 = process_cpu_s(process.pid)
            took = time.perf_counter() - start
            calls = fake.calls[first:]
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                await trio.to_thread.run_sync(spy.wait)
        finally:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                with trio.move_on_after(60):
                    await process.wait()
            if daemon is not None:
                await daemon.kill()
            elif process.returncode is None:
                process.kill()
        nursery.cancel_scope.cancel()
    shutil.rmtree(workdir, ignore_errors=True)  # kept when the run failed (its logs)
    by_method: dict[str, int] = {}
    for call in calls:
        by_method[call.method] = by_method.get(call.method, 0) + 1
    echoed = sum(1 for s in fake.sent if str(s.get("text", "")).startswith("ping "))
    assert cpu0 is not None and cpu1 is not None, "needs /proc"
    return {
        "system": system,
        "nodelay": nodelay,
        "updates_per_s": round(updates / took, 1),
        "cpu_ms_per_update": round((cpu1 - cpu0) * 1000 / updates, 3),
        "requests_per_update": round(len(calls) / updates, 3),
        "requests": by_method,
        "echoed": echoed,
        "seconds": round(took, 2),
    }


async def httpx_cost(backend: str, count: int) -> dict[str, Any]:
    """CPU per request of a bare ``httpx.AsyncClient`` on ``backend`` (a subprocess)."""
    fake = FakeBotApi(token=TOKEN)
    fake.chats.add("1000")
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        result = await trio.run_process(
            [sys.executable, "-c", HTTPX_CLIENT, backend, fake.origin, str(count), TOKEN],
            capture_stdout=True,
            env=_clean_env(),
        )
        nursery.cancel_scope.cancel()
    import json

    figures: dict[str, Any] = json.loads(result.stdout)
    return {"backend": backend, **{k: round(v, 4) for k, v in figures.items()}}


def _summary(runs: list[dict[str, Any]]) -> None:
    print("\nmedians:")
    keys = sorted({(r["system"], r["nodelay"]) for r in runs})
    for system, nodelay in keys:
        mine = [r for r in runs if (r["system"], r["nodelay"]) == (system, nodelay)]
        print(
            f"  {system:6} nodelay={nodelay!s:5}  "
            f"{statistics.median(r['updates_per_s'] for r in mine):7.1f} updates/s  "
            f"{statistics.median(r['cpu_ms_per_update'] for r in mine):6.3f} ms CPU/update  "
            f"{statistics.median(r['requests_per_update'] for r in mine):5.3f} requests/update"
            f"  ({len(mine)} runs)"
        )


async def main(args: argparse.Namespace) -> int:
    reason = ptb_available(args.ptb_python)
    systems = ["prismd"] if args.prismd_only else ["ptb"] if args.ptb_only else ["prismd", "ptb"]
    if reason is not None and not args.prismd_only:
        print(f"skipped: python-telegram-bot {PTB_VERSION} is not available: {reason}")
        return 0
    runs: list[dict[str, Any]] = []
    for round_no in range(args.rounds):
        order = systems if round_no % 2 == 0 else systems[::-1]
        for nodelay in (True, False) if not args.nodelay_only else (True,):
            for system in order:
                run = await run_one(
                    system,
                    nodelay=nodelay,
                    updates=args.updates,
                    chats=args.chats,
                    ptb_python=args.ptb_python,
                    profile=args.profile,
                )
                runs.append(run)
                print(run, flush=True)
    _summary(runs)
    if args.httpx:
        for backend in ("trio", "asyncio", "trio", "asyncio"):
            print(await httpx_cost(backend, args.httpx), flush=True)
    return 0


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--ptb-python", help="an interpreter with python-telegram-bot 22.8")
    parser.add_argument("--updates", type=int, default=2000)
    parser.add_argument("--chats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--httpx", type=int, default=0, metavar="N")
    parser.add_argument("--prismd-only", action="store_true")
    parser.add_argument("--ptb-only", action="store_true")
    parser.add_argument("--nodelay-only", action="store_true")
    parser.add_argument(
        "--profile", metavar="PREFIX", help="py-spy (on PATH) samples each bot: PREFIX-*.txt"
    )
    args = parser.parse_args(argv)
    return trio.run(main, args)


if __name__ == "__main__":
    sys.exit(cli())
