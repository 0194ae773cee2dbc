"""Child process for the multi-process store tests: SQLite crashes, PostgreSQL lease races.

``writer URL PREFIX``: create-only saves of ``PREFIX-0``, ``PREFIX-1``, … and a CAS counter,
printing ``ack KEY`` / ``counter N`` only after each save returned, until killed.

``batcher URL``: two tasks write atomic pairs ``a-N``/``b-N`` with ``write_checkpoints``
(sharing group-committed transactions), printing ``ack N`` after each returned; after 20
pairs the next pair stalls inside its transaction (a temporary trigger), printing
``in-transaction``, until killed.

``holder URL OWNER TTL_MS``: acquire the lease ``locks/shared``, print ``held FENCE``, wait for
a line on stdin, release, print ``released``. Prints ``busy`` when the lease is taken.

``contender URL OWNER``: print ``ready``; then for every line ``go R`` on stdin try to acquire
the lease ``rounds/R`` and print ``won R FENCE`` or ``lost R``; end at ``quit``. Two of them
on one database race each round through independent pools.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from stores import CheckpointConflictError, OwnershipScope, SaveCheckpoint, open_store

SCOPE = OwnershipScope("tenant", "acct", "user")


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def writer(url: str, prefix: str) -> None:
    async with open_store(url) as store:
        cp = store.checkpoints
        counter = await cp.load_checkpoint(namespace="crash", key="counter", scope=SCOPE)
        version = 0 if counter is None else counter.version
        i = 0
        while True:
            key = f"{prefix}-{i}"
            await cp.save_checkpoint(
                namespace="crash", key=key, scope=SCOPE, version=1, expected_version=0,
                value={"i": i, "pad": "x" * (i % 300)},
            )  # fmt: skip
            say(f"ack {key}")
            try:
                await cp.save_checkpoint(
                    namespace="crash", key="counter", scope=SCOPE, version=version + 1,
                    expected_version=version, value={"n": version + 1},
                )  # fmt: skip
            except CheckpointConflictError:
                say("counter-conflict")
                return
            version += 1
            say(f"counter {version}")
            i += 1


async def batcher(url: str) -> None:
    async with open_store(url) as store:
        done = trio.Event()
        count = 0

        def stall() -> int:
            say("in-transaction")
            time.sleep(60)
            return 0

        # Test-only: reach the writer connection to stall one transaction before its COMMIT.
        conn = store._db.conn  # type: ignore[attr-defined]
        conn.create_scalar_function("stall", stall, 0)
        conn.execute(
            "CREATE TEMP TRIGGER stall BEFORE INSERT ON main.prism_checkpoints"
            " WHEN NEW.key = 'stall-b' BEGIN SELECT stall(); END"
        )

        def pair(a: str, b: str) -> list[SaveCheckpoint]:
            return [
                SaveCheckpoint(namespace="prism.channels.v1.operation", key=k, scope=SCOPE,
                               version=1, value={"k": k}, expected_version=0)
                for k in (a, b)
            ]  # fmt: skip

        async def lane(lane_id: int) -> None:
            nonlocal count
            i = lane_id
            while not done.is_set():
                results = await store.checkpoints.write_checkpoints(
                    pair(f"a-{i}", f"b-{i}"), atomic=True
                )
                assert all(r.ok for r in results)
                say(f"ack {i}")
                count += 1
                i += 2
                if count >= 20:
                    done.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(lane, 0)
            nursery.start_soon(lane, 1)
        await store.checkpoints.write_checkpoints(pair("stall-a", "stall-b"), atomic=True)


async def holder(url: str, owner: str, ttl_ms: int) -> None:
    async with open_store(url) as store:
        lease = await store.leases.try_acquire_lease(
            namespace="locks", key="shared", scope=SCOPE, owner_id=owner, ttl_ms=ttl_ms
        )
        if lease is None:
            say("busy")
            return
        say(f"held {lease.fencing_token}")
        await trio.to_thread.run_sync(sys.stdin.readline)
        released = await store.leases.release_lease(
            namespace="locks", key="shared", scope=SCOPE, owner_id=owner, token=lease.token
        )
        say("released" if released else "lost")


async def contender(url: str, owner: str) -> None:
    async with open_store(url) as store:
        say("ready")
        while True:
            line = (await trio.to_thread.run_sync(sys.stdin.readline)).split()
            if not line or line[0] != "go":
                return
            lease = await store.leases.try_acquire_lease(
                namespace="rounds", key=line[1], scope=SCOPE, owner_id=owner, ttl_ms=60_000
            )
            say(f"lost {line[1]}" if lease is None else f"won {line[1]} {lease.fencing_token}")


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "writer":
        trio.run(writer, args[0], args[1])
    elif mode == "batcher":
        trio.run(batcher, args[0])
    elif mode == "holder":
        trio.run(holder, args[0], args[1], int(args[2]))
    elif mode == "contender":
        trio.run(contender, args[0], args[1])
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
