"""Core runtime behaviours (contract behaviours 9–37, 49–53), mostly without a journal."""

from __future__ import annotations

from .harness import Host, event, runtime


async def test_accepted_message_runs_once_and_replies_b9_b10() -> None:
    """Behaviours 9, 10: accepted with a chan-op- id, settled drain, one final reply."""
    host = Host()
    async with runtime(host) as rt:
        result = await rt.admit(event())
        assert result.status == "accepted"
        assert result.operation_id is not None and result.operation_id.startswith("chan-op-")
        drained = await rt.drain()
        assert drained.settled
    assert [r.kind for r in host.deliveries] == ["final"]
    reply = host.deliveries[0]
    assert reply.text == "answer" and reply.connection_id == "tg-1" and reply.in_reply_to == "1"
    assert len(host.agent.sessions) == 1
    assert [len(v) for v in host.agent.sessions.values()] == [2]
