"""A file that goes with a reply, in the chat page in real headless Chromium: a download link
under the reply, named by its (hostile) file name as text, whose bytes are the file's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio
import trio_websocket

from prismd.channel import OutboundFile, Reply

from ._stack import chat_stack
from .test_browser import TYPE_AND_SEND, DevTools, launch_chromium, page_url

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser

NAME = '<img src=x onerror="window.pwned=1">.png'
DATA = bytes(range(256)) * 12


async def test_a_file_is_a_download_link_with_its_bytes(tmp_path: Path) -> None:
    with trio.fail_after(60):
        async with (
            launch_chromium(tmp_path) as devtools_url,
            trio_websocket.open_websocket_url(
                devtools_url, max_message_size=16 * 1024 * 1024
            ) as ws,
            chat_stack("echo") as (adapter, _runtime),
        ):
            browser = DevTools(ws)
            await browser.open_page()
            await browser.navigate(page_url(adapter))
            await browser.wait_for("document.getElementById('status').dataset.state === 'online'")
            await browser.evaluate(TYPE_AND_SEND % json.dumps("a chart please"))
            await browser.wait_for("document.querySelector('#log .bot.final')")
            (actor,) = adapter._sessions.by_actor
            reply = Reply("web", actor, "the chart", "final", operation_id="op-file")
            sent = await adapter.send_file(reply, OutboundFile(NAME, "image/png", DATA))
            assert sent.delivered
            await browser.wait_for("document.querySelector('#log .bot.file a')")
            downloads = tmp_path / "downloads"
            downloads.mkdir()
            await browser.call(
                "Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)}
            )
            shown = await browser.evaluate(
                """(() => {
                const link = document.querySelector('#log .bot.file a');
                const shown = {
                    text: link.textContent,
                    download: link.getAttribute('download'),
                    blob: link.href.startsWith('blob:'),
                    pwned: window.pwned === undefined ? null : window.pwned,
                    images: document.querySelectorAll('#log img').length,
                };
                link.click();  // the user saves it
                return shown;
            })()"""
            )
            # Chromium replaces the characters a file system refuses; the bytes are the file's.
            with trio.move_on_after(15):
                while not [p for p in downloads.iterdir() if p.suffix == ".png"]:  # noqa: ASYNC110
                    await trio.sleep(0.05)
            errors = browser.page_errors()
    (saved,) = [p for p in downloads.iterdir() if p.suffix == ".png"]
    assert saved.read_bytes() == DATA
    assert shown["text"] == f"{NAME} (3 KB)"
    assert shown["download"] == NAME and shown["blob"]
    assert shown["pwned"] is None and shown["images"] == 0
    assert errors == []
