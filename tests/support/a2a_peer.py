"""A hand-written A2A peer for the audit tests (``tests/agents/test_a2a_reference_audit*``):
one coroutine per JSON-RPC method over a real loopback socket
(:func:`tests.support.handler_server.serve_handler`), for what other implementations do
that our fake (``tests/fakes/a2a_agent.py``) does not; and the runtime or client around it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
import trio

from adapters.toolkit import Http11
from prismd.agents import AgentContext, build_agent
from prismd.agents.a2a import A2AAgent, A2AClient
from stores import SYSTEM_CLOCK
from stores.memory import MemoryStore
from tests.support.handler_server import serve_handler
from tests.support.harness import Host, open_harness

OPS = {
    "1.0": {"SendMessage": "send", "GetTask": "get", "ListTasks": "list", "CancelTask": "cancel"},
    "0.3": {"message/send": "send", "tasks/get": "get", "tasks/cancel": "cancel"},
}
OPS["1.0"]["SubscribeToTask"] = "subscribe"
OPS["0.3"]["tasks/resubscribe"] = "subscribe"
Method = Callable[[Any, dict[str, Any]], Awaitable[httpx.Response]]


def result(rid: Any, value: Any) -> httpx.Response:
    return httpx.Response(200, json={"jsonrpc": "2.0", "id": rid, "result": value})


def error(rid: Any, code: int) -> httpx.Response:
    body = {"jsonrpc": "2.0", "id": rid, "error": {"code": code, "message": "no"}}
    return httpx.Response(200, json=body)


class Peer:
    """A hand-written A2A peer: its card (JSON-RPC at ``/a2a/``) and one coroutine per
    operation (``send``, ``get``, ``list``, ``cancel``, ``subscribe``) in :attr:`methods`;
    an operation it has no coroutine for is -32601, but ``get``, which answers from
    :attr:`tasks` (what :meth:`task` made last for each id). Every call is recorded."""

    def __init__(self, dialect: str = "1.0", *, streaming: bool = False, push: bool = False):
        self.dialect = dialect
        self.streaming = streaming
        self.push = push
        self.origin = ""
        self.methods: dict[str, Method] = {}
        self.calls: list[tuple[str, dict[str, Any], float]] = []
        self.card_queries: list[str] = []
        self.tasks: dict[str, dict[str, Any]] = {}

    @property
    def url(self) -> str:
        return f"{self.origin}/a2a/"

    def sends(self) -> list[dict[str, Any]]:
        return [params for op, params, _ in self.calls if op == "send"]

    def card(self) -> dict[str, Any]:
        caps = {"streaming": self.streaming, "pushNotifications": self.push}
        if self.dialect == "1.0":
            iface = {"url": self.url, "protocolBinding": "JSONRPC", "protocolVersion": "1.0"}
            return {"name": "peer", "supportedInterfaces": [iface], "capabilities": caps}
        return {
            "name": "peer",
            "protocolVersion": "0.3.0",
            "url": self.url,
            "preferredTransport": "JSONRPC",
            "capabilities": caps,
        }

    def task(
        self,
        task_id: str,
        state: str,
        text: str | None = None,
        *,
        context_id: str = "ctx-1",
        history: tuple[Mapping[str, Any], ...] = (),
    ) -> dict[str, Any]:
        """A Task in the peer's dialect; ``text`` its one artifact."""
        v1 = self.dialect == "1.0"
        out: dict[str, Any] = {
            "id": task_id,
            "contextId": context_id,
            "status": {
                "state": "TASK_STATE_" + state.upper().replace("-", "_") if v1 else state,
                "timestamp": "2026-12-06T00:00:00.000Z",
            },
            "history": list(history),
        }
        if text is not None:
            part = {"text": text} if v1 else {"kind": "text", "text": text}
            out["artifacts"] = [{"artifactId": "a", "parts": [part]}]
        if not v1:
            out["kind"] = "task"
        self.tasks[task_id] = out
        return out

    def sent(self, task: dict[str, Any]) -> dict[str, Any]:
        """A send's result: v1.0 wraps it, v0.3 does not."""
        return {"task": task} if self.dialect == "1.0" else task

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "GET":
            if request.url.path.endswith("/.well-known/agent-card.json"):
                self.card_queries.append(request.url.query.decode())
                return httpx.Response(200, json=self.card())
            return httpx.Response(404)
        body = json.loads(request.content)
        rid, params = body.get("id"), body.get("params") or {}
        op = OPS[self.dialect].get(body.get("method"), "")
        self.calls.append((op, params, trio.current_time()))
        method = self.methods.get(op)
        if method is None and op == "get":
            known = self.tasks.get(str(params.get("id")))
            return error(rid, -32001) if known is None else result(rid, known)
        if method is None:
            return error(rid, -32601)
        return await method(rid, params)


@asynccontextmanager
async def running(
    peer: Peer, mem: MemoryStore, *, push_base_url: str | None = None, **options: Any
) -> AsyncIterator[tuple[Host, A2AAgent]]:
    """``peer`` on loopback, an ``a2a`` agent on it and a runtime around the agent."""
    async with _running(peer, mem, push_base_url, options, resume=False) as running:
        yield running


@asynccontextmanager
async def restarted(
    peer: Peer, mem: MemoryStore, *, push_base_url: str | None = None, **options: Any
) -> AsyncIterator[tuple[Host, A2AAgent]]:
    """As :func:`running`, for a process started again: its runtime takes up the work an
    earlier one journaled (``resume_accepted``)."""
    async with _running(peer, mem, push_base_url, options, resume=True) as running:
        yield running


@asynccontextmanager
async def _running(
    peer: Peer,
    mem: MemoryStore,
    push_base_url: str | None,
    options: dict[str, Any],
    *,
    resume: bool,
) -> AsyncIterator[tuple[Host, A2AAgent]]:
    async with trio.open_nursery() as nursery:
        peer.origin = await serve_handler(nursery, peer.handle)
        settings = {"url": peer.url, "poll_interval_ms": 50, "max_poll_interval_ms": 300}
        settings.update(options)
        agent = build_agent(
            "a2a",
            AgentContext(
                alias="primary",
                options=settings,
                checkpoints=mem.checkpoints,
                push_base_url=push_base_url,
            ),
        )
        assert isinstance(agent, A2AAgent)
        try:
            async with open_harness(
                mem, SYSTEM_CLOCK, {"primary": agent}, resume_accepted=resume
            ) as h:
                yield h, agent
        finally:
            await agent.aclose()
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def client_of(peer: Peer) -> AsyncIterator[A2AClient]:
    """``peer`` on loopback and a client discovered from its card."""
    async with trio.open_nursery() as nursery, httpx.AsyncClient() as http:
        peer.origin = await serve_handler(nursery, peer.handle)
        rpc = Http11()
        try:
            yield await A2AClient.discover(http, rpc=rpc, url=peer.url, timeout_s=5)
        finally:
            await rpc.aclose()
            nursery.cancel_scope.cancel()


def gets(peer: Peer) -> int:
    return sum(op == "get" for op, _, _ in peer.calls)
