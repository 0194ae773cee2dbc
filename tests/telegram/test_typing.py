"""Typing only when it helps (issue 40): the runtime sends ``sendChatAction`` for a
Telegram turn only once it has run ``typing_delay_ms`` (the connection's key, default
1,000), then every 4.5 s while the agent runs; an instant answer sends none. Virtual time,
the real runtime and adapter, the fake Bot API."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from trio.testing import MockClock

from adapters import kinds
from adapters.telegram import TelegramAdapter
from prismd.agents import Agent
from prismd.channel import AdapterFeatures, Admission, BuildContext, Reply, SendResult
from prismd.cli._prismd import main
from prismd.daemon._config import ConfigError, load_config
from prismd.limits import Limits
from prismd.runtime import ResolveAgentInput, Runtime, open_messaging_runtime
from stores import Store
from stores.memory import MemoryStore
from tests.fakes.telegram_api import FakeBotApi
from tests.support.clocks import TrioClock
from tests.support.scripted import ScriptedAgent
from tests.support.waiting import wait_until

from .conftest import private_message
from .test_end_to_end import authorize


@asynccontextmanager
async def typing_runtime(
    store: Store, adapter: TelegramAdapter, agent: Agent
) -> AsyncIterator[Runtime]:
    """The daemon's wiring of the seams: ``on_typing`` is the adapter's ``send_typing``,
    the delay is what its features declare."""

    async def resolve_agent(_inp: ResolveAgentInput) -> Agent:
        return agent

    async def deliver(reply: Reply) -> SendResult:
        return await adapter.send(reply)

    async def on_typing(_conn: str, chat: str, thread: str | None) -> None:
        await adapter.send_typing(chat, thread)

    async with open_messaging_runtime(
        authorize=authorize,
        resolve_agent=resolve_agent,
        deliver=deliver,
        store=store,
        limits=Limits(),
        clock=TrioClock(),
        owner_id="daemon-a",
        on_typing=on_typing,
        typing_delay_ms=lambda _conn: adapter.features.typing_delay_ms,
    ) as runtime:
        yield runtime


async def _one_turn(
    fake: FakeBotApi,
    store: Store,
    make_adapter: Any,
    agent: ScriptedAgent,
    run_for_s: float,
    **adapter_options: Any,
) -> float:
    """One update answered by ``agent`` after ``run_for_s``; the time its run started."""
    sender = make_adapter(**adapter_options)
    async with typing_runtime(store, sender, agent) as runtime:
        adapter = make_adapter(admit=runtime.admit, **adapter_options)
        fake.push_update(private_message("hello"))
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            await agent.wait_started(1)
            started = trio.current_time()
            await trio.sleep(run_for_s)
            assert agent.gate is not None
            agent.gate.set()
            await wait_until(lambda: bool(fake.calls_to("sendMessage")))
            await trio.sleep(30)
            nursery.cancel_scope.cancel()
    return started


async def test_an_instant_answer_sends_no_chat_action(
    autojump_clock: MockClock, fake: FakeBotApi, store: Any, make_adapter: Any
) -> None:
    agent = ScriptedAgent(gate=trio.Event())
    await _one_turn(fake, store, make_adapter, agent, 0.5)
    assert len(fake.calls_to("sendMessage")) == 1
    assert fake.calls_to("sendChatAction") == []


async def test_a_long_turn_shows_typing_from_the_delay_renewed(
    autojump_clock: MockClock, fake: FakeBotApi, store: Any, make_adapter: Any
) -> None:
    agent = ScriptedAgent(gate=trio.Event())
    started = await _one_turn(fake, store, make_adapter, agent, 12)
    actions = fake.calls_to("sendChatAction")
    assert [round(c.at - started, 3) for c in actions] == [1.0, 5.5, 10.0]
    assert {(c.params["chat_id"], c.params["action"]) for c in actions} == {("101", "typing")}
    assert len(fake.calls_to("sendMessage")) == 1


async def test_the_connection_sets_its_delay(
    autojump_clock: MockClock, fake: FakeBotApi, store: Any, make_adapter: Any
) -> None:
    agent = ScriptedAgent(gate=trio.Event())
    started = await _one_turn(fake, store, make_adapter, agent, 4, typing_delay_ms=2500)
    assert [round(c.at - started, 3) for c in fake.calls_to("sendChatAction")] == [2.5]


CONFIG = """
[agents.echo]
kind = "echo"

[[connections]]
id = "tg"
kind = "telegram"
token_env = "TG_TOKEN"
{telegram}

[[connections]]
id = "sig"
kind = "signal"
account = "+15550001111"
socket = "/run/signal-cli/socket"
{signal}

[[grants]]
connection = "tg"
actors = ["202"]
aliases = ["echo"]
"""


def test_typing_delay_ms_is_a_key_of_each_connection(tmp_path: Path) -> None:
    path = tmp_path / "prismd.toml"
    path.write_text(CONFIG.format(telegram="", signal=""))
    tg, sig = load_config(path, env={}).connections
    assert (tg.typing_delay_ms, sig.typing_delay_ms) == (1000, 1000)  # type: ignore[attr-defined]
    path.write_text(CONFIG.format(telegram="typing_delay_ms = 0", signal="typing_delay_ms = 60000"))
    tg, sig = load_config(path, env={}).connections
    assert (tg.typing_delay_ms, sig.typing_delay_ms) == (0, 60_000)  # type: ignore[attr-defined]
    built = kinds.CONNECTION_KINDS["signal"].build
    assert built is not None
    adapter = built(
        sig,
        BuildContext(admit=_never, store=MemoryStore(), owner_id="o", secret=_no_secret),
    )
    assert adapter.features.typing_delay_ms == 60_000


@pytest.mark.parametrize(
    ("telegram", "signal", "key"),
    [
        ("typing_delay_ms = 60001", "", "[[connections]][1].typing_delay_ms"),
        ("typing_delay_ms = -1", "", "[[connections]][1].typing_delay_ms"),
        ('typing_delay_ms = "1s"', "", "[[connections]][1].typing_delay_ms"),
        ("", "typing_delay_ms = 90000", "[[connections]][2].typing_delay_ms"),
    ],
)
def test_check_config_names_a_bad_typing_delay(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], telegram: str, signal: str, key: str
) -> None:
    path = tmp_path / "prismd.toml"
    path.write_text(CONFIG.format(telegram=telegram, signal=signal))
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert info.value.key == key, str(info.value)
    assert main(["check-config", "--config", str(path)]) == 1
    assert "typing_delay_ms" in capsys.readouterr().err


def test_the_adapters_refuse_a_bad_delay() -> None:
    for bad in (-1, 60_001, True):
        with pytest.raises(ValueError, match="typing_delay_ms"):
            TelegramAdapter(
                connection_id="tg",
                token=lambda: "1:a",
                admit=_never,
                store=MemoryStore(),
                owner_id="o",
                typing_delay_ms=bad,
            )
        with pytest.raises(ValueError, match="typing_delay_ms"):
            AdapterFeatures(typing=True, typing_delay_ms=bad)


async def _never(_event: object) -> Admission:
    raise AssertionError("not admitted here")


def _no_secret(_key: str, _env: str | None, _file: str | None) -> str:
    raise AssertionError("no secret is read")


async def test_features_are_built_once_and_follow_a_change(make_adapter: Any) -> None:
    """The host reads the adapter's features on every turn: the same object while nothing
    they are made of changed, a new one (with the new value) once something did."""
    adapter = make_adapter(typing_delay_ms=0)
    first = adapter.features
    assert adapter.features is first and first.typing_delay_ms == 0
    adapter.typing_delay_ms = 2500
    assert adapter.features is not first and adapter.features.typing_delay_ms == 2500
    assert adapter.features.max_file_bytes == first.max_file_bytes
