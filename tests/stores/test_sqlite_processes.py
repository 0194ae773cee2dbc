"""Real processes on one SQLite file: SIGKILL mid-stream loses no acknowledged write, and
leases exclude across processes."""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import apsw
import pytest
import trio

from stores import OwnershipScope, open_store

CHILD = str(Path(__file__).with_name("_store_child.py"))
SCOPE = OwnershipScope("tenant", "acct", "user")

pytestmark = pytest.mark.slow


class Child:
    """A child process whose stdout is read line by line."""

    def __init__(self, process: trio.Process) -> None:
        self.process = process
        self.buffer = b""

    async def line(self) -> str:
        assert self.process.stdout is not None
        while b"\n" not in self.buffer:
            chunk = await self.process.stdout.receive_some(65536)
            if not chunk:
                raise EOFError(self.buffer.decode(errors="replace"))
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return line.decode()

    async def rest(self) -> list[str]:
        """Every complete line left after the process died (a torn last line is dropped)."""
        assert self.process.stdout is not None
        while chunk := await self.process.stdout.receive_some(65536):
            self.buffer += chunk
        *complete, _torn = self.buffer.split(b"\n")
        return [c.decode() for c in complete]

    async def exit_code(self) -> int:
        """Wait for the process and close its pipes."""
        code = await self.process.wait()
        for stream in (self.process.stdin, self.process.stdout):
            if stream is not None:
                await stream.aclose()
        return code

    async def send(self, text: str) -> None:
        assert self.process.stdin is not None
        await self.process.stdin.send_all(text.encode())


async def spawn(*args: str) -> Child:
    process = await trio.lowlevel.open_process(
        [sys.executable, CHILD, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    return Child(process)


async def test_sigkill_loses_no_acknowledged_write(tmp_path: Path) -> None:
    path = tmp_path / "crash.sqlite"
    url = f"sqlite:///{path}"
    rng = random.Random(2026)
    acked: list[str] = []
    counter_acked = 0
    with trio.fail_after(60):
        for run in range(20):
            child = await spawn("writer", url, f"run{run}")
            lines = [await child.line()]  # the first ack: the child is writing now
            await trio.sleep(rng.uniform(0.0, 0.1))
            child.process.send_signal(signal.SIGKILL)
            lines += await child.rest()
            assert await child.exit_code() == -signal.SIGKILL
            run_acks = [ln.split()[1] for ln in lines if ln.startswith("ack ")]
            counters = [int(ln.split()[1]) for ln in lines if ln.startswith("counter ")]
            assert run_acks and "counter-conflict" not in lines
            acked += run_acks
            counter_acked = max([counter_acked, *counters])

            async with open_store(url) as store:
                stored: set[str] = set()
                cursor = None
                while True:
                    page = await store.checkpoints.list_checkpoints(
                        namespace="crash", key_prefix="run", cursor=cursor, limit=500
                    )
                    stored.update(r.key for r in page.items)
                    if (cursor := page.next_cursor) is None:
                        break
                lost = set(acked) - stored
                assert not lost, f"acknowledged writes lost after SIGKILL {run}: {sorted(lost)}"
                # The last acknowledged key of this run, read back by exact key as well.
                rec = await store.checkpoints.load_checkpoint(
                    namespace="crash", key=run_acks[-1], scope=SCOPE
                )
                assert rec is not None
                counter = await store.checkpoints.load_checkpoint(
                    namespace="crash", key="counter", scope=SCOPE
                )
                # No counter row is right only while no counter save was acknowledged: a
                # child killed soon after its first ack (a loaded machine) may not have
                # committed its first counter save yet.
                if counter is None:
                    assert counter_acked == 0, f"acknowledged counter lost after SIGKILL {run}"
                else:
                    assert counter.version >= counter_acked
                    assert counter.value == {"n": counter.version}
                events = await store.checkpoints.list_events(after=0, limit=500)
                assert events.items and events.items[0].seq == 1
            probe = apsw.Connection(str(path))
            try:
                assert probe.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
            finally:
                probe.close()
    assert len(acked) >= 20


async def test_one_lease_holder_across_processes(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/leases.sqlite"
    lease_args: dict[str, Any] = {"namespace": "locks", "key": "shared", "scope": SCOPE}
    async with open_store(url) as store:
        with trio.fail_after(30):
            child = await spawn("holder", url, "proc-b", "60000")
            assert await child.line() == "held 1"
            # This process cannot take it, and a third process cannot either.
            assert (
                await store.leases.try_acquire_lease(owner_id="proc-a", ttl_ms=60_000, **lease_args)
                is None
            )
            held = await store.leases.get_lease(**lease_args)
            assert held is not None and held.owner_id == "proc-b"
            third = await spawn("holder", url, "proc-c", "60000")
            assert await third.line() == "busy"
            assert await third.exit_code() == 0
            # After the release the lease is ours, with the next fencing token.
            await child.send("go\n")
            assert await child.line() == "released"
            assert await child.exit_code() == 0
            mine = await store.leases.try_acquire_lease(
                owner_id="proc-a", ttl_ms=60_000, **lease_args
            )
            assert mine is not None and mine.fencing_token == 2
            # And now a child process is the one refused.
            fourth = await spawn("holder", url, "proc-d", "60000")
            assert await fourth.line() == "busy"
            assert await fourth.exit_code() == 0
            assert await store.leases.release_lease(
                owner_id="proc-a", token=mine.token, **lease_args
            )


async def test_killed_holder_lease_expires(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/leases.sqlite"
    lease_args: dict[str, Any] = {"namespace": "locks", "key": "shared", "scope": SCOPE}
    async with open_store(url) as store:
        with trio.fail_after(30):
            child = await spawn("holder", url, "proc-b", "400")
            assert await child.line() == "held 1"
            child.process.send_signal(signal.SIGKILL)
            await child.exit_code()
            assert (
                await store.leases.try_acquire_lease(owner_id="proc-a", ttl_ms=1000, **lease_args)
                is None
            )
            await trio.sleep(0.5)  # real time: the TTL is wall-clock in another process
            taken = await store.leases.try_acquire_lease(
                owner_id="proc-a", ttl_ms=1000, **lease_args
            )
            assert taken is not None and taken.fencing_token == 2
