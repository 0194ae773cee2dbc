"""Supervisor: start semantics, restarts with backoff, intensity limit, fatal errors, health."""

from __future__ import annotations

import logging
import random

import pytest
import trio
import trio.testing

from prismd.channel import AdapterFatalError
from prismd.daemon._supervisor import (
    ChildStartupError,
    RestartPolicy,
    Supervisor,
    TooManyRestartsError,
    describe_exception,
    watchdog,
)

NO_JITTER = RestartPolicy(jitter=0.0)


class Crashy:
    """A child that serves, then crashes ``crashes`` times at the given delay."""

    def __init__(self, crashes: int, after_s: float = 1.0, exc: Exception | None = None) -> None:
        self.crashes = crashes
        self.after_s = after_s
        self.exc = exc or RuntimeError("secret-token-in-message")
        self.starts: list[float] = []

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.starts.append(trio.current_time())
        task_status.started()
        await trio.sleep(self.after_s)
        if len(self.starts) <= self.crashes:
            raise self.exc
        await trio.sleep_forever()


async def test_start_returns_after_child_started_and_health_reports_running(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sup = Supervisor(policy=NO_JITTER)
    order: list[str] = []

    async def slow_start(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await trio.sleep(3)
        order.append("started")
        task_status.started()
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        await sup.start(nursery, "web", slow_start, health=lambda: {"listener": "bound"})
        order.append("returned")
        assert sup.health() == {"web": {"listener": "bound", "state": "running"}}
        sup.stop("web")
        await trio.testing.wait_all_tasks_blocked()
        assert sup.health()["web"]["state"] == "stopped"
    assert order == ["started", "returned"]


async def test_crashing_child_is_restarted_with_doubling_backoff(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="prismd.daemon")
    sup = Supervisor(policy=NO_JITTER)
    child = Crashy(crashes=3, after_s=1.0)
    async with trio.open_nursery() as nursery:
        t0 = trio.current_time()
        await sup.start(nursery, "web", child.run)
        await trio.sleep(20)
        assert sup.children["web"].state == "running"
        assert sup.children["web"].restarts == 3
        nursery.cancel_scope.cancel()
    # crash at +1, restart after 0.5; crash +1, restart after 1.0; crash +1, after 2.0
    rel = [round(s - t0, 3) for s in child.starts]
    assert rel == [0.0, 1.5, 3.5, 6.5]
    text = caplog.text
    assert "web crashed (RuntimeError); restart 1 in 0.5 s" in text
    assert "secret-token" not in text


async def test_backoff_is_bounded_and_jittered() -> None:
    sup = Supervisor(policy=RestartPolicy(jitter=0.2), rng=random.Random(7))
    values = [sup._backoff(n) for n in range(12)]
    # Each attempt within ±20 % of its doubled base (0.5, 1, 2, … capped at 30 s).
    for n, v in enumerate(values):
        base = min(30.0, 0.5 * 2**n)
        assert base * 0.8 <= v <= base * 1.2, (n, v)
    assert all(v <= 36.0 for v in values)
    assert 24.0 <= values[-1] <= 36.0
    # Jitter: not all identical at the cap.
    assert len({round(v, 6) for v in values[8:]}) > 1
    plain = Supervisor(policy=NO_JITTER)
    assert [plain._backoff(n) for n in range(8)] == [0.5, 1, 2, 4, 8, 16, 30, 30]


async def test_too_many_crashes_in_the_window_ends_with_a_clear_error(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sup = Supervisor(policy=RestartPolicy(jitter=0.0, max_restarts=5, window_s=60.0))
    child = Crashy(crashes=100, after_s=0.1)
    with pytest.RaisesGroup(pytest.RaisesExc(TooManyRestartsError)) as info:
        async with trio.open_nursery() as nursery:
            await sup.start(nursery, "telegram:tg", child.run)
    (exc,) = info.value.exceptions
    assert "telegram:tg crashed 6 times within 60 s" in str(exc)
    assert "secret" not in str(exc)
    assert sup.children["telegram:tg"].state == "failed"
    assert len(child.starts) == 6


async def test_crashes_spread_beyond_the_window_keep_restarting(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sup = Supervisor(policy=RestartPolicy(jitter=0.0, max_restarts=2, window_s=10.0))
    # Crashes 30 s apart: never more than 2 in any 10 s window; backoff resets after
    # stable_after_s of running.
    child = Crashy(crashes=6, after_s=30.0)
    async with trio.open_nursery() as nursery:
        await sup.start(nursery, "web", child.run)
        await trio.sleep(400)
        assert sup.children["web"].restarts == 6
        assert sup.children["web"].state == "running"
        nursery.cancel_scope.cancel()


async def test_backoff_resets_after_a_stable_run(autojump_clock: trio.testing.MockClock) -> None:
    sup = Supervisor(policy=RestartPolicy(jitter=0.0, stable_after_s=5.0, max_restarts=50))
    child = Crashy(crashes=3, after_s=6.0)
    async with trio.open_nursery() as nursery:
        await sup.start(nursery, "web", child.run)
        await trio.sleep(60)
        nursery.cancel_scope.cancel()
    gaps = [round(b - a, 3) for a, b in zip(child.starts, child.starts[1:])]
    assert gaps == [6.5, 6.5, 6.5]


async def test_fatal_adapter_error_stops_only_that_child(
    autojump_clock: trio.testing.MockClock,
) -> None:
    sup = Supervisor(policy=NO_JITTER)
    healthy = Crashy(crashes=0)

    async def fatal_later(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep(1)
        raise AdapterFatalError("401 from https://api.telegram.org/botSECRET")

    async def fatal_at_start(
        *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        async with trio.open_nursery():
            raise AdapterFatalError("webhook is active")

    async with trio.open_nursery() as nursery:
        await sup.start(nursery, "web", healthy.run)
        await sup.start(nursery, "tg", fatal_later)
        await sup.start(nursery, "tg2", fatal_at_start)
        await trio.sleep(10)
        assert sup.health() == {
            "web": {"state": "running"},
            "tg": {"state": "failed"},
            "tg2": {"state": "failed"},
        }
        nursery.cancel_scope.cancel()
    assert len(healthy.starts) == 1


async def test_failure_before_first_start_is_a_startup_error() -> None:
    sup = Supervisor(policy=NO_JITTER)

    async def bind_fails(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        raise OSError(98, "Address already in use")

    with pytest.RaisesGroup(pytest.RaisesExc(ChildStartupError)) as info:
        async with trio.open_nursery() as nursery:
            await sup.start(nursery, "webchat:web", bind_fails)
    message = (
        "webchat:web failed to start: OSError (Address already in use); another program holds"
        " that port (perhaps another prismd; `ss -ltnp` shows which): stop it, or give this"
        " listener another address in the config (prismd init writes one; prismd doctor"
        " checks every port)"
    )
    assert str(info.value.exceptions[0]) == message
    assert sup.children["webchat:web"].state == "failed"


async def test_a_low_port_without_privileges_says_what_to_do() -> None:
    sup = Supervisor(policy=NO_JITTER)

    async def bind_refused(
        *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        raise OSError(13, "Permission denied")

    with pytest.RaisesGroup(pytest.RaisesExc(ChildStartupError)) as info:
        async with trio.open_nursery() as nursery:
            await sup.start(nursery, "webchat:web", bind_refused, where="0.0.0.0:80")
    assert str(info.value.exceptions[0]) == (
        "webchat:web on 0.0.0.0:80 failed to start: PermissionError (Permission denied); port 80"
        " needs privileges prismd does not have: listen on a port above 1023 (a reverse proxy can"
        " face the outside on a low port)"
    )
    # Not a port's problem: no hint.
    sup = Supervisor(policy=NO_JITTER)
    with pytest.RaisesGroup(pytest.RaisesExc(ChildStartupError)) as info:
        async with trio.open_nursery() as nursery:
            await sup.start(nursery, "control", bind_refused)
    assert str(info.value.exceptions[0]) == (
        "control failed to start: PermissionError (Permission denied)"
    )


async def test_child_that_returns_is_stopped_and_duplicate_names_refused() -> None:
    sup = Supervisor()

    async def done(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        return

    async with trio.open_nursery() as nursery:
        await sup.start(nursery, "once", done)
        with pytest.raises(ValueError, match="duplicate"):
            await sup.start(nursery, "once", done)
    assert sup.health() == {"once": {"state": "stopped"}}


async def test_health_survives_a_raising_adapter_health() -> None:
    sup = Supervisor()

    def broken() -> dict[str, str]:
        raise RuntimeError("boom")

    async def idle(*, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        await sup.start(nursery, "x", idle, health=broken)
        assert sup.health() == {"x": {"state": "running"}}
        nursery.cancel_scope.cancel()


def test_describe_exception_never_includes_message_text() -> None:
    assert describe_exception(ValueError("bot123:SECRET")) == "ValueError"
    fatal = AdapterFatalError("Telegram rejected the bot credentials")
    assert describe_exception(fatal) == ("AdapterFatalError: Telegram rejected the bot credentials")
    leaky = AdapterFatalError("failed https://api.telegram.org/bot123456:" + "A" * 35 + "/getMe")
    assert "AAAA" not in describe_exception(leaky)
    group = ExceptionGroup("g", [KeyError("x"), OSError(13, "Permission denied")])
    assert describe_exception(group) == "KeyError + PermissionError (Permission denied)"


async def test_watchdog_pings_at_the_interval(autojump_clock: trio.testing.MockClock) -> None:
    pings: list[float] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(watchdog, 2.5, lambda: pings.append(trio.current_time()))
        await trio.sleep(10.1)
        nursery.cancel_scope.cancel()
    assert [round(p - pings[0], 3) for p in pings] == [0.0, 2.5, 5.0, 7.5, 10.0]

    quiet: list[float] = []
    async with trio.open_nursery() as nursery:
        await nursery.start(watchdog, None, lambda: quiet.append(1.0))
        await trio.sleep(100)
        nursery.cancel_scope.cancel()
    assert quiet == []
