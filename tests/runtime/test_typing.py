"""The ``on_typing`` hook (Telegram issue): called when a turn's agent run starts and
every 4 s while it runs, from a child task cancelled when the run ends."""

from __future__ import annotations

import logging

import pytest
import trio

from tests.support.builders import event
from tests.support.harness import Host, runtime
from tests.support.scripted import ScriptedAgent


async def test_typing_at_start_and_every_4s_until_the_run_ends(
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
        await trio.sleep(9)
        gate.set()
        await rt.drain()
        await trio.sleep(30)
        assert host.texts == ["answer"]
    offsets = [round(t - started) for t, _ in calls]
    assert offsets == [0, 4, 8]
    assert {c for _, c in calls} == {("tg-1", "chat-1", "77")}


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
        await trio.sleep(5)
        gate.set()
        await rt.drain()
    assert host.texts == ["answer"]
    assert attempts == 2
    assert "RuntimeError" in caplog.text
    assert "secret" not in caplog.text and "chat-1" not in caplog.text


async def test_hung_typing_never_blocks_the_turn(autojump_clock: trio.abc.Clock) -> None:
    host = Host()
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
        t0 = trio.current_time()
        await rt.admit(event("1"))
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
        await trio.sleep(1)
        await rt.admit(event("2", "/cancel"))
        await rt.drain()
        before = calls
        await trio.sleep(20)
        assert calls == before == 1
        assert "Request cancelled." in host.texts
