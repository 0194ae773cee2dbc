"""The chat page shows work, in real headless Chromium: a typing indicator from the admission
of a message until its answer, and a Stop button (``/cancel``) while a turn runs."""

from __future__ import annotations

import json
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio_websocket

from prismd.runtime._unanswered import UNANSWERED_TEXT
from tests.daemon.helpers import prismctl, running_daemon, write_config
from tests.fakes.openai_api import Answer, FakeOpenAI, start_fake_openai

from ._stack import chat_stack
from .test_browser import TRANSCRIPT, TYPE_AND_SEND, DevTools, launch_chromium, page_url

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser

ONLINE = "document.getElementById('status').dataset.state === 'online'"
WORKING = (
    "!!document.querySelector('#log li.typing')"
    " && document.querySelector('#log').lastElementChild.matches('li.typing')"
    " && !document.getElementById('stop').hidden"
)
IDLE = "!document.querySelector('#log li.typing') && document.getElementById('stop').hidden"


async def test_typing_shows_from_the_admission_until_the_reply(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with (
            launch_chromium(tmp_path) as devtools_url,
            trio_websocket.open_websocket_url(
                devtools_url, max_message_size=16 * 1024 * 1024
            ) as ws,
            chat_stack("mock", {"delay_ms": 2500}, typing=True) as (adapter, _runtime),
        ):
            browser = DevTools(ws)
            await browser.open_page()
            await browser.navigate(page_url(adapter))
            await browser.wait_for(ONLINE)
            assert await browser.evaluate(IDLE) is True
            started = trio.current_time()
            await browser.evaluate(TYPE_AND_SEND % json.dumps("think it over"))
            # at once: from the admission, before any typing frame of the runtime
            await browser.wait_for(WORKING, timeout_ms=2000)
            assert trio.current_time() - started < 2.0
            label = await browser.evaluate("document.querySelector('#log li.typing').textContent")
            assert label == "The agent is typing…"
            assert await browser.wait_for(TRANSCRIPT % 2) == [
                ["me", "think it over"],
                ["bot", "mock: think it over"],
            ]
            assert await browser.wait_for(IDLE) is True
            # the server's typing frames reached the page meanwhile, and none came later
            assert adapter.statistics().typing_sent >= 1
            await trio.sleep(0.5)
            assert await browser.evaluate(IDLE) is True
            assert browser.page_errors() == []


async def test_stop_cancels_the_running_turn(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with (
            launch_chromium(tmp_path) as devtools_url,
            trio_websocket.open_websocket_url(
                devtools_url, max_message_size=16 * 1024 * 1024
            ) as ws,
            chat_stack("mock", {"delay_ms": 30_000}, typing=True) as (adapter, runtime),
        ):
            browser = DevTools(ws)
            await browser.open_page()
            await browser.navigate(page_url(adapter))
            await browser.wait_for(ONLINE)
            await browser.evaluate(TYPE_AND_SEND % json.dumps("a very long job"))
            await browser.wait_for(WORKING)
            await browser.evaluate("document.getElementById('stop').click(), true")
            notices = await browser.wait_for(
                "Array.from(document.querySelectorAll('#log .bot.notice .text'))"
                ".map(n => n.textContent).join('|').includes('Cancelling the current request.')"
                " && Array.from(document.querySelectorAll('#log .bot .text'))"
                ".map(n => n.textContent)"
            )
            print(notices)
            assert "Cancelling the current request." in notices
            assert await browser.wait_for(IDLE) is True
            # /cancel went as a message of its own, not shown as the user's
            assert await browser.evaluate(
                "Array.from(document.querySelectorAll('#log li.me .text')).map(n => n.textContent)"
            ) == ["a very long job"]
            await runtime.drain(deadline_ms=5000)
            diagnostics = runtime.diagnostics()
            assert diagnostics.cancelled == 1 and diagnostics.completed == 0
            assert browser.page_errors() == []


HINT = "document.getElementById('hint')"


async def test_whitespace_only_input_is_refused_visibly(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with (
            launch_chromium(tmp_path) as devtools_url,
            trio_websocket.open_websocket_url(
                devtools_url, max_message_size=16 * 1024 * 1024
            ) as ws,
            chat_stack() as (adapter, runtime),
        ):
            browser = DevTools(ws)
            await browser.open_page()
            await browser.navigate(page_url(adapter))
            await browser.wait_for(ONLINE)
            assert await browser.evaluate(f"{HINT}.hidden") is True
            # the Send button, with spaces and a line break in the box
            await browser.evaluate(TYPE_AND_SEND % json.dumps("   \n\t  "))
            assert await browser.evaluate(
                f"[{HINT}.hidden, {HINT}.textContent, document.activeElement.id,"
                " document.getElementById('text').value,"
                " document.getElementById('text').getAttribute('aria-invalid')]"
            ) == [False, "Type a message first: spaces alone are not sent.", "text", "", "true"]
            # typing clears the hint; Enter on spaces (the keyboard path) refuses again
            await browser.evaluate("document.getElementById('text').focus(), true")
            await browser.call("Input.insertText", {"text": "  "})
            assert await browser.evaluate(f"{HINT}.hidden") is True
            await browser.call(
                "Input.dispatchKeyEvent",
                {"type": "keyDown", "key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13},
            )
            assert await browser.evaluate(f"!{HINT}.hidden && document.activeElement.id") == (
                "text"
            )
            # an empty box too (no browser validation bubble: the same hint)
            await browser.evaluate(TYPE_AND_SEND % json.dumps(""))
            assert await browser.evaluate(f"!{HINT}.hidden") is True
            # nothing was shown as sent, nothing reached the server
            assert await browser.evaluate("document.querySelectorAll('#log li').length") == 0
            stats = adapter.statistics()
            assert (stats.admissions, stats.rejected_frames) == (0, 0)
            assert runtime.diagnostics().admitted == 0
            # a real message goes, and the hint is gone
            await browser.evaluate(TYPE_AND_SEND % json.dumps("now with words"))
            assert await browser.wait_for(TRANSCRIPT % 2) == [
                ["me", "now with words"],
                ["bot", "now with words"],
            ]
            assert await browser.evaluate(f"{HINT}.hidden") is True
            assert browser.page_errors() == []


OWN_STATES = (
    "Array.from(document.querySelectorAll('#log li.me')).map(li => ["
    "li.querySelector('.text').textContent, li.querySelector('.meta')?.textContent ?? null])"
)


async def test_the_sent_state_survives_a_reload(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with (
            launch_chromium(tmp_path) as devtools_url,
            trio_websocket.open_websocket_url(
                devtools_url, max_message_size=16 * 1024 * 1024
            ) as ws,
            chat_stack() as (adapter, runtime),
        ):
            browser = DevTools(ws)
            await browser.open_page()
            await browser.navigate(page_url(adapter))
            await browser.wait_for(ONLINE)
            await browser.evaluate(TYPE_AND_SEND % json.dumps("keep me"))
            await browser.wait_for(TRANSCRIPT % 2)
            await browser.evaluate(TYPE_AND_SEND % json.dumps("/bogus"))
            refused = "not accepted: Unknown command. Send /help for the list of commands."
            expected = [["keep me", "sent"], ["/bogus", refused]]
            await browser.wait_for(f"({OWN_STATES})[1]?.[1] === {json.dumps(refused)}")
            assert await browser.evaluate(OWN_STATES) == expected
            await browser.navigate(page_url(adapter))
            await browser.wait_for(ONLINE)
            await browser.wait_for(TRANSCRIPT % 2)
            assert await browser.evaluate(OWN_STATES) == expected
            # shown from the page's own record: nothing was sent again
            assert adapter.statistics().admissions == 2
            assert runtime.diagnostics().admitted == 1
            assert browser.page_errors() == []


async def test_a_message_lost_to_a_crash_is_shown_unanswered_once_reconciled(
    tmp_path: Path,
) -> None:
    """A real ``prismd run`` is SIGKILLed while the agent works on the page's message; after
    the restart the page reconnects by itself, and once the operator files the message the
    page says it could not be answered, also after a reload."""
    (tmp_path / "daemon").mkdir()
    layout = write_config(tmp_path / "daemon", delay_ms=60_000)
    url = f"http://127.0.0.1:{layout.port}/"
    with trio.fail_after(60):
        async with (
            launch_chromium(tmp_path) as devtools_url,
            trio_websocket.open_websocket_url(
                devtools_url, max_message_size=16 * 1024 * 1024
            ) as ws,
        ):
            browser = DevTools(ws)
            await browser.open_page()
            async with running_daemon(layout, tag="first") as first:
                await first.wait_state("READY=1")
                await browser.navigate(url)
                await browser.wait_for(ONLINE)
                await browser.evaluate(TYPE_AND_SEND % json.dumps("a question lost"))
                await browser.wait_for(f"({OWN_STATES})[0]?.[1] === 'sent'")
                await browser.wait_for(WORKING)
                for _ in range(200):
                    code, entries, _err = await prismctl(layout, "list-unresolved")
                    if [e["state"] for e in entries] == ["executing"]:
                        break
                    await trio.sleep(0.1)
                first.send(signal.SIGKILL)
                assert await first.wait_exit() == -signal.SIGKILL
            await browser.wait_for("document.getElementById('status').dataset.state === 'offline'")
            async with running_daemon(layout, tag="second") as second:
                await second.wait_state("READY=1")
                await browser.wait_for(ONLINE, timeout_ms=20_000)
                code, entries, err = await prismctl(layout, "list-unresolved")
                assert code == 0, err
                [entry] = entries
                assert entry["state"] == "executing"
                code, _result, err = await prismctl(
                    layout,
                    "reconcile",
                    entry["operationId"],
                    "--connection",
                    "web",
                    "--version",
                    str(entry["version"]),
                    "--acknowledge-duplicate-risk",
                )
                assert code == 0, err
                shown = [["me", "a question lost"], ["bot", UNANSWERED_TEXT]]
                assert await browser.wait_for(TRANSCRIPT % 2) == shown
                await browser.wait_for(f"({OWN_STATES})[0][1] === 'not answered'")
                assert await browser.evaluate(IDLE) is True
                # a reload shows the same, from the page's record and the server's history
                await browser.navigate(url)
                await browser.wait_for(ONLINE)
                assert await browser.wait_for(TRANSCRIPT % 2) == shown
                assert await browser.evaluate(OWN_STATES) == [["a question lost", "not answered"]]
                second.send(signal.SIGTERM)
                assert await second.wait_exit() == 0
            assert "a question lost" not in first.stderr() + second.stderr()
            # only the reconnection attempts while the daemon was down
            errors = browser.page_errors()
            assert all("ERR_CONNECTION_REFUSED" in e for e in errors), errors


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with trio.open_nursery() as nursery:
        yield await start_fake_openai(nursery, api_key=None)
        nursery.cancel_scope.cancel()


async def test_the_first_preview_replaces_the_typing_indicator(
    tmp_path: Path, fake: FakeOpenAI
) -> None:
    # two pieces, each after 1.5 s: the indicator, then the live text, then the answer
    fake.push(Answer("The first half, then the second.", chunk_chars=16, delay_s=1.5))
    options = {"base_url": fake.base_url, "model": "gpt-4o-mini"}
    live = "document.querySelector('#log li.bot.live')"
    with trio.fail_after(60):
        async with (
            launch_chromium(tmp_path) as devtools_url,
            trio_websocket.open_websocket_url(
                devtools_url, max_message_size=16 * 1024 * 1024
            ) as ws,
            chat_stack("openai", options, previews=True, typing=True) as (adapter, _runtime),
        ):
            browser = DevTools(ws)
            await browser.open_page()
            await browser.navigate(page_url(adapter))
            await browser.wait_for(ONLINE)
            await browser.evaluate(TYPE_AND_SEND % json.dumps("take your time"))
            await browser.wait_for(WORKING, timeout_ms=1000)
            assert await browser.evaluate(f"!{live}") is True
            shown = await browser.wait_for(
                f"{live} && !document.querySelector('#log li.typing')"
                " && !document.getElementById('stop').hidden"
                f" && {live}.querySelector('.text').textContent"
            )
            assert shown == "The first half, "
            await browser.wait_for("document.querySelector('#log .bot.final')")
            assert await browser.evaluate(TRANSCRIPT % 2) == [
                ["me", "take your time"],
                ["bot", "The first half, then the second."],
            ]
            assert await browser.wait_for(IDLE) is True
            assert await browser.evaluate(f"!{live}") is True
            assert browser.page_errors() == []
