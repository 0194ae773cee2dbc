"""A restarted daemon re-drives the Discord replies a killed one left ``pending`` (issue 39).

The kill is the journal as a SIGKILL leaves it: a copy of the real SQLite file taken while
the first runtime's ``deliver`` is inside the send (reply staged and committed, its mark
not yet written). The next runtime opens the copy with a fresh adapter on the same fake
Discord and re-drives the connection (what the daemon does each time the adapter is up):
inside the nonce window the same nonce is posted again and Discord answers the original;
outside it the bot's reply is looked for; never a second post.
"""

from __future__ import annotations

import sqlite3
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import attrs
import trio

from adapters.discord import DiscordAdapter
from adapters.discord._send import NONCE_WINDOW_MS
from prismd.channel import Admission, InboundEvent, Reply, SendResult
from prismd.daemon._resending import resending_run
from prismd.journal import NS_REPLY, ReplyRecord
from prismd.limits import Limits
from prismd.runtime import Runtime, open_messaging_runtime
from stores import SYSTEM_CLOCK, Store, open_store
from tests.fakes.discord_api import FakeDiscord
from tests.support.builders import identity
from tests.support.harness import Host
from tests.support.scripted import ScriptedAgent
from tests.support.waiting import wait_until

from .conftest import CONN, DM, USER, AdapterFactory, _runtime
from .test_resume import _DyingStore, _Leases

DEADLINE_S = 40
POSTS = "/channels/"


@attrs.frozen
class Later:
    """The wall clock ``ahead_ms`` in the future (a restart that came late)."""

    ahead_ms: int

    def now_ms(self) -> int:
        return SYSTEM_CLOCK.now_ms() + self.ahead_ms


def _posts(fake: FakeDiscord) -> list[Any]:
    return [c.body for c in fake.calls("POST", POSTS) if c.path.endswith("/messages")]


@asynccontextmanager
async def _opened(store: Store, adapter: DiscordAdapter, deliver: Any) -> AsyncIterator[Runtime]:
    host = Host(agent=ScriptedAgent(answer=lambda text, _n: f"echo: {text}"))
    try:
        async with _runtime(store, adapter, host, deliver, {"limits": Limits()}) as rt:
            yield rt
    finally:
        await adapter.aclose()


async def _killed_mid_send(
    fake: FakeDiscord, tmp_path: Path, make_adapter: AdapterFactory, *, posted: bool
) -> Path:
    """Run one message until its reply's send is under way (posted to Discord or not yet),
    and return a copy of the journal as it is at that moment."""
    killed = tmp_path / "killed.db"
    snapshot = trio.Event()
    async with open_store(f"sqlite:///{tmp_path}/journal.db") as store:
        adapter = make_adapter(store=store)

        async def deliver(reply: Reply) -> SendResult:
            if posted:
                await adapter.send(reply)  # committed by Discord; the answer is lost
            source = sqlite3.connect(tmp_path / "journal.db")
            target = sqlite3.connect(killed)
            with source, target:
                source.backup(target)
            source.close()
            target.close()
            snapshot.set()
            # What this process does next is not in the copy: as if it had died here.
            return SendResult(False, reason="killed")

        async with _opened(store, adapter, deliver):
            await wait_until(lambda: adapter.health()["state"] == "connected")
            fake.user_message(DM, USER, "hello")
            await snapshot.wait()
    return killed


async def _replies(store: Store) -> list[ReplyRecord]:
    page = await store.checkpoints.list_checkpoints(namespace=NS_REPLY)
    return [ReplyRecord.from_json(r.value) for r in page.items]


async def _restart(
    killed: Path, make_adapter: AdapterFactory, **adapter_options: Any
) -> tuple[dict[str, int], list[ReplyRecord], list[Any]]:
    """Open the killed journal with a fresh adapter and re-drive the connection."""
    async with open_store(f"sqlite:///{killed}") as store:
        [before] = await _replies(store)
        assert before.state == "pending" and before.reason is None
        adapter = make_adapter(store=store, owner_id="daemon-b", **adapter_options)
        async with _opened(store, adapter, adapter.send) as rt:
            outcomes = await rt.resend_unconfirmed(CONN)
            again = await rt.resend_unconfirmed(CONN)  # nothing left: never twice
            assert again == {}
            listed = await rt.list_unresolved(identity=identity())
        return outcomes, await _replies(store), listed


async def test_restart_inside_the_window_resends_with_the_same_nonce(
    fake: FakeDiscord, tmp_path: Path, make_adapter: AdapterFactory
) -> None:
    with trio.fail_after(DEADLINE_S):
        killed = await _killed_mid_send(fake, tmp_path, make_adapter, posted=True)
        [first] = _posts(fake)
        assert len(fake.bot_messages()) == 1
        outcomes, [reply], listed = await _restart(killed, make_adapter)
    assert outcomes == {"delivered": 1}
    assert reply.state == "delivered"
    assert listed == []
    posts = _posts(fake)
    assert len(posts) == 2 and posts[1]["nonce"] == first["nonce"]
    assert posts[1]["enforce_nonce"] is True
    assert [m["content"] for m in fake.bot_messages()] == ["echo: hello"]  # the original


async def test_restart_outside_the_window_finds_the_posted_reply(
    fake: FakeDiscord, tmp_path: Path, make_adapter: AdapterFactory
) -> None:
    with trio.fail_after(DEADLINE_S):
        killed = await _killed_mid_send(fake, tmp_path, make_adapter, posted=True)
        late = Later(NONCE_WINDOW_MS + 60_000)
        outcomes, [reply], listed = await _restart(killed, make_adapter, clock=late)
    assert outcomes == {"delivered": 1}
    assert reply.state == "delivered"
    assert listed == []
    assert len(_posts(fake)) == 1  # looked up, not posted again
    assert [m["content"] for m in fake.bot_messages()] == ["echo: hello"]


async def test_restart_outside_the_window_without_the_reply_is_unknown(
    fake: FakeDiscord, tmp_path: Path, make_adapter: AdapterFactory
) -> None:
    with trio.fail_after(DEADLINE_S):
        killed = await _killed_mid_send(fake, tmp_path, make_adapter, posted=False)
        late = Later(NONCE_WINDOW_MS + 60_000)
        outcomes, [reply], listed = await _restart(killed, make_adapter, clock=late)
    assert outcomes == {"delivery_unknown": 1}
    assert reply.state == "delivery_unknown"
    assert reply.reason == "reply may have been posted; nonce window passed"
    assert [(e.reply_state, e.operation_id, e.reason) for e in listed] == [
        ("delivery_unknown", reply.operation_id, reply.reason)
    ]
    assert _posts(fake) == []  # never a blind post
    assert fake.bot_messages() == []


async def test_only_a_channel_that_repeats_safely_is_re_driven(
    store: Store, make_adapter: AdapterFactory
) -> None:
    """Discord declares ``idempotent_send``; Telegram and the web chat do not, so the
    daemon runs their adapters unchanged (their pending replies stay listed for
    ``reconcile``, as before)."""
    from adapters.telegram import TelegramAdapter
    from adapters.webchat._adapter import WebchatAdapter

    async def refuse(_event: InboundEvent) -> Admission:
        return Admission("denied", "stopped")

    discord = make_adapter()
    telegram = TelegramAdapter(
        connection_id="tg", token=lambda: "t", admit=refuse, store=store, owner_id="daemon-a"
    )
    web = WebchatAdapter(connection_id="web", listen="127.0.0.1:0", admit=refuse)
    host = Host()
    async with open_messaging_runtime(
        authorize=host.authorize,
        resolve_agent=host.resolve_agent,
        deliver=host.deliver,
        store=store,
        owner_id="daemon-a",
    ) as rt:
        assert discord.features.idempotent_send
        assert resending_run(discord, rt) != discord.run
        for other in (telegram, web):
            assert not other.features.idempotent_send
            assert resending_run(other, rt) == other.run
    await discord.aclose()


async def test_a_standby_that_takes_over_resends_the_dead_holders_reply(
    fake: FakeDiscord, store: Store, make_adapter: AdapterFactory
) -> None:
    """Two instances on one journal: the holder dies mid-send (its lease is not released,
    its reply stays ``pending``); the standby, started before that reply was staged, takes
    the lease over once it expires and re-drives the reply — same nonce, nothing new."""
    with trio.fail_after(DEADLINE_S):
        dying = _DyingStore(store.checkpoints, _Leases(store.leases))
        holder = make_adapter(owner_id="daemon-a", store=dying, lease_ttl_ms=2_000)
        standby = make_adapter(owner_id="daemon-b", lease_ttl_ms=2_000)
        sending = trio.Event()

        async def hang_after_post(reply: Reply) -> SendResult:
            await holder.send(reply)
            sending.set()
            await trio.sleep_forever()
            raise AssertionError("unreachable")

        host_b = Host()
        async with trio.open_nursery() as nursery:
            holder_scope = trio.CancelScope()

            async def run_holder() -> None:
                with holder_scope:
                    async with _opened(store, holder, hang_after_post):
                        await trio.sleep_forever()

            nursery.start_soon(run_holder)
            await wait_until(lambda: holder.health()["state"] == "connected")
            async with open_messaging_runtime(
                authorize=host_b.authorize,
                resolve_agent=host_b.resolve_agent,
                deliver=standby.send,
                store=store,
                owner_id="daemon-b",
                resume_accepted=False,
            ) as rt_b:
                standby.admit = rt_b.admit
                await nursery.start(resending_run(standby, rt_b))
                await trio.sleep(0.5)
                assert standby.health()["state"] == "standby"
                fake.user_message(DM, USER, "hello")
                await sending.wait()
                [first] = _posts(fake)
                holder_scope.cancel()  # killed: its lease and its reply stay as they are
                await wait_until(lambda: standby.health()["state"] == "connected")
                [reply] = await _replies(store)
                while reply.state == "pending":
                    await trio.sleep(0.2)
                    [reply] = await _replies(store)
                listed = await rt_b.list_unresolved(identity=identity())
                nursery.cancel_scope.cancel()
        await standby.aclose()
    assert reply.state == "delivered"
    assert listed == []
    posts = _posts(fake)
    assert len(posts) == 2 and posts[1]["nonce"] == first["nonce"]
    assert [m["content"] for m in fake.bot_messages()] == ["echo: hello"]
