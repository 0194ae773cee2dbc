"""Shared pieces for the control socket and prismctl tests (no tests of its own here).

A recording runtime, a JSON-RPC client and a server fixture.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from prismd.channel import Admission, InboundEvent
from prismd.control import ControlConfig
from prismd.control._methods import ControlHandler
from prismd.control._server import serve_control
from prismd.grants import AgentIdentity
from prismd.runtime.api import (
    Diagnostics,
    DrainResult,
    PairingTicket,
    PruneResult,
    ReconcileResult,
    UnresolvedEntry,
    UnresolvedPage,
)
from stores.memory import MemoryStore

DAEMON_UID = os.getuid()
"""The uid the test process, standing in for the daemon, runs as: its default operator."""


@attrs.define(eq=False)
class RecordingRuntime:
    """Implements the MessagingRuntime protocol; records every call, answers fixed records.

    Used until the real runtime lands in ``prismd.runtime``; ``fail`` makes every method
    raise an exception whose text must never reach the client.
    """

    calls: list[tuple[str, dict[str, Any]]] = attrs.field(factory=list)
    fail: bool = False
    entries: list[UnresolvedEntry] = attrs.field(
        factory=lambda: [
            UnresolvedEntry(
                operation_id="op-1",
                connection_id="web",
                state="executing",
                version=3,
                updated_at="2026-01-01T00:00:00.000Z",
            ),
            UnresolvedEntry(
                operation_id="op-2",
                connection_id="web",
                state="completed",
                version=5,
                updated_at="2026-01-01T00:00:01.000Z",
                reply_state="unknown",
                reason="the user blocks direct messages",
            ),
        ]
    )
    reconcile_status: str = "resolved"
    reconcile_result: ReconcileResult | None = None
    """When set, ``reconcile`` answers exactly this (``reconcile_status`` is ignored)."""
    notify_admission: Admission = attrs.field(
        factory=lambda: Admission("accepted", operation_id="op-n")
    )

    def _record(self, name: str, **kwargs: Any) -> None:
        self.calls.append((name, kwargs))
        if self.fail:
            raise RuntimeError("boom with secret detail 123456:ABCDEFGHIJKLMNOPQRSTUVWXYZabcd")

    async def admit(self, event: InboundEvent) -> Admission:
        self._record("admit", event=event)
        return Admission("accepted")

    async def notify(
        self,
        *,
        identity: AgentIdentity,
        connection_id: str,
        external_conversation_id: str,
        notify_id: str,
        text: str,
        thread_id: str | None = None,
    ) -> Admission:
        await trio.lowlevel.checkpoint()
        self._record(
            "notify",
            identity=identity,
            connection_id=connection_id,
            external_conversation_id=external_conversation_id,
            notify_id=notify_id,
            text=text,
            thread_id=thread_id,
        )
        return self.notify_admission

    async def list_unresolved(
        self, *, identity: AgentIdentity, limit: int | None = None
    ) -> list[UnresolvedEntry]:
        await trio.lowlevel.checkpoint()
        self._record("list_unresolved", identity=identity, limit=limit)
        return self.entries[: limit or None]

    async def list_unresolved_page(
        self, *, identity: AgentIdentity, limit: int | None = None, after: str | None = None
    ) -> UnresolvedPage:
        """Pages of ``entries``; the cursor is the index of the next entry."""
        await trio.lowlevel.checkpoint()
        self._record("list_unresolved", identity=identity, limit=limit)
        start = 0 if after is None else int(after)
        size = min(limit or 100, 100)
        page = self.entries[start : start + size]
        more = start + size < len(self.entries)
        return UnresolvedPage(
            tuple(page), str(start + size) if more else None, size, (limit or 0) > 100
        )

    async def count_unresolved(
        self, *, identities: Sequence[AgentIdentity], limit: int
    ) -> tuple[int, bool]:
        """``entries`` for each identity, counted up to ``limit``."""
        await trio.lowlevel.checkpoint()
        self._record("count_unresolved", identities=identities, limit=limit)
        total = len(self.entries) * len(identities)
        return min(total, limit), total > limit

    async def reconcile(
        self,
        *,
        identity: AgentIdentity,
        connection_id: str,
        operation_id: str,
        expected_version: int,
        acknowledge_duplicate_risk: bool = False,
    ) -> ReconcileResult:
        await trio.lowlevel.checkpoint()
        self._record(
            "reconcile",
            identity=identity,
            connection_id=connection_id,
            operation_id=operation_id,
            expected_version=expected_version,
            acknowledge_duplicate_risk=acknowledge_duplicate_risk,
        )
        if self.reconcile_result is not None:
            return self.reconcile_result
        if self.reconcile_status != "resolved":
            return ReconcileResult(self.reconcile_status)  # type: ignore[arg-type]
        return ReconcileResult(
            "resolved", outcome="execution_unknown", state="failed", detail="acknowledged"
        )

    async def prune(self, *, identity: AgentIdentity, now_ms: int | None = None) -> PruneResult:
        await trio.lowlevel.checkpoint()
        self._record("prune", identity=identity, now_ms=now_ms)
        return PruneResult(scanned=4, deleted=2, retained=2)

    async def create_pairing(
        self,
        *,
        identity: AgentIdentity,
        connection_id: str,
        aliases: tuple[str, ...] | None = None,
        ttl_ms: int | None = None,
    ) -> PairingTicket:
        await trio.lowlevel.checkpoint()
        self._record(
            "create_pairing",
            identity=identity,
            connection_id=connection_id,
            aliases=aliases,
            ttl_ms=ttl_ms,
        )
        return PairingTicket("pair-token-abc", "2026-01-01T00:05:00.000Z", connection_id)

    def health(self) -> dict[str, str]:
        return {"store": "ok"}

    def diagnostics(self) -> Diagnostics:
        self._record("diagnostics")
        return Diagnostics(admitted=7, delivery_failures=1)

    async def drain(self, *, deadline_ms: int | None = None) -> DrainResult:
        await trio.lowlevel.checkpoint()
        return DrainResult(True, 0, 0, 0, 0)

    async def stop(self) -> None:
        await trio.lowlevel.checkpoint()


class Client:
    """A newline-delimited JSON-RPC client over a trio Unix socket stream."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buffer = b""
        self.next_id = 0

    async def send_raw(self, data: bytes) -> None:
        await self.stream.send_all(data)

    async def read_line(self) -> bytes | None:
        """The next line, or None once the server closed the connection."""
        while b"\n" not in self.buffer:
            try:
                data = await self.stream.receive_some(65536)
            except trio.BrokenResourceError:
                return None
            if not data:
                return None
            self.buffer += data
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    async def read_message(self) -> dict[str, Any]:
        line = await self.read_line()
        assert line is not None, "server closed the connection"
        message = json.loads(line)
        assert isinstance(message, dict)
        return message

    async def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        self.next_id += 1
        request: dict[str, Any] = {"jsonrpc": "2.0", "id": self.next_id, "method": method}
        if params is not None:
            request["params"] = params
        await self.send_raw(json.dumps(request).encode() + b"\n")
        message = await self.read_message()
        assert message["id"] == self.next_id
        return message

    async def result(self, method: str, params: dict[str, Any] | None = None) -> Any:
        message = await self.call(method, params)
        assert "error" not in message, message
        return message["result"]


@asynccontextmanager
async def connect(path: Path | str) -> AsyncIterator[Client]:
    stream = await trio.open_unix_socket(str(path))
    async with stream:
        yield Client(stream)


@asynccontextmanager
async def running_server(
    config: ControlConfig,
    runtime: RecordingRuntime | None = None,
    *,
    store: MemoryStore | None = None,
    daemon_uid: int | None = DAEMON_UID,
    health: dict[str, Any] | None = None,
    pair_aliases: Callable[[str], tuple[str, ...] | None] | None = None,
    inbox_sources: tuple[str, ...] = (),
    retention_ms: int | None = None,
) -> AsyncIterator[tuple[RecordingRuntime, MemoryStore]]:
    runtime = runtime if runtime is not None else RecordingRuntime()
    store = store if store is not None else MemoryStore()
    snapshot = health if health is not None else {"status": "ok", "children": {"web": "running"}}
    handler = ControlHandler(
        runtime=runtime,
        store=store,
        health=lambda: snapshot,
        pair_aliases=pair_aliases,
        follow_poll_s=0.02,
        inbox_sources=inbox_sources,
        retention_ms=retention_ms,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(
            lambda task_status: serve_control(
                config, handler=handler, daemon_uid=daemon_uid, task_status=task_status
            )
        )
        yield runtime, store
        nursery.cancel_scope.cancel()
