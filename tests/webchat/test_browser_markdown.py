"""Markdown answers in the chat page, in real headless Chromium: rendered as elements, and no
markup from the model ever reaches the DOM (the page builds nodes, never ``innerHTML``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio
import trio_websocket

from tests.fakes.openai_api import Answer, FakeOpenAI, start_fake_openai
from tests.support.clocks import ManualClock

from ._stack import chat_stack
from .test_browser import TYPE_AND_SEND, DevTools, launch_chromium, page_url

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser

HOSTILE = (
    "# Result\n"
    "**bold** and *italic* and `<b>code</b>` and ~~old~~\n"
    '<img src=x onerror="window.pwned=1"> <script>window.pwned=2</script>\n'
    "[docs](https://example.com/docs) and [bad](javascript:window.pwned=3)\n"
    "\n"
    "- one\n"
    "- **two**\n"
    "\n"
    "> quoted <iframe src=about:blank></iframe>\n"
    "\n"
    "```python\n"
    "print('<svg onload=alert(1)>')\n"
    "```"
)


@pytest.fixture
async def fake() -> AsyncIterator[FakeOpenAI]:
    async with trio.open_nursery() as nursery:
        yield await start_fake_openai(nursery, api_key=None)
        nursery.cancel_scope.cancel()


async def test_markdown_answers_render_safely_in_chromium(tmp_path: Path, fake: FakeOpenAI) -> None:
    fake.push(Answer(HOSTILE, chunk_chars=7))
    options = {"base_url": fake.base_url, "model": "gpt-4o-mini"}
    with trio.fail_after(60):
        async with (
            launch_chromium(tmp_path) as devtools_url,
            trio_websocket.open_websocket_url(
                devtools_url, max_message_size=16 * 1024 * 1024
            ) as ws,
            chat_stack("openai", options) as (adapter, _runtime),
        ):
            browser = DevTools(ws)
            await browser.open_page()
            await browser.navigate(page_url(adapter))
            await browser.wait_for("document.getElementById('status').dataset.state === 'online'")
            await browser.evaluate(TYPE_AND_SEND % json.dumps("show me **markdown**"))
            await browser.wait_for("document.querySelector('#log .bot.final .text pre')")
            shape = await browser.evaluate(
                """(() => {
                const bot = document.querySelector('#log .bot.final .text');
                const own = document.querySelector('#log .me .text');
                const tags = Array.from(bot.querySelectorAll('*'))
                    .map(e => e.tagName.toLowerCase());
                return {
                    tags: Array.from(new Set(tags)).sort(),
                    heading: bot.querySelector('p.heading strong').textContent,
                    strong: Array.from(bot.querySelectorAll('strong')).map(e => e.textContent),
                    em: bot.querySelector('em').textContent,
                    code: bot.querySelector('p code').textContent,
                    links: Array.from(bot.querySelectorAll('a')).map(a => [a.textContent,
                        a.getAttribute('href'), a.rel, a.target]),
                    items: Array.from(bot.querySelectorAll('ul li')).map(e => e.textContent),
                    quote: bot.querySelector('blockquote').textContent,
                    pre: bot.querySelector('pre code').textContent,
                    lang: bot.querySelector('pre code').dataset.lang,
                    text: bot.textContent,
                    own: own.innerHTML,
                    pwned: window.pwned === undefined ? null : window.pwned,
                    dangerous: document.querySelectorAll(
                        '#log img, #log script, #log iframe, #log svg').length,
                };
            })()"""
            )
    assert shape["tags"] == sorted(
        ["a", "blockquote", "br", "code", "del", "em", "li", "p", "pre", "strong", "ul"]
    )
    assert shape["heading"] == "Result"
    assert shape["strong"] == ["Result", "bold", "two"]
    assert shape["em"] == "italic"
    assert shape["code"] == "<b>code</b>"
    assert shape["links"] == [
        ["docs", "https://example.com/docs", "noopener noreferrer nofollow", "_blank"]
    ]
    assert shape["items"] == ["one", "two"]
    assert shape["quote"] == "quoted <iframe src=about:blank></iframe>"
    assert shape["pre"] == "print('<svg onload=alert(1)>')" and shape["lang"] == "python"
    # the model's markup is shown as text, nothing of it became an element or ran
    assert '<img src=x onerror="window.pwned=1"> <script>window.pwned=2</script>' in shape["text"]
    assert "[bad](javascript:window.pwned=3)" in shape["text"]
    assert shape["pwned"] is None and shape["dangerous"] == 0
    # the user's own message is never interpreted
    assert shape["own"] == "show me **markdown**"
    assert browser.page_errors() == []


async def test_a_streamed_answer_shows_live_then_settles_in_chromium(
    tmp_path: Path, fake: FakeOpenAI
) -> None:
    text = "Thinking **out loud**, " + "word " * 60 + "done."
    fake.push(Answer(text, chunk_chars=6, delay_s=0.03))
    options = {"base_url": fake.base_url, "model": "gpt-4o-mini"}
    with trio.fail_after(60):
        async with (
            launch_chromium(tmp_path) as devtools_url,
            trio_websocket.open_websocket_url(
                devtools_url, max_message_size=16 * 1024 * 1024
            ) as ws,
            chat_stack("openai", options, previews=True) as (adapter, _runtime),
        ):
            browser = DevTools(ws)
            await browser.open_page()
            await browser.navigate(page_url(adapter))
            await browser.wait_for("document.getElementById('status').dataset.state === 'online'")
            await browser.evaluate(TYPE_AND_SEND % json.dumps("think aloud"))
            partial = await browser.wait_for(
                "document.querySelector('#log .bot.live .text')?.textContent"
            )
            # the text so far, rendered (an unclosed "**" still shows literally)
            assert any(form.startswith(partial) for form in (text, text.replace("**", "")))
            assert len(partial) < len(text) - 4
            assert await browser.evaluate(
                "document.querySelector('#log .bot.live .text strong')?.textContent"
            ) in (None, "out loud")
            final = await browser.wait_for(
                "document.querySelector('#log .bot.final .text')?.textContent"
            )
            assert final == text.replace("**", "")
            assert await browser.evaluate("document.querySelectorAll('#log .bot').length") == 1
            assert await browser.evaluate("document.querySelector('#log .bot.live')") is None
            assert browser.page_errors() == []


async def test_a_refused_decision_leaves_its_buttons_usable_in_chromium(tmp_path: Path) -> None:
    clock = ManualClock(1_700_000_000_000)
    with trio.fail_after(60):
        async with (
            launch_chromium(tmp_path) as devtools_url,
            trio_websocket.open_websocket_url(
                devtools_url, max_message_size=16 * 1024 * 1024
            ) as ws,
            chat_stack("mock", {"suspend_for_tool": "shell"}, clock=clock) as (adapter, _rt),
        ):
            browser = DevTools(ws)
            await browser.open_page()
            await browser.navigate(page_url(adapter))
            await browser.wait_for("document.getElementById('status').dataset.state === 'online'")
            await browser.evaluate(TYPE_AND_SEND % json.dumps("rm -rf /tmp/x"))
            await browser.wait_for("document.querySelector('#log .bot.notice button')")
            clock.ms += 10 * 60 * 1000  # the approval expires (5 minutes)
            await browser.evaluate(
                "document.querySelector('#log .bot.notice button').click(), true"
            )
            notice = await browser.wait_for("document.querySelector('#log .system')?.textContent")
            assert notice == "Not accepted: rejected"
            usable = await browser.wait_for(
                "Array.from(document.querySelectorAll('#log .bot.notice button'))"
                ".every(b => !b.disabled && !b.hasAttribute('aria-pressed')) && 'yes'"
            )
            assert usable == "yes"
            assert await browser.evaluate("document.querySelector('#log .bot.final')") is None
            assert browser.page_errors() == []
