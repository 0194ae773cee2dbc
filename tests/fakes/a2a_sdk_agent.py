"""The official a2a-sdk (1.3.0, test dependency only) as a real remote A2A agent.

Run as a subprocess: ``python -m tests.fakes.a2a_sdk_agent PORT_FILE [DELAY_S]``. It serves
the JSON-RPC binding (v1.0, with v0.3 compatibility on the same endpoint) and the agent card
on ``127.0.0.1:<port>`` (written to PORT_FILE once listening) through uvicorn, with the
SDK's in-memory task store and its push sender. The agent answers each message after
``DELAY_S`` seconds with one artifact: ``sdk[<n>]: <text>``, where ``n`` counts the messages
seen in that context (so a test sees the context continued). A message that starts with
``chunks:`` is answered in pieces of :data:`PIECE` characters, as an agent streams its
answer: ``add_artifact(…, append=True)`` after the first, one artifact-update event (and one
push) per piece, stored by the SDK as one part per piece.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import sys
from pathlib import Path

import httpx
import uvicorn
from a2a.helpers.proto_helpers import new_task_from_user_message, new_text_part
from a2a.server.agent_execution import AgentExecutor, RequestContext
from a2a.server.events import EventQueue
from a2a.server.request_handlers import DefaultRequestHandler
from a2a.server.routes import create_agent_card_routes, create_jsonrpc_routes
from a2a.server.tasks import (
    BasePushNotificationSender,
    InMemoryPushNotificationConfigStore,
    InMemoryTaskStore,
    TaskUpdater,
)
from a2a.types import AgentCapabilities, AgentCard, AgentInterface, AgentSkill
from starlette.applications import Starlette

PIECE = 4


class EchoLater(AgentExecutor):
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.turns: collections.Counter[str] = collections.Counter()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.message is not None
        task = context.current_task or new_task_from_user_message(context.message)
        if context.current_task is None:
            await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        await updater.start_work()
        self.turns[task.context_id] += 1
        await asyncio.sleep(self.delay_s)
        text = f"sdk[{self.turns[task.context_id]}]: {context.get_user_input()}"
        if context.get_user_input().startswith("chunks:"):
            pieces = [text[i : i + PIECE] for i in range(0, len(text), PIECE)]
            for n, piece in enumerate(pieces):
                await updater.add_artifact(
                    [new_text_part(piece)],
                    artifact_id="answer",
                    name="answer",
                    append=n > 0,
                    last_chunk=n == len(pieces) - 1,
                )
                await asyncio.sleep(0.02)
        else:
            await updater.add_artifact([new_text_part(text)], name="answer")
        await updater.complete()

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


def main() -> None:
    port_file = sys.argv[1]
    delay_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/"
    card = AgentCard(
        name="sdk-echo",
        description="a2a-sdk 1.3.0 echo agent for prismd's tests",
        version="1.0.0",
        supported_interfaces=[
            AgentInterface(url=url, protocol_binding="JSONRPC", protocol_version="1.0")
        ],
        capabilities=AgentCapabilities(streaming=True, push_notifications=True),
        default_input_modes=["text/plain"],
        default_output_modes=["text/plain"],
        skills=[AgentSkill(id="echo", name="echo", description="echo", tags=["echo"])],
    )
    push_store = InMemoryPushNotificationConfigStore()
    handler = DefaultRequestHandler(
        agent_executor=EchoLater(delay_s),
        task_store=InMemoryTaskStore(),
        agent_card=card,
        push_config_store=push_store,
        push_sender=BasePushNotificationSender(httpx.AsyncClient(), push_store),
    )
    routes = [
        *create_agent_card_routes(card),
        *create_jsonrpc_routes(handler, "/", enable_v0_3_compat=True),
    ]
    app = Starlette(routes=routes)
    config = uvicorn.Config(app, log_level="warning", lifespan="off")
    server = uvicorn.Server(config)

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:  # noqa: ASYNC110 (uvicorn offers no started event)
            await asyncio.sleep(0.02)
        Path(port_file).write_text(str(port))  # noqa: ASYNC240 (one tiny write at start)
        await task

    asyncio.run(serve())


if __name__ == "__main__":
    main()
