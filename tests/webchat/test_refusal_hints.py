"""A refused web chat message tells the user what to do: the size limit of an ``oversized``
message, ``/help`` after an unknown command — on the socket, in ``prismctl chat`` and on the
page in Chromium. Accepted messages carry no hint at all (the frame is as before)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import trio
import trio_websocket

from ._stack import chat_stack
from ._support import REPO_ROOT, connect, hello, recv, send
from .test_browser import TYPE_AND_SEND, DevTools, launch_chromium, page_url

ACTOR = "hinted-actor-0001"
LIMIT = 32 * 1024  # the default [limits] max_input_bytes
TOO_LONG = f"Message too long: at most {LIMIT} bytes (UTF-8)."
UNKNOWN = "Unknown command. Send /help for the list of commands."
HELP = "Commands: /help, /status, /new, /agent <alias>, /cancel."


async def test_refusals_carry_a_hint_and_acceptances_do_not() -> None:
    with trio.fail_after(15):
        async with chat_stack() as (adapter, runtime), connect(adapter) as ws:
            await hello(ws, ACTOR, history=True)
            # The limit is in bytes: 10 923 three-byte characters are one byte too many.
            for client_id, text in (("big", "x" * (LIMIT + 1)), ("wide", "€" * 10_923)):
                frame = {"type": "message", "id": client_id, "text": text}
                # Unescaped, as a browser sends it (escaped, "€" is 6 bytes of the frame).
                await ws.send_message(json.dumps(frame, ensure_ascii=False))
                assert await recv(ws) == {
                    "type": "admission",
                    "id": client_id,
                    "status": "denied",
                    "reason": "oversized",
                    "duplicate": False,
                    "hint": TOO_LONG,
                }
            await send(ws, {"type": "message", "id": "model", "text": "/model gpt-5"})
            assert await recv(ws) == {
                "type": "admission",
                "id": "model",
                "status": "unsupported",
                "reason": "unknown_command",
                "duplicate": False,
                "hint": UNKNOWN,
            }
            # No notice answers the unknown command (contract §8): the next reply is /help's.
            await send(ws, {"type": "message", "id": "help", "text": "/help"})
            assert await recv(ws) == {
                "type": "admission",
                "id": "help",
                "status": "accepted",
                "reason": None,
                "duplicate": False,
            }
            reply = await recv(ws)
            assert (reply["kind"], reply["text"], reply["inReplyTo"]) == (
                "notice",
                HELP,
                "help",
            )
            await send(ws, {"type": "message", "id": "fits", "text": "x" * LIMIT})
            assert "hint" not in await recv(ws)
            assert (await recv(ws))["text"] == "x" * LIMIT
            diagnostics = runtime.diagnostics()
            assert (diagnostics.denied, diagnostics.unsupported) == (2, 1)


async def test_prismctl_chat_prints_the_hint() -> None:
    big = "y" * (LIMIT + 100)
    with trio.fail_after(30):
        async with chat_stack() as (adapter, _):
            result = await trio.run_process(
                [sys.executable, "-m", "prismd.cli.prismctl", "chat", "--url", page_url(adapter)],
                stdin=f"{big}\n/model gpt-5\nhello\n".encode(),
                capture_stdout=True,
                capture_stderr=True,
                check=False,
                cwd=REPO_ROOT,
            )
    err = result.stderr.decode()
    assert result.returncode == 0, err
    assert result.stdout.decode() == "agent> hello\n"
    lines = err.splitlines()[1:]  # after "connected to …"
    assert lines == [f"(not accepted: {TOO_LONG})", f"(not accepted: {UNKNOWN})"]
    assert "yyyy" not in err


@pytest.mark.slow
async def test_the_page_shows_the_hint(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with (
            launch_chromium(tmp_path) as devtools_url,
            trio_websocket.open_websocket_url(
                devtools_url, max_message_size=16 * 1024 * 1024
            ) as ws,
            chat_stack() as (adapter, _),
        ):
            browser = DevTools(ws)
            await browser.open_page()
            await browser.navigate(page_url(adapter))
            await browser.wait_for("document.getElementById('status').dataset.state === 'online'")
            metas = (
                "Array.from(document.querySelectorAll('#log .me .meta')).map(m => m.textContent)"
            )
            # The refused metas once there are n of them (an empty list is truthy in JS).
            refused = (
                f"(n => {{ const m = {metas}.filter(t => t.startsWith('not accepted'));"
                " return m.length === n && m; })"
            )
            await browser.evaluate(TYPE_AND_SEND % json.dumps("z" * (LIMIT + 1)))
            assert await browser.wait_for(f"{refused}(1)") == [f"not accepted: {TOO_LONG}"]
            await browser.evaluate(TYPE_AND_SEND % json.dumps("/model gpt-5"))
            assert await browser.wait_for(f"{refused}(2)") == [
                f"not accepted: {TOO_LONG}",
                f"not accepted: {UNKNOWN}",
            ]
            assert browser.page_errors() == []
