"""A route's outbox (issue 40): a turn's reply is sent while the route's next turn runs.

The pump does not wait for a send: once a turn's end (settlement, binding, staged reply) is
committed, its reply goes to the route's outbox and the next turn is claimed and run. The
outbox sends in the order staged, one at a time, keeps the route's lease while it holds a
reply, and marks each outcome; nothing is sent twice and nothing is left unmarked.
"""

from __future__ import annotations

from pathlib import Path

import trio
import trio.testing

from prismd.agents import RunRequest
from stores import open_store
from tests.support.builders import event, identity
from tests.support.clocks import TrioClock
from tests.support.harness import FirstSendHeld, Host, runtime
from tests.support.scripted import ScriptedAgent
from tests.support.waiting import wait_until_async


async def test_the_next_turn_runs_while_a_reply_is_being_sent_and_replies_keep_their_order(
    tmp_path: Path,
) -> None:
    # Real time: SQLite commits on its writer thread, which a virtual clock would skip past.
    clock = TrioClock()
    third_run = trio.Event()
    runs: list[RunRequest] = []

    def on_run(request: RunRequest) -> None:
        runs.append(request)
        if len(runs) == 3:
            third_run.set()

    agent = ScriptedAgent(answer=lambda text, _n: f"re: {text}", on_run=on_run)
    host = Host(agent=agent)
    held = FirstSendHeld()
    sent = held.sent

    async with (
        open_store(f"sqlite:///{tmp_path}/outbox.sqlite", clock=clock) as store,
        runtime(host, store, deliver=held.deliver, clock=clock) as rt,
    ):
        with trio.fail_after(30):
            for i in range(3):
                admission = await rt.admit(event(str(i), f"m{i}"))
                assert admission.status == "accepted", admission
            await held.first_send.wait()
            # The first reply's send hangs; the two turns behind it still run.
            await third_run.wait()
            assert sent == []
            # Staged and unsent: listed while the send is open, the route still held. (The
            # third run has started; its end commits a moment later.)

            async def three_pending() -> bool:
                unresolved = await rt.list_unresolved(identity=identity())
                return sorted(e.reply_state or "" for e in unresolved) == ["pending"] * 3

            await wait_until_async(three_pending, step=0.01)
            assert sent == []
            assert "chat-1" in rt.busy_conversations("tg-1")
            held.release.set()
            assert (await rt.drain(deadline_ms=20_000)).settled
        assert sent == ["re: m0", "re: m1", "re: m2"]
        assert await rt.list_unresolved(identity=identity()) == []
        counters = rt.diagnostics()
        assert (counters.deliveries, counters.storage_failures, counters.lease_losses) == (3, 0, 0)
