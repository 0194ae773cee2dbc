"""The harness of the alt-fake scenarios (:mod:`tests.discord.test_alt_fake`,
:mod:`tests.discord.test_alt_fake_rest`): a daemon's config on the second fake Discord
(:mod:`tests.fakes.discord_alt`), the world a scenario runs in, and the settle-and-check
every scenario ends with — every user message answered exactly once or listed by
``prismctl list-unresolved``, no reply posted twice, no 1000/1001 close.
"""

from __future__ import annotations

import os
import random
import secrets
import signal
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import trio
import trio.testing

from prismd.journal import operation_id_for
from tests.daemon.helpers import DaemonProcess, Layout, prismctl, running_daemon
from tests.discord.test_killloop_discord import _config as _killloop_config
from tests.discord.test_killloop_discord import _op_states
from tests.fakes.discord_alt import AltDiscord

TOKEN = "alt-discord-token-secret"
USERS = ("2100000000000000001", "2100000000000000002", "2100000000000000003")
CHANNELS = {u: f"31{u[2:]}" for u in USERS}
ENV = {"PRISM_TEST_DISCORD_TOKEN": TOKEN}


def _config(
    root: Path,
    fake: AltDiscord,
    seed: int,
    connection: str = "",
    sweep_every_s: int = 2,
    shards: int = 1,
    delay_max_ms: int = 150,
) -> Layout:
    """The kill loops' daemon config (:func:`tests.discord.test_killloop_discord._config`)
    on the second fake, swept every ``sweep_every_s``."""
    return _killloop_config(
        root,
        fake,
        seed,
        connection=f"sweep_every_s = {sweep_every_s}\n{connection}",
        delay_max_ms=delay_max_ms,
        shards=shards,
    )


@asynccontextmanager
async def _world(
    tmp_path: Path, nursery: trio.Nursery, **knobs: Any
) -> AsyncIterator[tuple[AltDiscord, Layout, random.Random, str]]:
    seed = int(os.environ.get("PRISM_ALT_SEED", secrets.randbits(32)))
    knobs.setdefault("heartbeat_interval_ms", 1000)
    fake = AltDiscord(token=TOKEN, rng=random.Random(seed), **knobs)
    await nursery.start(fake.serve)
    for user, channel in CHANNELS.items():
        fake.open_dm(user, channel)
    yield fake, _config(tmp_path, fake, seed), random.Random(f"{seed}:test"), f"seed={seed}"


async def _health_entry(layout: Layout) -> dict[str, str]:
    """The Discord connection's entry of ``prismctl health``."""
    code, health, err = await prismctl(layout, "health")
    assert code == 0, err
    return dict(next(v for k, v in health["children"].items() if "dc" in k))


async def _adapter_state(layout: Layout) -> str:
    return str((await _health_entry(layout)).get("adapterState"))


async def _state_is(layout: Layout, wanted: str) -> None:
    """Until ``prismctl health`` shows the connection in state ``wanted``."""
    while True:
        if await _adapter_state(layout) == wanted:
            return
        await trio.sleep(0.2)


async def _connected(layout: Layout) -> None:
    await _state_is(layout, "connected")


async def _settle(fake: AltDiscord, layout: Layout, sent: list[dict[str, Any]], tag: str) -> str:
    """Until every message is answered, listed, or settled ``cancelled`` by a graceful stop
    (SIGTERM settles what was queued or running then, as in the other kill loops), and
    nothing moved for 3 s; then the checks: none answered twice, none lost. A summary
    line."""
    last: Any = None
    stable = trio.current_time()
    entries: list[dict[str, Any]] = []
    deadline = trio.current_time() + 30
    while True:
        await trio.sleep(0.5)
        if trio.current_time() > deadline:
            replies = _replies(fake)
            states = _op_states(layout)
            missing = [
                (m["content"][:12], states.get(operation_id_for("dc", m["id"]), "no record"))
                for m in sent
                if not replies[m["id"]]
            ]
            raise AssertionError(f"{tag}: never settled; unanswered {missing}; {entries}")
        code, entries, err = await prismctl(layout, "list-unresolved")
        assert code == 0, f"{tag}: {err}"
        replies = _replies(fake)
        listed = {str(e.get("externalEventId", "")) for e in entries} | {
            str(e.get("operationId", "")) for e in entries
        }
        # A reply still pending is on its way (a rate limit's wait): not settled yet.
        pending = any(e.get("replyState") == "pending" for e in entries)
        done = not pending and all(_ended(m, replies, entries, layout) for m in sent)
        snapshot = (len(fake.bot_messages()), len(entries), tuple(sorted(listed)))
        if snapshot != last:
            last, stable = snapshot, trio.current_time()
        elif done and trio.current_time() - stable >= 3.0:
            break
    contents = Counter(
        (m.get("message_reference", {}).get("message_id"), m["content"])
        for m in fake.bot_messages()
    )
    twice = [c[1][:40] for c, n in contents.items() if n > 1]
    lost = [m["content"] for m in sent if not _ended(m, replies, entries, layout)]
    multi = [m["content"][:40] for m in sent if replies[m["id"]] > 1 and len(m["content"]) < 1900]
    summary = (
        f"{tag} sent={len(sent)} answered={sum(1 for m in sent if replies[m['id']])} "
        f"listed={len(entries)} identifies={len(fake.identifies)} resumes={len(fake.resumes)} "
        f"closes={Counter(fake.client_close_codes)} "
        f"listed_as={Counter((e.get('state'), e.get('replyState')) for e in entries)}"
    )
    assert not twice and not multi, f"{summary}: posted twice {twice} {multi}"
    assert not lost, f"{summary}: lost {lost}"
    assert not {1000, 1001} & set(fake.client_close_codes), summary
    return summary


def _replies(fake: AltDiscord) -> Counter[str]:
    """Bot messages per inbound message they answer (a preview answers none)."""
    return Counter(
        m["message_reference"]["message_id"]
        for m in fake.bot_messages()
        if "message_reference" in m
    )


def _ended(
    message: dict[str, Any],
    replies: Counter[str],
    entries: list[dict[str, Any]],
    layout: Layout,
) -> bool:
    """Answered, listed by ``list-unresolved``, or settled ``cancelled`` by a stop."""
    if replies[message["id"]] or _listed(message, entries):
        return True
    return _op_states(layout).get(operation_id_for("dc", message["id"])) == "cancelled"


def _listed(message: dict[str, Any], entries: list[dict[str, Any]]) -> bool:
    op = operation_id_for("dc", message["id"])
    return any(e.get("operationId") == op for e in entries)


async def _say(fake: AltDiscord, sent: list[dict[str, Any]], rng: random.Random, n: int) -> None:
    for _ in range(n):
        # Each user first in turn: a DM channel the bot never saw cannot be read back.
        user = USERS[len(sent)] if len(sent) < len(USERS) else rng.choice(USERS)
        sent.append(fake.user_message(CHANNELS[user], user, f"alt{len(sent)}"))
        await trio.sleep(rng.uniform(0.02, 0.15))


@asynccontextmanager
async def _connected_daemon(layout: Layout, tag: str) -> AsyncIterator[DaemonProcess]:
    """``prismd run`` on the second fake, once ready and its gateway connected."""
    async with running_daemon(layout, tag=tag, extra_env=ENV) as daemon:
        await daemon.wait_state("READY=1")
        await _connected(layout)
        yield daemon


async def _scenario(
    tmp_path: Path,
    nursery: trio.Nursery,
    fault: Callable[[AltDiscord], None],
    *,
    heal: Callable[[AltDiscord], None] | None = None,
    knobs: dict[str, Any] | None = None,
    connection: str = "",
    before: int = 6,
    after: int = 10,
    hold_s: float = 2.0,
) -> tuple[AltDiscord, Layout, str]:
    """A daemon connected to the fake: ``before`` messages, ``fault``, ``after`` more while
    it holds, ``heal`` after ``hold_s``; settled and checked (:func:`_settle`)."""
    async with _world(tmp_path, nursery, **(knobs or {})) as (fake, layout, rng, tag):
        if connection:
            layout = _config(layout.root, fake, rng.randrange(1 << 30), connection)
        sent: list[dict[str, Any]] = []
        with trio.fail_after(55):
            async with _connected_daemon(layout, "a") as daemon:
                await _say(fake, sent, rng, before)
                fault(fake)
                await _say(fake, sent, rng, after)
                await trio.sleep(hold_s)
                if heal is not None:
                    heal(fake)
                try:
                    summary = await _settle(fake, layout, sent, tag)
                except AssertionError:
                    print(daemon.stderr()[-6000:])
                    raise
                if os.environ.get("ALT_DEBUG"):
                    print("DEBUG", daemon.stderr())
                # Why the gateway reconnected, if it did (an assertion on the summary says).
                warned = [ln for ln in daemon.stderr().splitlines() if "WARNING" in ln]
                summary += f" warnings={warned[-4:]}"
                daemon.send(signal.SIGTERM)
                assert await daemon.wait_exit() == 0, daemon.stderr()
                assert TOKEN not in daemon.stderr()
                assert not [m for m in sent if m["content"] in daemon.stderr()]
        print(summary)
        return fake, layout, summary
