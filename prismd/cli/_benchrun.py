"""The runtime that ``prismd bench`` and ``prismd soak`` drive: the real runtime on a real
store, every route answered by one agent (the ``mock`` agent unless one is given) under one
grant; and their options read from the command line."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import attrs

from stores import Store

from ..agents import Agent, AgentContext, build_agent
from ..channel import InboundEvent, Reply, SendResult
from ..grants import GrantAuthorizer, GrantConfig
from ..limits import Limits
from ..runtime import Runtime, open_messaging_runtime

__all__ = ["lane_event", "open_bench_runtime", "options_from_args"]

_Options = TypeVar("_Options", bound=attrs.AttrsInstance)


def options_from_args(cls: type[_Options], args: argparse.Namespace, **given: Any) -> _Options:
    """A command's options record: each field from the parsed argument of the same name,
    unless ``given`` (a value the command worked out) names it."""
    return cls(
        **{
            f.name: given[f.name] if f.name in given else getattr(args, f.name)
            for f in attrs.fields(cls)
        }
    )


def lane_event(connection_id: str, lane: str, event_id: str, text: str) -> InboundEvent:
    """A message of a load run on ``lane``: each lane is a conversation of its own
    (``chat-<lane>``) with an actor of its own (``user-<lane>``), so lanes never share a
    route."""
    return InboundEvent(
        connection_id=connection_id,
        external_conversation_id=f"chat-{lane}",
        external_actor_id=f"user-{lane}",
        event_id=event_id,
        text=text,
    )


@asynccontextmanager
async def open_bench_runtime(
    store: Store,
    grant: GrantConfig,
    deliver: Callable[[Reply], Awaitable[SendResult]],
    *,
    limits: Limits,
    tool: str,
    agent: Agent | None = None,
    before_run: Callable[[], Awaitable[None]] | None = None,
) -> AsyncIterator[Runtime]:
    """The runtime over ``store`` with the leases on, owned by this run of ``tool``
    (``prismd-<tool>-<pid>-<clock>``): ``grant`` authorizes, ``agent`` answers every turn
    (default: a ``mock`` agent named by the grant's ``default_alias``, else ``mock``),
    ``deliver`` takes every reply. ``before_run``, when given, is awaited before each turn
    is handed its agent (the bench holds turns back with it)."""
    if agent is None:
        alias = grant.default_alias or "mock"
        agent = build_agent(
            "mock", AgentContext(alias=alias, options={}, checkpoints=store.checkpoints)
        )
    answering = agent

    async def resolve_agent(_request: Any) -> Agent:
        if before_run is not None:
            await before_run()
        return answering

    async with open_messaging_runtime(
        authorize=GrantAuthorizer([grant]).authorize,
        resolve_agent=resolve_agent,
        deliver=deliver,
        store=store,
        limits=limits,
        owner_id=f"prismd-{tool}-{os.getpid()}-{time.monotonic_ns()}",
    ) as runtime:
        yield runtime
