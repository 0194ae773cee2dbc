"""A ``tools`` factory for the daemon tests (``tests.agents.daemon_tools:tools``): each call
appends one line to ``$PRISMD_TEST_TOOL_LOG``, so a test counts calls across processes;
``wait_here`` then blocks until ``$PRISMD_TEST_TOOL_LOG.go`` exists (a crash mid-tool)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import trio

from prismd.agents import AgentContext, Tool


def _log(name: str, arguments: Mapping[str, Any]) -> Path:
    path = Path(os.environ["PRISMD_TEST_TOOL_LOG"])
    with path.open("a", encoding="utf-8") as log:
        log.write(json.dumps({"tool": name, "arguments": dict(arguments)}) + "\n")
    return path


async def archive(arguments: Mapping[str, Any]) -> str:
    _log("archive", arguments)
    await trio.lowlevel.checkpoint()
    return "archived"


async def wait_here(arguments: Mapping[str, Any]) -> str:
    gate = trio.Path(str(_log("wait_here", arguments)) + ".go")
    while not await gate.exists():  # noqa: ASYNC110 (the test process creates it)
        await trio.sleep(0.05)
    return "went on"


def tools(ctx: AgentContext) -> list[Tool]:
    schema = {"type": "object", "properties": {"what": {"type": "string"}}}
    return [
        Tool("archive", "Archive something.", schema, archive, requires_approval=True),
        Tool("wait_here", "Blocks.", schema, wait_here, requires_approval=True),
    ]
