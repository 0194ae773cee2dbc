"""prismd beside discord.py on the same fake Discord: CPU per message, and a duplicated
dispatch. Not a test (it needs discord.py, which prismd does not depend on); run it by
hand with an interpreter that has discord.py installed::

    python -m venv /tmp/dpy && /tmp/dpy/bin/pip install discord.py
    .venv/bin/python -m tests.discord.peer_bench --discordpy /tmp/dpy/bin/python \
        [--messages 300] [--rounds 3]

Each bot (``prismd run`` with the ``echo`` agent and its SQLite journal; a discord.py echo
bot that replies to every DM) gets the same DMs from the fake, sent in bursts of 10; the
bot process's CPU time (utime + stime from /proc) is read before the first message and
after the last answer, and the REST requests it made meanwhile are counted. Then one
MESSAGE_CREATE is delivered twice (Discord's "up to N times"): the answers to it are
counted. With ``--rounds N`` the two bots run alternately N times each (on a shared machine
compare within a round) and the medians are printed last. With ``--spacing-ms X`` the DMs
come one every X ms instead (both bots then answer each message alone, at the same pace:
prismd's own pacing to Discord's global limit no longer sets its window apart). Neither bot
is rate limited unless ``--discord-limits``: then the fake answers as Discord does (5 posts a
channel in 5 s, 50 requests a second in all, 429 past them), and the messages answered and the
429s received are what to read. The CPU is given per DM sent and per DM answered: a bot that
answers fewer within the window (discord.py under 429s) has spent its CPU on fewer answers;
``--patience-s`` (default 60) is how long after the last DM the bench waits for them all.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import trio

from tests.daemon.helpers import Layout, child_env, free_port
from tests.fakes.discord_api import FakeDiscord
from tests.support.waiting import wait_until

TOKEN = "discord-bot-token-secret"
USER = "2000000000000000001"
DM = "3000000000000000001"
USERS = 30

DPY_BOT = """
import sys, discord, yarl
from discord.gateway import DiscordWebSocket
from discord.http import Route
Route.BASE = sys.argv[1] + "/api/v10"
DiscordWebSocket.DEFAULT_GATEWAY = yarl.URL(sys.argv[3])
client = discord.Client(intents=discord.Intents.default())

@client.event
async def on_message(message):
    if message.author.id != client.user.id:
        await message.channel.send(message.content)

client.run(sys.argv[2], log_handler=None)
"""


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


Result = tuple[float, float, float, int, int, int]
"""CPU seconds, wall seconds, REST requests per message, messages answered (within the
patience after the last DM), 429s received, answers to a duplicated dispatch."""


async def measure(
    fake: FakeDiscord,
    process: trio.Process,
    messages: int,
    spacing_s: float = 0.0,
    patience_s: float = 60.0,
) -> tuple[float, float, float, int, int]:
    """CPU seconds, wall seconds, requests a message, messages answered, 429s received."""
    with trio.fail_after(60):
        await wait_until(lambda: bool(fake.gateway.sessions))
        await trio.sleep(1.0)
    start_cpu, started = cpu_seconds(process.pid), trio.current_time()
    answered_before = len(fake.bot_messages())
    requests_before = len(fake.requests)
    for n in range(messages):
        user = str(int(USER) + n % USERS)  # 30 conversations, as many DMs each
        fake.user_message(str(int(DM) + n % USERS), user, f"m{n}")
        if spacing_s:
            await trio.sleep_until(started + spacing_s * (n + 1))
        elif n % 10 == 9:
            await trio.sleep(0.01)
    with trio.move_on_after(patience_s):
        await wait_until(lambda: len(fake.bot_messages()) - answered_before >= messages, 0.02)
    answered = len(fake.bot_messages()) - answered_before
    cpu, wall = cpu_seconds(process.pid) - start_cpu, trio.current_time() - started
    made = fake.requests[requests_before:]
    refused = sum(1 for r in made if r.status == 429)
    return cpu, wall, len(made) / messages, answered, refused


async def duplicate_answers(fake: FakeDiscord) -> int:
    fake.gateway.duplicate_next = 1
    sent = fake.user_message(DM, USER, "twice?")
    await trio.sleep(3.0)
    return sum(
        1
        for m in fake.bot_messages()
        if m["content"] == "twice?"
        or m.get("message_reference", {}).get("message_id") == sent["id"]
    )


def _fake(limits: bool) -> FakeDiscord:
    """The fake, with Discord's rate limits (``limits``: 5 a channel in 5 s, 50 a second in
    all, 429 past them) or none (the CPU of the work itself, without pacing)."""
    fake = FakeDiscord(token=TOKEN)
    if not limits:
        fake.route_limit = fake.global_limit = 100_000
    return fake


async def run_prismd(
    messages: int, spacing_s: float = 0.0, limits: bool = False, patience_s: float = 60.0
) -> Result:
    fake = _fake(limits)
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        with tempfile.TemporaryDirectory() as tmp:
            layout = Layout(root=Path(tmp), port=free_port())
            layout.config.write_text(
                f"""
[daemon]
state_dir = "{layout.state_dir}"
[store]
url = "sqlite:///{layout.db}"
[control]
socket = "{layout.control}"
[[connections]]
id = "dc"
kind = "discord"
token_env = "PRISM_BENCH_DISCORD_TOKEN"
api_origin = "{fake.origin}"
shards = 1
[agents.echo]
kind = "echo"
[[grants]]
connection = "dc"
actors = ["*"]
aliases = ["echo"]
"""
            )
            env = child_env(PRISM_BENCH_DISCORD_TOKEN=TOKEN)
            command = [sys.executable, "-m", "prismd", "run", "--config", str(layout.config)]
            process = await trio.lowlevel.open_process(command, env=env)
            try:
                measured = await measure(fake, process, messages, spacing_s, patience_s)
                twice = await duplicate_answers(fake)
            finally:
                process.terminate()
                await process.wait()
        nursery.cancel_scope.cancel()
    return (*measured, twice)


async def run_discordpy(
    python: str,
    messages: int,
    spacing_s: float = 0.0,
    limits: bool = False,
    patience_s: float = 60.0,
) -> Result:
    fake = _fake(limits)
    async with trio.open_nursery() as nursery:
        await nursery.start(fake.serve)
        command = [python, "-c", DPY_BOT, fake.origin, TOKEN, fake.gateway_url]
        process = await trio.lowlevel.open_process(command)
        try:
            measured = await measure(fake, process, messages, spacing_s, patience_s)
            twice = await duplicate_answers(fake)
        finally:
            process.terminate()
            await process.wait()
        nursery.cancel_scope.cancel()
    return (*measured, twice)


def show(name: str, messages: int, result: Result) -> None:
    cpu, wall, requests, answered, refused, twice = result
    per_answer = f"{cpu * 1000 / answered:.2f}" if answered else "-"
    print(
        f"{name}: {answered} of {messages} DMs answered in {wall:.2f} s, "
        f"CPU {cpu * 1000 / messages:.2f} ms/message ({per_answer} per answer), "
        f"{requests:.2f} requests/message "
        f"({refused} answered 429), a duplicated dispatch answered {twice} time(s)",
        flush=True,
    )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--discordpy", required=True, help="a python with discord.py installed")
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument(
        "--discord-limits",
        action="store_true",
        help="the fake enforces Discord's rate limits (5 a channel in 5 s, 50 a second in "
        "all, 429 past them) for both bots, as Discord does; without it neither is limited",
    )
    parser.add_argument(
        "--spacing-ms",
        type=float,
        default=0.0,
        help="one DM every this many ms instead of bursts of 10 (each bot then handles "
        "each message alone, at the same pace; 25 is under prismd's 50 replies a second)",
    )
    parser.add_argument(
        "--patience-s",
        type=float,
        default=60.0,
        help="how long after the last DM to wait for every answer before the CPU is read "
        "(under --discord-limits a bot slowed by 429s may need more than the default minute "
        "to answer them all: then its CPU per answer covers all its work)",
    )
    args = parser.parse_args()
    spacing_s = args.spacing_ms / 1000
    cpu: dict[str, list[float]] = {"prismd": [], "discord.py": []}
    per_answer: dict[str, list[float]] = {"prismd": [], "discord.py": []}
    for _round in range(args.rounds):
        for name in cpu:
            if name == "prismd":
                result = await run_prismd(
                    args.messages, spacing_s, args.discord_limits, args.patience_s
                )
            else:
                result = await run_discordpy(
                    args.discordpy, args.messages, spacing_s, args.discord_limits, args.patience_s
                )
            show(name, args.messages, result)
            cpu[name].append(result[0] * 1000 / args.messages)
            per_answer[name].append(result[0] * 1000 / max(result[3], 1))
    if args.rounds > 1:
        ratios = [p / d for p, d in zip(cpu["prismd"], cpu["discord.py"], strict=True)]
        print(
            f"medians: prismd {statistics.median(cpu['prismd']):.2f} ms/message, "
            f"discord.py {statistics.median(cpu['discord.py']):.2f}; "
            f"prismd / discord.py per round {statistics.median(ratios):.2f}x "
            f"(min {min(ratios):.2f}, max {max(ratios):.2f}); per answer: prismd "
            f"{statistics.median(per_answer['prismd']):.2f} ms, discord.py "
            f"{statistics.median(per_answer['discord.py']):.2f}"
        )


if __name__ == "__main__":
    trio.run(main)
