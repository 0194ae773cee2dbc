"""Through a real ``prismd run`` (SQLite, the web chat, SIGKILL) against the loopback fake
A2A agent: an ``auth-required`` status is relayed once — not again after the daemon is
killed and restarted — and the answer follows; an answer's files reach the web chat as
``file`` frames after its reply, fetched again when a reply held across a kill is shown."""

from __future__ import annotations

import base64
import signal
from pathlib import Path

import pytest
import trio

from tests.agents.test_a2a_daemon import layout_for
from tests.daemon.helpers import chat, prismctl, running_daemon
from tests.fakes.a2a_agent import FakeA2A, FakeFile, Plan

pytestmark = pytest.mark.slow
ACTOR = "a2a-files-0001"
SIGN_IN = "Please sign in to the archive first."
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8


def gets(fake: FakeA2A) -> int:
    return sum(1 for r in fake.requests if r["method"] in ("GetTask", "tasks/get"))


async def test_auth_required_is_relayed_once_across_a_kill(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="1.0", streaming=False)
            await nursery.start(fake.serve)
            fake.plan(Plan("work"))
            layout = layout_for(tmp_path, fake)
            async with running_daemon(layout, tag="first") as d:
                await d.wait_state("READY=1")
                async with chat(layout.port, ACTOR) as client:
                    await client.send_message("m1", "search the archive")
                    await fake.wait_state(lambda: gets(fake) >= 1)
                    (task_id,) = fake.tasks
                    await fake.move(task_id, "auth-required", SIGN_IN)
                    relayed = await client.next_frame("reply", limit_s=10)
                    assert (relayed["text"], relayed["kind"]) == (SIGN_IN, "notice")
                    assert relayed["inReplyTo"] == "m1"
                seen = gets(fake)
                await fake.wait_state(lambda: gets(fake) >= seen + 3)
                d.send(signal.SIGKILL)
                assert await d.wait_exit() == -signal.SIGKILL
            async with running_daemon(layout, tag="second") as second:
                await second.wait_state("READY=1")
                seen = gets(fake)
                await fake.wait_state(lambda: gets(fake) >= seen + 3)  # followed again
                async with chat(layout.port, ACTOR) as client:
                    await fake.move(task_id, "working", None)
                    await fake.move(task_id, "completed", "three boxes found")
                    reply = await client.next_frame("reply", limit_s=10)
                    assert (reply["text"], reply["kind"]) == ("three boxes found", "final")
                    with trio.move_on_after(1.0):
                        extra = await client.next_frame("reply", limit_s=1.0)
                        raise AssertionError(f"a reply twice: {extra}")
                code, unresolved, _ = await prismctl(layout, "list-unresolved")
                assert code == 0 and unresolved == []
                second.send(signal.SIGTERM)
                assert await second.wait_exit() == 0
            for log in (d.stderr(), second.stderr()):
                assert "sign in" not in log and "archive" not in log
            (sent,) = fake.sends()
            assert fake.sends_of(sent["params"]["message"]["messageId"]) == 1
            nursery.cancel_scope.cancel()


async def test_files_reach_the_web_chat_and_are_fetched_again_after_a_kill(
    tmp_path: Path,
) -> None:
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            fake = FakeA2A(dialect="0.3", streaming=False)
            await nursery.start(fake.serve)
            fake.plan(Plan("work"), Plan("work"))
            url = fake.offer_download("/files/notes.txt", b"line one\nline two\n", "text/plain")
            layout = layout_for(tmp_path, fake)
            async with running_daemon(layout, tag="first") as d:
                await d.wait_state("READY=1")
                async with chat(layout.port, ACTOR) as client:
                    await client.send_message("m1", "draw the chart")
                    await fake.wait_state(lambda: len(fake.tasks) == 1)
                    first = next(iter(fake.tasks))
                    await fake.move(
                        first,
                        "completed",
                        "Here is the chart.",
                        files=(FakeFile("chart.png", "image/png", data=PNG),),
                    )
                    reply = await client.next_frame("reply", limit_s=10)
                    assert reply["text"] == "Here is the chart."
                    file = await client.next_frame("file", limit_s=10)
                    assert (file["replyId"], file["name"], file["mediaType"]) == (
                        reply["replyId"],
                        "chart.png",
                        "image/png",
                    )
                    assert base64.b64decode(file["data"]) == PNG and file["size"] == len(PNG)
                    # The second answer comes while no tab is open: held in the journal.
                    await client.send_message("m2", "and the notes")
                    await fake.wait_state(lambda: len(fake.tasks) == 2)
                second_task = list(fake.tasks)[1]
                await fake.move(
                    second_task,
                    "completed",
                    None,
                    files=(FakeFile("notes.txt", "text/plain", url=url),),
                )
                while True:  # until its answer is settled (held: no tab is open)
                    code, listed, _ = await prismctl(layout, "list-remote-tasks")
                    assert code == 0
                    if not listed["tasks"]:
                        break
                    await trio.sleep(0.1)
                assert fake.fetched == []  # held: nothing fetched for a reply not shown
                d.send(signal.SIGKILL)
                assert await d.wait_exit() == -signal.SIGKILL
            async with running_daemon(layout, tag="second") as second:
                await second.wait_state("READY=1")
                async with chat(layout.port, ACTOR) as client:
                    reply = await client.next_frame("reply", limit_s=10)
                    assert reply["text"] == "The remote agent answered with one file."
                    file = await client.next_frame("file", limit_s=10)
                    assert file["name"] == "notes.txt"
                    assert base64.b64decode(file["data"]) == b"line one\nline two\n"
                    with trio.move_on_after(1.0):
                        extra = await client.next_frame("reply", limit_s=1.0)
                        raise AssertionError(f"a reply twice: {extra}")
                assert fake.fetched == ["/files/notes.txt"]
                second.send(signal.SIGTERM)
                assert await second.wait_exit() == 0
            for log in (d.stderr(), second.stderr()):
                assert "chart.png" not in log and "notes.txt" not in log
            nursery.cancel_scope.cancel()
