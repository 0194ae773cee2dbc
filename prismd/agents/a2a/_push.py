"""The push receiver ``[a2a] push_listen``: remote agents' notifications, committed to the
durable inbox before the answer, then applied by a worker.

Per request (``POST /a2a/push/<alias>``), in this order:

1. path other than ``/a2a/push/<alias of an a2a agent>`` → 404; a method other than POST →
   405; a declared ``Content-Length`` over :data:`MAX_PUSH_BYTES` (1 MiB) → 413, before the
   body is read (a body that turns out larger: 413 too);
2. a body that is not JSON, or neither a v0.3 Task nor a v1.0 StreamResponse naming a task
   → 400;
3. the task must be one this alias follows (its index record) → else 404; the sender's
   credential is checked in constant time against the hashes journaled with the send:
   ``Authorization: <scheme> <credentials>`` against the credentials,
   ``X-A2A-Notification-Token`` against the token, either one suffices (the SDKs disagree
   on which they send) → else 401. A credential of another task is wrong for this one;
4. the observation is committed to the store's inbox (source :data:`PUSH_SOURCE`, partition
   ``<alias>/<task id>``, deduplicated on a key derived from the alias, the task and the
   body, so a duplicate push is acknowledged without a second row) → 200; a store that
   cannot commit → 503 (the sender may retry; most never do, polling covers it).

Nothing of the body is logged or kept beyond the task id and the state it reports (and
the id of an artifact it appends to).

The worker (:func:`apply_pushes`) reserves the inbox's items, applies each to its task record
(the state only moves forward: a late ``working`` after ``completed`` changes nothing),
wakes the task's follower in this process when the push reports a state worth a read (not
an artifact chunk, nor a task still working as before), and acknowledges the item only
after that write committed. A pushed artifact chunk with ``append: true`` carries its
artifact's id into the inbox item (bounded, :func:`._book.appended_key`; never its text),
and the worker notes it in the task record, so that the answer joins that artifact's parts
as they were sent. The reply itself is built by the follower from a final
``GetTask``, never from a push, so duplicates and reordering cannot answer twice.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Iterable, Mapping

import attrs
import h11
import trio

from adapters.toolkit import (
    PENDING,
    SERVING,
    ConnectionLimiter,
    HttpError,
    RequestHead,
    Slot,
    parse_host_port,
    read_body,
    receiver_limiter,
    serve_limited,
    serve_requests,
)
from stores import InboxReservation, InboxStore

from ._agent import A2AAgent
from ._book import appended_key, secret_hash, secret_matches
from ._wire import (
    ACTIVE_STATES,
    ArtifactUpdate,
    moves_forward,
    observed_state,
    observed_task_id,
    read_observation,
)

log = logging.getLogger("prismd.agents.a2a")

PUSH_SOURCE = "a2a-push"
PATH_PREFIX = "/a2a/push/"
MAX_PUSH_BYTES = 1024 * 1024
MAX_PENDING = 256
MAX_SERVING = 128
RESERVATION_TTL_MS = 60_000
MAX_ATTEMPTS = 8


def a2a_statistics(agents: Iterable[A2AAgent], pushes: Mapping[str, int]) -> dict[str, int]:
    """The a2a counters of ``health`` and ``/metrics``: ``pushes`` plus every agent's."""
    totals = {"following": 0, **pushes}
    for agent in agents:
        for name, value in agent.statistics().items():
            totals[name] = totals.get(name, 0) + int(value)
    return totals


def _presented(headers: Mapping[str, str]) -> list[str]:
    """The hashes of the secrets a push presents (token, then credentials)."""
    out = []
    token = headers.get("x-a2a-notification-token")
    if token:
        out.append(secret_hash(token))
    auth = headers.get("authorization")
    if auth:
        out.append(secret_hash(auth.partition(" ")[2].strip()))
    return out


def _credential_ok(headers: Mapping[str, str], index: Mapping[str, object]) -> bool:
    token = headers.get("x-a2a-notification-token")
    token_hash = index.get("tokenHash")
    token_ok = token is not None and secret_matches(
        token, token_hash if isinstance(token_hash, str) else None
    )
    auth = headers.get("authorization")
    cred_hash = index.get("credentialsHash")
    auth_ok = False
    if auth is not None:
        _scheme, _, credentials = auth.partition(" ")
        auth_ok = secret_matches(
            credentials.strip(), cred_hash if isinstance(cred_hash, str) else None
        )
    return token_ok or auth_ok


@attrs.define(eq=False)
class PushReceiver:
    """The receiver and its worker; ``agents`` maps each a2a alias to its agent."""

    listen: str
    agents: Mapping[str, A2AAgent]
    inbox: InboxStore
    counters: dict[str, int] = attrs.field(factory=dict)
    address: tuple[str, int] | None = None
    wake: trio.Event = attrs.field(factory=trio.Event)
    limiter: ConnectionLimiter = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.limiter = receiver_limiter(
            "a2a push",
            max_pending=MAX_PENDING,
            max_serving=MAX_SERVING,
            serving="push requests",
            logger=log,
        )

    def count(self, name: str) -> None:
        self.counters[name] = self.counters.get(name, 0) + 1

    async def serve(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        host, port = parse_host_port(self.listen)
        listeners = await trio.open_tcp_listeners(port, host=host.strip("[]"))
        self.address = (host, int(listeners[0].socket.getsockname()[1]))
        async with trio.open_nursery() as nursery:
            serve = functools.partial(serve_limited, budget=PENDING)
            await nursery.start(serve, self._handle, listeners, self.limiter)
            log.info("a2a push receiver listening on %s port %d", *self.address)
            task_status.started()

    async def run(
        self, owner_id: str, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The receiver and its worker, until cancelled (a daemon child)."""
        async with trio.open_nursery() as nursery:
            await nursery.start(self.serve)
            nursery.start_soon(self.apply_pushes, owner_id)
            task_status.started()

    def health(self) -> Mapping[str, str]:
        """Bounded entries only (a child's health): the listener's state."""
        return {"listener": "listening" if self.address is not None else "starting"}

    def statistics(self) -> dict[str, int]:
        """Counters: pushes accepted / refused / unavailable, and over every a2a agent the
        tasks followed now, polls, sends, refused sends and unknown outcomes."""
        return a2a_statistics(self.agents.values(), self.counters)

    async def _handle(self, stream: trio.SocketStream, slot: Slot) -> None:
        await serve_requests(stream, slot, self._answer)  # nothing of a request is logged

    async def _answer(
        self, stream: trio.SocketStream, conn: h11.Connection, head: RequestHead, slot: Slot
    ) -> tuple[int, bool]:
        alias = head.path[len(PATH_PREFIX) :] if head.path.startswith(PATH_PREFIX) else None
        agent = self.agents.get(alias) if alias else None
        if agent is None or alias is None:
            self.count("pushes_refused")
            return 404, True
        if head.method != "POST":
            self.count("pushes_refused")
            return 405, True
        if not slot.move(SERVING):
            return 503, True
        try:
            body = await read_body(stream, conn, head, max_bytes=MAX_PUSH_BYTES)
        except HttpError as refused:
            self.count("pushes_refused")
            return refused.status, True
        try:
            observation = read_observation(json.loads(body))
        except (ValueError, RecursionError):
            observation = None
        task_id = None if observation is None else observed_task_id(observation)
        if observation is None or task_id is None:
            self.count("pushes_refused")
            return 400, False
        index = await agent.book.find_index(alias, task_id)
        secret: str | None = None
        if index is None or not _credential_ok(head.headers, index):
            # Not journaled yet (the send's answer is on its way, or was lost in a crash),
            # or a continued task (input-required) whose index still holds the last turn's
            # credentials: the credential journaled with this send's intent identifies it.
            for digest in _presented(head.headers):
                by_secret = await agent.book.find_by_secret(alias, digest)
                if by_secret is None:
                    continue
                sent = by_secret[0].record
                # A credential of another known task is wrong for this one.
                if (index is None and sent.task_id in (None, task_id)) or (
                    sent.task_id == task_id and sent.phase in ("sending", "unknown")
                ):
                    index, secret = by_secret[1], digest
                    break
        if index is None:
            self.count("pushes_refused")
            return 404, False
        if not _credential_ok(head.headers, index):
            self.count("pushes_refused")
            return 401, False
        key = hashlib.sha256(f"{alias}\0{task_id}\0".encode() + body).hexdigest()[:40]
        payload = {
            "alias": alias,
            "taskId": task_id,
            "state": observed_state(observation),
            "secret": secret,
        }
        if isinstance(observation, ArtifactUpdate) and observation.append:
            # A chunk appended to an artifact (a2a-sdk 1.x pushes each): its id only
            # (bounded), noted with the task so the answer joins the chunks as sent.
            payload["appended"] = appended_key(observation.artifact.artifact_id)
        try:
            await self.inbox.put(
                source=PUSH_SOURCE,
                key=key,
                partition=f"{alias}/{task_id}",
                order=0,
                payload=payload,
            )
        except Exception as exc:
            log.warning("a2a push: committing to the inbox failed (%s)", type(exc).__name__)
            self.count("pushes_unavailable")
            return 503, False
        self.count("pushes_accepted")
        self.wake.set()
        return 200, False

    async def apply_pushes(self, owner_id: str, *, idle_s: float = 1.0) -> None:
        """The worker: reserve, apply, acknowledge — until cancelled."""
        while True:
            try:
                reservations = await self.inbox.reserve(
                    owner_id=owner_id,
                    ttl_ms=RESERVATION_TTL_MS,
                    limit=64,
                    max_attempts=MAX_ATTEMPTS,
                    sources=(PUSH_SOURCE,),
                )
            except Exception as exc:
                log.warning("a2a push: reserving failed (%s)", type(exc).__name__)
                reservations = ()
            if reservations:
                # The items of one claim concern distinct tasks (one partition each, handed
                # out one at a time): applied side by side, their writes share commits.
                async with trio.open_nursery() as nursery:
                    for reservation in reservations:
                        nursery.start_soon(self._apply_one, reservation)
            else:
                with trio.move_on_after(idle_s):
                    await self.wake.wait()
                self.wake = trio.Event()

    async def _apply_one(self, reservation: InboxReservation) -> None:
        try:
            await self._apply(reservation.item.payload)
        except Exception as exc:
            log.warning("a2a push: applying failed (%s)", type(exc).__name__)
            try:
                await self.inbox.retry(
                    reservation, delay_ms=1000, error="apply_failed", max_attempts=MAX_ATTEMPTS
                )
            except Exception:
                pass
            return
        try:
            await self.inbox.complete(reservation)
        except Exception as exc:
            log.warning("a2a push: acknowledging failed (%s)", type(exc).__name__)

    async def _apply(self, payload: object) -> None:
        if not isinstance(payload, dict):
            return
        alias, task_id, state = payload.get("alias"), payload.get("taskId"), payload.get("state")
        if not isinstance(alias, str) or not isinstance(task_id, str):
            return
        agent = self.agents.get(alias)
        if agent is None:
            return
        found = await agent.book.find_task(alias, task_id)
        digest = payload.get("secret")
        if found is None and isinstance(digest, str):
            found = await agent.book.find_by_secret(alias, digest)
        if found is None:
            return
        stored, _index = found
        record = stored.record
        if record.task_id is None and record.phase in ("sending", "unknown"):
            # The push names the task the send created: journaled, so a send whose
            # answer was lost finds it again (never sent twice).
            stored = await agent.book.update(stored, task_id=task_id)
        elif record.phase == "following" and moves_forward(record.state, state):
            stored = await agent.book.update(stored, state=state)
        appended = payload.get("appended")
        if isinstance(appended, str):
            await agent.book.note_appended(stored, appended)
        if isinstance(state, str) and (
            state not in ACTIVE_STATES or moves_forward(record.state, state)
        ):
            # Read the task now. Not for an artifact chunk (no state) nor a task still
            # working as it was: a2a-sdk 1.x pushes every event, each streamed chunk too.
            agent.observe(task_id)
