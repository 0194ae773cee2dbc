"""The one place that imports asyncpg and trio-asyncio: connections on an asyncio loop in Trio.

:func:`open_driver` runs ``trio_asyncio.open_loop()`` for the store's whole life and a pool
of asyncpg connections on that loop, kept on the Trio side (a semaphore and a list: checking
a connection out and in costs no asyncio step, and under trio-asyncio the steps are what
costs). Everything else in prismd stays Trio: :meth:`Driver.call` runs one asyncio-flavoured
function on one pooled connection (a :class:`Session`) and answers in Trio, so one store call
costs one crossing of the bridge however many statements it runs.

Cancellation really stops waiting: a cancelled Trio caller cancels the asyncio task and
returns at once; asyncpg sends the server a cancel request in the background, and the next
statement on that connection waits until the server confirmed it.

No timer runs on the Trio clock (which a test may drive by hand) or on the asyncio loop (whose
clock *is* the Trio clock under trio-asyncio): every time limit is real time.

* Statements: the server's ``statement_timeout``, set per connection at startup, and
  ``idle_in_transaction_session_timeout`` for a transaction whose client went away.
* A dead network: ``TCP_USER_TIMEOUT`` and keepalives on every TCP socket, so the kernel
  drops a connection whose peer stopped answering and the call in flight fails.
* Connecting (TCP, TLS, authentication): a real-time timer thread cancels the attempt.

Errors become :class:`~stores.StoreUnavailableError` (or :class:`~stores.StoreUnreachableError`
when trying again later may help) whose message names the server (host, port, database), the
driver's reason when connecting, and otherwise only the error class and SQLSTATE: a server
message can quote a value, and values never reach a log. The password never appears.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar

import asyncpg
import attrs
import trio
import trio_asyncio

from .._types import StoreUnavailableError, StoreUnreachableError
from ._url import PostgresOptions, PostgresURL, default_pool_size

T = TypeVar("T")
log = logging.getLogger("stores.postgres")

IDLE_IN_TRANSACTION_TIMEOUT_MS = 60_000
"""A transaction left open by a vanished client is ended by the server after this."""
CLOSE_BUDGET_S = 5.0
"""Closing the pool gracefully may take this long; then its connections are dropped."""

# SQLSTATEs (https://www.postgresql.org/docs/current/errcodes-appendix.html).
_RETRY_TRANSACTION = frozenset({"40001", "40P01"})  # serialization failure, deadlock
_UNREACHABLE = frozenset({"57P01", "57P02", "57P03", "53300", "53400"})  # shutdown, starting, full
_DATA_CLASSES = ("22", "23", "54")  # data exception, integrity violation, program limit


class RetryTransaction(StoreUnavailableError):
    """The server aborted the transaction to resolve a deadlock or serialization conflict;
    nothing of it was written and running it again is safe."""


class WriteRefused(StoreUnavailableError):
    """The server refused the data of one statement (a data or limit error, SQLSTATE class
    22, 23 or 54): nothing of its transaction was written; other writes may succeed alone."""


class ConnectTimeout(Exception):
    """A new connection was not up within ``connect_timeout_ms`` (real time)."""


@attrs.frozen
class Session:
    """One pooled connection, for the asyncio-flavoured function given to :meth:`Driver.call`.

    ``args`` are bound as statement parameters (never formatted into SQL).
    """

    _conn: Any

    async def fetch(self, sql: str, *args: object) -> Sequence[Sequence[Any]]:
        rows: Sequence[Sequence[Any]] = await self._conn.fetch(sql, *args)
        return rows

    async def fetchrow(self, sql: str, *args: object) -> Sequence[Any] | None:
        row: Sequence[Any] | None = await self._conn.fetchrow(sql, *args)
        return row

    async def execute(self, sql: str, *args: object) -> None:
        await self._conn.execute(sql, *args)

    def transaction(self) -> contextlib.AbstractAsyncContextManager[Any]:
        """``async with session.transaction():`` — BEGIN … COMMIT (ROLLBACK on error)."""
        transaction: contextlib.AbstractAsyncContextManager[Any] = self._conn.transaction()
        return transaction


def _connect_kwargs(url: PostgresURL, options: PostgresOptions) -> dict[str, Any]:
    given = {
        "host": url.host,
        "port": url.port,
        "user": url.user,
        "database": url.database,
        "password": options.password if options.password is not None else url.password,
    }
    # What the URL leaves out, the driver fills in (PGHOST, PGUSER…, the local socket).
    kwargs: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    kwargs |= {
        # No asyncio timers (see the module docstring): the limits are the server's and ours.
        "timeout": None,
        "command_timeout": None,
        "statement_cache_size": 256,
        "max_cached_statement_lifetime": 0,
        "server_settings": {
            "application_name": "prismd",
            "statement_timeout": str(options.statement_timeout_ms),
            "idle_in_transaction_session_timeout": str(IDLE_IN_TRANSACTION_TIMEOUT_MS),
        },
    }
    if url.sslmode is not None:
        kwargs["ssl"] = url.sslmode
    return kwargs


def _tune_socket(conn: Any, options: PostgresOptions) -> None:
    """Keepalives and ``TCP_USER_TIMEOUT``: a peer that stops answering (a pulled cable, a
    frozen host) fails the connection in bounded real time instead of hanging a call."""
    transport = getattr(conn, "_transport", None)
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    bound_ms = options.statement_timeout_ms + options.connect_timeout_ms
    with contextlib.suppress(OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, 30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, 10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, 3)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, bound_ms)


def _leaves_connection_usable(exc: BaseException) -> bool:
    """An ordinary error answered by a live server (a timeout, a refused value, a deadlock)
    leaves the connection ready for the next statement; anything else may not."""
    if isinstance(exc, asyncio.CancelledError):
        return True  # asyncpg cancels the statement and waits for the server before reuse
    state = _sqlstate(exc)
    if not isinstance(exc, asyncpg.PostgresError) or state is None:
        return False
    return not (state in _UNREACHABLE or state.startswith("08"))


def _sqlstate(exc: BaseException) -> str | None:
    state = getattr(exc, "sqlstate", None)
    return state if isinstance(state, str) else None


@attrs.define(eq=False)
class _Lease:
    """The connection one call holds (``None`` until it has one, or once it was dropped)."""

    conn: Any


@attrs.define(eq=False)
class Driver:
    """The loop, the pool and the error vocabulary of one open store."""

    url: PostgresURL
    options: PostgresOptions
    loop: Any
    size: int
    """Connections at most (``pool_size``)."""
    closed: bool = False
    _idle: list[Any] = attrs.Factory(list)
    """Open connections no call holds (asyncpg ``Connection`` objects)."""
    _slots: trio.Semaphore = attrs.field(init=False)
    """One token per connection that may exist: held from a call's start to its task's end."""
    _connect_kwargs: dict[str, Any] = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._slots = trio.Semaphore(self.size)
        self._connect_kwargs = _connect_kwargs(self.url, self.options)

    @property
    def where(self) -> str:
        return self.url.where

    # ------------------------------------------------------------------ errors

    def _clean(self, text: str) -> str:
        for secret in (self.options.password, self.url.password):
            if secret:
                text = text.replace(secret, "[REDACTED]")
        return text

    def connect_error(self, exc: BaseException) -> StoreUnavailableError:
        """What a failed connection attempt (at open or a reconnect) tells the caller."""
        where = f"PostgreSQL store {self.where}"
        state = _sqlstate(exc)
        if isinstance(exc, ConnectTimeout):
            return StoreUnreachableError(
                f"{where}: cannot connect: no answer within {self.options.connect_timeout_ms} ms"
            )
        if isinstance(exc, OSError):
            # asyncio words a refusal "Connect call failed (addr)": the errno says more.
            if isinstance(exc, socket.gaierror) or not exc.errno or exc.errno < 0:
                reason = exc.strerror or type(exc).__name__
            else:
                reason = os.strerror(exc.errno)
            return StoreUnreachableError(self._clean(f"{where}: cannot connect: {reason}"))
        if isinstance(exc, asyncpg.PostgresError):
            # The server's words at login ('password authentication failed for user "x"',
            # 'database "y" does not exist') name no value of ours.
            reason = self._clean(getattr(exc, "message", None) or str(exc) or type(exc).__name__)
            cls = StoreUnreachableError if state in _UNREACHABLE else StoreUnavailableError
            return cls(f"{where}: cannot connect: {reason} (SQLSTATE {state})")
        return StoreUnreachableError(f"{where}: cannot connect: {type(exc).__name__}")

    def error(self, exc: BaseException) -> StoreUnavailableError:
        """A failed call: class and SQLSTATE only (server messages can quote values)."""
        where = f"PostgreSQL store {self.where}"
        if isinstance(exc, StoreUnavailableError):
            return exc
        state = _sqlstate(exc)
        if isinstance(exc, asyncpg.PostgresError) and state is not None:
            name = type(exc).__name__
            if state in _RETRY_TRANSACTION:
                return RetryTransaction(f"{where}: transaction aborted ({name}, SQLSTATE {state})")
            if state.startswith(_DATA_CLASSES):
                return WriteRefused(f"{where}: statement refused ({name}, SQLSTATE {state})")
            if state == "57014":
                return StoreUnavailableError(
                    f"{where}: statement cancelled after statement_timeout"
                    f" ({self.options.statement_timeout_ms} ms) or by an operator"
                )
            if state == "42501":
                return StoreUnavailableError(
                    f"{where}: permission denied (SQLSTATE 42501): the role lacks a privilege"
                    " this needs, such as creating tables in the schema (make the database"
                    " or the schema the role's own)"
                )
            if state in _UNREACHABLE or state.startswith("08"):
                return StoreUnreachableError(f"{where}: connection lost ({name}, SQLSTATE {state})")
            return StoreUnavailableError(f"{where}: {name} (SQLSTATE {state})")
        if isinstance(exc, asyncpg.InterfaceError | asyncpg.InternalClientError | OSError):
            return StoreUnreachableError(f"{where}: connection lost ({type(exc).__name__})")
        if isinstance(exc, asyncio.CancelledError):
            return StoreUnavailableError(f"{where}: store is closed")
        return StoreUnavailableError(f"{where}: {type(exc).__name__}")

    # ------------------------------------------------------------------ connecting

    async def _connect(self, *args: Any, **kwargs: Any) -> Any:
        """asyncpg's connect, bounded in real time and with the socket tuned (every new
        pooled connection comes through here)."""
        task = asyncio.current_task()
        assert task is not None
        loop = self.loop
        # Touched on the loop only, so a timer firing just as the connection comes up
        # cannot cancel the statement that follows.
        attempt = {"connecting": True, "expired": False}

        def expire_on_loop() -> None:
            if attempt["connecting"]:
                attempt["expired"] = True
                task.cancel()

        def expire() -> None:  # on the timer's thread
            with contextlib.suppress(RuntimeError):  # the loop already closed
                loop.call_soon_threadsafe(expire_on_loop)

        timer = threading.Timer(self.options.connect_timeout_ms / 1000, expire)
        timer.daemon = True
        timer.start()
        try:
            conn = await asyncpg.connect(*args, **kwargs)
        except asyncio.CancelledError:
            if attempt["expired"]:
                task.uncancel()
                raise ConnectTimeout() from None
            raise
        finally:
            attempt["connecting"] = False
            timer.cancel()
        _tune_socket(conn, self.options)
        return conn

    # ------------------------------------------------------------------ calls

    async def call(self, fn: Callable[[Session], Coroutine[Any, Any, T]]) -> T:
        """Run ``fn`` (asyncio-flavoured) on a pooled connection; Trio-flavoured.

        At most ``pool_size`` calls hold a connection at once; the others wait here, in
        Trio. The connection comes back to the pool when ``fn``'s task is over (after a
        cancelled caller has moved on, too), unless the call left it unusable: then it is
        dropped and a later call connects anew. Raises what :meth:`error` makes of a driver
        error; our own exceptions pass through.
        """
        if self.closed:
            raise StoreUnavailableError(f"PostgreSQL store {self.where}: store is closed")
        await self._slots.acquire()
        if self.closed:  # closed while this call waited for a connection
            self._slots.release()
            raise StoreUnavailableError(f"PostgreSQL store {self.where}: store is closed")
        lease = _Lease(self._idle.pop() if self._idle else None)
        try:
            future = asyncio.ensure_future(self._on_connection(lease, fn), loop=self.loop)
        except BaseException:
            self._slots.release()
            raise

        def settle(_fut: asyncio.Future[T]) -> None:
            # On the loop, once fn's task is done: return the connection, free the slot.
            if lease.conn is not None and not lease.conn.is_closed():
                if self.closed:
                    lease.conn.terminate()
                else:
                    self._idle.append(lease.conn)
            self._slots.release()

        future.add_done_callback(settle)
        return await self._wait(future)

    async def _on_connection(
        self, lease: _Lease, fn: Callable[[Session], Coroutine[Any, Any, T]]
    ) -> T:
        try:
            if lease.conn is None or lease.conn.is_closed():
                lease.conn = None
                try:
                    lease.conn = await self._connect(**self._connect_kwargs)
                except (ConnectTimeout, OSError, asyncpg.PostgresError) as exc:
                    raise self.connect_error(exc) from None
            conn = lease.conn
            try:
                return await fn(Session(conn))
            except BaseException as exc:
                if not _leaves_connection_usable(exc):
                    # asyncpg may not have seen the connection die yet (a FATAL answer
                    # before the EOF): never hand it out again.
                    conn.terminate()
                    lease.conn = None
                raise
        except (StoreUnavailableError, asyncio.CancelledError):
            raise
        except Exception as exc:
            raise self.error(exc) from None

    async def run(self, coro: Awaitable[T]) -> T:
        """Await an asyncio coroutine from Trio: one crossing; a cancel returns at once."""
        try:
            future = asyncio.ensure_future(coro, loop=self.loop)
        except BaseException:
            if isinstance(coro, Coroutine):
                coro.close()
            raise
        return await self._wait(future)

    async def _wait(self, future: asyncio.Future[T]) -> T:
        done = trio.Event()

        def finished(fut: asyncio.Future[T]) -> None:
            done.set()
            if not fut.cancelled():
                fut.exception()  # retrieved: a cancelled call's late error is not "lost"

        future.add_done_callback(finished)
        try:
            await done.wait()
        except trio.Cancelled:
            future.cancel()
            raise
        try:
            return future.result()
        except asyncio.CancelledError:
            raise StoreUnavailableError(f"PostgreSQL store {self.where}: store is closed") from None

    async def aclose(self) -> None:
        """Close every connection: gracefully (a Terminate message to each server backend)
        once the calls in flight are over, within a bound; by force after it."""
        if self.closed:
            return
        self.closed = True
        with trio.move_on_after(CLOSE_BUDGET_S):
            for _ in range(self.size):
                await self._slots.acquire()
            idle, self._idle = self._idle, []
            for conn in idle:
                try:
                    await self.run(conn.close())
                except Exception as exc:  # a broken connection: nothing to close politely
                    log.debug("closing a connection: %s", type(exc).__name__)
        for conn in self._idle:
            conn.terminate()
        self._idle = []


@contextlib.asynccontextmanager
async def open_driver(url: PostgresURL, options: PostgresOptions) -> AsyncIterator[Driver]:
    """The loop and the pool for the block; connections are made on first use (the caller
    makes one at once: the migration check)."""
    async with trio_asyncio.open_loop() as loop:
        size = options.pool_size or default_pool_size(os.cpu_count())
        driver = Driver(url=url, options=options, loop=loop, size=size)
        try:
            yield driver
        finally:
            with trio.CancelScope(shield=True):
                await driver.aclose()


def plain_asyncio_timings(
    driver: Driver, sql: str, batch: Sequence[Sequence[object]]
) -> list[float]:
    """Seconds per ``fetch(sql, *args)`` for each ``args`` of ``batch`` from plain asyncio:
    a selector loop of its own in this (worker) thread and one fresh connection, no Trio.
    The baseline the bridge is measured against (``prismd bench``'s ``postgres-bridge``)."""

    async def main() -> list[float]:
        kwargs = _connect_kwargs(driver.url, driver.options)
        conn = await asyncpg.connect(**kwargs)
        try:
            out: list[float] = []
            for args in batch:
                start = time.perf_counter()
                await conn.fetch(sql, *args)
                out.append(time.perf_counter() - start)
            return out
        finally:
            await conn.close()

    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as runner:
        return runner.run(main())
