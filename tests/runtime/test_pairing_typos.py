"""A stranger's ``/pair`` with a cut, mistyped or missing token is answered "That pairing
code is not valid." as a wrong token is (docs/telegram.md): it was refused without a word,
so a user who pasted part of the token waited for an answer that never came. A bare
``/start`` (Telegram's greeting) and a connection without pairing stay silent."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import trio

from prismd.agents import AgentContext, build_agent
from stores import OwnershipScope
from stores.memory import MemoryStore
from tests.support.builders import event
from tests.support.clocks import ManualClock
from tests.support.harness import open_harness

INVALID = "That pairing code is not valid."
# The web chat shows a refusal's hint ("not accepted: …"); "rejected" alone said nothing.
NOT_GRANTED = (
    "No grant lets you talk to an agent here. With a pairing code, send /pair CODE;"
    " the operator grants access in the [[grants]] of prismd's config."
)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def store(clock: ManualClock) -> AsyncIterator[MemoryStore]:
    async with MemoryStore(clock=clock) as s:
        yield s


async def test_a_stranger_s_malformed_pair_is_told_the_code_is_not_valid(
    store: MemoryStore, clock: ManualClock, autojump_clock: trio.testing.MockClock
) -> None:
    echo = build_agent(
        "echo",
        AgentContext(alias="primary", options={}, checkpoints=store.checkpoints, clock=clock),
    )
    pair_scope = OwnershipScope("default", "tg-1", None)
    async with open_harness(
        store,
        clock,
        {"primary": echo},
        grants={"stranger": None},
        pairing_scope=lambda conn: pair_scope if conn == "tg-1" else None,
    ) as h:
        for number, text in enumerate(
            ["/pair WRONGTOKEN", "/pair", "  /PAIR q3Jm-cut-short ", "/pair a b"], start=1
        ):
            admission = await h.runtime.admit(event(f"p{number}", text, actor="stranger"))
            assert (admission.status, admission.reason) == ("denied", "rejected")
            assert admission.hint == NOT_GRANTED
            await h.settle()
            assert len(h.replies) == number, text
            assert h.last().text == INVALID
        silent = ["/start", "hello", "/pairing", "/start WRONG"]
        for number, text in enumerate(silent, start=10):
            admission = await h.runtime.admit(event(f"s{number}", text, actor="stranger"))
            assert (admission.status, admission.reason) == ("denied", "rejected")
        # Not on a connection without pairing either.
        other = await h.runtime.admit(event("o1", "/pair x", conn="tg-2", actor="stranger"))
        assert (other.status, other.reason) == ("denied", "rejected")
        await h.settle()
        assert len(h.replies) == 4
