"""A ``python`` agent factory for the kill loops: the ``mock`` agent behind a random delay.

Each run appends its idempotency key to ``count_file`` (O_APPEND, fsync'd) when it *starts*,
so a test can count runs per operation across SIGKILLs. The delay is drawn uniformly from
``[delay_min_ms, delay_max_ms]`` so kills land before, during and after agent calls, by a
generator seeded with ``seed`` (the test's seed, so a replay draws the same delays).
"""

from __future__ import annotations

import os
import random
from typing import Any

import attrs
import trio

from prismd.agents._base import AgentContext, RunRequest, RunResult
from prismd.agents.mock import MockAgent


@attrs.define(eq=False)
class CountingMock:
    """The ``mock`` agent that logs each run's idempotency key to ``count_file`` as it starts."""

    inner: MockAgent
    count_file: str

    @property
    def agent_id(self) -> str:
        return self.inner.agent_id

    @property
    def definition_revision(self) -> str:
        return self.inner.definition_revision

    @property
    def input_capabilities(self) -> frozenset[str]:
        return self.inner.input_capabilities

    @property
    def supports_approvals(self) -> bool:
        return self.inner.supports_approvals

    async def run(self, request: RunRequest, *, on_event: Any = None) -> RunResult:
        fd = os.open(self.count_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, f"{request.idempotency_key}\n".encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        await self.pause()
        return await self.inner.run(request, on_event=on_event)

    async def pause(self) -> None:
        """Between counting a run and running it; subclasses wait here."""

    async def status(self, **kwargs: Any) -> Any:
        return await self.inner.status(**kwargs)

    async def resume(self, **kwargs: Any) -> Any:
        return await self.inner.resume(**kwargs)


def inner_mock(ctx: AgentContext, *own: str) -> MockAgent:
    """The wrapped ``mock`` agent: ``ctx`` without the wrapper's own options."""
    skip = ("factory", "count_file", *own)
    options = {k: v for k, v in ctx.options.items() if k not in skip}
    return MockAgent.from_context(attrs.evolve(ctx, options=options))


@attrs.define(eq=False)
class JitterCountingMock(CountingMock):
    delay_min_ms: int
    delay_max_ms: int
    rng: random.Random

    async def pause(self) -> None:
        await trio.sleep(self.rng.uniform(self.delay_min_ms, self.delay_max_ms) / 1000)


def jitter_counting_mock(ctx: AgentContext) -> JitterCountingMock:
    return JitterCountingMock(
        inner=inner_mock(ctx, "delay_min_ms", "delay_max_ms", "seed"),
        count_file=str(ctx.options["count_file"]),
        delay_min_ms=int(ctx.options.get("delay_min_ms", 0)),
        delay_max_ms=int(ctx.options.get("delay_max_ms", 0)),
        rng=random.Random(str(ctx.options.get("seed", ""))),
    )
