"""The official a2a-sdk (1.3.0, test dependency only) as a real remote A2A agent.

Run as a subprocess: ``python -m tests.fakes.a2a_sdk_agent PORT_FILE [DELAY_S [PORT]]``
(``tests/agents/sdk_peer.py``). It serves
the JSON-RPC binding (v1.0, with v0.3 compatibility on the same endpoint) and the agent card
on ``127.0.0.1:<port>`` (written to PORT_FILE once listening) through uvicorn, with the
SDK's in-memory task store and its push sender. The agent answers each message after
``DELAY_S`` seconds with one artifact: ``sdk[<n>]: <text>``, where ``n`` counts the messages
seen in that context (so a test sees the context continued). A message that starts with
``chunks:`` is answered in pieces of :data:`PIECE` characters, as an agent streams its
answer: ``add_artifact(…, append=True)`` after the first, one artifact-update event (and one
push) per piece, stored by the SDK as one part per piece.

Other prefixes end the task otherwise: ``ask:`` asks :data:`QUESTION` (``input-required``)
and the message that continues the task is answered ``sdk[<n>]: <text> (continued)``;
``auth:<s>`` says :data:`SIGN_IN` (``auth-required``), then after ``s`` seconds (2 by
default) goes on by itself and answers; ``reject:``, ``fail:`` end ``rejected`` / ``failed``
and ``status:`` ``completed`` with no artifact, each with the message's text in its status;
``data:`` completes with a data part only, ``many:`` with three artifacts, ``big:<n>`` with
one text of ``n`` characters. ``late:<s>`` makes the task known only after ``s`` seconds: a
send with immediate acceptance waits that long for its answer. ``reply:`` is answered by a
bare message (no task), ``sdk[<n>]: <the rest>``.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import sys
from pathlib import Path

import httpx
import uvicorn
from a2a.helpers.proto_helpers import (
    new_data_part,
    new_task_from_user_message,
    new_text_message,
    new_text_part,
)
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
QUESTION = "which year do you mean?"
SIGN_IN = "sign in at the portal, please"


class EchoLater(AgentExecutor):
    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.turns: collections.Counter[str] = collections.Counter()

    async def execute(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.message is not None
        prefix, _, rest = context.get_user_input().partition(":")
        if prefix == "late" and context.current_task is None:
            await asyncio.sleep(float(rest.split()[0]))  # the send's answer waits for the task
        if prefix == "reply" and context.current_task is None:
            # A message-only agent: the answer is a bare message, no task to follow.
            self.turns[context.context_id or ""] += 1
            n = self.turns[context.context_id or ""]
            await event_queue.enqueue_event(
                new_text_message(f"sdk[{n}]: {rest.strip()}", context_id=context.context_id)
            )
            return
        task = context.current_task or new_task_from_user_message(context.message)
        if context.current_task is None:
            await event_queue.enqueue_event(task)
        updater = TaskUpdater(event_queue, task.id, task.context_id)
        await updater.start_work()
        self.turns[task.context_id] += 1
        await asyncio.sleep(self.delay_s)
        text = f"sdk[{self.turns[task.context_id]}]: {context.get_user_input()}"
        if await self._other_ending(context, updater, text):
            return
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

    async def _other_ending(self, context: RequestContext, updater: TaskUpdater, text: str) -> bool:
        """The endings other than one text artifact, by the message's prefix (see the
        module's docstring); ``False`` for the usual answer."""
        said = context.get_user_input()
        prefix, _, rest = said.partition(":")
        history = context.current_task.history if context.current_task else []
        if any(part.text == QUESTION for message in history for part in message.parts):
            # The answer to the question, in the task that asked it (the SDK moved it to
            # ``working`` before this run).
            await updater.add_artifact([new_text_part(f"{text} (continued)")], name="answer")
            await updater.complete()
            return True
        if prefix == "ask":
            await updater.requires_input(updater.new_agent_message([new_text_part(QUESTION)]))
            return True
        if prefix == "auth":
            await updater.requires_auth(updater.new_agent_message([new_text_part(SIGN_IN)]))
            await asyncio.sleep(float(rest or 2.0))
            await updater.start_work()
            await updater.add_artifact([new_text_part(text)], name="answer")
            await updater.complete()
            return True
        endings = {"reject": updater.reject, "fail": updater.failed, "status": updater.complete}
        if prefix in endings:
            # The peer's own words in its status: never to reach the chat but ``status``'s.
            await endings[prefix](updater.new_agent_message([new_text_part(f"{prefix}: {rest}")]))
            return True
        if prefix == "data":
            await updater.add_artifact([new_data_part({"n": 1})], name="answer")
            await updater.complete()
            return True
        if prefix == "many":
            for n in range(3):
                await updater.add_artifact([new_text_part(f"part {n}")], name=f"a{n}")
            await updater.complete()
            return True
        if prefix == "big":
            await updater.add_artifact([new_text_part("x" * int(rest))], name="answer")
            await updater.complete()
            return True
        return False

    async def cancel(self, context: RequestContext, event_queue: EventQueue) -> None:
        assert context.task_id is not None and context.context_id is not None
        await TaskUpdater(event_queue, context.task_id, context.context_id).cancel()


def main() -> None:
    port_file = sys.argv[1]
    delay_s = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restarted on its port
    sock.bind(("127.0.0.1", int(sys.argv[3]) if len(sys.argv) > 3 else 0))
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
