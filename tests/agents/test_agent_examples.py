"""docs/agents.md, "Writing your own agent": the example agent and tools, imported exactly as
the page shows them, run behind the real runtime (the tools with the fake OpenAI server)."""

from __future__ import annotations

import importlib
import re
import sys
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import trio.testing

from prismd.agents import AgentContext, OpenAIAgent, build_agent, validate_agent_options
from stores.memory import MemoryStore
from tests.conftest import REPO
from tests.fakes.openai_api import Answer, FakeOpenAI, start_fake_openai
from tests.support.builders import event
from tests.support.clocks import ManualClock
from tests.support.harness import open_harness

PAGE = (REPO / "docs" / "agents.md").read_text(encoding="utf-8")


def block(language: str, first_line: str) -> str:
    """The page's code block of ``language`` whose first line is ``first_line``."""
    for match in re.finditer(rf"```{language}\n(.*?)```", PAGE, re.S):
        if match.group(1).startswith(first_line + "\n"):
            return match.group(1)
    raise AssertionError(f"docs/agents.md has no {language} block starting with {first_line!r}")


def agent_table(marker: str) -> tuple[str, dict[str, Any]]:
    """The ``[agents.*]`` TOML block containing ``marker``: (alias, options)."""
    for match in re.finditer(r"```toml\n(.*?)```", PAGE, re.S):
        if marker in match.group(1) and match.group(1).startswith("[agents."):
            data = tomllib.loads(match.group(1))["agents"]
            ((alias, table),) = data.items()
            return alias, table
    raise AssertionError(f"docs/agents.md has no agent table with {marker!r}")


@pytest.fixture
def examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("myagent", "mytools"):
        (tmp_path / f"{name}.py").write_text(block("python", f"# {name}.py"), encoding="utf-8")
        sys.modules.pop(name, None)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    importlib.invalidate_caches()
    return tmp_path


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with trio.open_nursery() as nursery:
        yield await start_fake_openai(nursery, api_key=None)
        nursery.cancel_scope.cancel()


async def test_the_example_agent_runs_as_configured(
    examples: Path, store: MemoryStore, clock: ManualClock
) -> None:
    alias, table = agent_table('factory = "myagent:make_agent"')
    assert table.pop("kind") == "python"
    validate_agent_options("python", table)
    agent = build_agent(
        "python", AgentContext(alias=alias, options=table, checkpoints=store.checkpoints)
    )
    async with open_harness(store, clock, {alias: agent}) as h:
        h.default_grant = attrs_evolve_grant(h.default_grant, alias)
        assert (await h.runtime.admit(event("1", "hello world"))).status == "accepted"
        await h.settle()
    assert h.last().text == "↩ dlrow olleh" and h.last().kind == "final"
    assert h.previews[-1].text.strip() == "↩ dlrow olleh"


def attrs_evolve_grant(grant: Any, alias: str) -> Any:
    return attrs.evolve(grant, agent_aliases=(alias,))


async def test_the_example_tools_run_with_the_openai_agent(
    examples: Path,
    fake: FakeOpenAI,
    store: MemoryStore,
    clock: ManualClock,
    autojump_clock: trio.testing.MockClock,
) -> None:
    alias, table = agent_table('kind = "openai"')
    assert table.pop("kind") == "openai" and table["tools"] == "mytools:tools"
    validate_agent_options("openai", table)
    table.pop("api_key_env")  # the fake local server takes no key
    table["base_url"] = fake.base_url
    agent = build_agent(
        "openai", AgentContext(alias=alias, options=table, checkpoints=store.checkpoints)
    )
    assert isinstance(agent, OpenAIAgent) and sorted(agent.tools) == ["utc_now", "write_note"]
    fake.push(
        Answer(tool_calls=(("utc_now", {}),)),
        Answer(tool_calls=(("write_note", {"text": "buy milk"}),)),
        Answer("Saved your note."),
    )
    async with open_harness(store, clock, {alias: agent}) as h:
        h.default_grant = attrs_evolve_grant(h.default_grant, alias)
        assert (await h.runtime.admit(event("1", "note: buy milk"))).status == "accepted"
        await h.settle()
        assert h.last().text.startswith("Approval required for tool write_note")
        assert not (examples / "notes.txt").exists()
        allow = {c.label: c.value for c in h.last().buttons}["Allow once"][4:]
        assert (await h.runtime.admit(event("2", "", approval=(allow, "allow_once")))).status == (
            "accepted"
        )
        await h.settle()
    assert h.last().text == "Saved your note."
    assert (examples / "notes.txt").read_text(encoding="utf-8") == "buy milk\n"
    utc = fake.completions[1].body["messages"][-1]
    assert utc["role"] == "tool" and '"utc": "' in utc["content"]
    assert fake.completions[0].body["messages"][0] == {
        "role": "system",
        "content": "You are a helpful assistant. Answer in Markdown.",
    }
    await agent.aclose()
