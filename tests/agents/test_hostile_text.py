"""Agent transcripts and text the stores cannot hold as UTF-8 (a lone surrogate)."""

from __future__ import annotations

from typing import Any

import pytest

from prismd.agents import RunRequest, build_agent
from prismd.grants import AgentIdentity, Principal, ownership_from_identity
from stores.memory import MemoryStore
from tests.support.clocks import ManualClock

IDENTITY = AgentIdentity(
    tenant_id="tenant-1", principal=Principal("user", "user-1"), scopes=("chat",),
    issued_at_ms=0, user_id="user-1",
)  # fmt: skip


def _ctx(store: MemoryStore, clock: ManualClock, **options: Any) -> Any:
    from prismd.agents import AgentContext

    return AgentContext(
        alias="primary", options=options, checkpoints=store.checkpoints, clock=clock
    )


async def test_lone_surrogate_input_does_not_fail_the_run(
    store: MemoryStore, clock: ManualClock
) -> None:
    """The runtime admits such text (a channel may hand it over); storing it in the transcript
    used to raise InvalidCheckpointError and fail the run. It is kept with U+FFFD instead."""
    for kind in ("echo", "mock"):
        # echo keeps a transcript only with ``history``.
        options = {"history": True} if kind == "echo" else {}
        agent = build_agent(kind, _ctx(store, clock, **options))
        request = RunRequest(
            session_id=f"s-{kind}", input="a\ud800b", identity=IDENTITY, idempotency_key="op-1"
        )
        result = await agent.run(request)
        assert result.status == "succeeded"
        entries = await agent.session_entries(f"s-{kind}", ownership_from_identity(IDENTITY))  # type: ignore[attr-defined]
        assert entries[0].text == "a\ufffdb"


async def test_transcript_refused_by_the_store_is_not_retried_as_a_cas_loss(
    store: MemoryStore, clock: ManualClock
) -> None:
    """InvalidCheckpointError subclasses CheckpointConflictError; the append loop used to
    retry it eight times and then report a lost compare-and-swap."""
    from prismd.agents._session import SessionLog
    from stores import InvalidCheckpointError

    class Refusing:
        calls = 0

        async def load_checkpoint(self, **kwargs: Any) -> Any:
            return await store.checkpoints.load_checkpoint(**kwargs)

        async def write_checkpoints(self, writes: Any, **kwargs: Any) -> Any:
            self.calls += 1
            raise InvalidCheckpointError("value is not JSON-serialisable")

    refusing = Refusing()
    log = SessionLog(refusing, "primary")  # type: ignore[arg-type]
    with pytest.raises(InvalidCheckpointError, match="JSON"):
        await log.append("s", ownership_from_identity(IDENTITY), (("user", "x"),))
    assert refusing.calls == 1


async def test_python_factory_module_that_fails_to_import_is_an_option_error(
    store: MemoryStore, clock: ManualClock, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module with a syntax error or one that raises at import escaped as that exception
    (a traceback at start-up); it is an AgentOptionError naming the module and error type."""
    from prismd.agents import AgentOptionError

    (tmp_path / "prismd_broken_syntax.py").write_text("def f(:\n")
    (tmp_path / "prismd_broken_raises.py").write_text("raise RuntimeError('secret detail')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for module, kind in (
        ("prismd_broken_syntax", "SyntaxError"),
        ("prismd_broken_raises", "RuntimeError"),
    ):
        with pytest.raises(AgentOptionError, match=f"cannot import module '{module}'") as info:
            build_agent("python", _ctx(store, clock, factory=f"{module}:make"))
        assert kind in str(info.value) and "secret detail" not in str(info.value)
