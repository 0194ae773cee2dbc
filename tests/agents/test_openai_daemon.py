"""The ``openai`` agent through a real ``prismd run`` (SQLite, the web chat, real signals)
against the fake OpenAI-compatible server in this process: answers and history across a
restart, ``/new``, a retry after 429, a provider outage, cancel and SIGTERM during a stream
(the fake sees its connection close), tool approvals across SIGKILL, the round trip in
headless Chromium, and the key never in a log line at debug level."""

from __future__ import annotations

import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import trio
import trio_websocket

from prismd.journal import operation_id_for
from tests.daemon.helpers import (
    ChatClient,
    Layout,
    chat,
    free_port,
    prismctl,
    running_daemon,
)
from tests.fakes.openai_api import Answer, Failure, FakeOpenAI, start_fake_openai
from tests.webchat.test_browser import TYPE_AND_SEND, DevTools, launch_chromium

pytestmark = pytest.mark.slow

KEY = "sk-daemon-SECRET-KEY-9f8e7d6c5b4a"
ACTOR = "openai-actor-0001"


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with trio.open_nursery() as nursery:
        yield await start_fake_openai(nursery, api_key=KEY)
        nursery.cancel_scope.cancel()


def layout_for(root: Path, fake: FakeOpenAI, *, tools: bool = False) -> Layout:
    layout = Layout(root=root, port=free_port())
    tools_line = 'tools = "tests.agents.daemon_tools:tools"' if tools else ""
    layout.config.write_text(
        f"""
[daemon]
state_dir = "{layout.state_dir}"

[store]
url = "sqlite:///{layout.db}"

[limits]
stop_deadline_ms = 3000

[control]
socket = "{layout.control}"

[[connections]]
id = "web"
kind = "webchat"
listen = "127.0.0.1:{layout.port}"

[agents.gpt]
kind = "openai"
base_url = "{fake.base_url}"
model = "gpt-4o-mini"
api_key_env = "OPENAI_API_KEY"
system_prompt = "Be brief."
timeout_ms = 5000
{tools_line}

[[grants]]
connection = "web"
actors = ["*"]
aliases = ["gpt"]
"""
    )
    return layout


def env_for(layout: Layout) -> dict[str, str]:
    return {"OPENAI_API_KEY": KEY, "PRISMD_TEST_TOOL_LOG": str(layout.root / "tools.log")}


def tool_calls(layout: Layout) -> list[dict[str, Any]]:
    path = layout.root / "tools.log"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


async def frame(client: ChatClient, limit_s: float = 30) -> dict[str, Any]:
    with trio.fail_after(limit_s):
        received: dict[str, Any] = json.loads(await client.ws.get_message())
        return received


async def next_reply(client: ChatClient, seen: list[dict[str, Any]]) -> dict[str, Any]:
    """The oldest reply frame not yet taken (``seen`` keeps the ones read early)."""
    while not any(f["type"] == "reply" for f in seen):
        seen.append(await frame(client))
    first = next(f for f in seen if f["type"] == "reply")
    seen.remove(first)
    return first


async def admitted(
    client: ChatClient, payload: dict[str, Any], seen: list[dict[str, Any]]
) -> dict[str, Any]:
    """Send ``payload``; its admission frame (replies read meanwhile stay in ``seen``: a
    command's notice may arrive before its admission)."""
    await client.ws.send_message(json.dumps(payload))
    while True:
        received = await frame(client)
        if received["type"] == "admission" and received.get("id") == payload.get("id"):
            return received
        seen.append(received)


SEEN: list[dict[str, Any]] = []


async def ask(client: ChatClient, client_id: str, text: str) -> dict[str, Any]:
    payload = {"type": "message", "id": client_id, "text": text}
    admission = await admitted(client, payload, SEEN)
    assert admission["status"] == "accepted", admission
    return await next_reply(client, SEEN)


async def approve_when_free(client: ChatClient, value: str) -> None:
    """Press the button until the approval is taken. The notice is sent at the very end of
    its turn; an approval arriving before the turn let go of its route is refused with its
    token still valid (and its record removed, so the retry is no duplicate)."""
    for attempt in range(100):
        admission = await approve(client, value, f"try{attempt}")
        if admission["status"] == "accepted":
            assert admission["duplicate"] is False
            return
        assert admission["reason"] == "rejected", admission
        await trio.sleep(0.05)
    raise AssertionError("the approval was never taken")


async def approve(client: ChatClient, value: str, client_id: str = "a1") -> dict[str, Any]:
    return await admitted(client, {"type": "approve", "value": value, "id": client_id}, SEEN)


@pytest.fixture(autouse=True)
def _fresh_frames() -> None:
    SEEN.clear()


async def test_answers_history_across_a_restart_new_and_no_key_in_debug_logs(
    tmp_path: Path, fake: FakeOpenAI
) -> None:
    layout = layout_for(tmp_path, fake)
    debug = ("--log-level", "debug")
    with trio.fail_after(120):
        async with running_daemon(layout, tag="first", extra_env=env_for(layout), args=debug) as d:
            await d.wait_state("READY=1")
            async with chat(layout.port, ACTOR) as client:
                reply = await ask(client, "m1", "hello there")
                assert reply["text"] == "You said: hello there (I remember 0 earlier message(s).)"
                assert reply["kind"] == "final"
                fake.push(Answer(f"Your key is {KEY}."))
                assert (await ask(client, "m2", "my key?"))["text"] == "Your key is [REDACTED]."
            d.send(signal.SIGTERM)
            assert await d.wait_exit() == 0
        async with running_daemon(
            layout, tag="second", extra_env=env_for(layout), args=debug
        ) as second:
            await second.wait_state("READY=1")
            async with chat(layout.port, ACTOR) as client:
                reply = await ask(client, "m3", "still me")
                assert reply["text"] == "You said: still me (I remember 2 earlier message(s).)"
                # the last turn may still be wrapping up (marking its reply delivered)
                for attempt in range(50):
                    answer = (await ask(client, f"new{attempt}", "/new"))["text"]
                    if answer == "Started a new conversation.":
                        break
                    assert answer.startswith("Finish or cancel"), answer
                    await trio.sleep(0.1)
                else:
                    raise AssertionError("/new stayed busy")
                reply = await ask(client, "m5", "fresh start")
                assert reply["text"] == "You said: fresh start (I remember 0 earlier message(s).)"
            second.send(signal.SIGTERM)
            assert await second.wait_exit() == 0
        log = d.stderr() + second.stderr()
    sent = fake.completions
    assert all(r.headers["authorization"] == f"Bearer {KEY}" for r in sent)
    assert sent[2].body["messages"][0] == {"role": "system", "content": "Be brief."}
    assert "DEBUG" in log and "admission accepted" in log
    assert KEY not in log and KEY[-8:] not in log
    assert "hello there" not in log and "You said" not in log


async def test_a_429_is_retried_an_outage_is_a_notice_and_the_daemon_stays_healthy(
    tmp_path: Path, fake: FakeOpenAI
) -> None:
    layout = layout_for(tmp_path, fake)
    with trio.fail_after(120):
        async with running_daemon(layout, extra_env=env_for(layout)) as d:
            await d.wait_state("READY=1")
            async with chat(layout.port, ACTOR) as client:
                fake.push(Failure(429, retry_after="1"))
                reply = await ask(client, "m1", "hi")
                assert reply["text"] == "You said: hi (I remember 0 earlier message(s).)"
                first, retried = fake.completions
                assert retried.at - first.at >= 1.0
                fake.push(*[Failure(500)] * 4)
                reply = await ask(client, "m2", "are you down?")
                assert reply["text"] == (
                    "Request failed: the model server failed (HTTP 500); try again later"
                )
                assert reply["kind"] == "notice" and len(fake.completions) == 6
                code, health, err = await prismctl(layout, "health")
                assert code == 0, err
                assert health["ready"] is True
                reply = await ask(client, "m3", "back?")
                assert reply["text"] == "You said: back? (I remember 1 earlier message(s).)"
            code, unresolved, err = await prismctl(layout, "list-unresolved")
            assert (code, unresolved) == (0, []), err
            d.send(signal.SIGTERM)
            assert await d.wait_exit() == 0
    assert "the model server failed" not in d.stderr()  # the code, not the notice text
    assert "model call failed: provider_unavailable" in d.stderr()


async def test_cancel_and_sigterm_during_a_stream_close_the_connection(
    tmp_path: Path, fake: FakeOpenAI
) -> None:
    layout = layout_for(tmp_path, fake)
    slow = Answer("many words " * 300, chunk_chars=5, delay_s=0.05)
    with trio.fail_after(120):
        async with running_daemon(layout, extra_env=env_for(layout)) as d:
            await d.wait_state("READY=1")
            async with chat(layout.port, ACTOR) as client:
                fake.push(slow)
                payload = {"type": "message", "id": "m1", "text": "talk a lot"}
                assert (await admitted(client, payload, SEEN))["status"] == "accepted"
                await fake.wait_requests(1)
                await trio.sleep(0.5)  # streaming now
                cancelled_at = trio.current_time()
                first = (await ask(client, "m2", "/cancel"))["text"]
                closed_at = await fake.wait_disconnect(1)
                assert closed_at - cancelled_at < 1.0
                second = (await next_reply(client, SEEN))["text"]
                # the command's notice and the run's end, in either order
                assert {first, second} == {"Cancelling the current request.", "Request cancelled."}
                fake.push(slow)
                payload = {"type": "message", "id": "m3", "text": "again"}
                assert (await admitted(client, payload, SEEN))["status"] == "accepted"
                await fake.wait_requests(2)
                await trio.sleep(0.5)
                stopped_at = trio.current_time()
                d.send(signal.SIGTERM)
                closed_at = await fake.wait_disconnect(2)
                assert closed_at - stopped_at < 1.0
            assert await d.wait_exit() == 0
        async with running_daemon(layout, tag="after", extra_env=env_for(layout)) as after:
            await after.wait_state("READY=1")
            code, unresolved, err = await prismctl(layout, "list-unresolved")
            assert code == 0, err
            after.send(signal.SIGTERM)
            assert await after.wait_exit() == 0
    # The run stopped by SIGTERM was settled ``cancelled`` (nothing ``executing`` is left
    # to reconcile); its "Request cancelled." notice may still be listed as an unsent reply
    # when the daemon stopped before the web chat took it.
    stopped = operation_id_for("web", f"{ACTOR}:m3")
    assert all(e["operationId"] == stopped and e["state"] == "cancelled" for e in unresolved), (
        unresolved
    )


async def test_a_sigkill_while_a_tool_awaits_approval_then_the_approval_runs_it_once(
    tmp_path: Path, fake: FakeOpenAI
) -> None:
    layout = layout_for(tmp_path, fake, tools=True)
    with trio.fail_after(120):
        async with running_daemon(layout, tag="first", extra_env=env_for(layout)) as d:
            await d.wait_state("READY=1")
            async with chat(layout.port, ACTOR) as client:
                fake.push(Answer(tool_calls=(("archive", {"what": "old logs"}),)))
                notice = await ask(client, "m1", "archive the old logs")
                assert notice["text"] == (
                    "Approval required for tool archive: the model wants to call archive with "
                    '{"what": "old logs"}'
                )
                allow = {c["label"]: c["value"] for c in notice["controls"]}["Allow once"]
            d.send(signal.SIGKILL)
            assert await d.wait_exit() == -signal.SIGKILL
        assert tool_calls(layout) == []
        async with running_daemon(layout, tag="second", extra_env=env_for(layout)) as second:
            await second.wait_state("READY=1")
            async with chat(layout.port, ACTOR) as client:
                fake.push(Answer("Archived the old logs."))
                assert (await approve(client, allow))["status"] == "accepted"
                final = await next_reply(client, SEEN)
                assert (final["kind"], final["text"]) == ("final", "Archived the old logs.")
                assert tool_calls(layout) == [
                    {"tool": "archive", "arguments": {"what": "old logs"}}
                ]
                again = await approve(client, allow, "a2")  # the same button again
                assert again["status"] != "accepted" or again.get("duplicate") is True
                await trio.sleep(0.5)
                assert len(tool_calls(layout)) == 1
            second.send(signal.SIGTERM)
            assert await second.wait_exit() == 0


async def test_a_sigkill_mid_tool_is_listed_and_never_dispatched_again(
    tmp_path: Path, fake: FakeOpenAI
) -> None:
    layout = layout_for(tmp_path, fake, tools=True)
    op = operation_id_for("web", f"{ACTOR}:m1")
    with trio.fail_after(120):
        async with running_daemon(layout, tag="first", extra_env=env_for(layout)) as d:
            await d.wait_state("READY=1")
            async with chat(layout.port, ACTOR) as client:
                fake.push(Answer(tool_calls=(("wait_here", {"what": "x"}),)))
                notice = await ask(client, "m1", "do the slow thing")
                allow = {c["label"]: c["value"] for c in notice["controls"]}["Allow once"]
                await approve_when_free(client, allow)
                while not tool_calls(layout):  # noqa: ASYNC110 (another process writes it)
                    await trio.sleep(0.05)
            d.send(signal.SIGKILL)
            assert await d.wait_exit() == -signal.SIGKILL
        (layout.root / "tools.log.go").write_text("")  # a second dispatch would finish now
        async with running_daemon(layout, tag="second", extra_env=env_for(layout)) as second:
            await second.wait_state("READY=1")
            assert "1 unresolved operation(s)" in second.stderr()
            code, unresolved, err = await prismctl(layout, "list-unresolved")
            assert code == 0, err
            assert [(e["operationId"], e["state"]) for e in unresolved] == [(op, "executing")]
            async with chat(layout.port, ACTOR) as client:
                again = await approve(client, allow, "a2")
                assert again["status"] != "accepted" or again.get("duplicate") is True
                reply = await ask(client, "m2", "/cancel")
                assert reply["text"] == (
                    "Request failed: the request was interrupted by a restart; an interrupted "
                    "tool call is never repeated"
                )
                reply = await ask(client, "m3", "hello?")
                assert reply["text"].startswith("You said: hello?")
            await trio.sleep(0.5)
            assert tool_calls(layout) == [{"tool": "wait_here", "arguments": {"what": "x"}}]
            code, unresolved, err = await prismctl(layout, "list-unresolved")
            assert (code, unresolved) == (0, []), err
            second.send(signal.SIGTERM)
            assert await second.wait_exit() == 0


async def test_the_tool_approval_round_trip_in_chromium(tmp_path: Path, fake: FakeOpenAI) -> None:
    layout = layout_for(tmp_path, fake, tools=True)
    with trio.fail_after(120):
        async with (
            running_daemon(layout, extra_env=env_for(layout)) as d,
            launch_chromium(tmp_path) as devtools_url,
            trio_websocket.open_websocket_url(
                devtools_url, max_message_size=16 * 1024 * 1024
            ) as ws,
        ):
            await d.wait_state("READY=1")
            browser = DevTools(ws)
            await browser.open_page()
            await browser.navigate(f"http://127.0.0.1:{layout.port}/")
            await browser.wait_for("document.getElementById('status').dataset.state === 'online'")
            fake.push(
                Answer("I need to archive first.", tool_calls=(("archive", {"what": "inbox"}),)),
                Answer("Done: **inbox** archived."),
            )
            await browser.evaluate(TYPE_AND_SEND % json.dumps("archive my inbox"))
            labels = await browser.wait_for(
                "Array.from(document.querySelectorAll('#log .bot.notice button'))"
                ".map(b => b.textContent).join('|')",
                timeout_ms=15000,
            )
            assert labels == "Allow once|Deny"
            # Click Allow; if the turn had not let go of the route yet, the page says so and
            # offers the buttons again (the token is still valid): click again.
            final = None
            for _attempt in range(50):
                await browser.evaluate(
                    "document.querySelector('#log .bot.notice button').click(), true"
                )
                final = await browser.wait_for(
                    "(document.querySelector('#log .bot.final .text strong')"
                    " && document.querySelector('#log .bot.final .text').textContent)"
                    " || (!document.querySelector('#log .bot.notice button').disabled"
                    " && 'again')",
                    timeout_ms=15000,
                )
                if final != "again":
                    break
            assert final == "Done: inbox archived."
            assert tool_calls(layout) == [{"tool": "archive", "arguments": {"what": "inbox"}}]
            assert browser.page_errors() == []
            d.send(signal.SIGTERM)
            assert await d.wait_exit() == 0
