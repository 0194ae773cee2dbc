"""``[metrics]``: the config section, the timed store, the /metrics server over real loopback
TCP (scraped with httpx, parsed with ``prometheus_client``'s parsers) and the daemon's child."""

from __future__ import annotations

import io
import socket
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs
import httpx
import prometheus_client
import pytest
import trio
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from prismd.cli._prismd import main
from prismd.daemon._config import ConfigError, parse_config
from prismd.daemon._daemon import Daemon
from prismd.daemon._metrics import MAX_CONNECTIONS, DaemonMetrics, MetricsServer
from prismd.runtime.api import Diagnostics
from stores import CheckpointConflictError, OwnershipScope, StoreUnavailableError
from stores.memory import MemoryStore

from .helpers import chat
from .helpers import inprocess_config as _config

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser

SCOPE = OwnershipScope(tenant_id="t", account_id="a", user_id="u")
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def samples(text: str) -> Samples:
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return found


def value(found: Samples, name: str, **labels: str) -> float | None:
    return found.get((name, frozenset(labels.items())))


def _config_with(metrics: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "connections": [{"id": "web", "kind": "webchat"}],
        "agents": {"echo": {"kind": "echo"}},
        "grants": [{"connection": "web", "actors": ["*"], "aliases": ["echo"]}],
        "metrics": dict(metrics),
    }


# ---------------------------------------------------------------------- config


def test_metrics_section_is_optional_and_defaults_to_loopback() -> None:
    without = _config_with({})
    del without["metrics"]
    assert parse_config(without).metrics is None
    metrics = parse_config(_config_with({})).metrics
    assert metrics is not None
    assert (metrics.listen, metrics.allow_non_loopback) == ("127.0.0.1:9464", False)
    assert parse_config(_config_with({"listen": "[::1]:9000"})).metrics is not None


@pytest.mark.parametrize(
    ("section", "key", "message"),
    [
        ({"listen": "0.0.0.0:9464"}, "[metrics].listen", "allow_non_loopback = true"),
        ({"listen": "192.0.2.7:9464"}, "[metrics].listen", "non-loopback"),
        ({"listen": "localhost"}, "[metrics].listen", "host:port"),
        ({"listen": 9464}, "[metrics].listen", "must be a string"),
        ({"allow_non_loopback": "yes"}, "[metrics].allow_non_loopback", "true or false"),
        ({"port": 9464}, "[metrics].port", "unknown key"),
    ],
)
def test_bad_metrics_sections_name_the_key(section: dict[str, Any], key: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(_config_with(section), source="prismd.toml")
    assert info.value.key == key
    assert message in str(info.value)


def test_non_loopback_needs_the_explicit_opt_in() -> None:
    metrics = parse_config(
        _config_with({"listen": "0.0.0.0:9464", "allow_non_loopback": True})
    ).metrics
    assert metrics is not None and metrics.allow_non_loopback


def test_check_config_refuses_an_exposed_metrics_listener(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "prismd.toml"
    path.write_text('[metrics]\nlisten = "0.0.0.0:9464"\n')
    assert main(["check-config", "--config", str(path)]) == 1
    err = capsys.readouterr().err
    assert f"{path}: [metrics].listen: a non-loopback address" in err
    # (a config needs a connection to pass check-config at all)
    web = '[[connections]]\nid = "web"\nkind = "webchat"\n'
    path.write_text(web + '[metrics]\nlisten = "127.0.0.1:9464"\n')
    assert main(["check-config", "--config", str(path)]) == 0


# ---------------------------------------------------------------------- the timed store


async def test_every_store_call_is_timed_in_one_wrapper() -> None:
    metrics = DaemonMetrics()
    inner = MemoryStore()
    store = metrics.timed_store(inner)
    assert store.url == inner.url
    await store.checkpoints.save_checkpoint(namespace="n", key="k", scope=SCOPE, version=1, value=1)
    with pytest.raises(CheckpointConflictError):  # a failing call is timed and re-raised
        await store.checkpoints.save_checkpoint(
            namespace="n", key="k", scope=SCOPE, version=2, value=2, expected_version=7
        )
    assert (
        await store.checkpoints.load_checkpoint(namespace="n", key="k", scope=SCOPE)
    ) is not None
    lease = await store.leases.try_acquire_lease(
        namespace="n", key="k", scope=SCOPE, owner_id="o", ttl_ms=30_000
    )
    assert lease is not None
    registry = metrics.registry

    def count(operation: str) -> float | None:
        return registry.get_sample_value(
            "prismd_store_call_seconds_count", {"operation": operation}
        )

    assert count("save_checkpoint") == 2
    assert count("load_checkpoint") == 1
    assert count("try_acquire_lease") == 1
    assert count("renew_lease") is None
    total = registry.get_sample_value(
        "prismd_store_call_seconds_sum", {"operation": "save_checkpoint"}
    )
    assert total is not None and 0 < total < 5
    # one wrapper per method, not one per call
    assert store.checkpoints.save_checkpoint is store.checkpoints.save_checkpoint
    # private registry: nothing lands in prometheus_client's process-global one
    assert (
        prometheus_client.REGISTRY.get_sample_value(
            "prismd_store_call_seconds_count", {"operation": "save_checkpoint"}
        )
        is None
    )
    await store.aclose()
    with pytest.raises(StoreUnavailableError):  # aclose reached the inner store
        await inner.checkpoints.load_checkpoint(namespace="n", key="k", scope=SCOPE)


# ---------------------------------------------------------------------- the server


@attrs.define(eq=False)
class Live:
    """Sources the collector reads at each scrape (mutable: proves nothing is copied)."""

    diagnostics: Diagnostics = attrs.field(factory=lambda: Diagnostics(admitted=3, queued=2))
    health: dict[str, dict[str, str]] = attrs.field(
        factory=lambda: {
            "telegram:tg": {"state": "running", "adapterState": "polling", "mode": "polling"},
            "control": {"state": "restarting"},
        }
    )
    restarts: dict[str, int] = attrs.field(factory=lambda: {"control": 2, "telegram:tg": 0})
    leases: dict[str, int] = attrs.field(factory=lambda: {"binding": 1, "receiver": 1})
    broken: bool = False

    def read_diagnostics(self) -> Diagnostics:
        if self.broken:
            raise RuntimeError("a source with a bug")
        return self.diagnostics


async def start_server(
    nursery: trio.Nursery, live: Live, **kwargs: Any
) -> tuple[MetricsServer, str]:
    metrics = DaemonMetrics()
    metrics.watch(
        diagnostics=live.read_diagnostics,
        health=lambda: live.health,
        restarts=lambda: live.restarts,
        leases=lambda: live.leases,
    )
    server = MetricsServer(listen="127.0.0.1:0", metrics=metrics, **kwargs)
    await nursery.start(server.run)
    assert server.bound is not None
    return server, server.url


async def wait_until(predicate: Callable[[], bool]) -> None:
    with trio.fail_after(10):
        while True:
            if predicate():
                return
            await trio.sleep(0.01)


async def scrape(url: str, **kwargs: Any) -> httpx.Response:
    with trio.fail_after(10):
        async with httpx.AsyncClient() as client:
            return await client.request(kwargs.pop("method", "GET"), url, **kwargs)


async def test_scrape_parses_and_reads_live_values(nursery: trio.Nursery) -> None:
    live = Live()
    server, url = await start_server(nursery, live)
    assert url == f"http://127.0.0.1:{server.bound[1]}/metrics"  # type: ignore[index]
    assert server.health() == {"listener": "listening"}
    response = await scrape(url)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert response.headers["cache-control"] == "no-store"
    found = samples(response.text)
    assert value(found, "prismd_admitted_total") == 3
    assert value(found, "prismd_denied_total") == 0
    assert value(found, "prismd_lease_losses_total") == 0
    assert value(found, "prismd_queue_depth") == 2
    assert value(found, "prismd_active_sessions") == 0
    assert value(found, "prismd_child_state", child="control", state="restarting") == 1
    assert value(found, "prismd_child_state", child="control", state="running") == 0
    assert value(found, "prismd_child_state", child="telegram:tg", state="running") == 1
    assert (
        value(
            found, "prismd_child_health", child="telegram:tg", key="adapterState", value="polling"
        )
        == 1
    )
    assert (
        value(found, "prismd_child_health", child="telegram:tg", key="mode", value="polling") == 1
    )
    assert value(found, "prismd_child_restarts_total", child="control") == 2
    assert value(found, "prismd_leases_held", kind="binding") == 1
    assert value(found, "prismd_leases_held", kind="receiver") == 1
    # live: the next scrape reads the sources again
    live.diagnostics = Diagnostics(admitted=4, lease_losses=1)
    live.health["telegram:tg"] = {"state": "restarting", "adapterState": "backoff"}
    live.leases["receiver"] = 0
    found = samples((await scrape(url)).text)
    assert value(found, "prismd_admitted_total") == 4
    assert value(found, "prismd_lease_losses_total") == 1
    assert value(found, "prismd_child_state", child="telegram:tg", state="restarting") == 1
    assert (
        value(
            found, "prismd_child_health", child="telegram:tg", key="adapterState", value="backoff"
        )
        == 1
    )
    assert (
        value(
            found, "prismd_child_health", child="telegram:tg", key="adapterState", value="polling"
        )
        is None
    )
    assert value(found, "prismd_leases_held", kind="receiver") == 0


async def test_openmetrics_when_the_scraper_asks(nursery: trio.Nursery) -> None:
    _server, url = await start_server(nursery, Live())
    accept = "application/openmetrics-text; version=1.0.0,text/plain;version=0.0.4;q=0.5"
    response = await scrape(url, headers={"accept": accept})
    assert response.headers["content-type"].startswith(
        "application/openmetrics-text; version=1.0.0"
    )
    assert response.text.endswith("# EOF\n")
    names = {family.name for family in openmetrics_families(response.text)}
    assert {"prismd_admitted", "prismd_child_state", "prismd_store_call_seconds"} <= names


async def test_routes_methods_and_head(nursery: trio.Nursery) -> None:
    _server, url = await start_server(nursery, Live())
    base = url.removesuffix("/metrics")
    for path in ("/", "/metrics/", "/metricsx", "/healthz"):
        assert (await scrape(base + path)).status_code == 404, path
    refused = await scrape(url, method="POST", content=b"x")
    assert refused.status_code == 405 and refused.headers["allow"] == "GET, HEAD"
    head = await scrape(url, method="HEAD")
    assert head.status_code == 200 and head.content == b""
    assert int(head.headers["content-length"]) > 1000
    with_query = await scrape(url + "?name[]=prismd_admitted")
    assert with_query.status_code == 200 and "prismd_queue_depth" in with_query.text


async def _raw(address: tuple[str, int], data: bytes) -> bytes:
    with trio.fail_after(10):
        stream = await trio.open_tcp_stream(*address)
        async with stream:
            await stream.send_all(data)
            answer = b""
            while chunk := await stream.receive_some(65536):
                answer += chunk
    return answer


async def test_oversized_and_unparsable_heads(nursery: trio.Nursery) -> None:
    server, url = await start_server(nursery, Live())
    assert server.bound is not None
    big = b"GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"p" * 5000 + b"\r\n\r\n"
    assert (await _raw(server.bound, big)).startswith(
        b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    )
    assert (await _raw(server.bound, b"NOT HTTP AT ALL\r\n\r\n")).startswith(
        b"HTTP/1.1 400 Bad Request\r\n"
    )
    assert (await scrape(url)).status_code == 200  # still serving


async def test_a_slow_head_is_cut_off_whole_not_per_read(
    nursery: trio.Nursery, autojump_clock: trio.abc.Clock
) -> None:
    server, _url = await start_server(nursery, Live())
    assert server.bound is not None
    stream = await trio.open_tcp_stream(*server.bound)
    started = trio.current_time()
    answer = b""
    async with stream, trio.open_nursery() as client:

        async def drip() -> None:
            for byte in b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: slow\r\n":
                await stream.send_all(bytes([byte]))
                await trio.sleep(0.5)  # each read is quick; the whole head is not

        client.start_soon(drip)
        with trio.fail_after(60):
            while chunk := await stream.receive_some(65536):
                client.cancel_scope.cancel()
                answer += chunk
    assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
    assert 5 <= trio.current_time() - started <= 5.6
    # a connection that sends nothing is closed silently, also after the head timeout
    silent = await trio.open_tcp_stream(*server.bound)
    async with silent:
        with trio.fail_after(60):
            assert await silent.receive_some(65536) == b""


async def test_stuck_connections_cannot_keep_the_scraper_out(nursery: trio.Nursery) -> None:
    """The cap bounds connections, but a newcomer pushes out the oldest: clients stuck in
    their head (more of them than the cap) never keep a scrape from being answered."""
    server, url = await start_server(nursery, Live())
    assert server.bound is not None
    holders = []
    for _ in range(MAX_CONNECTIONS + 4):
        stream = await trio.open_tcp_stream(*server.bound)
        await stream.send_all(b"GET /metrics HTTP/1.1\r\n")  # a head that never ends
        holders.append(stream)
    await wait_until(lambda: server.limiter.open() == MAX_CONNECTIONS)
    assert (await scrape(url)).status_code == 200
    assert server.limiter.open() <= MAX_CONNECTIONS
    with trio.fail_after(10):
        # the oldest were closed to make room (unanswered: EOF, or a reset since the server
        # left their head unread); the newest still wait
        try:
            assert await holders[0].receive_some(65536) == b""
        except trio.BrokenResourceError:
            pass
    assert server.limiter.statistics()["scrapes"].evicted >= 5
    for stream in holders:
        await stream.aclose()


async def test_a_failing_source_is_a_500_and_the_server_stays(
    nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    live = Live(broken=True)
    _server, url = await start_server(nursery, live)
    response = await scrape(url)
    assert response.status_code == 500
    assert "a source with a bug" not in response.text + caplog.text
    assert "collecting metrics failed: RuntimeError" in caplog.text
    live.broken = False
    assert (await scrape(url)).status_code == 200


async def test_non_loopback_listen_needs_the_opt_in() -> None:
    server = MetricsServer(listen="0.0.0.0:0", metrics=DaemonMetrics())
    with pytest.raises(ValueError, match="allow_non_loopback"):
        await server.run()


# ---------------------------------------------------------------------- the daemon's child


async def _run_daemon(daemon: Daemon, body: Callable[[], Any]) -> list[int]:
    codes: list[int] = []
    async with trio.open_nursery() as nursery:

        async def run() -> None:
            codes.append(await daemon.run())

        nursery.start_soon(run)
        with trio.fail_after(20):
            await daemon.ready.wait()
        await body()
        daemon.request_stop()
        with trio.fail_after(20):
            await daemon.stopped.wait()
    return codes


async def test_daemon_serves_its_metrics_as_a_supervised_child(tmp_path: Path) -> None:
    config = _config(tmp_path, metrics={"listen": "127.0.0.1:0"})
    daemon = Daemon(
        config, env={}, install_signals=False, notify=lambda _s: None, out=io.StringIO()
    )

    async def body() -> None:
        url = daemon.endpoints["metrics"]
        port = int(daemon.endpoints["webchat:web"].rsplit(":", 1)[1].rstrip("/"))
        async with chat(port, actor="metrics-actor-1") as client:
            assert (await client.send_message("m1", "count me"))["status"] == "accepted"
            await client.next_frame("reply")
            assert (await client.send_message("m1", "count me"))["duplicate"] is True
        assert daemon.health()["children"]["metrics"] == {
            "listener": "listening",
            "state": "running",
        }
        with trio.fail_after(10):
            while True:  # the delivery is counted right after the reply went out
                found = samples((await scrape(url)).text)
                if value(found, "prismd_deliveries_total") == 1:
                    break
                await trio.sleep(0.05)
        assert value(found, "prismd_admitted_total") == 2
        assert value(found, "prismd_duplicates_total") == 1
        assert value(found, "prismd_child_state", child="webchat:web", state="running") == 1
        assert value(found, "prismd_child_state", child="metrics", state="running") == 1
        assert value(found, "prismd_child_state", child="control", state="running") == 1
        assert (
            value(
                found, "prismd_child_health", child="webchat:web", key="listener", value="listening"
            )
            == 1
        )
        assert value(found, "prismd_leases_held", kind="receiver") == 0
        assert value(found, "prismd_leases_held", kind="binding") in (0, 1)
        # The journal writes through the batch API: the operation record, the claim and the
        # settlement with its reply at least, each one store call.
        writes = value(found, "prismd_store_call_seconds_count", operation="write_checkpoints")
        assert writes is not None and writes >= 3
        assert "metrics-actor-1" not in (await scrape(url)).text

    assert await _run_daemon(daemon, body) == [0]
    port = httpx.URL(daemon.endpoints["metrics"]).port
    assert port is not None
    with pytest.raises(OSError):  # the listener went with the daemon
        await trio.open_tcp_stream("127.0.0.1", port)


async def test_without_the_section_there_is_no_endpoint(tmp_path: Path) -> None:
    daemon = Daemon(_config(tmp_path), env={}, install_signals=False, notify=lambda _s: None)

    async def body() -> None:
        assert "metrics" not in daemon.supervisor.children
        assert "metrics" not in daemon.endpoints

    assert daemon.metrics is None
    assert await _run_daemon(daemon, body) == [0]


async def test_a_busy_metrics_port_is_a_startup_error_naming_the_address(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = io.StringIO()
        config = _config(tmp_path, metrics={"listen": f"127.0.0.1:{port}"})
        daemon = Daemon(config, env={}, install_signals=False, notify=lambda _s: None, out=out)
        with trio.fail_after(20):
            assert await daemon.run() == 1
    assert f"metrics on 127.0.0.1:{port} failed to start: OSError (Address already in use)" in (
        out.getvalue()
    )
