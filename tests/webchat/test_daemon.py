"""The web chat's promises through a real ``prismd run`` (SQLite, real signals) and a real
``prismctl chat`` subprocess: an answer for a closed tab survives a SIGKILL and reaches the
same browser once; the chat client reconnects after a restart and keeps its id."""

from __future__ import annotations

import json
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import trio_websocket

from prismd.journal import operation_id_for
from prismd.runtime._unanswered import UNANSWERED_TEXT
from tests.daemon.helpers import child_env, prismctl, running_daemon, write_config

from ._support import connect_to

pytestmark = pytest.mark.slow

ACTOR = "daemon-actor-00001"


async def unresolved(layout: Any) -> list[dict[str, Any]]:
    code, entries, err = await prismctl(layout, "list-unresolved")
    assert code == 0, err
    assert isinstance(entries, list)
    return entries


async def wait_listed(layout: Any, reply_state: str | None) -> dict[str, Any] | None:
    """The first unresolved entry once it shows ``reply_state``; with ``None``, once the
    list is empty."""
    with trio.fail_after(20):
        for _ in range(1000):
            entries = await unresolved(layout)
            if reply_state is None and not entries:
                return None
            if entries and entries[0].get("replyState") == reply_state:
                return entries[0]
            await trio.sleep(0.1)
    raise AssertionError(f"never listed with reply state {reply_state}")


async def frames_until(ws: trio_websocket.WebSocketConnection, kind: str) -> dict[str, Any]:
    while True:
        frame: dict[str, Any] = json.loads(await ws.get_message())
        if frame["type"] == kind:
            return frame


async def test_an_answer_for_a_closed_tab_survives_a_sigkill_and_arrives_once(
    tmp_path: Path,
) -> None:
    layout = write_config(tmp_path, delay_ms=300)
    op = operation_id_for("web", f"{ACTOR}:m1")
    with trio.fail_after(90):
        async with running_daemon(layout, tag="first") as first:
            await first.wait_state("READY=1")
            async with connect_to("127.0.0.1", layout.port) as ws:
                await ws.send_message(json.dumps({"type": "hello", "actor": ACTOR}))
                ready = await frames_until(ws, "ready")
                resume = ready["resume"]
                await ws.send_message(json.dumps({"type": "message", "id": "m1", "text": "hi"}))
                assert (await frames_until(ws, "admission"))["status"] == "accepted"
            # the tab is closed; the answer is journaled and held, listed as pending
            entry = await wait_listed(layout, "pending")
            assert entry is not None
            assert (entry["operationId"], entry["state"]) == (op, "succeeded")
            first.send(signal.SIGKILL)
            assert await first.wait_exit() == -signal.SIGKILL
        async with running_daemon(layout, tag="second") as second:
            await second.wait_state("READY=1")
            assert [e["operationId"] for e in await unresolved(layout)] == [op]
            async with connect_to("127.0.0.1", layout.port) as ws:
                # the same browser (its resume token) reconnects to the restarted daemon
                await ws.send_message(
                    json.dumps({"type": "hello", "actor": ACTOR, "resume": resume})
                )
                assert await frames_until(ws, "ready") == {"type": "ready", "actor": ACTOR}
                assert await frames_until(ws, "history") == {"type": "history", "replies": []}
                reply = await frames_until(ws, "reply")
                assert (reply["replyId"], reply["text"], reply["inReplyTo"]) == (
                    op,
                    "mock: hi",
                    "m1",
                )
                await wait_listed(layout, None)  # delivered: listed no more
                # the next answer comes straight after the re-sent m1 is seen as a duplicate:
                # no second copy of the held one in between
                await ws.send_message(json.dumps({"type": "message", "id": "m1", "text": "hi"}))
                assert (await frames_until(ws, "admission"))["duplicate"] is True
                await ws.send_message(json.dumps({"type": "message", "id": "m2", "text": "yo"}))
                nxt = await frames_until(ws, "reply")
                assert nxt["text"] == "mock: yo"
            # a stranger with the actor id but not the token gets nothing
            async with connect_to("127.0.0.1", layout.port) as ws:
                await ws.send_message(json.dumps({"type": "hello", "actor": ACTOR}))
                assert (await frames_until(ws, "error"))["code"] == "resume_refused"
            code, events, _ = await prismctl(layout, "events")
            assert code == 0
            second.send(signal.SIGTERM)
            assert await second.wait_exit() == 0
            log = first.stderr() + second.stderr()
    assert resume not in log and "mock: hi" not in log
    assert resume not in json.dumps(events)


class Output:
    """A subprocess pipe read in the background, waited on by pattern."""

    def __init__(self, stream: trio.abc.ReceiveStream) -> None:
        self._stream = stream
        self.text = ""
        self._changed = trio.Event()
        self.closed = False

    async def pump(self) -> None:
        while chunk := await self._stream.receive_some(4096):
            self.text += chunk.decode("utf-8", "replace")
            self._changed.set()
            self._changed = trio.Event()
        self.closed = True
        self._changed.set()

    async def wait_for(self, pattern: str) -> re.Match[str]:
        while (match := re.search(pattern, self.text)) is None:
            assert not self.closed, self.text
            await self._changed.wait()
        return match


async def run_chat(
    layout: Any, nursery: trio.Nursery, started: list[trio.Process]
) -> tuple[trio.Process, Output, Output]:
    process = await trio.lowlevel.open_process(
        [
            sys.executable,
            "-m",
            "prismd.cli.prismctl",
            "chat",
            "--url",
            f"http://127.0.0.1:{layout.port}/",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=child_env(),
        cwd=str(layout.root),
    )
    started.append(process)
    assert process.stdout is not None and process.stderr is not None
    out, err = Output(process.stdout), Output(process.stderr)
    nursery.start_soon(out.pump)
    nursery.start_soon(err.pump)
    return process, out, err


async def type_line(process: trio.Process, line: str) -> None:
    assert process.stdin is not None
    await process.stdin.send_all(line.encode() + b"\n")


async def test_prismctl_chat_reconnects_after_a_daemon_restart_and_keeps_its_id(
    tmp_path: Path, _private_state_home: Path
) -> None:
    layout = write_config(tmp_path, delay_ms=10)
    started: list[trio.Process] = []
    seen: list[Output] = []
    try:
        with trio.fail_after(90):
            actor = await _chat_across_a_restart(layout, started, seen)
    finally:
        with trio.CancelScope(shield=True):
            for proc in started:
                if proc.returncode is None:
                    proc.kill()
                await proc.wait()
                for pipe in (proc.stdin, proc.stdout, proc.stderr):
                    if pipe is not None:
                        await pipe.aclose()
    state_file = _private_state_home / "prismd" / "chat.json"
    kept = json.loads(state_file.read_text())
    [entry] = kept["servers"].values()
    assert entry["actor"] == actor and re.fullmatch(r"[A-Za-z0-9_-]{43}", entry["resume"])
    assert stat.S_IMODE(state_file.stat().st_mode) == 0o600
    assert stat.S_IMODE(state_file.parent.stat().st_mode) == 0o700
    assert all(entry["resume"] not in o.text for o in seen)  # never printed


async def _chat_across_a_restart(
    layout: Any, started: list[trio.Process], seen: list[Output]
) -> str:
    """One ``prismctl chat`` across a SIGTERM + restart, then a second run; its actor id."""
    async with trio.open_nursery() as pumps:
        async with running_daemon(layout, tag="first") as first:
            await first.wait_state("READY=1")
            process, out, err = await run_chat(layout, pumps, started)
            seen += [out, err]
            actor = (await err.wait_for(r"connected to \S+ as (\S+);")).group(1)
            await type_line(process, "first")
            await out.wait_for("agent> mock: first")
            first.send(signal.SIGTERM)
            assert await first.wait_exit() == 0
        await err.wait_for("connection lost; reconnecting in ")
        await type_line(process, "typed while it restarts")
        async with running_daemon(layout, tag="second") as second:
            await second.wait_state("READY=1")
            await out.wait_for("agent> mock: typed while it restarts")
            assert "reconnected to ws://127.0.0.1:" in err.text
            assert process.stdin is not None
            await process.stdin.aclose()  # Ctrl-D
            assert await process.wait() == 0
            assert out.text == "agent> mock: first\nagent> mock: typed while it restarts\n"
            # The next run is the same chat: the kept id and resume token.
            again, out2, err2 = await run_chat(layout, pumps, started)
            seen += [out2, err2]
            assert (await err2.wait_for(r"as (\S+);")).group(1) == actor
            await type_line(again, "third")
            await out2.wait_for("agent> mock: third")
            assert again.stdin is not None
            await again.stdin.aclose()
            assert await again.wait() == 0
            assert "refused" not in err2.text
            second.send(signal.SIGTERM)
            assert await second.wait_exit() == 0
    return actor


async def test_a_message_lost_to_a_sigkill_is_told_unanswered_once_reconciled(
    tmp_path: Path,
) -> None:
    """SIGKILL while the agent runs leaves the message ``executing``, listed; once the
    operator files it, the open tab is told at once and a later visit sees it in its
    history; nothing stays listed and the message's text is never logged."""
    layout = write_config(tmp_path, delay_ms=60_000)
    actor = "daemon-actor-00002"
    op = operation_id_for("web", f"{actor}:m1")
    with trio.fail_after(90):
        async with running_daemon(layout, tag="first") as first:
            await first.wait_state("READY=1")
            async with connect_to("127.0.0.1", layout.port) as ws:
                await ws.send_message(json.dumps({"type": "hello", "actor": actor}))
                resume = (await frames_until(ws, "ready"))["resume"]
                await ws.send_message(
                    json.dumps({"type": "message", "id": "m1", "text": "a question lost"})
                )
                assert (await frames_until(ws, "admission"))["status"] == "accepted"
                with trio.fail_after(20):
                    for _ in range(200):
                        if [e["state"] for e in await unresolved(layout)] == ["executing"]:
                            break
                        await trio.sleep(0.1)
            first.send(signal.SIGKILL)
            assert await first.wait_exit() == -signal.SIGKILL
        hello = json.dumps({"type": "hello", "actor": actor, "resume": resume})
        async with running_daemon(layout, tag="second") as second:
            await second.wait_state("READY=1")
            [entry] = await unresolved(layout)
            assert (entry["operationId"], entry["state"]) == (op, "executing")
            async with connect_to("127.0.0.1", layout.port) as ws:
                await ws.send_message(hello)
                assert await frames_until(ws, "history") == {"type": "history", "replies": []}
                code, result, err = await prismctl(
                    layout,
                    "reconcile",
                    op,
                    "--connection",
                    "web",
                    "--version",
                    str(entry["version"]),
                    "--acknowledge-duplicate-risk",
                )
                assert code == 0, err
                assert result["outcome"] == "execution_unknown"
                told = await frames_until(ws, "reply")
            assert told == {
                "type": "reply",
                "replyId": f"unanswered-{op}",
                "kind": "notice",
                "text": UNANSWERED_TEXT,
                "controls": [],
                "inReplyTo": "m1",
            }
            assert await unresolved(layout) == []
            # the next visit (the page reloaded) shows it with its history
            async with connect_to("127.0.0.1", layout.port) as ws:
                await ws.send_message(hello)
                history = await frames_until(ws, "history")
            [past] = history["replies"]
            assert (past["replyId"], past["text"], past["inReplyTo"]) == (
                f"unanswered-{op}",
                UNANSWERED_TEXT,
                "m1",
            )
            second.send(signal.SIGTERM)
            assert await second.wait_exit() == 0
            log = first.stderr() + second.stderr()
    assert "a question lost" not in log and resume not in log
