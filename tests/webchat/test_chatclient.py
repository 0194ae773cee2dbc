"""``prismctl chat`` (prismd.chatclient) against a real adapter and runtime."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable

import trio
import trio.testing

from adapters.webchat import WebchatAdapter
from prismd.chatclient import chat

from ._stack import chat_stack
from ._support import REPO_ROOT, Recorder, start

ACTOR = "terminal-actor-01"
SECRET = "chat-client-secret-token"


def page(adapter: WebchatAdapter) -> str:
    assert adapter.bound is not None
    return f"http://{adapter.bound[0]}:{adapter.bound[1]}/"


async def feed(lines: Iterable[str]) -> AsyncIterator[str]:
    for line in lines:
        await trio.lowlevel.checkpoint()
        yield line + "\n"


class Transcript(io.StringIO):
    """Captured output that a test can wait on."""

    def __init__(self) -> None:
        super().__init__()
        self._changed = trio.Event()

    def write(self, text: str) -> int:
        written = super().write(text)
        self._changed.set()
        self._changed = trio.Event()
        return written

    async def wait_for(self, pattern: str) -> re.Match[str]:
        while (match := re.search(pattern, self.getvalue())) is None:
            await self._changed.wait()
        return match


async def test_lines_are_sent_and_replies_printed() -> None:
    out, err = io.StringIO(), io.StringIO()
    with trio.fail_after(15):
        async with chat_stack() as (adapter, runtime):
            code = await chat(
                page(adapter),
                actor=ACTOR,
                token=None,
                lines=feed(["hello there", "   ", "second line"]),
                out=out,
                err=err,
            )
            assert runtime.diagnostics().admitted == 2
    assert code == 0
    assert out.getvalue() == "agent> hello there\nagent> second line\n"
    assert f"connected to ws://127.0.0.1:{adapter.bound[1]}/ws as {ACTOR}" in err.getvalue()  # type: ignore[index]


async def test_approve_by_text_from_the_terminal() -> None:
    out, err = Transcript(), io.StringIO()
    send_line, lines = trio.open_memory_channel[str](10)
    with trio.fail_after(15):
        async with (
            chat_stack("mock", {"suspend_for_tool": "shell"}) as (adapter, _),
            trio.open_nursery() as nursery,
        ):

            async def client() -> None:
                code = await chat(
                    page(adapter), actor=ACTOR, token=None, lines=lines, out=out, err=err
                )
                assert code == 0

            nursery.start_soon(client)
            await send_line.send("run it\n")
            match = await out.wait_for(r"\[Allow once\] type: (/approve [A-Za-z0-9_-]+)")
            assert "[Deny] type: /deny " in out.getvalue()
            await send_line.send(match.group(1) + "\n")
            await out.wait_for("agent> mock: run it")
            await send_line.aclose()
    assert "agent (notice)> Approval required for tool shell" in out.getvalue()


async def test_unreachable_server_exits_1() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()
    err = io.StringIO()
    with trio.fail_after(15):
        code = await chat(
            f"http://127.0.0.1:{port}/",
            actor=None,
            token=None,
            lines=feed([]),
            out=io.StringIO(),
            err=err,
        )
    assert code == 1
    assert err.getvalue().startswith(f"prismctl chat: cannot connect to ws://127.0.0.1:{port}/ws")


async def test_bad_url_and_actor_exit_1() -> None:
    for url, actor, expected in [
        ("ftp://127.0.0.1:1/", None, "must start with http://"),
        ("http://127.0.0.1:1/", "bad actor!", "the actor id must be"),
    ]:
        err = io.StringIO()
        code = await chat(url, actor=actor, token=None, lines=feed([]), out=io.StringIO(), err=err)
        assert code == 1 and expected in err.getvalue()


async def test_token_is_needed_and_never_printed(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        adapter, recorder = await start(nursery, access_token=SECRET)
        err = io.StringIO()
        code = await chat(
            page(adapter), actor=ACTOR, token="wrong", lines=feed(["x"]), out=io.StringIO(), err=err
        )
        assert code == 1
        assert (
            "refused the chat socket: HTTP 401 (wrong or missing access token?)" in err.getvalue()
        )
        assert recorder.events == []
        err = io.StringIO()
        code = await chat(
            page(adapter) + "?token=ignored",
            actor=ACTOR,
            token=SECRET,
            lines=feed(["with token"]),
            out=io.StringIO(),
            err=err,
            linger_s=0.5,  # the recording admit never answers with a reply
        )
        assert code == 0
        assert [e.text for e in recorder.events] == ["with token"]
        assert SECRET not in err.getvalue() and "ignored" not in err.getvalue()


async def test_server_going_away_exits_1() -> None:
    err = io.StringIO()
    _send_line, lines = trio.open_memory_channel[str](10)
    codes: list[int] = []

    async def client(adapter: WebchatAdapter) -> None:
        codes.append(
            await chat(
                page(adapter), actor=ACTOR, token=None, lines=lines, out=io.StringIO(), err=err
            )
        )

    with trio.fail_after(15):
        async with trio.open_nursery() as clients, trio.open_nursery() as server:
            adapter, _ = await start(server)
            clients.start_soon(client, adapter)
            while adapter.statistics().open_sockets == 0:
                await trio.testing.wait_all_tasks_blocked()
            server.cancel_scope.cancel()  # the daemon stops; the socket closes
    assert codes == [1]
    assert "closed the connection" in err.getvalue()


async def test_run_chat_cli_reads_stdin_until_eof() -> None:
    with trio.fail_after(30):
        async with chat_stack() as (adapter, _):
            script = (
                "import sys\n"
                "from prismd.chatclient import run_chat_cli\n"
                f"sys.exit(run_chat_cli({page(adapter)!r}, actor=None, token=None))\n"
            )
            result = await trio.run_process(
                [sys.executable, "-c", script],
                stdin=b"ping from stdin\n",
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                cwd=REPO_ROOT,
            )
    assert result.returncode == 0, result.stderr
    assert result.stdout.decode() == "agent> ping from stdin\n"


async def test_run_chat_cli_exits_1_when_the_server_goes_away_mid_read() -> None:
    """stdin stays open (a person at the terminal); the daemon stops: exit 1, no hang."""
    with trio.fail_after(30):
        async with trio.open_nursery() as outer:
            server = trio.CancelScope()
            adapter = WebchatAdapter(connection_id="web", listen="127.0.0.1:0", admit=Recorder())

            async def serve(task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
                with server:
                    await adapter.run(task_status=task_status)

            await outer.start(serve)
            script = (
                "import sys\n"
                "from prismd.chatclient import run_chat_cli\n"
                f"sys.exit(run_chat_cli({page(adapter)!r}, actor=None, token=None))\n"
            )
            process = await trio.lowlevel.open_process(
                [sys.executable, "-c", script],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                cwd=REPO_ROOT,
            )
            try:
                assert process.stderr is not None
                seen = b""
                while b"connected to" not in seen:
                    chunk = await process.stderr.receive_some(4096)
                    assert chunk, seen
                    seen += chunk
                server.cancel()
                with trio.fail_after(10):
                    code = await process.wait()
                assert code == 1
                rest = b""
                while chunk := await process.stderr.receive_some(4096):
                    rest += chunk
                assert b"closed the connection" in rest
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
                for pipe in (process.stdin, process.stderr):
                    if pipe is not None:
                        await pipe.aclose()
