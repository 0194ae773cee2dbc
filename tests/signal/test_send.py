"""Sending through the fake signal-cli (contract §12.5; behaviours 168–171 adapted to SPEC
difference 5: results by JSON-RPC error code and per-recipient result type, not wording)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

from adapters.signal._send import UNKNOWN, error_outcome, render, result_outcome
from adapters.toolkit import RpcError, utf16_units
from prismd.channel import (
    AttachmentRef,
    Button,
    DeliveryOutcomeUnknownError,
    OutboundFile,
    Preview,
    Reply,
    SendResult,
)
from tests.fakes.signal_cli import SENDER_UUID, FakeSignalCli, SendOutcome
from tests.support.waiting import raises_flat

from .conftest import CONN, fixture

TOKEN_A = "A" * 43
TOKEN_D = "d" * 32


def reply(text: str = "final answer", conversation: str = SENDER_UUID, **kw: Any) -> Reply:
    return Reply(
        connection_id=kw.pop("connection_id", CONN),
        external_conversation_id=conversation,
        text=text,
        kind="final",
        **kw,
    )


async def test_a_reply_is_one_send_with_exact_params(
    fake: FakeSignalCli, make_adapter: Any
) -> None:
    adapter = make_adapter()  # not running: sending does not need the receiver
    with trio.fail_after(10):
        result = await adapter.send(reply())
    assert result == SendResult(delivered=True, message_id="1768900000000")
    sends = [r["params"] for _c, r in fake.requests_for("send")]
    assert sends == [{"recipient": [SENDER_UUID], "message": "final answer"}]
    with trio.fail_after(10):
        assert (await adapter.send(reply("to a number", "+15557654321"))).delivered
    assert fake.sends[-1] == {"recipient": ["+15557654321"], "message": "to a number"}


async def test_what_signal_does_not_offer_sends_nothing(
    fake: FakeSignalCli, make_adapter: Any
) -> None:
    """No previews, attachments or files: the features say so, a file is refused
    (``files_unsupported``) and nothing reaches signal-cli."""
    adapter = make_adapter()
    features = adapter.features
    assert (features.previews, features.attachments, features.max_file_bytes) == (False, False, 0)
    adapter.send_draft(Preview(CONN, SENDER_UUID, "partial"))
    with trio.fail_after(10):
        assert (
            await adapter.fetch_attachment(AttachmentRef("image", "file-1", connection_id=CONN))
            is None
        )
        sent = await adapter.send_file(reply(), OutboundFile("a.png", "image/png", b"png"))
        await adapter.aclose()
    assert sent == SendResult(False, reason="files_unsupported")
    assert fake.requests_for("send") == [] and fake.typing == []


async def test_171_approval_controls_are_lines_of_text(
    fake: FakeSignalCli, make_adapter: Any
) -> None:
    adapter = make_adapter()
    buttons = (Button("Allow once", f"p:a:{TOKEN_A}"), Button("Deny", f"p:d:{TOKEN_D}"))
    with trio.fail_after(10):
        result = await adapter.send(reply("Approval required.", buttons=buttons))
    assert result.delivered and result.message_id is not None
    assert [s["message"] for s in fake.sends] == [
        "Approval required.\n\n"
        f"Reply /approve {TOKEN_A} to allow once.\n"
        f"Reply /deny {TOKEN_D} to deny."
    ]


@pytest.mark.parametrize(
    ("outcome", "reason"),
    [
        (SendOutcome.results("RATE_LIMIT_FAILURE"), "signal_rate_limited"),
        (SendOutcome.results("RATE_LIMIT_FAILURE", token="challenge-1"), "signal_captcha_required"),
        (
            SendOutcome.fail(-5, "Failed to send message due to rate limiting"),
            "signal_rate_limited",
        ),
        (SendOutcome.fail(-6, "Captcha rejected"), "signal_captcha_required"),
        (SendOutcome.results("UNREGISTERED_FAILURE"), "signal_recipient_unregistered"),
        (SendOutcome.results("INVALID_PRE_KEY_FAILURE"), "signal_invalid_pre_key"),
        (SendOutcome.fail(-1, "The user +1555 is not registered."), "signal_rejected"),
        (SendOutcome.fail(-32602, "invalid params"), "signal_rpc_error"),
        (SendOutcome.fail(-32601, "Method not implemented"), "signal_rpc_error"),
        # wording does not matter: a -1 that *says* rate limit is still a user error
        (SendOutcome.fail(-1, "rate limit relink required CAPTCHA"), "signal_rejected"),
    ],
)
async def test_168_known_failures_map_by_code_and_result_type(
    fake: FakeSignalCli, make_adapter: Any, outcome: SendOutcome, reason: str
) -> None:
    adapter = make_adapter()
    fake.script_send(outcome)
    with trio.fail_after(10):
        result = await adapter.send(reply())
    assert result == SendResult(delivered=False, reason=reason)
    assert adapter.health()["account"] == "unverified"


async def test_169_an_untrusted_identity_is_reported_and_shown(
    fake: FakeSignalCli, make_adapter: Any
) -> None:
    adapter = make_adapter()
    fake.script_send(SendOutcome.results("IDENTITY_FAILURE"))
    with trio.fail_after(10):
        result = await adapter.send(reply())
    assert result == SendResult(delivered=False, reason="signal_identity_changed")
    assert adapter.health()["account"] == "identity_changed"
    # other contacts are not blocked by one contact's new safety number
    with trio.fail_after(10):
        assert (await adapter.send(reply("still works", "+15557654321"))).delivered


@pytest.mark.parametrize(
    "outcome",
    [
        SendOutcome(close_after=True),
        SendOutcome(close_before=True),
        SendOutcome(hang=True),
        SendOutcome.results("NETWORK_FAILURE"),
        SendOutcome.fail(-3, "Failed to send message: timeout (IOException)"),
        SendOutcome.fail(-32603, "internal error"),
    ],
)
async def test_170_an_outcome_that_may_be_out_is_ambiguous(
    autojump_clock: MockClock,
    fake: FakeSignalCli,
    make_adapter: Any,
    outcome: SendOutcome,
    caplog: pytest.LogCaptureFixture,
) -> None:
    adapter = make_adapter(send_timeout_s=30.0)
    fake.script_send(outcome)
    with (
        trio.fail_after(120),
        pytest.raises(DeliveryOutcomeUnknownError, match="Signal delivery outcome unknown"),
    ):
        await adapter.send(reply("secret reply text"))
    for record in caplog.records:
        assert "secret reply text" not in record.getMessage()
        assert SENDER_UUID not in record.getMessage()


async def test_notifications_on_a_send_connection_do_not_stall_it(
    fake: FakeSignalCli, make_adapter: Any
) -> None:
    """A signal-cli not in manual mode sends messages to every connection, the send's too:
    they are discarded there, and the answer still gets through."""
    fake.automatic_on_send = 200
    adapter = make_adapter()
    with trio.fail_after(10):
        assert (await adapter.send(reply())).delivered


async def test_a_failure_after_a_first_chunk_is_ambiguous(
    fake: FakeSignalCli, make_adapter: Any
) -> None:
    adapter = make_adapter()
    fake.script_send(SendOutcome(), SendOutcome.results("RATE_LIMIT_FAILURE"))
    with trio.fail_after(10), pytest.raises(DeliveryOutcomeUnknownError):
        await adapter.send(reply("x" * 2500))
    assert [len(s["message"]) for s in fake.sends] == [2000]


async def test_signal_cli_down_is_a_known_failure(
    fake: FakeSignalCli, make_adapter: Any, caplog: pytest.LogCaptureFixture
) -> None:
    adapter = make_adapter()
    await fake.kill()
    with trio.fail_after(10):
        result = await adapter.send(reply())
    assert result == SendResult(delivered=False, reason="signal_unavailable")
    assert "signal-cli is unreachable (ConnectionRefusedError)" in caplog.text


async def test_long_text_is_chunked_in_order_at_2000_utf16_units(
    fake: FakeSignalCli, make_adapter: Any
) -> None:
    adapter = make_adapter()
    text = "a" * 1999 + "😀" + "b" * 2000 + "😀" * 3
    with trio.fail_after(10):
        result = await adapter.send(reply(text))
    messages = [s["message"] for s in fake.sends]
    assert "".join(messages) == text
    assert [utf16_units(m) for m in messages] == [1999, 2000, 8]  # the pair is never split
    assert messages[0] == "a" * 1999 and messages[1].startswith("😀")
    assert result.message_id == "1768900000002"  # the last chunk's timestamp


async def test_controls_go_on_a_chunk_of_their_own_when_the_last_one_is_full(
    fake: FakeSignalCli, make_adapter: Any
) -> None:
    adapter = make_adapter()
    with trio.fail_after(10):
        await adapter.send(reply("z" * 1990, buttons=(Button("Allow", f"p:a:{TOKEN_A}"),)))
    assert [s["message"] for s in fake.sends] == [
        "z" * 1990,
        f"Reply /approve {TOKEN_A} to allow once.",
    ]


async def test_group_conversations_send_to_the_group(
    fake: FakeSignalCli, make_adapter: Any
) -> None:
    adapter = make_adapter()
    fake.script_send(SendOutcome.results("SUCCESS", "UNREGISTERED_FAILURE"))
    with trio.fail_after(10):
        result = await adapter.send(reply("to all", "group:R1JPVVA="))
    assert result.delivered  # one member got it: sending again would repeat it to them
    assert fake.sends == [{"groupId": "R1JPVVA=", "message": "to all"}]


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"connection_id": "other"}, "invalid_destination"),
        ({"conversation": "not-a-recipient"}, "invalid_destination"),
        ({"conversation": "group:bad id"}, "invalid_destination"),
        ({"conversation": SENDER_UUID.upper()}, "invalid_destination"),
        ({"text": "  "}, "empty_reply"),
        ({"buttons": (Button("x", "p:x:" + TOKEN_A),)}, "invalid_controls"),
        ({"buttons": (Button("a", f"p:a:{TOKEN_A}"),) * 3}, "invalid_controls"),
        ({"buttons": (Button("a", "p:a:short"),)}, "invalid_controls"),
    ],
)
async def test_replies_that_cannot_be_sent_send_nothing(
    fake: FakeSignalCli, make_adapter: Any, changes: dict[str, Any], reason: str
) -> None:
    adapter = make_adapter()
    with trio.fail_after(10):
        result = await adapter.send(reply(**changes))
    assert result == SendResult(delivered=False, reason=reason)
    assert fake.connections_opened == 0


def test_sg03_results_map_to_outcomes() -> None:
    samples = fixture("sg03_rpc_request_response_examples.json")
    assert result_outcome(samples["send_full_result_shape_DERIVED"]["result"]) == "delivered"
    assert (
        result_outcome(samples["send_recipient"]["response_manpage_abbreviated"]["result"])
        == "delivered"
    )
    error = samples["send_all_failed_ratelimit_DERIVED"]["error"]
    assert (
        error_outcome(RpcError(error["code"], error["message"], error["data"]))
        == "signal_rate_limited"
    )
    network = {"response": {"timestamp": 1, "results": [{"type": "NETWORK_FAILURE"}]}}
    assert error_outcome(RpcError(-1, "Failed to send message", network)) == UNKNOWN
    assert result_outcome({"timestamp": 1, "results": [{"type": "SOMETHING_NEW"}]}) == UNKNOWN
    assert result_outcome("nonsense") == UNKNOWN
    assert result_outcome({"timestamp": 1, "results": []}) == "delivered"


@given(
    st.text(alphabet=st.characters(codec="utf-8"), min_size=0, max_size=6000),
    st.lists(st.sampled_from([f"p:a:{TOKEN_A}", f"p:d:{TOKEN_D}"]), max_size=2),
)
@settings(max_examples=80, deadline=None)
def test_render_keeps_the_text_whole_within_the_unit_budget(text: str, values: list[str]) -> None:
    chunks = render(text, [Button("c", v) for v in values])
    assert chunks is not None
    for chunk in chunks:
        assert 0 < utf16_units(chunk) <= 2000
    lines = [
        f"Reply /approve {v[4:]} to allow once." if v[2] == "a" else f"Reply /deny {v[4:]} to deny."
        for v in values
    ]
    body = "".join(chunks)
    if lines:
        block = "\n".join(lines)
        assert body.endswith(block)
        body = body.removesuffix(block).removesuffix("\n\n")
    assert body == (text if text.strip() else "")


async def test_logs_name_neither_recipient_nor_text(
    fake: FakeSignalCli, make_adapter: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    adapter = make_adapter()
    fake.script_send(SendOutcome.results("UNREGISTERED_FAILURE"))
    with trio.fail_after(10):
        await adapter.send(reply("the private words"))
    assert "send refused (code -1, chunk 1 of 1): signal_recipient_unregistered" in caplog.text
    assert "the private words" not in caplog.text and SENDER_UUID not in caplog.text


async def test_a_send_raises_nothing_wrapped(fake: FakeSignalCli, make_adapter: Any) -> None:
    """The client's nursery must not turn the ambiguous error into an exception group (the
    runtime checks for a raising ``deliver``, whatever it raises, but operators read it)."""
    adapter = make_adapter()
    fake.script_send(SendOutcome(close_after=True))
    with trio.fail_after(10), raises_flat(DeliveryOutcomeUnknownError):
        await adapter.send(reply())
    fake.script_send(SendOutcome(close_after=True))
    with trio.fail_after(10), pytest.raises(DeliveryOutcomeUnknownError):
        await adapter.send(reply())
