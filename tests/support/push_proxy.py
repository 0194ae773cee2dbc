"""A loopback balancer for A2A pushes in front of several prismd instances' ``[a2a]
push_listen``: each POST goes to the instances in turn until one answers (a refused
connection — an instance down — moves on to the next), and that answer is relayed. A
remote agent is told one push URL for every instance, as behind a real load balancer."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import h11
import httpx
import trio

from tests.support.handler_server import read_request
from tests.support.spreader import OneChunk


@attrs.define(eq=False)
class PushProxy:
    ports: Sequence[int]
    port: int = 0
    served: list[int] = attrs.Factory(list)
    """The instance (index in ``ports``) that answered each relayed push."""
    _next_port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
        self.port = listeners[0].socket.getsockname()[1]
        async with httpx.AsyncClient() as client, trio.open_nursery() as nursery:

            async def handle(stream: trio.SocketStream) -> None:
                await self._relay(stream, client)

            await nursery.start(trio.serve_listeners, handle, listeners)
            task_status.started()

    async def _relay(self, stream: trio.SocketStream, client: httpx.AsyncClient) -> None:
        conn = h11.Connection(h11.SERVER)
        async with stream:
            try:
                got = await read_request(conn, stream)
                if got is None:
                    return
                head, body = got
                headers = {
                    k.decode(): v.decode()
                    for k, v in head.headers
                    if k.lower() not in (b"host", b"content-length", b"connection")
                }
                status = 502
                for _ in range(len(self.ports)):
                    index = self._next_port % len(self.ports)
                    self._next_port += 1
                    target = f"http://127.0.0.1:{self.ports[index]}{head.target.decode()}"
                    try:
                        response = await client.post(
                            target, content=OneChunk(body), headers=headers, timeout=5
                        )
                    except httpx.HTTPError:
                        continue
                    status = response.status_code
                    self.served.append(index)
                    break
                out = conn.send(
                    h11.Response(
                        status_code=status,
                        headers=[("content-length", "0"), ("connection", "close")],
                    )
                )
                out = (out or b"") + (conn.send(h11.EndOfMessage()) or b"")
                await stream.send_all(out)
            except (trio.BrokenResourceError, h11.ProtocolError):
                return
