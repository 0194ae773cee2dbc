"""A loopback load spreader for Telegram webhook updates over several prismd instances.

It plays Telegram and the load balancer in front of the instances at once: each update is
POSTed (with the secret header) to one instance, chosen in turn; an answer that is not a
2xx — a refused connection (the instance is down), a 503, a timeout — is retried on the next
instance after a short pause, as Telegram retries an unacknowledged update and a balancer
routes around a dead backend. Like Telegram, it sometimes delivers an acknowledged update
again (it may have missed the 2xx), to any instance. Nothing is posted concurrently for one
update; redeliveries run beside the stream.

Each body goes out as a :class:`OneChunk` stream, not as httpx's ``content=``: httpx sends
``content=`` bytes from an async generator, and a request broken between its headers and its
body (an instance killed just then) leaves that generator unfinished. Trio then warns when
the collector finds it, and under ``-W error`` the warning fails whatever test is running.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import httpx
import trio

SECRET_HEADER = "X-Telegram-Bot-Api-Secret-Token"
RETRY_PAUSE_S = 0.1
RETRY_PAUSE_CAP_S = 1.0
POST_TIMEOUT_S = 5.0
MAX_TRIES = 400
"""Far more than a run of kills and restarts needs; an update never acknowledged fails the
test instead of looping forever."""


class OneChunk(httpx.AsyncByteStream):
    """A request body of one chunk, iterated by a plain object: nothing is left to finalize
    when the request breaks off before the chunk is taken."""

    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data

    def __aiter__(self) -> OneChunk:
        return self

    async def __anext__(self) -> bytes:
        data, self._data = self._data, None
        if data is None:
            raise StopAsyncIteration
        return data


@attrs.define(eq=False)
class Spreader:
    ports: Sequence[int]
    path: str
    secret: str
    rng: random.Random
    redeliver: float = 0.15
    """The share of acknowledged updates delivered once more, later."""
    acknowledged: dict[int, int] = attrs.field(factory=dict)
    """update_id → the instance (index into ``ports``) whose 2xx acknowledged it first."""
    statuses: Counter[str] = attrs.field(factory=Counter)
    """What the instances answered: ``"204"``, ``"503"``, ``"refused"``, ``"timeout"``…"""
    redelivered: int = 0
    _next: int = 0

    async def run(self, updates: Sequence[Mapping[str, Any]], pause_s: tuple[float, float]) -> None:
        """Deliver ``updates`` in order, each until acknowledged, ``pause_s`` apart."""
        async with (
            httpx.AsyncClient(
                timeout=POST_TIMEOUT_S, limits=httpx.Limits(max_keepalive_connections=0)
            ) as client,
            trio.open_nursery() as redeliveries,
        ):
            for update in updates:
                await self._deliver(client, update)
                if self.rng.random() < self.redeliver:
                    redeliveries.start_soon(self._again, client, update, self.rng.uniform(0, 2))
                await trio.sleep(self.rng.uniform(*pause_s))

    async def _deliver(self, client: httpx.AsyncClient, update: Mapping[str, Any]) -> None:
        pause = RETRY_PAUSE_S
        for _ in range(MAX_TRIES):
            index = self._next % len(self.ports)
            self._next += 1
            if await self._post(client, index, update):
                self.acknowledged.setdefault(int(update["update_id"]), index)
                return
            await trio.sleep(pause)
            pause = min(pause * 2, RETRY_PAUSE_CAP_S)
        raise AssertionError(f"update {update['update_id']} never acknowledged: {self.statuses}")

    async def _again(
        self, client: httpx.AsyncClient, update: Mapping[str, Any], after_s: float
    ) -> None:
        await trio.sleep(after_s)
        self.redelivered += 1
        await self._post(client, self.rng.randrange(len(self.ports)), update)

    async def _post(self, client: httpx.AsyncClient, index: int, update: Mapping[str, Any]) -> bool:
        url = f"http://127.0.0.1:{self.ports[index]}{self.path}"
        body = json.dumps(update).encode()
        headers = {"content-type": "application/json", SECRET_HEADER: self.secret}
        request = client.build_request("POST", url, content=body, headers=headers)
        request.stream = OneChunk(body)  # the same bytes and Content-Length, no generator
        try:
            response = await client.send(request)
        except httpx.ConnectError:
            self.statuses["refused"] += 1
            return False
        except httpx.TimeoutException:
            self.statuses["timeout"] += 1
            return False
        except httpx.HTTPError:  # the instance died mid-request
            self.statuses["broken"] += 1
            return False
        self.statuses[str(response.status_code)] += 1
        return 200 <= response.status_code < 300
