"""Webhook mode: a small Trio HTTP/1.1 server (h11) that receives Telegram updates.

HTTP is read and written by the shared pieces of :mod:`adapters.toolkit`: a request head
over 16 KiB → 431, unparsable → 400, not complete within 30 s → 408 (a kept-alive
connection must send its next whole head within 75 s); a body not complete within 30 s →
408. Every connection is closed gracefully, so an answer given before the body was read
(401, 413…) reaches a client that is still sending.

Connections are bounded by :func:`adapters.toolkit.serve_limited` in two budgets: at most
:data:`MAX_PENDING` still in a request head (or idle between kept-alive requests), where a
newcomer pushes out the oldest, so idle or dripping connections — 2,000 of them — cannot
keep Telegram out; and at most :data:`MAX_SERVING` requests past the secret check (Telegram
opens at most 100 connections), beyond which a request is answered 503 and retried by
Telegram. Out of file descriptors, accept backs off and logs once a minute.

Per request, in this order (contract §11.7; status codes exact):

1. path other than ``webhook_path`` → 404; method other than POST → 405; a content type
   not starting with ``application/json`` → 415;
2. ``X-Telegram-Bot-Api-Secret-Token`` compared as SHA-256 digests with
   :func:`hmac.compare_digest` → missing or wrong → 401, before the body is read;
3. :data:`MAX_SERVING` authenticated requests in progress already → 503; this server
   does not hold the receiver lease (another receiver is active) → 503;
4. body over ``max_request_bytes`` → 413; not JSON → 400; not an object with a valid
   ``update_id`` → 400;
5. a callback query is answered (failure → 503 so Telegram redelivers);
6. nothing admissible → 204; otherwise the update is admitted *before* the answer:
   a retryable admission → 503 (Telegram retries), else 204; any exception → 503.

Lease choice: the receiver lease is held by the server for its whole lifetime (acquired at
start, renewed at half its TTL by :class:`~adapters.toolkit.ReceiverLease`) rather than per
request as in the reference. A webhook server and a poller of the same bot therefore
exclude each other for as long as either runs, a standby server answers 503 (Telegram
retries later), and a lost lease stops the server: it stops accepting, gives the requests
in flight :data:`DRAIN_S` to finish (a deadline on the handlers' nursery), then raises
:class:`~adapters.toolkit.LeaseLostError`. No offset is kept: the runtime's operation
journal deduplicates Telegram's redeliveries.

**Inbox mode** (``inbox`` set, the connection's ``webhook_inbox``): no receiver lease, so
every instance behind a load balancer serves the same path. Steps 3, 5 and 6 become one:
the validated update is committed to the durable inbox (deduplicated on the connection and
``update_id``; a redelivery is acknowledged without a second row) and answered 204 once
committed, 503 when the store refused (Telegram retries). The inbox workers admit it
(:mod:`adapters.telegram._inbox`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import logging
from collections.abc import Callable

import attrs
import h11
import trio

from prismd.channel import AdapterFatalError
from stores import InboxStore

from ..toolkit import (
    PENDING,
    SERVING,
    Backoff,
    ConnectionLimiter,
    HttpError,
    LeaseLostError,
    ReceiverLease,
    RequestHead,
    Slot,
    parse_host_port,
    read_body,
    receiver_limiter,
    serve_limited,
    serve_requests,
)
from ._api import ReceiverStatus, TelegramApi, TelegramError
from ._inbox import put_update
from ._updates import UpdateHandler, update_id_of

log = logging.getLogger("prismd.telegram")

SECRET_HEADER = "x-telegram-bot-api-secret-token"
HEAD_TIMEOUT_S = 30.0
"""The first request head (and every body) must arrive within this time."""
IDLE_TIMEOUT_S = 75.0
"""A kept-alive connection must send its next request head within this time."""
MAX_HEAD_BYTES = 16 * 1024
MAX_PENDING = 128
"""Connections in a request head or idle between requests; the oldest gives way when full."""
MAX_SERVING = 100
"""Requests past the secret check at once: Telegram's ``max_connections`` is at most 100."""
DRAIN_S = 5.0
"""After the lease is lost: how long requests in flight may take to finish."""
GETME_MAX_BACKOFF_S = 60.0


def _secret_ok(expected: str, given: str | None) -> bool:
    want = hashlib.sha256(expected.encode()).digest()
    got = hashlib.sha256(given.encode("latin-1") if given is not None else b"").digest()
    return hmac.compare_digest(want, got) and given is not None


@attrs.define(eq=False, kw_only=True)
class WebhookServer:
    """What the webhook needs and nothing more: the receiver lease, the update handler,
    the receiving status and client (``getMe``)."""

    connection_id: str
    listen: str
    path: str
    secret: str = attrs.field(repr=False)
    max_request_bytes: int
    lease: ReceiverLease
    updates: UpdateHandler
    status: ReceiverStatus
    api: TelegramApi
    inbox: InboxStore | None = None
    """Inbox mode: updates are committed here (no receiver lease); ``None``: admitted here."""
    on_put: Callable[[], None] | None = None
    """Called after an update was committed to the inbox (wakes this instance's worker)."""
    max_pending: int = MAX_PENDING
    max_serving: int = MAX_SERVING
    address: tuple[str, int] | None = attrs.field(default=None, init=False)
    """``(host, port)`` the server listens on, once it does (port 0 resolved)."""
    limiter: ConnectionLimiter = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.limiter = receiver_limiter(
            f"telegram {self.connection_id} webhook",
            max_pending=self.max_pending,
            max_serving=self.max_serving,
            serving="authenticated requests",
            logger=log,
        )

    async def serve(self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled; raises :class:`LeaseLostError` once the lease is lost
        (after the drain) and :class:`AdapterFatalError` for rejected credentials."""
        host, port = parse_host_port(self.listen)
        listeners = await trio.open_tcp_listeners(port, host=host)
        sockname = listeners[0].socket.getsockname()
        self.address = (host, int(sockname[1]))
        self.status.state = "starting"
        lost = False
        async with trio.open_nursery() as handlers:
            try:
                async with trio.open_nursery() as nursery:

                    async def hold(task_status: trio.TaskStatus[None]) -> None:
                        nonlocal lost
                        await self._acquire(task_status)
                        await self.lease.keep()
                        lost = True
                        nursery.cancel_scope.cancel()  # stop accepting; drain below

                    if self.inbox is None:
                        await nursery.start(hold)
                    else:
                        self.status.state = "serving"  # every instance serves: no lease
                    nursery.start_soon(self._learn_username)
                    serve = functools.partial(
                        serve_limited, budget=PENDING, handler_nursery=handlers
                    )
                    await nursery.start(serve, self._handle, listeners, self.limiter)
                    log.info(
                        "telegram %s: webhook listening on %s port %d",
                        self.connection_id,
                        *self.address,
                    )
                    task_status.started()
            finally:
                # hypercorn's drain: requests in flight get a deadline, not an open end.
                handlers.cancel_scope.deadline = trio.current_time() + DRAIN_S
        if lost:
            raise LeaseLostError()

    async def _acquire(self, task_status: trio.TaskStatus[None]) -> None:
        def standby() -> None:
            self.status.state = "standby"
            task_status.started()

        stood_by = await self.lease.acquire(on_standby=standby)
        self.status.state = "serving"
        if not stood_by:
            task_status.started()

    async def _learn_username(self) -> None:
        """``getMe`` (for ``/cmd@bot`` stripping); 401/403 stop the adapter, others retry."""
        backoff = Backoff(cap_s=GETME_MAX_BACKOFF_S)
        while True:
            try:
                me = await self.api.call("getMe", {})
            except TelegramError as error:
                fatal = self.status.fatal(error)
                if fatal is not None:
                    raise fatal from None
                delay = backoff.next_delay()
                self.status.log_retry("getMe", error, delay)
                await trio.sleep(delay)
                continue
            self.status.log_reachable()
            if isinstance(me, dict) and isinstance(me.get("username"), str):
                self.updates.bot_username = me["username"]
            return

    async def _handle(self, stream: trio.SocketStream, slot: Slot) -> None:
        # Unreadable heads get 400/431, slow ones 408 (adapters.toolkit); Telegram itself
        # sends neither, but a misrouted client should get an answer, not silence.
        await serve_requests(
            stream,
            slot,
            self._answer,
            max_head_bytes=MAX_HEAD_BYTES,
            head_timeout_s=HEAD_TIMEOUT_S,
            idle_timeout_s=IDLE_TIMEOUT_S,
            fatal=(AdapterFatalError,),
        )

    async def _answer(
        self, stream: trio.SocketStream, conn: h11.Connection, head: RequestHead, slot: Slot
    ) -> tuple[int, bool]:
        """``(status, close the connection)`` for one request, following the module docstring."""
        if head.path != self.path:
            return 404, True
        if head.method != "POST":
            return 405, True
        if not head.headers.get("content-type", "").lower().startswith("application/json"):
            return 415, True
        if not _secret_ok(self.secret, head.headers.get(SECRET_HEADER)):
            return 401, True
        if not slot.move(SERVING):
            return 503, True  # more requests at once than Telegram opens: it retries
        if self.inbox is None and not self.lease.held:
            return 503, True
        try:
            body = await read_body(
                stream, conn, head, max_bytes=self.max_request_bytes, timeout_s=HEAD_TIMEOUT_S
            )
        except HttpError as refused:
            return refused.status, True
        try:
            update = json.loads(body)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's
            return 400, False
        if not isinstance(update, dict) or update_id_of(update) is None:
            return 400, False
        if self.inbox is not None:
            return await self._commit(update), False
        try:
            final = await self.updates.process(update, strict=True)
        except AdapterFatalError:
            raise
        except Exception:
            return 503, False
        return (204 if final else 503), False

    async def _commit(self, update: dict[str, object]) -> int:
        """Inbox mode: 204 once the update is committed (or was already), 503 otherwise."""
        assert self.inbox is not None
        try:
            await put_update(self.inbox, self.connection_id, update)
        except Exception as exc:
            log.warning(
                "telegram %s: committing an update to the inbox failed (%s)",
                self.connection_id,
                type(exc).__name__,
            )
            return 503
        if self.on_put is not None:
            self.on_put()
        return 204
