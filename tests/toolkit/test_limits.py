"""adapters.toolkit's connection limiter and accept loop over real loopback sockets: budgets
that evict their idlest member or refuse, moves between budgets, and an accept loop that
runs out of file descriptors without stopping or logging a traceback storm."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import resource
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Literal

import pytest
import trio

from adapters.toolkit import (
    Budget,
    ConnectionLimiter,
    LogThrottle,
    Slot,
    close_gracefully,
    open_listeners,
    quiet_note,
    serve_limited,
)
from tests.support.flood import gone
from tests.support.waiting import wait_until

DEADLINE = 20


def test_a_throttle_lets_one_line_per_interval_per_key_and_counts_the_rest() -> None:
    now = [100.0]
    throttle = LogThrottle(interval_s=60.0, clock=lambda: now[0], max_keys=3)
    assert [throttle.passes("a") for _ in range(4)] == [0, None, None, None]
    assert throttle.passes("b") == 0  # keys are independent
    now[0] = 159.9
    assert throttle.passes("a") is None
    now[0] = 160.0
    assert throttle.passes("a") == 4  # the four quiet ones since its last line
    assert throttle.passes("a") is None
    # Bounded: a fourth key forgets the oldest ("b"), which then passes at once again.
    throttle.passes("c")
    throttle.passes("d")
    assert throttle.passes("b") == 0
    assert quiet_note(0) == "" and quiet_note(3) == " (3 more since the last line)"


async def test_a_full_evicting_budget_pushes_out_its_idlest_member() -> None:
    limiter = ConnectionLimiter("t", {"a": Budget(2, "evict")})
    first, second = limiter.admit("a"), limiter.admit("a")
    assert first is not None and second is not None
    first.touch()  # now `second` is the idlest
    third = limiter.admit("a")
    assert third is not None
    assert second.evicted and second.cancel_scope.cancel_called and second.released
    assert not first.evicted and limiter.open("a") == 2
    assert limiter.statistics()["a"].evicted == 1


async def test_a_refusing_budget_refuses_newcomers_and_moves() -> None:
    limiter = ConnectionLimiter(
        "t", {"pending": Budget(2, "evict"), "serving": Budget(1, "refuse")}
    )
    one, two = limiter.admit("pending"), limiter.admit("pending")
    assert one is not None and two is not None
    assert one.move("serving")
    assert not two.move("serving")  # full and refusing: stays where it was
    assert two.budget == "pending" and not two.evicted
    assert limiter.admit("serving") is None
    assert limiter.statistics()["serving"].refused == 2
    one.release()
    assert two.move("serving") and limiter.open() == 1
    one.release()  # idempotent
    assert limiter.open("pending") == 0
    with pytest.raises(ValueError):
        Budget(0)


@contextlib.asynccontextmanager
async def serving(
    limiter: ConnectionLimiter,
    handler: Callable[[trio.SocketStream, Slot], Awaitable[object]] | None = None,
    *,
    hold_in: str | None = None,
) -> AsyncIterator[tuple[int, list[bytes]]]:
    """A server that reads one line per connection and answers ``ok`` (each connection
    moved to ``hold_in`` first, if given); yields its port and the lines it answered."""
    answered: list[bytes] = []

    async def echo_line(stream: trio.SocketStream, slot: Slot) -> None:
        if hold_in is not None:
            assert slot.move(hold_in)
        data = b""
        while not data.endswith(b"\n"):
            chunk = await stream.receive_some(4096)
            if not chunk:
                return
            data += chunk
        answered.append(data)
        await stream.send_all(b"ok\n")
        await close_gracefully(stream)

    async with (
        open_listeners("127.0.0.1", 0) as (listeners, (_host, port)),
        trio.open_nursery() as nursery,
    ):
        serve = functools.partial(serve_limited, budget="pending")
        await nursery.start(serve, handler or echo_line, listeners, limiter)
        yield port, answered
        nursery.cancel_scope.cancel()


async def test_open_listeners_gives_the_bound_port_and_closes_on_exit() -> None:
    with trio.fail_after(DEADLINE):
        async with open_listeners("127.0.0.1", 0) as (listeners, bound):
            assert bound == ("127.0.0.1", listeners[0].socket.getsockname()[1])
            assert bound[1] > 0  # port 0 resolved
            stream = await trio.open_tcp_stream(*bound)  # the listener takes connections
            await stream.aclose()
        assert all(listener.socket.fileno() == -1 for listener in listeners)
        with pytest.raises(OSError):
            await trio.open_tcp_stream(*bound)


async def _ask(port: int, line: bytes) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(line)
        answer = b""
        while chunk := await stream.receive_some(4096):
            answer += chunk
    return answer


@pytest.mark.parametrize("when_full", ["evict", "refuse"])
async def test_a_flood_of_silent_connections_over_real_sockets(
    when_full: Literal["evict", "refuse"],
) -> None:
    """Evicting: 50 silent connections against a cap of 5 hold 5 places and a client that
    speaks at once is answered. Refusing: the newcomers are closed at accept instead."""
    limiter = ConnectionLimiter("t", {"pending": Budget(5, when_full)})
    with trio.fail_after(DEADLINE):
        async with serving(limiter) as (port, answered):
            flood = [await trio.open_tcp_stream("127.0.0.1", port) for _ in range(50)]
            try:

                def settled() -> bool:
                    stats = limiter.statistics()["pending"]
                    return stats.open == 5 and stats.evicted + stats.refused == 45

                await wait_until(settled)
                assert limiter.open() == 5
                if when_full == "evict":
                    assert await _ask(port, b"hello\n") == b"ok\n"
                    assert answered == [b"hello\n"]
                    assert await gone(flood[0])  # the oldest gave way
                else:
                    assert await gone(flood[-1])  # refused at accept, unanswered
                    assert limiter.statistics()["pending"].refused == 45
                    for stream in flood[:5]:
                        await stream.send_all(b"early\n")
                        assert await stream.receive_some(4096) == b"ok\n"
                        await stream.aclose()
                    await wait_until(lambda: limiter.open() == 0)
                    assert await _ask(port, b"later\n") == b"ok\n"
            finally:
                for stream in flood:
                    await stream.aclose()


async def test_an_evicted_handler_is_cancelled_and_its_stream_closed() -> None:
    limiter = ConnectionLimiter("t", {"pending": Budget(1, "evict")})
    cancelled: list[bool] = []

    async def hold(stream: trio.SocketStream, slot: Slot) -> None:
        try:
            await trio.sleep_forever()
        finally:
            cancelled.append(slot.evicted)

    with trio.fail_after(DEADLINE):
        async with serving(limiter, hold) as (port, _answered):
            first = await trio.open_tcp_stream("127.0.0.1", port)
            await wait_until(lambda: limiter.open() >= 1)
            second = await trio.open_tcp_stream("127.0.0.1", port)
            async with first, second:
                assert await gone(first)
                assert cancelled == [True]
                assert limiter.open() == 1


# ---------------------------------------------------------------- out of file descriptors


@contextlib.contextmanager
def no_free_descriptor() -> Iterator[int]:
    """Lower ``RLIMIT_NOFILE`` so that no new descriptor can be allocated (they take the
    lowest free number, and the limit is set to it); yields that limit, restores it after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowest_free = os.dup(0)
    os.close(lowest_free)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))
    try:
        yield lowest_free
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _unconnected() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    return sock


async def _ask_on(sock: socket.socket, line: bytes) -> bytes:
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
    async with stream:
        await stream.send_all(line)
        return bytes(await stream.receive_some(4096))


def _accept_failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    assert all(r.exc_info is None and not r.exc_text for r in caplog.records), "a traceback"
    return [r.getMessage() for r in caplog.records if "accept failed" in r.getMessage()]


async def test_out_of_descriptors_accept_sheds_the_idlest_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """At EMFILE the loop sheds its idlest evictable connection, which frees the descriptor
    the next accept needs: a newcomer is served although none could be allocated."""
    limiter = ConnectionLimiter("flooded", {"pending": Budget(10, "evict")})
    with trio.fail_after(DEADLINE):
        async with serving(limiter) as (port, answered):
            idle = await trio.open_tcp_stream("127.0.0.1", port)
            await wait_until(lambda: limiter.open() >= 1)
            late = _unconnected()
            with no_free_descriptor() as limit:
                with contextlib.suppress(BlockingIOError):
                    late.connect(("127.0.0.1", port))
                assert await _ask_on(late, b"late\n") == b"ok\n"
            async with idle:
                assert await gone(idle)
    assert answered == [b"late\n"] and limiter.statistics()["pending"].evicted == 1
    failures = _accept_failures(caplog)
    assert len(failures) == 1, failures  # then "nobody waiting": nothing more was shed
    assert "EMFILE" in failures[0] and f"open file limit {limit}" in failures[0]
    assert "shed the idlest connection" in failures[0]


@pytest.mark.slow
async def test_out_of_descriptors_accept_backs_off_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With nothing to shed, accept keeps failing: at a bounded pace (0.1 s doubling to
    1 s), with one warning however often, and it serves again once descriptors are free."""
    limiter = ConnectionLimiter(
        "flooded", {"pending": Budget(10, "evict"), "held": Budget(10, "refuse")}
    )
    with trio.fail_after(DEADLINE):
        async with serving(limiter, hold_in="held") as (port, answered):
            held = await trio.open_tcp_stream("127.0.0.1", port)
            await wait_until(lambda: limiter.open("held") >= 1)
            late = _unconnected()
            started = trio.current_time()
            with no_free_descriptor():
                with contextlib.suppress(BlockingIOError):
                    late.connect(("127.0.0.1", port))
                await trio.sleep(2.0)  # 0.1 + 0.2 + 0.4 + 0.8: four or five failures
            assert await _ask_on(late, b"late\n") == b"ok\n"
            assert trio.current_time() - started < 2.0 + 1.0 + 0.5  # within one backoff
            async with held:
                await held.send_all(b"held\n")
                assert await held.receive_some(4096) == b"ok\n"
    assert sorted(answered) == [b"held\n", b"late\n"]
    (failure,) = _accept_failures(caplog)
    assert "EMFILE" in failure and "nothing of ours to shed" in failure


async def test_other_accept_errors_propagate() -> None:
    class Broken(trio.abc.Listener[trio.SocketStream]):
        async def accept(self) -> trio.SocketStream:
            await trio.lowlevel.checkpoint()
            raise OSError(errno.EINVAL, "listener is broken")

        async def aclose(self) -> None:
            await trio.lowlevel.checkpoint()

    limiter = ConnectionLimiter("t", {"pending": Budget(1)})

    async def never(stream: trio.SocketStream, slot: Slot) -> None:
        raise AssertionError("no connection was accepted")

    with trio.fail_after(DEADLINE), pytest.RaisesGroup(OSError, flatten_subgroups=True):
        await serve_limited(never, [Broken()], limiter, budget="pending")
