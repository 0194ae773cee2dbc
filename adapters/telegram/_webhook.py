"""Webhook mode: a small Trio HTTP/1.1 server (h11) that receives Telegram updates.

HTTP is read and written by the shared pieces of :mod:`adapters._http`: a request head over
16 KiB → 431, unparsable → 400, not complete within 30 s → 408 (a kept-alive connection
silent for 75 s is closed); a body not complete within 30 s → 408.

Per request, in this order (contract §11.7; status codes exact):

1. path other than ``webhook_path`` → 404; method other than POST → 405; a content type
   not starting with ``application/json`` → 415;
2. ``X-Telegram-Bot-Api-Secret-Token`` compared as SHA-256 digests with
   :func:`hmac.compare_digest` → missing or wrong → 401, before the body is read;
3. this server does not hold the receiver lease (another receiver is active) → 503;
4. body over ``max_request_bytes`` → 413; not JSON → 400; not an object with a valid
   ``update_id`` → 400;
5. a callback query is answered (failure → 503 so Telegram redelivers);
6. nothing admissible → 204; otherwise the update is admitted *before* the answer:
   a retryable admission → 503 (Telegram retries), else 204; any exception → 503.

Lease choice: the receiver lease is held by the server for its whole lifetime (acquired at
start, renewed at a third of its TTL) rather than per request as in the reference. A
webhook server and a poller of the same bot therefore exclude each other for as long as
either runs, a standby server answers 503 (Telegram retries later), and a lost lease stops
the server with :class:`~adapters.telegram.ReceiverLeaseLostError`. No offset is kept: the
runtime's operation journal deduplicates Telegram's redeliveries.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import h11
import trio

from prismd.channel import AdapterFatalError
from prismd.daemon import parse_host_port

from ..toolkit import (
    HttpError,
    RequestHead,
    read_body,
    read_request_head,
    respond,
    server_connection,
)
from ._api import TelegramError
from ._parse import update_id_of

if TYPE_CHECKING:
    from ._adapter import TelegramAdapter

log = logging.getLogger("prismd.telegram")

SECRET_HEADER = "x-telegram-bot-api-secret-token"
HEAD_TIMEOUT_S = 30.0
"""The first request head (and every body) must arrive within this time."""
IDLE_TIMEOUT_S = 75.0
"""A kept-alive connection must send its next request head within this time."""
MAX_HEAD_BYTES = 16 * 1024


def _secret_ok(expected: str, given: str | None) -> bool:
    want = hashlib.sha256(expected.encode()).digest()
    got = hashlib.sha256(given.encode("latin-1") if given is not None else b"").digest()
    return hmac.compare_digest(want, got) and given is not None


async def serve_webhook(
    adapter: TelegramAdapter, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
) -> None:
    """Serve until cancelled; ``adapter.webhook_address`` is set once listening."""
    host, port = parse_host_port(adapter.webhook_listen)
    listeners = await trio.open_tcp_listeners(port, host=host)
    sockname = listeners[0].socket.getsockname()
    adapter.webhook_address = (host, int(sockname[1]))
    adapter._state = "starting"
    async with trio.open_nursery() as nursery:
        if await adapter._acquire_lease():
            adapter._state = "serving"
        else:
            adapter._state = "standby"
        nursery.start_soon(_keep_lease, adapter)
        nursery.start_soon(_learn_username, adapter)
        await nursery.start(trio.serve_listeners, _handler(adapter), listeners)
        log.info(
            "telegram %s: webhook listening on %s port %d",
            adapter.connection_id,
            *adapter.webhook_address,
        )
        task_status.started()


async def _keep_lease(adapter: TelegramAdapter) -> None:
    """Renew while held (losing it stops the server); acquire when it frees up."""
    while True:
        await trio.sleep(adapter.lease_ttl_ms / 3000)
        if adapter._lease is not None:
            await adapter._renew_lease()
        elif await adapter._acquire_lease():
            adapter._state = "serving"


async def _learn_username(adapter: TelegramAdapter) -> None:
    """``getMe`` (for ``/cmd@bot`` stripping); 401/403 stop the adapter, others retry."""
    delay = 1.0
    while True:
        try:
            me = await adapter._rx_api.call("getMe", {})
        except TelegramError as error:
            fatal = adapter._fatal(error)
            if fatal is not None:
                raise fatal from None
            adapter._log_retry("getMe", error, delay)
            await trio.sleep(delay)
            delay = min(delay * 2, 60.0)
            continue
        if isinstance(me, dict) and isinstance(me.get("username"), str):
            adapter._bot_username = me["username"]
        return


def _handler(adapter: TelegramAdapter) -> Callable[[trio.SocketStream], Awaitable[None]]:
    async def handle(stream: trio.SocketStream) -> None:
        try:
            await _serve_connection(adapter, stream)
        except AdapterFatalError:
            raise
        except Exception:
            pass  # one broken connection never takes the server down; no payload is logged
        finally:
            with trio.move_on_after(1, shield=True):
                await stream.aclose()

    return handle


async def _serve_connection(adapter: TelegramAdapter, stream: trio.SocketStream) -> None:
    conn = server_connection(MAX_HEAD_BYTES)
    timeout = HEAD_TIMEOUT_S
    while True:
        # Unreadable heads get 400/431, slow ones 408 (adapters._http); Telegram itself
        # sends neither, but a misrouted client should get an answer, not silence.
        head = await read_request_head(
            stream, conn, max_head_bytes=MAX_HEAD_BYTES, timeout_s=timeout
        )
        if head is None:
            return
        status, close = await _answer(adapter, stream, conn, head)
        await respond(stream, conn, head.method, status, close=close, allow="POST")
        if close or conn.our_state is h11.MUST_CLOSE or conn.their_state is not h11.DONE:
            return
        conn.start_next_cycle()
        timeout = IDLE_TIMEOUT_S


async def _answer(
    adapter: TelegramAdapter, stream: trio.SocketStream, conn: h11.Connection, head: RequestHead
) -> tuple[int, bool]:
    """``(status, close the connection)`` for one request, following the module docstring."""
    if head.path != adapter.webhook_path:
        return 404, True
    if head.method != "POST":
        return 405, True
    if not head.headers.get("content-type", "").lower().startswith("application/json"):
        return 415, True
    assert adapter.webhook_secret is not None
    if not _secret_ok(adapter.webhook_secret, head.headers.get(SECRET_HEADER)):
        return 401, True
    if adapter._lease is None:
        return 503, True
    try:
        body = await read_body(
            stream, conn, head, max_bytes=adapter.max_request_bytes, timeout_s=HEAD_TIMEOUT_S
        )
    except HttpError as refused:
        return refused.status, True
    try:
        update = json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's
        return 400, False
    if not isinstance(update, dict) or update_id_of(update) is None:
        return 400, False
    try:
        final = await adapter._process(update, strict=True)
    except AdapterFatalError:
        raise
    except Exception:
        return 503, False
    return (204 if final else 503), False
