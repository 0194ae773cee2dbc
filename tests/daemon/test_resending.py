"""The re-drive of unconfirmed replies (``prismd.daemon._resending``) follows the adapter's
receiver lease, in virtual time: it starts the moment the lease is taken (at the start, or
later from another instance, or back after a loss), told by the lease — no poll — and
nothing is re-driven while another instance holds it."""

from __future__ import annotations

import logging
import random
from typing import Any

import attrs
import trio
from trio.testing import MockClock

from adapters.toolkit import LeaseWatch, ReceiverLease
from prismd.channel import AdapterFeatures
from prismd.daemon._resending import resending_run
from prismd.runtime import Runtime
from stores import OwnershipScope
from stores.memory import MemoryStore
from tests.support.clocks import TrioClock

NS = "prism.test.receiver"
KEY = "r1:dc"
SCOPE = OwnershipScope(tenant_id="prismd-service", account_id="dc")
TTL_MS = 60_000


class RecordingRuntime(Runtime):
    """A runtime whose re-drive records when it was asked, and whether the lease was held."""

    def __init__(self, adapter: LeasedAdapter) -> None:
        super().__init__()
        self.adapter = adapter
        self.asked: list[tuple[float, bool, bool]] = []

    async def resend_unconfirmed(
        self, connection_id: str, *, taken_over: bool = False
    ) -> dict[str, int]:
        assert connection_id == "dc"
        self.asked.append((trio.current_time(), taken_over, self.adapter.receiver_lease_held))
        await trio.lowlevel.checkpoint()
        return {}


@attrs.define(eq=False)
class LeasedAdapter:
    """What ``resending_run`` reads of an adapter, over a real receiver lease: it stands by
    while another instance holds the lease, and stands by again when it loses it."""

    store: MemoryStore
    connection_id: str = "dc"
    features: AdapterFeatures = attrs.field(factory=lambda: AdapterFeatures(idempotent_send=True))
    watch: LeaseWatch = attrs.field(factory=LeaseWatch)
    lease: ReceiverLease = attrs.field(init=False)
    taken: list[float] = attrs.field(factory=list)

    def __attrs_post_init__(self) -> None:
        self.lease = ReceiverLease(
            leases=self.store.leases,
            namespace=NS,
            key=KEY,
            scope=SCOPE,
            owner_id="daemon-b",
            ttl_ms=TTL_MS,
            label="test dc",
            log=logging.getLogger("prismd.test.resending"),
            random=random.Random(5),
            clock=TrioClock(),
            watch=self.watch,
        )

    @property
    def receiver_lease_held(self) -> bool:
        return self.lease.held

    async def wait_receiver_lease(self, held: bool) -> None:
        await self.watch.wait(lambda: self.lease.held, held)

    async def run(self, *, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        started = False

        def up() -> None:
            nonlocal started
            if not started:
                started = True
                task_status.started()

        while True:
            await self.lease.acquire(on_standby=up)
            self.taken.append(trio.current_time())
            up()
            await self.lease.keep()  # returns once lost


async def _holder(store: MemoryStore, owner: str = "daemon-a") -> Any:
    record = await store.leases.try_acquire_lease(
        namespace=NS, key=KEY, scope=SCOPE, owner_id=owner, ttl_ms=TTL_MS * 10
    )
    assert record is not None
    return record


async def _release(store: MemoryStore, record: Any) -> None:
    await store.leases.release_lease(
        namespace=NS, key=KEY, scope=SCOPE, owner_id=record.owner_id, token=record.token
    )


async def test_the_redrive_begins_when_the_lease_is_taken_never_while_another_holds_it(
    autojump_clock: MockClock,
) -> None:
    store = MemoryStore(clock=TrioClock())
    adapter = LeasedAdapter(store)
    rt = RecordingRuntime(adapter)
    held = await _holder(store)
    async with trio.open_nursery() as nursery:
        await nursery.start(resending_run(adapter, rt))  # type: ignore[arg-type]
        await trio.sleep(300)
        # Standing by for five minutes: the other instance's replies are its own.
        assert rt.asked == [] and adapter.taken == []
        await _release(store, held)
        await trio.sleep(30)
        [taken] = adapter.taken
        # Taken over: re-driven at that very moment (a poll would come up to 1 s later),
        # holding the lease, everything staged before now.
        assert rt.asked == [(taken, True, True)]
        # Lost (another instance took it behind its back): nothing while it is away...
        row = await store.leases.get_lease(namespace=NS, key=KEY, scope=SCOPE)
        assert row is not None
        await _release(store, row)
        intruder = await _holder(store, "daemon-c")
        await trio.sleep(600)
        assert not adapter.lease.held and len(rt.asked) == 1
        # ...and once it is back, again at once.
        await _release(store, intruder)
        await trio.sleep(30)
        assert len(adapter.taken) == 2
        assert rt.asked[1:] == [(adapter.taken[1], True, True)]
        nursery.cancel_scope.cancel()


async def test_a_lease_held_at_the_start_redrives_what_was_staged_before_it(
    autojump_clock: MockClock,
) -> None:
    store = MemoryStore(clock=TrioClock())
    adapter = LeasedAdapter(store)
    rt = RecordingRuntime(adapter)
    async with trio.open_nursery() as nursery:
        await nursery.start(resending_run(adapter, rt))  # type: ignore[arg-type]
        await trio.sleep(600)
        # Once, at the start, not as a takeover (this process's predecessor's replies).
        assert rt.asked == [(0.0, False, True)]
        assert adapter.taken == [0.0]
        nursery.cancel_scope.cancel()
