"""Signal's typing indicator (issue 40): signal-cli's ``sendTyping`` on a connection of its
own, started by the runtime's rule — only once a turn has run ``typing_delay_ms``, then
renewed while the agent runs; an instant answer sends none."""

from __future__ import annotations

from typing import Any

import trio
from trio.testing import MockClock

from prismd.agents import Agent
from prismd.channel import InboundEvent, Reply, SendResult
from prismd.limits import Limits
from prismd.runtime import ResolveAgentInput, open_messaging_runtime
from tests.fakes.signal_cli import FakeSignalCli
from tests.support.clocks import TrioClock
from tests.support.scripted import ScriptedAgent
from tests.telegram.test_end_to_end import authorize

from .conftest import CONN

PEER = "+15550002222"
GROUP = "group:" + "Z" * 43 + "="


async def test_send_typing_names_the_conversation(fake: FakeSignalCli, make_adapter: Any) -> None:
    adapter = make_adapter()
    assert adapter.features.typing and adapter.features.typing_delay_ms == 1000
    with trio.fail_after(10):
        await adapter.send_typing(PEER)
        await adapter.send_typing(GROUP)
        await adapter.send_typing("not a conversation")  # nothing to name: nothing sent
    assert [params for _at, params in fake.typing] == [
        {"recipient": [PEER]},
        {"groupId": GROUP.removeprefix("group:")},
    ]


async def test_a_failing_indicator_is_ignored(fake: FakeSignalCli, make_adapter: Any) -> None:
    adapter = make_adapter()
    await fake.kill()
    with trio.fail_after(10):
        await adapter.send_typing(PEER)  # signal-cli unreachable: no exception
    assert fake.typing == []


async def _turn(fake: FakeSignalCli, make_adapter: Any, run_for_s: float, **options: Any) -> float:
    """One turn answered after ``run_for_s`` with the daemon's wiring of the typing seams;
    the time the agent run started."""
    adapter = make_adapter(**options)
    agent = ScriptedAgent(gate=trio.Event())
    replies: list[Reply] = []

    async def resolve_agent(_inp: ResolveAgentInput) -> Agent:
        return agent

    async def deliver(reply: Reply) -> SendResult:
        replies.append(reply)
        return SendResult(delivered=True)

    async def on_typing(_conn: str, chat: str, thread: str | None) -> None:
        await adapter.send_typing(chat, thread)

    async with open_messaging_runtime(
        authorize=authorize,
        resolve_agent=resolve_agent,
        deliver=deliver,
        limits=Limits(),
        clock=TrioClock(),
        on_typing=on_typing,
        typing_delay_ms=lambda _conn: adapter.features.typing_delay_ms,
    ) as runtime:
        await runtime.admit(InboundEvent(CONN, PEER, PEER, "e1", text="hello"))
        await agent.wait_started(1)
        started = trio.current_time()
        await trio.sleep(run_for_s)
        assert agent.gate is not None
        agent.gate.set()
        with trio.fail_after(30):
            await runtime.drain()
        assert len(replies) == 1
        await trio.sleep(20)
    return started


async def test_an_instant_answer_shows_no_typing(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any
) -> None:
    await _turn(fake, make_adapter, 0.5)
    assert fake.typing == []


async def test_a_long_turn_shows_typing_from_the_delay_renewed(
    autojump_clock: MockClock, fake: FakeSignalCli, make_adapter: Any
) -> None:
    started = await _turn(fake, make_adapter, 7, typing_delay_ms=2000)
    assert [round(at - started, 3) for at, _params in fake.typing] == [2.0, 6.5]
    assert {str(params["recipient"]) for _at, params in fake.typing} == {str([PEER])}
