"""The ``on_typing`` hook (Telegram issue, issue 40): called once a turn's agent run has
lasted the connection's typing delay (default 1 s: an instant answer shows none) and every
4.5 s after that while it runs, from a child task cancelled when the run ends."""

from __future__ import annotations

import logging

import pytest
import trio

from tests.support.builders import event
from tests.support.harness import Host, runtime
from tests.support.scripted import ScriptedAgent


async def test_typing_after_the_delay_and_every_4_5s_until_the_run_ends(
    autojump_clock: trio.abc.Clock,
) -> None:
    gate = trio.Event()
    agent = ScriptedAgent(gate=gate)
    host = Host(agent=agent)
    calls: list[tuple[float, tuple[str, str, str | None]]] = []

    async def on_typing(conn: str, chat: str, thread: str | None) -> None:
        calls.append((trio.current_time(), (conn, chat, thread)))

    async with runtime(host, on_typing=on_typing) as rt:
        await rt.admit(event("1", thread="77"))
        await agent.wait_started(1)
        started = trio.current_time()
        await trio.sleep(11)
        gate.set()
        await rt.drain()
        await trio.sleep(30)
        assert host.texts == ["answer"]
    offsets = [round(t - started, 3) for t, _ in calls]
    assert offsets == [1.0, 5.5, 10.0]
    assert {c for _, c in calls} == {("tg-1", "chat-1", "77")}


async def test_an_instant_answer_shows_no_typing(autojump_clock: trio.abc.Clock) -> None:
    gate = trio.Event()
    agent = ScriptedAgent(gate=gate)
    host = Host(agent=agent)
    calls: list[float] = []

    async def on_typing(conn: str, chat: str, thread: str | None) -> None:
        calls.append(trio.current_time())

    async with runtime(host, on_typing=on_typing) as rt:
        await rt.admit(event("1"))
        await agent.wait_started(1)
        await trio.sleep(0.999)
        gate.set()
        await rt.drain()
        await trio.sleep(30)
        assert host.texts == ["answer"]
    assert calls == []


async def test_the_delay_is_the_connections(autojump_clock: trio.abc.Clock) -> None:
    """``typing_delay_ms`` is asked per connection id; 0 starts at once, a bad answer (or a
    failing lookup) falls back to the default, a huge one is capped at 60 s."""
    asked: list[str] = []
    delays: dict[str, object] = {"tg-1": 0, "tg-2": 2500, "tg-3": "soon", "tg-4": 10**9}

    def typing_delay_ms(conn: str) -> int:
        asked.append(conn)
        if conn == "tg-5":
            raise RuntimeError("lookup failed")
        return delays[conn]  # type: ignore[return-value]

    for conn, expected in (
        ("tg-1", 0.0),
        ("tg-2", 2.5),
        ("tg-3", 1.0),
        ("tg-4", 60.0),
        ("tg-5", 1.0),
    ):
        gate = trio.Event()
        agent = ScriptedAgent(gate=gate)
        host = Host(agent=agent)
        calls: list[float] = []

        async def on_typing(
            conn: str, chat: str, thread: str | None, calls: list[float] = calls
        ) -> None:
            calls.append(trio.current_time())

        async with runtime(host, on_typing=on_typing, typing_delay_ms=typing_delay_ms) as rt:
            await rt.admit(event("1", conn=conn))
            await agent.wait_started(1)
            started = trio.current_time()
            await trio.sleep(expected + 0.5)
            gate.set()
            await rt.drain()
        assert [round(t - started, 3) for t in calls] == [expected], conn
    assert asked == ["tg-1", "tg-2", "tg-3", "tg-4", "tg-5"]


async def test_no_typing_for_commands_and_denials(autojump_clock: trio.abc.Clock) -> None:
    calls: list[str] = []

    async def on_typing(conn: str, chat: str, thread: str | None) -> None:
        calls.append(conn)

    host = Host()
    async with runtime(host, on_typing=on_typing) as rt:
        await rt.admit(event("1", "/help"))
        await rt.drain()
    assert calls == [] and len(host.texts) == 1


async def test_failing_typing_is_logged_by_type_and_never_breaks_the_turn(
    autojump_clock: trio.abc.Clock, caplog: pytest.LogCaptureFixture
) -> None:
    gate = trio.Event()
    agent = ScriptedAgent(gate=gate)
    host = Host(agent=agent)
    attempts = 0

    async def on_typing(conn: str, chat: str, thread: str | None) -> None:
        nonlocal attempts
        attempts += 1
        raise RuntimeError(f"secret-{chat}-token")

    caplog.set_level(logging.WARNING)
    async with runtime(host, on_typing=on_typing) as rt:
        await rt.admit(event("1"))
        await agent.wait_started(1)
        await trio.sleep(6)
        gate.set()
        await rt.drain()
    assert host.texts == ["answer"]
    assert attempts == 2
    assert "RuntimeError" in caplog.text
    assert "secret" not in caplog.text and "chat-1" not in caplog.text


async def test_hung_typing_never_blocks_the_turn(autojump_clock: trio.abc.Clock) -> None:
    gate = trio.Event()
    agent = ScriptedAgent(gate=gate)
    host = Host(agent=agent)
    entered = 0
    cancelled = 0

    async def on_typing(conn: str, chat: str, thread: str | None) -> None:
        nonlocal entered, cancelled
        entered += 1
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            cancelled += 1
            raise

    async with runtime(host, on_typing=on_typing) as rt:
        await rt.admit(event("1"))
        await agent.wait_started(1)
        await trio.sleep(2)  # the indicator started at 1 s and hangs
        assert entered == 1
        t0 = trio.current_time()
        gate.set()
        with trio.fail_after(1):
            await rt.drain()
        assert trio.current_time() - t0 < 1
        assert host.texts == ["answer"]
        await trio.sleep(20)
    assert entered == 1 and cancelled == 1


async def test_typing_task_is_cancelled_when_the_run_is_cancelled(
    autojump_clock: trio.abc.Clock,
) -> None:
    agent = ScriptedAgent(wait_for_cancel=True)
    host = Host(agent=agent)
    calls = 0

    async def on_typing(conn: str, chat: str, thread: str | None) -> None:
        nonlocal calls
        calls += 1

    async with runtime(host, on_typing=on_typing) as rt:
        await rt.admit(event("1"))
        await agent.wait_started(1)
        await trio.sleep(2)
        await rt.admit(event("2", "/cancel"))
        await rt.drain()
        before = calls
        await trio.sleep(20)
        assert calls == before == 1
        assert "Request cancelled." in host.texts


async def test_turns_of_several_connections_each_at_their_delay(
    autojump_clock: trio.abc.Clock,
) -> None:
    """One timer serves every running turn: a turn due sooner than the one it sleeps for
    (another connection's shorter delay) is started at its own time, a turn answered
    before its delay never is, and the runtime closes at once when the runs are done."""
    gate = trio.Event()
    agent = ScriptedAgent(gate=gate)
    host = Host(agent=agent)
    calls: list[tuple[str, float]] = []
    delays = {"tg-1": 3000, "tg-2": 500, "tg-3": 60_000}

    async def on_typing(conn: str, chat: str, thread: str | None) -> None:
        calls.append((conn, trio.current_time()))

    async with runtime(host, on_typing=on_typing, typing_delay_ms=lambda conn: delays[conn]) as rt:
        started = trio.current_time()
        for conn in ("tg-1", "tg-3", "tg-2"):
            await rt.admit(event("1", conn=conn))
        await agent.wait_started(3)
        await trio.sleep(4)
        gate.set()
        await rt.drain()
        closing = trio.current_time()
    assert trio.current_time() - closing < 0.1  # no timer left sleeping for tg-3's 60 s
    assert [(conn, round(at - started, 1)) for conn, at in calls] == [
        ("tg-2", 0.5),
        ("tg-1", 3.0),
    ]
