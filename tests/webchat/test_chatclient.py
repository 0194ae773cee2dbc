"""``prismctl chat`` (prismd.cli._chat) against a real adapter and runtime."""

from __future__ import annotations

import io
import json
import random
import re
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import pytest
import trio
import trio.testing

from adapters.webchat._adapter import WebchatAdapter
from prismd.channel import Admission, InboundEvent, SendResult
from prismd.cli._chat import ChatState, chat, default_state_path

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


@pytest.mark.slow
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


@pytest.mark.slow
async def test_server_going_away_and_back_reconnects_and_gets_the_held_answer() -> None:
    """The adapter goes away (a restart) with an answer still due and a line typed while it
    is down: the client reconnects with backoff, receives the held answer once (the runtime
    re-drives it), sends the line typed meanwhile, and ends cleanly at EOF."""
    out, err = Transcript(), Transcript()
    send_line, lines = trio.open_memory_channel[str](10)
    results_in, results = trio.open_memory_channel[SendResult](10)
    registry: dict[str, WebchatAdapter] = {}
    admitted = trio.Event()
    codes: list[int] = []
    with trio.fail_after(30):
        async with (
            chat_stack("mock", {"delay_ms": 300}, results_in, registry) as (stack, runtime),
            trio.open_nursery() as servers,
        ):

            async def admit(event: InboundEvent) -> Admission:
                admission = await runtime.admit(event)
                admitted.set()
                return admission

            def restartable(listen: str) -> WebchatAdapter:
                adapter = WebchatAdapter(
                    connection_id="web",
                    listen=listen,
                    admit=admit,
                    checkpoints=stack.checkpoints,
                    conversations=runtime,
                )
                registry["web"] = adapter
                return adapter

            async def serve(
                adapter: WebchatAdapter,
                scope: trio.CancelScope,
                task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
            ) -> None:
                with scope:
                    await adapter.run(task_status=task_status)

            async def client(url: str) -> None:
                rng = random.Random(7)
                codes.append(
                    await chat(url, actor=ACTOR, token=None, lines=lines, out=out, err=err, rng=rng)
                )

            serving = trio.CancelScope()
            first = restartable("127.0.0.1:0")
            await servers.start(serve, first, serving)
            assert first.bound is not None
            async with trio.open_nursery() as clients:
                clients.start_soon(client, page(first))
                await err.wait_for("connected to ")
                await send_line.send("slow one\n")
                await admitted.wait()
                serving.cancel()  # the tab's server goes away while the agent still runs
                await err.wait_for("connection lost; reconnecting in ")
                await send_line.send("typed while away\n")
                assert await results.receive() == SendResult.hold("webchat_not_connected")
                again = restartable(f"127.0.0.1:{first.bound[1]}")
                await servers.start(serve, again, trio.CancelScope())
                await out.wait_for("agent> mock: typed while away")
                await send_line.aclose()
            servers.cancel_scope.cancel()
    assert codes == [0]
    assert out.getvalue() == "agent> mock: slow one\nagent> mock: typed while away\n"
    assert "reconnected to ws://127.0.0.1:" in err.getvalue()
    diagnostics = runtime.diagnostics()
    assert diagnostics.completed == 2  # each message ran once (a re-send is a duplicate)
    assert diagnostics.deliveries == 2  # the held answer once, the new one once


@pytest.mark.slow
async def test_a_server_that_never_comes_back_is_given_up_on() -> None:
    err = Transcript()
    _send_line, lines = trio.open_memory_channel[str](10)
    codes: list[int] = []

    async def client(adapter: WebchatAdapter) -> None:
        codes.append(
            await chat(
                page(adapter),
                actor=ACTOR,
                token=None,
                lines=lines,
                out=io.StringIO(),
                err=err,
                reconnect_for_s=1.0,
                rng=random.Random(3),
            )
        )

    with trio.fail_after(15):
        async with trio.open_nursery() as clients, trio.open_nursery() as server:
            adapter, _ = await start(server)
            clients.start_soon(client, adapter)
            await err.wait_for("connected to ")
            server.cancel_scope.cancel()  # the daemon stops for good
    assert codes == [1]
    text = err.getvalue()
    assert text.count("connection lost; reconnecting in ") >= 2  # it did try again
    assert text.endswith("unreachable for 1 s; giving up\n")


async def test_an_actor_owned_by_another_client_is_refused(nursery: trio.Nursery) -> None:
    with trio.fail_after(15):
        adapter, recorder = await start(nursery)
        kept = await chat(
            page(adapter),
            actor=ACTOR,
            token=None,
            lines=feed(["mine"]),
            out=io.StringIO(),
            err=io.StringIO(),
            linger_s=0.2,
        )
        assert kept == 0
        err = io.StringIO()
        # the same id without its resume token (another machine, a copied id)
        code = await chat(
            page(adapter),
            actor=ACTOR,
            token=None,
            lines=feed(["theirs"]),
            out=io.StringIO(),
            err=err,
        )
    assert code == 1
    assert f"refused actor id {ACTOR}: it belongs to another client" in err.getvalue()
    assert [e.text for e in recorder.events] == ["mine"]
    assert adapter.statistics().hellos_refused == 1


async def test_run_chat_cli_reads_stdin_until_eof() -> None:
    with trio.fail_after(30):
        async with chat_stack() as (adapter, _):
            script = (
                "import sys\n"
                "from prismd.cli._chat import run_chat_cli\n"
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


@pytest.mark.slow
async def test_run_chat_cli_gives_up_when_the_server_stays_away_mid_read() -> None:
    """stdin stays open (a person at the terminal); the daemon stops and never returns:
    bounded reconnect attempts, then exit 1 — no hang."""
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
                "from prismd.cli._chat import run_chat_cli\n"
                f"sys.exit(run_chat_cli({page(adapter)!r}, actor=None, token=None,"
                " reconnect_for_s=1.0))\n"
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
                assert b"connection lost; reconnecting in" in rest
                assert b"giving up" in rest
            finally:
                if process.returncode is None:
                    process.kill()
                    await process.wait()
                for pipe in (process.stdin, process.stderr):
                    if pipe is not None:
                        await pipe.aclose()


def test_state_path_follows_xdg_state_home(tmp_path: Path) -> None:
    assert default_state_path({"XDG_STATE_HOME": str(tmp_path)}) == (
        tmp_path / "prismd" / "chat.json"
    )
    # a relative XDG_STATE_HOME is ignored, as the XDG spec says
    home = Path.home() / ".local" / "state" / "prismd" / "chat.json"
    assert default_state_path({"XDG_STATE_HOME": "relative/dir"}) == home
    assert default_state_path({}) == home


def test_state_file_is_private_bounded_and_survives_garbage(tmp_path: Path) -> None:
    path = tmp_path / "state" / "prismd" / "chat.json"
    state = ChatState(path)
    assert state.get("ws://h:1/ws") is None
    state.put("ws://h:1/ws", "actor-000000001", "T" * 43)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert ChatState(path).get("ws://h:1/ws") == ("actor-000000001", "T" * 43)
    for n in range(40):
        state.put(f"ws://h:{n + 2}/ws", f"actor-{n:09d}", None)
    again = ChatState(path)
    assert again.get("ws://h:1/ws") is None  # the least recently used servers are dropped
    assert again.get("ws://h:41/ws") == ("actor-000000039", None)
    assert len(json.loads(path.read_text())["servers"]) == 32
    assert [p.name for p in path.parent.iterdir()] == ["chat.json"]  # no temp files left
    # a corrupt file or a tampered entry is ignored, never trusted
    path.write_text("{not json")
    assert ChatState(path).get("ws://h:41/ws") is None
    path.write_text(json.dumps({"servers": {"ws://x/ws": {"actor": "bad id!", "resume": "x"}}}))
    assert ChatState(path).get("ws://x/ws") is None
    path.write_text(json.dumps({"servers": {"ws://x/ws": {"actor": "good-actor-1", "resume": 5}}}))
    assert ChatState(path).get("ws://x/ws") == ("good-actor-1", None)


async def test_chat_keeps_its_id_and_token_across_runs(tmp_path: Path) -> None:
    path = tmp_path / "chat.json"
    with trio.fail_after(15):
        async with chat_stack() as (adapter, runtime):
            outs = []
            for line in ("first run", "second run"):
                out, err = io.StringIO(), io.StringIO()
                code = await chat(
                    page(adapter),
                    actor=None,
                    token=None,
                    lines=feed([line]),
                    out=out,
                    err=err,
                    state_path=path,
                )
                assert code == 0, err.getvalue()
                outs.append((out.getvalue(), err.getvalue()))
            [(first_out, first_err), (second_out, second_err)] = outs
    actor = re.search(r" as (\S+);", first_err)
    assert actor is not None and f" as {actor.group(1)};" in second_err
    assert (first_out, second_out) == ("agent> first run\n", "agent> second run\n")
    kept = ChatState(path).get(f"ws://127.0.0.1:{adapter.bound[1]}/ws")  # type: ignore[index]
    assert kept is not None and kept[0] == actor.group(1) and kept[1] is not None
    assert kept[1] not in first_err + second_err
    assert adapter.statistics().hellos_refused == 0
    assert runtime.diagnostics().completed == 2


async def test_an_unwritable_state_dir_is_reported_once_and_the_chat_goes_on(
    tmp_path: Path,
) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the state directory should be")
    err = io.StringIO()
    with trio.fail_after(15):
        async with chat_stack() as (adapter, _):
            code = await chat(
                page(adapter),
                actor=None,
                token=None,
                lines=feed(["hi"]),
                out=io.StringIO(),
                err=err,
                state_path=blocker / "prismd" / "chat.json",
            )
    assert code == 0
    assert err.getvalue().count("cannot keep the chat id in ") == 1
