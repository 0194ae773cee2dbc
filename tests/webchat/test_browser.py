"""The chat page in real headless Chromium (Debian's ``chromium``), driven over DevTools.

Never skipped: without Chromium the test fails and says how to get it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio_websocket

from adapters.webchat._adapter import WebchatAdapter
from prismd.channel import SendResult

from ._stack import OPERATOR, chat_stack, sqlite_url

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser

TOKEN = "browser-access-token-0123456789"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-port=0",
]


def chromium_path() -> str:
    path = os.environ.get("PRISMD_TEST_CHROMIUM") or shutil.which("chromium")
    if not path or not os.access(path, os.X_OK):
        pytest.fail(
            "the browser test needs Chromium: install Debian's `chromium` package "
            "(`make test` does) or point PRISMD_TEST_CHROMIUM at a chromium binary"
        )
    return path


@asynccontextmanager
async def launch_chromium(tmp_path: Path) -> AsyncIterator[str]:
    """Start headless Chromium with a fresh profile; yield its browser DevTools URL.

    Chromium and its helpers run in their own process group, which is terminated (then
    killed) in every case.
    """
    profile = tmp_path / "profile"
    profile.mkdir()
    log_path = tmp_path / "chromium.log"
    with log_path.open("wb") as log_file:
        process = await trio.lowlevel.open_process(
            [chromium_path(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank"],
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=log_file,
            start_new_session=True,
        )
    try:
        port_file = profile / "DevToolsActivePort"
        lines: list[str] = []
        for _ in range(300):
            if port_file.exists():
                lines = port_file.read_text().split()
                if len(lines) == 2:
                    break
            if process.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                pytest.fail(f"chromium exited with {process.returncode}:\n{tail}")
            await trio.sleep(0.05)
        else:
            pytest.fail("chromium did not write DevToolsActivePort within 15 s")
        yield f"ws://127.0.0.1:{lines[0]}{lines[1]}"
    finally:
        with trio.CancelScope(shield=True):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(process.pid, sig)
                except ProcessLookupError:
                    break
                with trio.move_on_after(5):
                    await process.wait()
                    break
            await process.wait()


class DevTools:
    """A minimal DevTools protocol client: one call at a time, events ignored."""

    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self._ws = ws
        self._next_id = 0
        self.session: str | None = None
        self.events: list[dict[str, Any]] = []

    async def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if self.session is not None and not method.startswith("Target."):
            message["sessionId"] = self.session
        await self._ws.send_message(json.dumps(message))
        while True:
            answer = json.loads(await self._ws.get_message())
            if "method" in answer:
                self.events.append(answer)
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise AssertionError(f"DevTools {method} failed: {answer['error']}")
                result: dict[str, Any] = answer["result"]
                return result

    async def open_page(self) -> None:
        target = await self.call("Target.createTarget", {"url": "about:blank"})
        attached = await self.call(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
        )
        self.session = attached["sessionId"]
        await self.call("Log.enable")  # CSP violations and failed loads arrive as entries
        await self.call("Runtime.enable")

    def page_errors(self) -> list[str]:
        """Console errors, failed loads and uncaught exceptions seen so far."""
        errors = []
        for event in self.events:
            if event["method"] == "Log.entryAdded" and event["params"]["entry"]["level"] == "error":
                errors.append(event["params"]["entry"]["text"])
            elif event["method"] == "Runtime.exceptionThrown":
                errors.append(str(event["params"]["exceptionDetails"].get("text")))
            elif (
                event["method"] == "Runtime.consoleAPICalled" and event["params"]["type"] == "error"
            ):
                errors.append(str(event["params"]["args"]))
        return errors

    async def evaluate(self, expression: str) -> Any:
        result = await self.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in result:
            raise AssertionError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout_ms: int = 8000) -> Any:
        """Poll ``expression`` inside the page until it is truthy; return its value."""
        waiter = f"""new Promise((resolve, reject) => {{
            const started = Date.now();
            (function check() {{
                let value = null;
                try {{ value = ({expression}); }} catch (e) {{ value = null; }}
                if (value) {{ resolve(value); }}
                else if (Date.now() - started > {timeout_ms}) {{
                    reject(new Error("timed out waiting for: " + {json.dumps(expression)}));
                }} else {{ setTimeout(check, 25); }}
            }})();
        }})"""
        return await self.evaluate(waiter)

    async def leave(self) -> None:
        """Navigate to ``about:blank`` (the chat page unloads: its socket closes)."""
        await self.evaluate("window.prismdOldDocument = true")
        await self.call("Page.navigate", {"url": "about:blank"})
        for _ in range(100):
            try:
                if await self.evaluate(
                    "!window.prismdOldDocument && location.href === 'about:blank'"
                ):
                    return
            except AssertionError:
                pass  # the old execution context went away mid-call
            await trio.sleep(0.05)
        raise AssertionError("the chat page did not unload")

    async def navigate(self, url: str) -> None:
        # mark the current document so the check below cannot mistake it for the new one
        await self.evaluate("window.prismdOldDocument = true")
        await self.call("Page.navigate", {"url": url})
        for _ in range(100):
            try:
                if await self.evaluate(
                    "!window.prismdOldDocument && !!document.getElementById('status')"
                ):
                    return
            except AssertionError:
                pass  # the old execution context went away mid-call
            await trio.sleep(0.05)
        raise AssertionError("the chat page did not load")


def page_url(adapter: WebchatAdapter) -> str:
    assert adapter.bound is not None
    host, port = adapter.bound
    return f"http://{host}:{port}/"


TRANSCRIPT = """(() => {
    const rows = Array.from(document.querySelectorAll('#log li.me, #log li.bot'));
    return rows.length >= %d && rows.map(li => [
        li.classList.contains('me') ? 'me' : 'bot', li.querySelector('.text').textContent]);
})()"""
"""The conversation as shown, top to bottom: ``[["me"|"bot", text], …]``, once it has at
least the given number of messages (falsy before)."""

TYPE_AND_SEND = """(() => {
    const input = document.getElementById('text');
    input.value = %s;
    document.getElementById('send').click();
    return true;
})()"""


async def test_chat_page_in_headless_chromium(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with (
            launch_chromium(tmp_path) as devtools_url,
            trio_websocket.open_websocket_url(
                devtools_url, max_message_size=16 * 1024 * 1024
            ) as ws,
        ):
            browser = DevTools(ws)
            await browser.open_page()

            # 1. echo agent: type, send, see the reply bubble
            async with chat_stack() as (adapter, runtime):
                await browser.navigate(page_url(adapter))
                await browser.wait_for(
                    "document.getElementById('status').dataset.state === 'online'"
                )
                await browser.evaluate(TYPE_AND_SEND % json.dumps("hello from chromium"))
                reply = await browser.wait_for(
                    "document.querySelector('#log .bot .text')?.textContent"
                )
                assert reply == "hello from chromium"
                own = await browser.wait_for(
                    "document.querySelector('#log .me .meta')?.textContent === 'sent'"
                    " && document.querySelector('#log .me .text').textContent"
                )
                assert own == "hello from chromium"
                actor = await browser.evaluate("localStorage.getItem('prismd.webchat.actor')")
                assert isinstance(actor, str) and len(actor) >= 8
                assert runtime.diagnostics().admitted == 1
                # the inline style ran too (allowed by its CSP hash)
                assert await browser.evaluate("getComputedStyle(document.body).display") == "flex"
                # a reload keeps the actor id (localStorage) and reconnects
                await browser.navigate(page_url(adapter))
                await browser.wait_for(
                    "document.getElementById('status').dataset.state === 'online'"
                )
                again = await browser.evaluate("localStorage.getItem('prismd.webchat.actor')")
                assert again == actor
                # the first exchange is back: the own message from localStorage, the answer
                # from the journal (history frame)
                assert await browser.wait_for(TRANSCRIPT % 2) == [
                    ["me", "hello from chromium"],
                    ["bot", "hello from chromium"],
                ]
                await browser.evaluate(TYPE_AND_SEND % json.dumps("second visit"))
                reply = await browser.wait_for(
                    "document.querySelectorAll('#log .bot').length === 2"
                    " && document.querySelectorAll('#log .bot .text')[1].textContent"
                )
                assert reply == "second visit"
                assert adapter.statistics().actors == 1

            assert browser.page_errors() == []

            # 2. an agent that asks before using a tool: the notice's buttons work
            async with chat_stack("mock", {"suspend_for_tool": "shell"}) as (adapter, _):
                await browser.navigate(page_url(adapter))
                await browser.wait_for(
                    "document.getElementById('status').dataset.state === 'online'"
                )
                await browser.evaluate(TYPE_AND_SEND % json.dumps("delete the logs"))
                labels = await browser.wait_for(
                    "Array.from(document.querySelectorAll('#log .bot.notice button'))"
                    ".map(b => b.textContent).join('|')"
                )
                assert labels == "Allow once|Deny"
                await browser.evaluate(
                    "document.querySelector('#log .bot.notice button').click(), true"
                )
                final = await browser.wait_for(
                    "document.querySelector('#log .bot.final .text')?.textContent"
                )
                assert final == "mock: delete the logs"
                disabled = await browser.evaluate(
                    "Array.from(document.querySelectorAll('#log .bot.notice button'))"
                    ".every(b => b.disabled)"
                )
                assert disabled is True
            assert browser.page_errors() == []
            assert browser.page_errors() == []

            # 3. a token-guarded chat; the page goes offline, keeps what was typed meanwhile
            #    and sends it once the daemon is back on the same port
            registry: dict[str, WebchatAdapter] = {}
            async with (
                chat_stack(registry=registry) as (stack, runtime),
                trio.open_nursery() as run,
            ):
                first = WebchatAdapter(
                    connection_id="web",
                    listen="127.0.0.1:0",
                    admit=runtime.admit,
                    access_token=TOKEN,
                    checkpoints=stack.checkpoints,
                    conversations=runtime,
                )
                registry["web"] = first
                serving = trio.CancelScope()

                async def serve(
                    adapter: WebchatAdapter,
                    scope: trio.CancelScope,
                    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
                ) -> None:
                    with scope:
                        await adapter.run(task_status=task_status)

                await run.start(serve, first, serving)
                url = page_url(first) + "?token=" + TOKEN
                await browser.navigate(url)
                await browser.wait_for(
                    "document.getElementById('status').dataset.state === 'online'"
                )
                serving.cancel()  # the daemon restarts
                await browser.wait_for(
                    "document.getElementById('status').dataset.state === 'offline'"
                )
                await browser.evaluate(TYPE_AND_SEND % json.dumps("typed while offline"))
                pending = await browser.evaluate(
                    "document.querySelector('#log .me .meta').textContent"
                )
                assert pending == "waiting for connection…"
                assert first.bound is not None
                second = WebchatAdapter(
                    connection_id="web",
                    listen=f"127.0.0.1:{first.bound[1]}",
                    admit=runtime.admit,
                    access_token=TOKEN,
                    checkpoints=stack.checkpoints,
                    conversations=runtime,
                )
                registry["web"] = second
                await run.start(serve, second, trio.CancelScope())
                reply = await browser.wait_for(
                    "document.querySelector('#log .bot .text')?.textContent", timeout_ms=15000
                )
                assert reply == "typed while offline"
                assert runtime.diagnostics().admitted == 1
                run.cancel_scope.cancel()

            # the error collection above really sees page errors
            await browser.evaluate("console.error('probe-error'), true")
            await browser.evaluate("1")
            assert any("probe-error" in e for e in browser.page_errors())


async def test_a_reload_shows_the_answer_that_arrived_while_the_page_was_closed(
    tmp_path: Path,
) -> None:
    results_in, results = trio.open_memory_channel[SendResult](10)
    with trio.fail_after(60):
        async with (
            launch_chromium(tmp_path) as devtools_url,
            trio_websocket.open_websocket_url(
                devtools_url, max_message_size=16 * 1024 * 1024
            ) as ws,
            chat_stack("mock", {"delay_ms": 1500}, results_in, store_url=sqlite_url(tmp_path)) as (
                adapter,
                runtime,
            ),
        ):
            browser = DevTools(ws)
            await browser.open_page()
            await browser.navigate(page_url(adapter))
            await browser.wait_for("document.getElementById('status').dataset.state === 'online'")
            await browser.evaluate(TYPE_AND_SEND % json.dumps("are you there?"))
            await browser.wait_for(
                "document.querySelector('#log .me .meta')?.textContent === 'sent'"
            )
            actor = await browser.evaluate("localStorage.getItem('prismd.webchat.actor')")
            resume = await browser.evaluate("localStorage.getItem('prismd.webchat.resume')")
            assert isinstance(resume, str) and len(resume) == 43

            # The tab is closed before the agent answers: the answer is journaled and held.
            await browser.leave()
            assert await results.receive() == SendResult.hold("webchat_not_connected")

            # Opened again: the page shows the answer (re-driven by the runtime) after the
            # question (kept by the page), and the journal records it delivered.
            await browser.navigate(page_url(adapter))
            assert await browser.wait_for(TRANSCRIPT % 2) == [
                ["me", "are you there?"],
                ["bot", "mock: are you there?"],
            ]
            assert (await results.receive()).delivered
            assert await browser.evaluate("localStorage.getItem('prismd.webchat.actor')") == actor
            for _ in range(200):  # the mark follows the delivery
                if not await runtime.list_unresolved(identity=OPERATOR):
                    break
                await trio.sleep(0.025)
            assert await runtime.list_unresolved(identity=OPERATOR) == []

            # A reload now shows it from the journal's history, once; nothing is sent again.
            await browser.navigate(page_url(adapter))
            await browser.wait_for("document.getElementById('status').dataset.state === 'online'")
            assert await browser.wait_for(TRANSCRIPT % 2) == [
                ["me", "are you there?"],
                ["bot", "mock: are you there?"],
            ]
            await trio.sleep(0.3)  # a duplicate would arrive right after the history frame
            assert await browser.evaluate(TRANSCRIPT % 0) == [
                ["me", "are you there?"],
                ["bot", "mock: are you there?"],
            ]
            with pytest.raises(trio.WouldBlock):
                results.receive_nowait()
            assert runtime.diagnostics().deliveries == 1

            # A page holding the id but not its token (a copied profile) gets none of it:
            # the server refuses, the page starts a new chat under a new id.
            await browser.evaluate(f"localStorage.setItem('prismd.webchat.resume', '{'A' * 43}')")
            await browser.navigate(page_url(adapter))
            await browser.wait_for("document.getElementById('status').dataset.state === 'online'")
            renewed = await browser.evaluate("localStorage.getItem('prismd.webchat.actor')")
            assert isinstance(renewed, str) and renewed != actor
            assert (
                await browser.evaluate("document.querySelectorAll('#log .me, #log .bot').length")
                == 0
            )
            notice = await browser.evaluate("document.querySelector('#log .system').textContent")
            assert notice == "This chat belongs to another browser; a new chat was started."
            assert adapter.statistics().hellos_refused == 1
            assert browser.page_errors() == []
