"""A real ``prismd run`` (SQLite, the web chat, push and streams) against the official
a2a-sdk 1.3.0 server in a subprocess, SIGKILLed at a random moment while a message is on
its way — before the send, between the send and its task id, while the task is streamed
and pushed, around the answer — then started again: each message reaches the SDK agent at
most once (its tasks' histories say which ``messageId`` it saw), is answered in the chat at
most once, and one that was neither answered nor told is listed by ``list-unresolved``.
The moments are drawn at random (the seed is printed; ``A2A_KILL_SEED=<seed>`` replays
them)."""

from __future__ import annotations

import os
import random
import re
import signal
from collections import defaultdict
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from prismd.agents.a2a import NOTICES, A2AClient
from tests.agents.sdk_peer import running_sdk_agent
from tests.daemon.helpers import Layout, chat, free_port, prismctl, running_daemon

pytestmark = pytest.mark.slow
ACTOR = "a2a-killed-actor-01"
DELAY_S = 1.5
"""The SDK agent's time per answer: a kill drawn in [0, 2 s) after the message's
admission lands before, during and after the remote task."""


def _layout(root: Path, url: str, protocol: str = "auto", max_poll_ms: int = 1000) -> Layout:
    layout = Layout(root=root, port=free_port())
    layout.config.write_text(
        f"""
[daemon]
state_dir = "{layout.state_dir}"

[store]
url = "{layout.url}"

[limits]
stop_deadline_ms = 3000

[control]
socket = "{layout.control}"

[a2a]
push_listen = "127.0.0.1:{free_port()}"

[[connections]]
id = "web"
kind = "webchat"
listen = "127.0.0.1:{layout.port}"

[agents.remote]
kind = "a2a"
url = "{url}"
protocol = "{protocol}"
poll_interval_ms = 200
max_poll_interval_ms = {max_poll_ms}

[[grants]]
connection = "web"
actors = ["*"]
aliases = ["remote"]
"""
    )
    return layout


async def _seen_by_the_agent(url: str) -> dict[str, int]:
    """How many of the SDK agent's tasks hold each ``messageId`` prismd sent."""
    async with httpx.AsyncClient() as http:
        client = await A2AClient.discover(http, url=url)
        try:
            tasks, _ = await client.list_tasks(page_size=100)
        finally:
            await client.aclose()
    seen: dict[str, int] = defaultdict(int)
    for task in tasks:
        for message_id in set(task.message_ids):
            if message_id.startswith("prismd-"):
                seen[message_id] += 1
    return dict(seen)


@attrs.define
class Replies:
    """The reply frames the chat showed, by the client id of the message they answer."""

    by_message: dict[str, set[str]] = attrs.field(factory=lambda: defaultdict(set))

    def add(self, frame: dict[str, Any]) -> None:
        self.by_message[str(frame.get("inReplyTo"))].add(str(frame["text"]))


async def _collect(client: Any, replies: Replies, until_s: float) -> None:
    with trio.move_on_after(until_s):
        while True:
            replies.add(await client.next_frame("reply", limit_s=until_s + 1))


async def test_a_sigkill_at_a_random_moment_sends_and_answers_at_most_once(
    tmp_path: Path,
) -> None:
    seed = int(os.environ.get("A2A_KILL_SEED") or random.randrange(2**32))
    rng = random.Random(seed)
    moments = [rng.uniform(0.0, 2.0) for _ in range(2)]
    print(f"seed {seed}: SIGKILL {moments} s after each admission")
    replies = Replies()
    with trio.fail_after(60):
        async with running_sdk_agent(tmp_path, DELAY_S) as url:
            layout = _layout(tmp_path, url)
            logs: list[str] = []
            answered = 0
            for n, moment in enumerate(moments, start=1):
                async with running_daemon(layout, tag=f"{n}-killed") as d:
                    await d.wait_state("READY=1")
                    async with chat(layout.port, ACTOR) as client:
                        admission = await client.send_message(f"m{n}", f"question {n} zq")
                        assert admission["status"] == "accepted"
                        await _collect(client, replies, moment)
                    d.send(signal.SIGKILL)
                    assert await d.wait_exit() == -signal.SIGKILL
                    logs.append(d.stderr())
                async with running_daemon(layout, tag=f"{n}-again") as d:
                    await d.wait_state("READY=1")
                    async with chat(layout.port, ACTOR) as client:
                        with trio.move_on_after(15):
                            while f"m{n}" not in replies.by_message:
                                replies.add(await client.next_frame("reply", limit_s=15))
                        await _collect(client, replies, 1.0)  # and nothing more
                    code, unresolved, _ = await prismctl(layout, "list-unresolved")
                    assert code == 0
                    d.send(signal.SIGTERM)
                    assert await d.wait_exit() == 0
                    logs.append(d.stderr())
                shown = replies.by_message.get(f"m{n}", set())
                may_have = f"Request failed: {NOTICES['unknown']}"
                # Answered once (or told its fate once), or listed for the operator.
                assert len(shown) <= 1, shown
                assert all(
                    text == may_have or re.fullmatch(rf"sdk\[[12]\]: question {n} zq", text)
                    for text in shown
                ), shown
                if not shown:
                    assert unresolved, f"m{n}: neither answered nor listed"
                elif shown != {may_have}:
                    answered += 1
            seen = await _seen_by_the_agent(url)
    assert all(count == 1 for count in seen.values()), seen
    assert len(seen) >= answered  # each answer came from a task the agent holds
    for log in logs:
        assert "zq" not in log and "Traceback" not in log


@pytest.mark.parametrize(
    ("signum", "protocol"),
    [(signal.SIGKILL, "1.0"), (signal.SIGTERM, "1.0"), (signal.SIGKILL, "0.3")],
)
async def test_a_daemon_stopped_while_the_send_waits_for_its_answer_finds_the_task(
    tmp_path: Path, signum: int, protocol: str
) -> None:
    """A slow peer: the SDK agent makes its task known 4 s after the message arrived, so
    the send waits for its answer that long, and the daemon is SIGKILLed (or stopped:
    a stop does not wait for the peer) meanwhile. The send may have landed (it did): after
    the restart the task is found — v1.0 by ``ListTasks`` (its ``messageId``), v0.3 by the
    push that carries the send's credential — followed and answered once: not sent again,
    not left for an operator to guess."""
    with trio.fail_after(60):
        async with running_sdk_agent(tmp_path, 0.5) as url:
            layout = _layout(tmp_path, url, protocol, max_poll_ms=8000)
            async with running_daemon(layout, tag="stopped") as d:
                await d.wait_state("READY=1")
                async with chat(layout.port, ACTOR) as client:
                    admission = await client.send_message("m1", "late:4 zq")
                    assert admission["status"] == "accepted"
                    await trio.sleep(1.0)
                d.send(signum)
                assert await d.wait_exit() == (0 if signum == signal.SIGTERM else -signum)
            replies = Replies()
            async with running_daemon(layout, tag="again") as d:
                await d.wait_state("READY=1")
                async with chat(layout.port, ACTOR) as client:
                    with trio.move_on_after(25):
                        replies.add(await client.next_frame("reply", limit_s=25))
                    await _collect(client, replies, 1.0)
                code, unresolved, _ = await prismctl(layout, "list-unresolved")
                d.send(signal.SIGTERM)
                assert await d.wait_exit() == 0
            assert dict(replies.by_message) == {"m1": {"sdk[1]: late:4 zq"}}
            assert code == 0 and unresolved == []
            assert list((await _seen_by_the_agent(url)).values()) == [1]
