"""Durable commits per message, counted by the SQLite store itself (issue 9's target: at
most 6 per message of a steady conversation, every one the contract requires).

A steady conversation: one user, one chat, each message sent after the previous answer
arrived (the chat pattern), the ``mock`` agent keeping its transcript in the same store.
Per message the journal writes: the ``accepted`` record with the cursor (the dedup and
acknowledgement point), the claim ``accepted → executing`` (before the agent runs), the
agent's transcript, the terminal state with the binding and the staged reply (one atomic
transaction), and the delivery outcome. The route lease is acquired once and kept while
the conversation is busy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import trio
import trio.testing

from prismd.agents import AgentContext, MockAgent
from prismd.journal import NS_REPLY
from prismd.runtime import _core
from stores import open_store
from stores.sqlite import SQLiteStore
from tests.support.builders import event, identity
from tests.support.clocks import TrioClock
from tests.support.harness import Host, runtime
from tests.support.waiting import wait_until, wait_until_async

TARGET = 6
MESSAGES = 20


async def test_a_steady_conversation_costs_at_most_six_commits_per_message(
    tmp_path: Path,
) -> None:
    # Real time: SQLite works on threads, which a virtual clock would skip past.
    clock = TrioClock()
    async with open_store(f"sqlite:///{tmp_path}/commits.sqlite", clock=clock) as store:
        assert isinstance(store, SQLiteStore)
        agent = MockAgent.from_context(
            AgentContext(alias="primary", options={}, checkpoints=store.checkpoints, clock=clock)
        )
        host = Host(agent=agent)
        per_message: list[int] = []
        async with runtime(host, store, clock=clock) as rt:
            for i in range(MESSAGES):
                before = store.statistics().commits
                admission = await rt.admit(event(str(i), f"message {i}"))
                assert admission.status == "accepted" and not admission.duplicate, admission
                with trio.fail_after(30):
                    await rt.drain()
                assert len(host.replies) == i + 1
                per_message.append(store.statistics().commits - before)
            steady = per_message[1:]  # the first also creates the binding and the lease
            print(f"commits per message: first {per_message[0]}, then {steady}", file=sys.stderr)
            assert max(steady) <= TARGET, per_message
            assert host.texts == [f"mock: message {i}" for i in range(MESSAGES)]
            assert await rt.list_unresolved(identity=identity()) == []


async def test_a_replys_delivery_mark_shares_the_next_admissions_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a connection whose sends are idempotent (Discord's nonces: a mark lost to a crash
    is re-driven and proven, never listed), the ``delivered`` mark waits for company."""
    # Long enough that only the next admission ends the first wait on a loaded machine.
    monkeypatch.setattr(_core, "MARK_LINGER_S", 2.0)
    clock = TrioClock()
    async with open_store(f"sqlite:///{tmp_path}/commits.sqlite", clock=clock) as store:
        assert isinstance(store, SQLiteStore)
        host = Host()
        async with runtime(host, store, clock=clock, idempotent_send=lambda _c: True) as rt:
            with trio.fail_after(10):
                await rt.admit(event("1", "first"))
                await wait_until(lambda: len(host.replies) == 1)
                await trio.testing.wait_all_tasks_blocked()
            # The reply is out; its mark waits for company and is not durable yet.
            assert await reply_states(store) == ["pending"]
            before = store.statistics().commits
            with trio.fail_after(10):
                admission = await rt.admit(event("2", "second"))
            assert admission.status == "accepted"
            # One commit made both durable: the second message's admission and the mark.
            assert store.statistics().commits - before == 1
            assert await reply_states(store) == ["delivered"]

            async def both_delivered() -> bool:
                return await reply_states(store) == ["delivered"] * 2

            # The last mark has no company: it commits alone when its time is up.
            with trio.fail_after(30):
                await rt.drain()
                await wait_until(lambda: len(host.replies) == 2)
                await wait_until_async(both_delivered)
            assert await rt.list_unresolved(identity=identity()) == []


async def test_elsewhere_a_replys_delivery_mark_commits_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection without idempotent sends (Telegram, the web chat, Signal): a mark lost
    to a crash would leave the reply listed for an operator, so it does not wait."""
    monkeypatch.setattr(_core, "MARK_LINGER_S", 30.0)
    clock = TrioClock()
    async with open_store(f"sqlite:///{tmp_path}/commits.sqlite", clock=clock) as store:
        assert isinstance(store, SQLiteStore)
        host = Host()
        async with runtime(host, store, clock=clock) as rt:
            with trio.fail_after(10):
                await rt.admit(event("1", "first"))
                await wait_until(lambda: len(host.replies) == 1)
                await trio.testing.wait_all_tasks_blocked()
            assert await reply_states(store) == ["delivered"]


async def reply_states(store: SQLiteStore) -> list[str]:
    page = await store.checkpoints.list_checkpoints(namespace=NS_REPLY)
    return [record.value["state"] for record in page.items]
