"""Child process for the SQLite crash and multi-process tests (run as a script).

``writer URL PREFIX``: create-only saves of ``PREFIX-0``, ``PREFIX-1``, … and a CAS counter,
printing ``ack KEY`` / ``counter N`` only after each save returned, until killed.

``holder URL OWNER TTL_MS``: acquire the lease ``locks/shared``, print ``held FENCE``, wait for
a line on stdin, release, print ``released``. Prints ``busy`` when the lease is taken.
"""

from __future__ import annotations

import sys
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from stores import CheckpointConflictError, OwnershipScope, open_store

SCOPE = OwnershipScope("tenant", "acct", "user")


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


async def writer(url: str, prefix: str) -> None:
    store = await open_store(url)
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


async def holder(url: str, owner: str, ttl_ms: int) -> None:
    store = await open_store(url)
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
    await store.aclose()


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "writer":
        trio.run(writer, args[0], args[1])
    elif mode == "holder":
        trio.run(holder, args[0], args[1], int(args[2]))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
