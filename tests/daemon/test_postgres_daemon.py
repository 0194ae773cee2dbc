"""``prismd`` on PostgreSQL: a real ``prismd run`` answering through the web chat and Telegram
polling, an unreachable server waited for, a missing database refused, ``prismd migrate``,
``prismd soak`` and ``prismd bench`` — real subprocesses, the server ``make test`` starts."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from stores.postgres._schema import LATEST
from tests.fakes.telegram_api import start_fake
from tests.support import pgserver

from .helpers import chat, child_env, free_port, prismctl, running_daemon, write_config

pytestmark = pytest.mark.slow

PASSWORD = "pg-password-7f3a"


@pytest.fixture
def url() -> Iterator[str]:
    fresh = pgserver.fresh_url("d")
    yield fresh
    pgserver.drop_schema(fresh)


def prismd(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "prismd", *args],
        capture_output=True, text=True, timeout=180, env=child_env(**env), cwd=str(tmp_path),
        check=False,
    )  # fmt: skip


async def eventually(condition: Callable[[], bool], limit_s: float = 30) -> None:
    with trio.fail_after(limit_s):
        for _ in range(1_000_000):
            if condition():
                return
            await trio.sleep(0.05)


def table(url: str, name: str) -> str:
    return f'"{pgserver.schema_of(url)}".{name}'


async def test_prismd_run_on_postgres_answers_web_chat_and_telegram(
    tmp_path: Path, url: str
) -> None:
    async with trio.open_nursery() as nursery:
        fake = await start_fake(nursery)
        layout = write_config(
            tmp_path,
            delay_ms=1,
            store_url=url,
            store_extra='password_env = "PRISMD_PG_PASSWORD"\npool_size = 3',
            extra=f"""
[[connections]]
id = "tg"
kind = "telegram"
token_env = "TG_TOKEN"
api_origin = "{fake.origin}"
poll_timeout_s = 1

[[grants]]
connection = "tg"
actors = ["202"]
aliases = ["slow"]
""",
        )
        env = {"TG_TOKEN": fake.token, "PRISMD_PG_PASSWORD": PASSWORD}
        async with running_daemon(layout, extra_env=env, args=("--log-level", "debug")) as daemon:
            await daemon.wait_state("READY=1")
            async with chat(layout.port) as client:
                admission = await client.send_message("m1", "hello web")
                assert admission["status"] == "accepted"
                reply = await client.next_frame("reply")
                assert reply["text"] == "mock: hello web"
            fake.push_update(
                {
                    "message": {
                        "message_id": 1,
                        "from": {"id": 202, "is_bot": False, "first_name": "Ada"},
                        "chat": {"id": 101, "type": "private", "first_name": "Ada"},
                        "date": 1_700_000_000,
                        "text": "hello telegram",
                    }
                }
            )
            await eventually(
                lambda: any(s.get("text") == "mock: hello telegram" for s in fake.sent)
            )
            code, health, _ = await prismctl(layout, "health")
            assert code == 0 and health["children"]["telegram:tg"]["state"] == "running"
            daemon.send(signal.SIGTERM)
            assert await daemon.wait_exit() == 0
            log = daemon.stderr()
        nursery.cancel_scope.cancel()
    assert PASSWORD not in log and fake.token not in log and "hello web" not in log
    # The journal is in PostgreSQL: both operations succeeded and were journaled as events.
    rows = await pgserver.query(
        url, f"SELECT value->>'state' FROM {table(url, 'prism_checkpoints')}"
        " WHERE namespace = 'prism.channels.v1.operation'",
    )  # fmt: skip
    assert sorted(str(r[0]) for r in rows) == ["succeeded", "succeeded"]
    events = await pgserver.query(url, f"SELECT count(*) FROM {table(url, 'prism_events')}")
    assert int(events[0][0]) > 0  # type: ignore[call-overload]


async def test_prismd_run_waits_for_an_unreachable_server_then_starts(
    tmp_path: Path, url: str
) -> None:
    """The server is not there at first: prismd says so (host, port, the driver's reason)
    and tries again with backoff; once a server answers on that port it starts."""
    port = free_port()
    proxied = url.replace(f":{pgserver.port_of(url)}/", f":{port}/")
    layout = write_config(tmp_path, delay_ms=1, store_url=proxied)
    async with running_daemon(layout, extra_env={"PGPASSWORD": PASSWORD}) as daemon:
        await eventually(lambda: "trying again in 2 s" in daemon.stderr())
        log = daemon.stderr()
        assert f"cannot open the store: PostgreSQL store 127.0.0.1:{port}/postgres" in log
        assert "Connection refused; trying again in 1 s" in log
        assert "READY=1" not in daemon.states
        async with trio.open_nursery() as nursery:
            await nursery.start(pgserver.forward, port, pgserver.port_of(url))
            await daemon.wait_state("READY=1", limit_s=60)
            async with chat(layout.port) as client:
                assert (await client.send_message("m1", "hi"))["status"] == "accepted"
                assert (await client.next_frame("reply"))["text"] == "mock: hi"
            daemon.send(signal.SIGTERM)
            assert await daemon.wait_exit() == 0
            nursery.cancel_scope.cancel()
        assert PASSWORD not in daemon.stderr()


async def test_a_stop_while_waiting_for_the_store_exits_0_at_once(tmp_path: Path) -> None:
    pgserver.server_url()
    layout = write_config(
        tmp_path, delay_ms=1, store_url=f"postgresql://prismd@127.0.0.1:{free_port()}/prismd"
    )
    async with running_daemon(layout) as daemon:
        await eventually(lambda: "trying again" in daemon.stderr())
        daemon.send(signal.SIGTERM)
        sent = trio.current_time()
        assert await daemon.wait_exit(limit_s=20) == 0
        assert trio.current_time() - sent < 5
        assert "stopped during startup" in daemon.stderr()
        await daemon.wait_state("STATUS=stopping", limit_s=5)  # reads what was sent
        assert any(s.startswith("STATUS=starting: waiting for the store") for s in daemon.states)


async def test_a_missing_database_is_refused_at_once(tmp_path: Path) -> None:
    base = pgserver.admin_url(pgserver.server_url())
    missing = base.rsplit("/", 1)[0] + "/no_such_db_7f3a"
    layout = write_config(tmp_path, delay_ms=1, store_url=missing)
    async with running_daemon(layout) as daemon:
        assert await daemon.wait_exit(limit_s=30) == 1
        log = daemon.stderr()
    assert "cannot open the store: PostgreSQL store 127.0.0.1:" in log
    assert 'database "no_such_db_7f3a" does not exist' in log and "trying again" not in log


def test_prismd_migrate_and_check(tmp_path: Path, url: str) -> None:
    layout = write_config(tmp_path, delay_ms=1, store_url=url)
    config = str(layout.config)
    checked = prismd(tmp_path, "migrate", "--check", "--config", config)
    assert checked.returncode == 1, checked.stderr
    schema = pgserver.schema_of(url)
    every = ", ".join(str(v) for v in range(1, LATEST + 1))
    assert f"schema {schema} at version 0 of {LATEST}; pending: {every}" in checked.stdout
    assert pgserver.run_sql(url, "SELECT 1 FROM pg_namespace WHERE nspname = $1", schema) == []
    applied = prismd(tmp_path, "migrate", "--config", config)
    assert applied.returncode == 0, applied.stderr
    assert applied.stdout.strip().endswith(
        f"schema {schema} at version {LATEST} of {LATEST}; applied {every}"
    )
    again = prismd(tmp_path, "migrate", "--config", config)
    assert again.returncode == 0 and again.stdout.strip().endswith("up to date")
    assert prismd(tmp_path, "migrate", "--check", "--config", config).returncode == 0
    pgserver.run_sql(
        url,
        f"INSERT INTO {table(url, 'prism_schema_migrations')}"
        f" VALUES ({LATEST + 1}, 'x', 'x', now())",
    )
    newer = prismd(tmp_path, "migrate", "--check", "--config", config)
    assert newer.returncode == 1 and "newer than this prismd knows" in newer.stderr


def test_prismd_migrate_on_sqlite(tmp_path: Path) -> None:
    layout = write_config(tmp_path, delay_ms=1)
    config = str(layout.config)
    checked = prismd(tmp_path, "migrate", "--check", "--config", config)
    assert checked.returncode == 1 and "at version 0 of 3; pending: 1, 2, 3" in checked.stdout
    assert not layout.db.exists()
    applied = prismd(tmp_path, "migrate", "--config", config)
    assert applied.returncode == 0 and applied.stdout.strip().endswith("applied 1, 2, 3")
    assert layout.db.exists()
    assert prismd(tmp_path, "migrate", "--check", "--config", config).returncode == 0


def test_prismd_soak_on_postgres_runs_clean(tmp_path: Path, url: str) -> None:
    done = prismd(
        tmp_path, "soak", "--duration-ms", "1500", "--lanes", "3", "--prune-every", "5",
        "--store", url,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    (line,) = done.stdout.strip().splitlines()
    summary: dict[str, Any] = json.loads(line)
    assert summary["ok"] is True and summary["iterations"] >= 5
    assert summary["delivered"] == summary["admitted"] == summary["uniqueReplies"]
    assert summary["denied"] == summary["unsettled"] == summary["unresolvedAtEnd"] == 0
    assert summary["diagnostics"]["storageFailures"] == 0
    assert summary["pruned"]["deleted"] > 0


def test_prismd_bench_on_postgres_with_the_bridge_scenario(tmp_path: Path, url: str) -> None:
    secret_url = url.replace("postgresql://postgres@", f"postgresql://postgres:{PASSWORD}@")
    args = ["bench", "--json", "--duration-s", "0.3", "--store", secret_url]
    for scenario in ("admission", "postgres-bridge"):
        args += ["--scenario", scenario]
    done = prismd(tmp_path, *args)
    assert done.returncode == 0, done.stderr
    assert PASSWORD not in done.stdout + done.stderr
    summary = json.loads(done.stdout)
    assert summary["store"] == url  # shown without the password
    scenarios = summary["scenarios"]
    legs = ("postgres_bridge_store", "postgres_bridge_trio", "postgres_bridge_asyncio")
    assert set(scenarios) == {"admission", "admission_64", *legs}
    # PostgreSQL's store does not time its commits: no slow_commits beside its figures.
    assert "slow_commits" not in scenarios["admission"]
    for leg in legs:
        assert scenarios[leg]["count"] >= 50 and scenarios[leg]["p50_ms"] > 0
    # One round: every leg wrote the same number of rows.
    assert len({scenarios[leg]["count"] for leg in legs}) == 1
    assert "bridge_cost_p50_ms" in scenarios["postgres_bridge_trio"]
    # A second run on the same store works (event ids carry a per-run nonce).
    again = prismd(tmp_path, "bench", "--json", "--duration-s", "0.2", "--store", url,
                   "--scenario", "admission")  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["scenarios"]["admission"]["count"] > 0


def test_bench_scale_runs_the_pipeline_in_one_two_and_three_processes(
    tmp_path: Path, url: str
) -> None:
    done = prismd(tmp_path, "bench", "--json", "--duration-s", "0.3", "--routes", "5",
                  "--store", url, "--scenario", "scale")  # fmt: skip
    assert done.returncode == 0, done.stderr
    scenarios = json.loads(done.stdout)["scenarios"]
    assert set(scenarios) == {"scale_1", "scale_2", "scale_3"}
    for n in (1, 2, 3):
        row = scenarios[f"scale_{n}"]
        assert row["processes"] == n and len(row["per_process_per_s"]) == n
        assert all(rate > 0 for rate in row["per_process_per_s"])
        assert row["per_s"] == round(sum(row["per_process_per_s"]), 1)
        assert row["count"] > 0 and row["p95_ms"] > 0


@pytest.mark.parametrize("scenario", ["postgres-bridge", "scale"])
def test_bench_refuses_the_postgres_scenarios_without_postgres(
    tmp_path: Path, scenario: str
) -> None:
    done = prismd(tmp_path, "bench", "--scenario", scenario)
    assert done.returncode == 2 and "needs --store postgresql://" in done.stderr


@pytest.mark.serial
async def test_prismd_keeps_serving_across_a_server_restart(tmp_path: Path, url: str) -> None:
    """``pg_ctl restart -m fast`` while messages flow: what the web chat acknowledged is
    answered once or listed unresolved (a turn cut by the restart stays ``executing`` for the
    operator), anything else was refused as ``unavailable``, and the same prismd — not
    restarted — answers again once the server is back."""
    layout = write_config(tmp_path, delay_ms=1, store_url=url)
    accepted: list[str] = []
    replies: list[str] = []
    refused = 0
    async with running_daemon(layout) as daemon:
        await daemon.wait_state("READY=1")
        async with chat(layout.port) as client:

            async def send(number: int, reply_within_s: float = 10) -> bool:
                nonlocal refused
                admission = await client.send_message(f"m{number}", f"message {number}")
                if admission["status"] != "accepted":
                    assert admission["reason"] == "unavailable", admission
                    refused += 1
                    await trio.sleep(0.1)
                    return False
                accepted.append(f"m{number}")
                with trio.move_on_after(reply_within_s):
                    while f"m{number}" not in replies:
                        replies.append((await client.next_frame("reply"))["inReplyTo"])
                return f"m{number}" in replies

            for number in range(1, 6):
                assert await send(number)
            restarted = trio.Event()

            async def restart() -> None:
                done = await trio.to_thread.run_sync(
                    pgserver.pg_ctl, "restart", "-m", "fast", "-w", "-t", "60"
                )
                assert done.returncode == 0, done.stdout + done.stderr
                restarted.set()

            with trio.fail_after(90):
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(restart)
                    while not restarted.is_set():  # keep admitting while it is away
                        await send(number := number + 1, reply_within_s=0.3)
                # The same prismd, not restarted: five more, each answered.
                answered_after = 0
                while answered_after < 5:
                    answered_after += await send(number := number + 1)
        assert daemon.process.returncode is None
        with trio.fail_after(30):
            while True:
                code, unresolved, err = await prismctl(layout, "list-unresolved")
                assert code == 0, err
                if len(set(replies)) + len(unresolved) >= len(accepted):
                    break
                await trio.sleep(0.2)
        daemon.send(signal.SIGTERM)
        assert await daemon.wait_exit() == 0
    assert len(replies) == len(set(replies)), "a message was answered twice"
    assert set(replies) <= set(accepted)
