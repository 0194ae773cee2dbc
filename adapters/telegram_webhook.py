"""Webhook mode: a small Trio HTTP/1.1 server (h11) that receives Telegram updates.

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

import contextlib
import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import h11
import trio

from prismd.adapter import AdapterFatalError
from prismd.config import parse_host_port

from .telegram_api import TelegramError
from .telegram_parse import update_id_of

if TYPE_CHECKING:
    from .telegram import TelegramAdapter

SECRET_HEADER = b"x-telegram-bot-api-secret-token"
HEAD_TIMEOUT_S = 30.0
IDLE_TIMEOUT_S = 75.0
MAX_HEAD_BYTES = 16 * 1024


class _BodyTooLarge(Exception):
    pass


def _secret_ok(expected: str, given: bytes | None) -> bool:
    want = hashlib.sha256(expected.encode()).digest()
    got = hashlib.sha256(given if given is not None else b"").digest()
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


async def _next_event(conn: h11.Connection, stream: trio.SocketStream) -> object:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        data = await stream.receive_some(65536)
        conn.receive_data(data)


async def _respond(
    conn: h11.Connection, stream: trio.SocketStream, status: int, *, close: bool
) -> None:
    headers = [("server", "prismd")]
    if status != 204:
        headers.append(("content-length", "0"))
    if close:
        headers.append(("connection", "close"))
    data = conn.send(h11.Response(status_code=status, headers=headers))
    data = (data or b"") + (conn.send(h11.EndOfMessage()) or b"")
    await stream.send_all(data)


async def _serve_connection(adapter: TelegramAdapter, stream: trio.SocketStream) -> None:
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD_BYTES)
    timeout = HEAD_TIMEOUT_S
    while True:
        event: object = None
        try:
            with trio.move_on_after(timeout):
                event = await _next_event(conn, stream)
        except h11.RemoteProtocolError as exc:
            # Not HTTP/1.1 we can read (bad Content-Length, no Host, TLS to a plain port):
            # answer like any HTTP server instead of dropping the connection silently.
            status = exc.error_status_hint if exc.error_status_hint >= 400 else 400
            with contextlib.suppress(h11.LocalProtocolError):
                await _respond(conn, stream, status, close=True)
            return
        if not isinstance(event, h11.Request):
            return
        status, close = await _answer(adapter, conn, stream, event)
        await _respond(conn, stream, status, close=close)
        if close or conn.our_state is h11.MUST_CLOSE or conn.their_state is not h11.DONE:
            return
        conn.start_next_cycle()
        timeout = IDLE_TIMEOUT_S


async def _answer(
    adapter: TelegramAdapter, conn: h11.Connection, stream: trio.SocketStream, request: h11.Request
) -> tuple[int, bool]:
    """``(status, close the connection)`` for one request, following the module docstring."""
    path = request.target.split(b"?", 1)[0]
    if path != (adapter.webhook_path or "").encode():
        return 404, True
    if request.method != b"POST":
        return 405, True
    headers = {name.lower(): value for name, value in request.headers}
    content_type = headers.get(b"content-type", b"").lower()
    if not content_type.startswith(b"application/json"):
        return 415, True
    assert adapter.webhook_secret is not None
    if not _secret_ok(adapter.webhook_secret, headers.get(SECRET_HEADER)):
        return 401, True
    if adapter._lease is None:
        return 503, True
    length = headers.get(b"content-length")
    if length is not None and length.isdigit() and int(length) > adapter.max_request_bytes:
        return 413, True
    try:
        with trio.fail_after(HEAD_TIMEOUT_S):
            body = await _read_body(conn, stream, adapter.max_request_bytes)
    except _BodyTooLarge:
        return 413, True
    except h11.RemoteProtocolError:
        return 400, True  # a broken chunked body
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


async def _read_body(conn: h11.Connection, stream: trio.SocketStream, cap: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        event = await _next_event(conn, stream)
        if isinstance(event, h11.Data):
            size += len(event.data)
            if size > cap:
                raise _BodyTooLarge()
            chunks.append(bytes(event.data))
        elif isinstance(event, h11.EndOfMessage):
            return b"".join(chunks)
        else:
            raise _BodyTooLarge()
