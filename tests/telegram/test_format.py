"""Markdown answers as Telegram HTML: conversion and escaping, the fake Bot API's HTML parser,
and the plain-text fallback when Telegram cannot parse the entities (never a lost reply)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.telegram._send import to_telegram_html, visible_text, well_formed
from prismd.channel import Button, Reply, ReplyKind
from tests.fakes.telegram_api import ApiError, FakeBotApi, parse_html

from .conftest import CONN


def reply(text: str, kind: ReplyKind = "final", **kwargs: Any) -> Reply:
    return Reply(connection_id=CONN, external_conversation_id="101", text=text, kind=kind, **kwargs)


@pytest.mark.parametrize(
    ("markdown", "expected"),
    [
        ("**bold** and *italic* and _also_", "<b>bold</b> and <i>italic</i> and <i>also</i>"),
        ("a < b && c > d", "a &lt; b &amp;&amp; c &gt; d"),
        ("<script>alert(1)</script> **x**", "&lt;script&gt;alert(1)&lt;/script&gt; <b>x</b>"),
        ("use `x < y` here", "use <code>x &lt; y</code> here"),
        ("`**not bold**`", "<code>**not bold**</code>"),
        ("snake_case_name stays", "snake_case_name stays"),
        ("2 * 3 * 4", "2 * 3 * 4"),
        ("~~gone~~ ||secret||", "<s>gone</s> <tg-spoiler>secret</tg-spoiler>"),
        ("[docs](https://example.com/a?b=1&c=\"2\")",
         '<a href="https://example.com/a?b=1&amp;c=&quot;2&quot;">docs</a>'),
        ("[click](javascript:alert(1))", "[click](javascript:alert(1))"),
        ("# Title\n- one\n* two", "<b>Title</b>\n• one\n• two"),
        ("> quoted\n> more\nafter", "<blockquote>quoted\nmore</blockquote>\nafter"),
        ("```python\nif a < b:\n    print('**')\n```\ndone",
         "<pre><code class=\"language-python\">if a &lt; b:\n    print('**')</code></pre>\ndone"),
        ("```\nunclosed <fence>", "<pre>unclosed &lt;fence&gt;</pre>"),
        ("**a *b** c*", "**a *b** c*"),  # overlapping markers: left literal, never broken
    ],
)  # fmt: skip
def test_markdown_to_telegram_html(markdown: str, expected: str) -> None:
    converted = to_telegram_html(markdown)
    assert converted == expected
    parse_html(converted)  # the Bot API accepts it


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab <>&*_~|`[]()#->\n:/.\"'h"), max_size=80))
def test_any_text_converts_to_html_the_bot_api_accepts(text: str) -> None:
    converted = to_telegram_html(text)
    assert well_formed(converted)
    shown = parse_html(converted)
    assert shown == visible_text(converted)
    # formatting only removes markers: the text never grows (chunk limits hold)
    assert len(shown) <= len(text)


def test_the_fake_parses_like_the_bot_api() -> None:
    assert parse_html("<b>x</b> &lt;&#33;&#x41;&quot;") == 'x <!A"'
    for bad, reason in [
        ("<foo>x</foo>", 'Unsupported start tag "foo"'),
        ("<b>x", 'Can\'t find end tag corresponding to start tag "b"'),
        ("<b><i>x</b></i>", "Unmatched end tag"),
        ("a & b", "Character '&' is reserved"),
        ("a < b", 'Unsupported start tag ""'),
        ("&nbsp;", 'Unsupported HTML entity "&nbsp;"'),
    ]:
        with pytest.raises(ApiError) as info:
            parse_html(bad)
        assert info.value.status == 400
        assert info.value.description.startswith("Bad Request: can't parse entities: " + reason)


async def test_final_answers_go_out_as_html_and_notices_stay_plain(
    fake: FakeBotApi, make_adapter: Any
) -> None:
    fake.chats.add("101")
    adapter = make_adapter()
    result = await adapter.send(reply("**Done** — see `a<b>`"))
    assert result.delivered
    sent = fake.calls_to("sendMessage")[-1].params
    assert sent["parse_mode"] == "HTML"
    assert sent["text"] == "<b>Done</b> — see <code>a&lt;b&gt;</code>"
    # plain text without markup keeps going out as it always did
    await adapter.send(reply("just words"))
    assert "parse_mode" not in fake.calls_to("sendMessage")[-1].params
    # a notice (runtime text, tool arguments) is never interpreted
    await adapter.send(reply("Approval required for **x**", kind="notice"))
    assert fake.calls_to("sendMessage")[-1].params == {
        "chat_id": "101", "text": "Approval required for **x**",
    }  # fmt: skip
    await adapter.aclose()


async def test_refused_entities_fall_back_to_plain_text(
    fake: FakeBotApi, make_adapter: Any
) -> None:
    fake.chats.add("101")
    fake.fail_next(
        "sendMessage",
        status=400,
        description="Bad Request: can't parse entities: Can't find end tag corresponding to "
        'start tag "b"',
    )
    adapter = make_adapter()
    buttons = (Button("Allow once", "p:a:" + "A" * 43), Button("Deny", "p:d:" + "B" * 43))
    result = await adapter.send(reply("**bold** answer", buttons=buttons))
    assert result.delivered
    first, second = fake.calls_to("sendMessage")
    assert first.params["parse_mode"] == "HTML"
    assert "parse_mode" not in second.params and second.params["text"] == "**bold** answer"
    assert second.params["reply_markup"] == first.params["reply_markup"]
    assert [m["text"] for m in fake.sent] == ["**bold** answer"]
    # any other 400 is not retried as plain text
    fake.fail_next("sendMessage", status=400, description="Bad Request: chat not found")
    failed = await adapter.send(reply("**x**"))
    assert not failed.delivered and failed.reason == "telegram_api_error"
    await adapter.aclose()


async def test_long_markdown_answers_are_chunked_and_each_chunk_parses(
    fake: FakeBotApi, make_adapter: Any
) -> None:
    fake.chats.add("101")
    adapter = make_adapter()
    text = "\n".join(f"- item **{n}** with <angle> & `code {n}`" for n in range(400))
    result = await adapter.send(reply(text))
    assert result.delivered
    calls = fake.calls_to("sendMessage")
    assert len(calls) >= 3 and all(c.params.get("parse_mode") == "HTML" for c in calls)
    assert len(fake.sent) == len(calls)  # every chunk was accepted by the parser
    shown = "\n".join(parse_html(c.params["text"]) for c in calls)
    assert "• item 399 with <angle> & code 399" in shown
    await adapter.aclose()
