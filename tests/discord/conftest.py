"""The fake Discord on loopback, a store, an adapter builder, and a runtime over them
(the recording host's authorize/agents; replies delivered through the adapter)."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio

from adapters.discord import DiscordAdapter
from prismd.channel import Admission, InboundEvent, Reply, SendResult
from prismd.limits import Limits
from prismd.runtime import Runtime, open_messaging_runtime
from stores import Store, open_store
from tests.fakes.discord_api import FakeDiscord
from tests.support.harness import Host
from tests.support.scripted import ScriptedAgent

CONN = "discord-main"
USER = "2000000000000000001"
DM = "3000000000000000001"
GUILD = "4000000000000000001"
GUILD_CHANNEL = "5000000000000000001"


@pytest.fixture
async def fake(nursery: trio.Nursery) -> FakeDiscord:
    server = FakeDiscord(heartbeat_interval_ms=1000)
    server.max_concurrency = 50  # tests space identifies 0.2 s apart, not 5 s
    await nursery.start(server.serve)
    return server


@pytest.fixture
async def store(tmp_path: Any) -> AsyncIterator[Store]:
    async with open_store(f"sqlite:///{tmp_path}/journal.db") as opened:
        yield opened


AdapterFactory = Callable[..., DiscordAdapter]


@pytest.fixture
def make_adapter(fake: FakeDiscord, store: Store) -> AdapterFactory:
    def make(admit: Any = None, **options: Any) -> DiscordAdapter:
        async def refuse(_event: InboundEvent) -> Admission:
            return Admission("denied", "stopped")

        options.setdefault("owner_id", "daemon-a")
        options.setdefault("store", store)
        options.setdefault("random", random.Random(7))
        options.setdefault("lease_ttl_ms", 5_000)
        options.setdefault("token", lambda: fake.token)
        options.setdefault("reidentify_delay_s", 0.05)
        options.setdefault("identify_spacing_ms", 200)
        adapter = DiscordAdapter(
            connection_id=CONN,
            admit=admit or refuse,
            api_origin=fake.origin,
            **options,
        )
        return adapter

    return make


@asynccontextmanager
async def serving(
    store: Store, adapter: DiscordAdapter, host: Host | None = None, **options: Any
) -> AsyncIterator[tuple[Runtime, Host]]:
    """A real runtime on ``store`` whose replies go out through ``adapter`` (the host
    records them too); ``adapter.admit`` is pointed at it and ``adapter.run`` started."""
    host = host or Host(agent=ScriptedAgent(answer=lambda text, _n: f"echo: {text}"))

    async def deliver(reply: Reply) -> SendResult:
        host.replies.append(reply)
        return await adapter.send(reply)

    options.setdefault("limits", Limits())
    try:
        async with _runtime(store, adapter, host, deliver, options) as rt:
            yield rt, host
    finally:
        await adapter.aclose()


@asynccontextmanager
async def _runtime(
    store: Store, adapter: DiscordAdapter, host: Host, deliver: Any, options: Any
) -> AsyncIterator[Runtime]:
    async with open_messaging_runtime(
        authorize=host.authorize,
        resolve_agent=host.resolve_agent,
        deliver=deliver,
        store=store,
        owner_id="daemon-a",
        **options,
    ) as rt:
        host._runtime = rt
        adapter.admit = rt.admit
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            try:
                yield rt
            finally:
                nursery.cancel_scope.cancel()
        host._runtime = None
