"""What the Telegram adapter logs: failed calls with cause class and retry delay, the first
success after an outage, receiver lease decisions. Never the token, a URL or message text.

The outage is real: a loopback TCP relay between the adapter and the fake Bot API is taken
down (live connections cut, then connection refused) and brought back on the same port.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import attrs
import pytest
import trio
from trio.testing import MockClock

from adapters.telegram import ReceiverLeaseLostError
from adapters.telegram._api import (
    TelegramApi,
    TelegramApiError,
    TelegramNetworkError,
    TelegramResponseError,
    describe_failure,
)
from prismd.channel import Reply
from tests.daemon.helpers import free_port
from tests.fakes.telegram_api import FakeBotApi
from tests.support.recorder import Recorder
from tests.support.waiting import raises_flat, wait_until

from .conftest import CONN, SERVICE, TOKEN, private_message

RETRY_RE = re.compile(
    rf"^telegram {CONN}: (\w+) failed: (.+); retry in (\d+\.\d) s \(attempt (\d+)\)$"
)
SECRET_TEXT = "diagnostics-secret-text-8c1e"


@attrs.define(eq=False)
class Relay:
    """A loopback TCP relay to ``target`` that can be taken down and brought back."""

    target: int
    port: int = attrs.field(factory=free_port)  # bound later, and again
    _scope: trio.CancelScope | None = None

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def up(self, nursery: trio.Nursery) -> None:
        async def serve(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
            with trio.CancelScope() as scope:
                self._scope = scope
                listeners = await trio.open_tcp_listeners(self.port, host="127.0.0.1")
                async with trio.open_nursery() as inner:
                    await inner.start(trio.serve_listeners, self._pipe, listeners)
                    task_status.started()

        await nursery.start(serve)

    def down(self) -> None:
        """Close the listener and cut every relayed connection (a long poll in flight too)."""
        assert self._scope is not None
        self._scope.cancel()

    async def _pipe(self, client: trio.SocketStream) -> None:
        async with client, await trio.open_tcp_stream("127.0.0.1", self.target) as server:

            async def copy(source: trio.SocketStream, sink: trio.SocketStream) -> None:
                try:
                    while data := await source.receive_some(65536):
                        await sink.send_all(data)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

            async with trio.open_nursery() as nursery:
                nursery.start_soon(copy, client, server)
                await copy(server, client)
                nursery.cancel_scope.cancel()


def _retries(caplog: pytest.LogCaptureFixture) -> list[tuple[str, str, float, int]]:
    found = []
    for record in caplog.records:
        match = RETRY_RE.match(record.getMessage())
        if match is not None:
            assert record.levelno == logging.WARNING
            method, cause, delay, attempt = match.groups()
            found.append((method, cause, float(delay), int(attempt)))
    return found


def _assert_clean(caplog: pytest.LogCaptureFixture, *also_absent: str) -> None:
    # the messages and any traceback (caplog.text would add file names and line numbers)
    text = "\n".join(r.getMessage() + (r.exc_text or "") for r in caplog.records)
    for secret in (TOKEN, TOKEN.split(":")[1], "/bot", SECRET_TEXT, *also_absent):
        assert secret not in text


async def test_an_outage_is_logged_with_cause_and_delay_then_the_reconnect(
    autojump_clock: MockClock,
    fake: FakeBotApi,
    make_adapter: Any,
    recorder: Recorder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    async with trio.open_nursery() as nursery:
        relay = Relay(target=fake.port)
        await relay.up(nursery)
        adapter = make_adapter(api_origin=relay.origin)
        await nursery.start(adapter.run)
        await wait_until(lambda: bool(fake.calls_to("getUpdates")))
        relay.down()  # cuts the long poll in flight; later connects are refused
        await trio.sleep(40)
        assert adapter.health()["state"] == "backoff"
        retries = _retries(caplog)
        assert len(retries) >= 4
        assert all(method == "getUpdates" for method, *_ in retries)
        # the first failure is the cut long poll, the later ones are refused connections
        assert retries[0][1].startswith("network error (")
        assert {cause for _m, cause, *_ in retries[1:]} == {"network error (ConnectError)"}
        # jittered exponential backoff: attempt n waits 2**(n-1) s scaled by [0.5, 1]
        for _m, _c, delay, attempt in retries:
            base = min(30.0, 2.0 ** (attempt - 1))
            assert base / 2 - 0.05 <= delay <= base + 0.05
        assert [attempt for *_, attempt in retries] == list(range(1, len(retries) + 1))
        await relay.up(nursery)
        fake.push_update(private_message(SECRET_TEXT))
        await recorder.wait_for(1)
        nursery.cancel_scope.cancel()
    back = [r for r in caplog.records if "reachable again" in r.getMessage()]
    assert len(back) == 1 and back[0].levelno == logging.INFO
    assert back[0].getMessage() == (
        f"telegram {CONN}: Bot API reachable again after {len(_retries(caplog))} failed call(s)"
    )
    _assert_clean(caplog, relay.origin, str(relay.port), "101", "202")


async def test_api_errors_are_named_by_class_never_by_description(
    autojump_clock: MockClock,
    fake: FakeBotApi,
    make_adapter: Any,
    recorder: Recorder,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="prismd.telegram")
    fake.fail_next("getMe", status=502, description="x", raw_body=b"<html>proxy page</html>")
    fake.rate_limit("getUpdates", 7)
    fake.fail_next("getUpdates", status=500, description="Internal Server Error: db-7f")
    fake.push_update(private_message("x"))
    adapter = make_adapter()
    async with trio.open_nursery() as nursery:
        await nursery.start(adapter.run)
        await recorder.wait_for(1)
        nursery.cancel_scope.cancel()
    retries = _retries(caplog)
    assert [(method, cause) for method, cause, *_ in retries] == [
        ("getMe", "HTTP 502 without a Bot API answer"),
        ("getUpdates", "rate limited (HTTP 429, retry_after 7 s)"),
        ("getUpdates", "Bot API error 500"),
    ]
    # a success in between (getWebhookInfo) starts the count again
    assert [attempt for *_, attempt in retries] == [1, 1, 2]
    assert 7 <= retries[1][2] <= 8.05  # retry_after plus up to 1 s of jitter
    _assert_clean(caplog, "proxy page", "db-7f", "Too Many Requests")


def test_describe_failure_is_fixed_text() -> None:
    assert describe_failure(TelegramNetworkError("ReadTimeout")) == "network error (ReadTimeout)"
    assert describe_failure(TelegramNetworkError()) == "network error (unknown)"
    assert describe_failure(TelegramResponseError()) == "unreadable response"
    error = TelegramApiError(409, description="Conflict: terminated by other getUpdates request")
    assert describe_failure(error) == "conflict (HTTP 409: another poller or a webhook)"


async def test_a_request_outliving_its_deadline_is_a_deadline_cause(
    autojump_clock: MockClock, fake: FakeBotApi
) -> None:
    fake.delay("getMe", 500)
    api = TelegramApi(token=lambda: TOKEN, api_origin=fake.origin, read_timeout_s=1000)
    try:
        with pytest.raises(TelegramNetworkError) as info:
            await api.call("getMe", {}, read_timeout_s=5)
    finally:
        await api.aclose()
    # httpx's own read timeout (5 s) fires before the whole-request bound (35 s)
    assert info.value.cause == "ReadTimeout"
    assert info.value.__context__ is None and info.value.__cause__ is None
    assert str(info.value) == "Telegram request failed"


async def test_receiver_lease_decisions_are_logged(
    autojump_clock: MockClock,
    fake: FakeBotApi,
    store: Any,
    make_adapter: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="prismd.telegram")
    first = make_adapter(owner_id="daemon-a")
    second = make_adapter(owner_id="daemon-b")
    async with trio.open_nursery() as nursery:
        await nursery.start(first.run)
        assert first.receiver_lease_held
        await nursery.start(second.run)
        assert not second.receiver_lease_held
        # The lease keeper renews at half the TTL (45 s of the default 90 s): four renewals.
        await trio.sleep(190)
        nursery.cancel_scope.cancel()
    assert not first.receiver_lease_held
    messages = [(r.levelno, r.getMessage()) for r in caplog.records]
    prefix = f"telegram {CONN}: "
    assert (logging.DEBUG, prefix + "receiver lease acquired") in messages
    assert (logging.DEBUG, prefix + "receiver lease held by another receiver") in messages
    assert (logging.INFO, prefix + "another receiver holds the lease; standing by") in messages
    renewed = messages.count((logging.DEBUG, prefix + "receiver lease renewed"))
    assert renewed >= 4
    assert (logging.DEBUG, prefix + "receiver lease released") in messages


async def test_a_lost_receiver_lease_is_a_warning(
    autojump_clock: MockClock,
    fake: FakeBotApi,
    store: Any,
    make_adapter: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="prismd.telegram")
    adapter = make_adapter(lease_ttl_ms=45_000, poll_timeout_s=30)
    with raises_flat(ReceiverLeaseLostError):
        async with trio.open_nursery() as nursery:
            await nursery.start(adapter.run)
            lease = await store.leases.get_lease(
                namespace="prism.channels.v1.telegram.receiver", key=f"r1:{CONN}", scope=SERVICE
            )
            await store.leases.release_lease(
                namespace=lease.namespace,
                key=lease.key,
                scope=SERVICE,
                owner_id=lease.owner_id,
                token=lease.token,
            )
            await store.leases.try_acquire_lease(
                namespace=lease.namespace,
                key=lease.key,
                scope=SERVICE,
                owner_id="intruder",
                ttl_ms=300_000,
            )
            await trio.sleep(100)
    lost = [r for r in caplog.records if "lease lost" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in lost] == [
        (logging.WARNING, f"telegram {CONN}: receiver lease lost (expired or taken over)")
    ]
    assert lease.token not in caplog.text


async def test_a_rate_limited_send_logs_each_retry(
    autojump_clock: MockClock,
    fake: FakeBotApi,
    make_adapter: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="prismd.telegram")
    fake.chats.add("101")
    fake.rate_limit("sendMessage", 3, times=2)
    adapter = make_adapter()
    result = await adapter.send(Reply(CONN, "101", SECRET_TEXT, "final"))
    assert result.delivered
    assert [(m, c, d, a) for m, c, d, a in _retries(caplog)] == [
        ("sendMessage", "rate limited (HTTP 429, retry_after 3 s)", 3.0, 1),
        ("sendMessage", "rate limited (HTTP 429, retry_after 3 s)", 3.0, 2),
    ]
    # sends do not count towards the receiving side's "reachable again" line
    assert "reachable again" not in caplog.text
    _assert_clean(caplog, "101")
