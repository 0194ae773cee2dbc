"""The ``a2a`` agent through a real ``prismd run`` (SQLite, the web chat, real signals)
against the loopback fake A2A agent in this process: a task followed while the daemon is
SIGKILLed or SIGTERMed is followed again after the restart and answered once, the fake saw
one send per messageId, and a push through ``[a2a] push_listen`` answers a task whose poll
is a minute away."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.daemon.helpers import Layout, chat, free_port, prismctl, running_daemon
from tests.fakes.a2a_agent import FakeA2A, Plan
from tests.support.waiting import wait_until_async

pytestmark = pytest.mark.slow
ACTOR = "a2a-actor-0001"


def layout_for(
    root: Path,
    fake: FakeA2A,
    *,
    poll_ms: int = 100,
    push_port: int = 0,
    store_url: str | None = None,
    lease_ttl_ms: int = 30_000,
    push_base_url: str | None = None,
) -> Layout:
    layout = Layout(root=root, port=free_port(), store_url=store_url)
    push = f'[a2a]\npush_listen = "127.0.0.1:{push_port}"\n' if push_port else ""
    if push and push_base_url:
        push += f'push_base_url = "{push_base_url}"\n'
    layout.config.write_text(
        f"""
[daemon]
state_dir = "{layout.state_dir}"

[store]
url = "{layout.url}"

[limits]
stop_deadline_ms = 3000
lease_ttl_ms = {lease_ttl_ms}

[control]
socket = "{layout.control}"
{push}
[[connections]]
id = "web"
kind = "webchat"
listen = "127.0.0.1:{layout.port}"

[agents.remote]
kind = "a2a"
url = "{fake.base_url}"
stream = false
poll_interval_ms = {poll_ms}
max_poll_interval_ms = {max(poll_ms, 500)}

[[grants]]
connection = "web"
actors = ["*"]
aliases = ["remote"]
"""
    )
    return layout


async def _polled(fake: FakeA2A) -> None:
    """Until the daemon follows the task (its first GetTask)."""
    await fake.wait_state(
        lambda: any(r["method"] in ("GetTask", "tasks/get") for r in fake.requests)
    )


@pytest.mark.parametrize("signum", [signal.SIGKILL, signal.SIGTERM])
async def test_a_followed_task_survives_the_daemon_and_is_answered_once(
    tmp_path: Path, signum: int
) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            fake.plan(Plan("work"), Plan("complete", "the second answer"))
            layout = layout_for(tmp_path, fake)
            async with running_daemon(layout, tag="first") as d:
                await d.wait_state("READY=1")
                async with chat(layout.port, ACTOR) as client:
                    admission = await client.send_message("m1", "a long research job")
                    assert admission["status"] == "accepted"
                    await _polled(fake)
                    queued = await client.send_message("m2", "and then this")
                    assert queued["status"] == "accepted"
                (task_id,) = fake.tasks
                code, listed, _ = await prismctl(layout, "list-remote-tasks")
                assert code == 0
                (entry,) = listed["tasks"]
                assert (entry["alias"], entry["remoteTaskId"], entry["phase"]) == (
                    "remote",
                    task_id,
                    "following",
                )
                assert entry["owner"].startswith("prismd-") and entry["lastObservation"]
                # The next poll, from the follower's schedule (this daemon follows it).
                assert entry["nextPoll"] and entry["nextPoll"].endswith("Z")
                # Followed work needs no decision: only the message queued behind it is
                # listed (accepted, as every acknowledged message waiting for its turn).
                code, unresolved, _ = await prismctl(layout, "list-unresolved")
                assert code == 0
                assert [e["state"] for e in unresolved] == ["accepted"]
                assert entry["operationId"] not in [e["operationId"] for e in unresolved]
                d.send(signum)
                code = await d.wait_exit()
                assert code == (0 if signum == signal.SIGTERM else -signal.SIGKILL)
            # Neither a stop nor a kill cancels the remote task.
            assert fake.tasks[task_id].state == "working"
            assert not any(r["method"] == "CancelTask" for r in fake.requests)
            await fake.move(task_id, "completed", "the first answer", push=False)
            async with running_daemon(layout, tag="second") as second:
                await second.wait_state("READY=1")
                async with chat(layout.port, ACTOR) as client:
                    first = await client.next_frame("reply")
                    then = await client.next_frame("reply")
                    assert [first["text"], then["text"]] == [
                        "the first answer",
                        "the second answer",
                    ]
                    with trio.move_on_after(1.0):
                        extra = await client.next_frame("reply", limit_s=1.0)
                        raise AssertionError(f"a reply twice: {extra}")
                code, listed, _ = await prismctl(layout, "list-remote-tasks")
                assert code == 0 and listed["tasks"] == []
                code, health, _ = await prismctl(layout, "health")
                assert health["a2a"]["following"] == 0 and health["a2a"]["polls"] >= 1
                second.send(signal.SIGTERM)
                assert await second.wait_exit() == 0
            # Nothing but counters in the logs: no message text, no answer.
            for log in (d.stderr(), second.stderr()):
                assert "research job" not in log and "first answer" not in log
            sends = fake.sends()
            assert len(sends) == 2
            for sent in sends:
                assert fake.sends_of(sent["params"]["message"]["messageId"]) == 1
            nursery.cancel_scope.cancel()


async def test_a_push_through_the_daemon_answers_before_any_poll(tmp_path: Path) -> None:
    """At debug level too, no push secret and no text reaches the log."""
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="0.3", streaming=False)
            await nursery.start(fake.serve)
            fake.plan(Plan("work"))
            push_port = free_port()
            layout = layout_for(tmp_path, fake, poll_ms=60_000, push_port=push_port)
            async with running_daemon(layout, args=("--log-level", "debug")) as d:
                await d.wait_state("READY=1")
                async with chat(layout.port, ACTOR) as client:
                    await client.send_message("m1", "go")
                    await _polled(fake)
                    (task_id,) = fake.tasks
                    push = fake.tasks[task_id].push
                    assert push is not None
                    assert push["url"] == f"http://127.0.0.1:{push_port}/a2a/push/remote"
                    await fake.move(task_id, "completed", "pushed")
                    reply = await client.next_frame("reply", limit_s=10)
                    assert reply["text"] == "pushed"
                d.send(signal.SIGTERM)
                assert await d.wait_exit() == 0
            assert "pushed" not in d.stderr()
            assert push["token"] not in d.stderr()
            assert push["authentication"]["credentials"] not in d.stderr()
            nursery.cancel_scope.cancel()


async def test_reconcile_cancel_remote_cancels_and_settles(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            fake.plan(Plan("work"))
            layout = layout_for(tmp_path, fake)
            async with running_daemon(layout) as d:
                await d.wait_state("READY=1")
                async with chat(layout.port, ACTOR) as client:
                    await client.send_message("m1", "go")
                    await _polled(fake)
                    code, listed, _ = await prismctl(layout, "list-remote-tasks")
                    (entry,) = listed["tasks"]
                    assert entry["connectionId"] == "web"
                    stale = str(entry["version"] - 1)
                    cancel = ("reconcile", entry["operationId"], "--connection", "web")
                    code, result, _ = await prismctl(
                        layout, *cancel, "--version", stale, "--cancel-remote"
                    )
                    assert result["status"] == "conflict"  # not the version listed
                    assert not any(r["method"] == "CancelTask" for r in fake.requests)
                    code, result, _ = await prismctl(
                        layout, *cancel, "--version", str(entry["version"]), "--cancel-remote"
                    )
                    assert code == 0, result
                    assert result["status"] == "resolved"
                    reply = await client.next_frame("reply", limit_s=10)
                    assert reply["text"] == "Request failed: the remote agent cancelled it."
                (task,) = fake.tasks.values()
                assert task.state == "canceled"
                code, listed, _ = await prismctl(layout, "list-remote-tasks")
                assert listed["tasks"] == []
                code, result, _ = await prismctl(
                    layout, *cancel, "--version", str(entry["version"]), "--cancel-remote"
                )
                assert result["status"] == "conflict"  # settled since: another version
                d.send(signal.SIGTERM)
                assert await d.wait_exit() == 0
            nursery.cancel_scope.cancel()


async def _followed(layout: Layout) -> dict[str, Any]:
    """The one remote task ``layout``'s instance lists (``listRemoteTasks``)."""
    code, listed, _ = await prismctl(layout, "list-remote-tasks")
    assert code == 0
    (entry,) = listed["tasks"]
    return dict(entry)


async def test_another_instance_takes_over_a_task_whose_follower_was_killed(
    tmp_path: Path,
) -> None:
    """Two instances on one PostgreSQL database behind one push URL (a balancer): the one
    following a task is SIGKILLed and never restarted; once its binding lease expired the
    other follows the same task (no second send), and the push that completes it — refused
    by the dead instance, taken by the live one — answers it once, a minute before any
    poll would."""
    from tests.daemon.helpers import _RESUME_TOKENS
    from tests.support import pgserver
    from tests.support.push_proxy import PushProxy

    url = pgserver.fresh_url("a2a")
    try:
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                fake = FakeA2A(dialect="1.0", streaming=False)
                await nursery.start(fake.serve)
                fake.plan(Plan("work"))
                push_ports = [free_port(), free_port()]
                proxy = PushProxy(push_ports)
                await nursery.start(proxy.serve)
                (tmp_path / "a").mkdir()
                (tmp_path / "b").mkdir()
                a, b = (
                    layout_for(
                        tmp_path / name, fake, store_url=url, lease_ttl_ms=1500,
                        poll_ms=60_000, push_port=port, push_base_url=proxy.url,
                    )
                    for name, port in zip("ab", push_ports, strict=True)
                )  # fmt: skip
                async with running_daemon(a, tag="a") as da, running_daemon(b, tag="b") as db:
                    await da.wait_state("READY=1")
                    await db.wait_state("READY=1")
                    async with chat(a.port, ACTOR) as client:
                        await client.send_message("m1", "long job")
                        await _polled(fake)
                    _code, b_health, _ = await prismctl(b, "health")
                    b_instance = b_health["instance"]
                    da.send(signal.SIGKILL)
                    assert await da.wait_exit() == -signal.SIGKILL
                    (task_id,) = fake.tasks
                    push = fake.tasks[task_id].push
                    assert push is not None and push["url"] == f"{proxy.url}/a2a/push/remote"

                    # The other instance takes the task over once A's binding lease expired
                    # (listRemoteTasks names it the owner). Its first poll comes when the
                    # task is due — the time A set, a minute away — or, as here, on a push.
                    async def taken_over() -> bool:
                        return b_instance in str((await _followed(b))["owner"])

                    with trio.fail_after(20):
                        await wait_until_async(taken_over, step=0.2)
                    await fake.move(task_id, "completed", "taken over")
                    assert proxy.served == [1]
                    token = _RESUME_TOKENS.get((a.port, ACTOR))
                    if token is not None:
                        _RESUME_TOKENS[(b.port, ACTOR)] = token
                    async with chat(b.port, ACTOR) as client:
                        reply = await client.next_frame("reply", limit_s=20)
                        assert reply["text"] == "taken over"
                        with trio.move_on_after(1.0):
                            extra = await client.next_frame("reply", limit_s=1.0)
                            raise AssertionError(f"a reply twice: {extra}")
                    _code, health, _ = await prismctl(b, "health")
                    assert health["a2a"]["pushes_accepted"] == 1
                    db.send(signal.SIGTERM)
                    assert await db.wait_exit() == 0
                (sent,) = fake.sends()
                assert fake.sends_of(sent["params"]["message"]["messageId"]) == 1
                nursery.cancel_scope.cancel()
    finally:
        pgserver.drop_schema(url)
