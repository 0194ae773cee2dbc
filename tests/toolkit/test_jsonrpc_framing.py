"""prismd.jsonrpc: the newline-delimited JSON-RPC 2.0 framing shared by the control socket,
prismctl and the signal-cli client (standard library only)."""

from __future__ import annotations

import json
import subprocess
import sys

import hypothesis
import pytest
from hypothesis import strategies as st

from prismd.jsonrpc import (
    INVALID_PARAMS,
    INVALID_REQUEST,
    PARSE_ERROR,
    FrameBuffer,
    FrameError,
    FrameTooLargeError,
    Incoming,
    Request,
    RequestError,
    Response,
    encode,
    encode_error,
    encode_notification,
    encode_request,
    encode_result,
    parse_message,
    parse_request,
)
from tests.conftest import REPO


@hypothesis.given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
@hypothesis.settings(max_examples=200, deadline=None)
def test_parse_request_never_raises_anything_but_a_request_error(line: bytes) -> None:
    try:
        request = parse_request(line)
    except RequestError as refused:
        outcome = encode_error(refused.request_id, refused.code, refused.message)
        message = json.loads(outcome)
        assert message["jsonrpc"] == "2.0"
        assert message["error"]["code"] in (-32700, -32600, -32602)
        assert outcome.endswith(b"\n") and outcome.count(b"\n") == 1
    else:
        assert isinstance(request.id, str | int) and request.method


@pytest.mark.parametrize(
    ("line", "code", "request_id", "text"),
    [
        (b"\xff\xfe", PARSE_ERROR, None, "not UTF-8"),
        (b"{nope", PARSE_ERROR, None, "not JSON"),
        (b"[" * 100_000, PARSE_ERROR, None, "not JSON"),
        (b"[1]", INVALID_REQUEST, None, "expected one JSON object"),
        (b'{"jsonrpc":"2.0","method":"health"}', INVALID_REQUEST, None, "id is required"),
        (b'{"jsonrpc":"2.0","id":true,"method":"x"}', INVALID_REQUEST, None, "string or integer"),
        (b'{"jsonrpc":"2.0","id":1.5,"method":"x"}', INVALID_REQUEST, None, "string or integer"),
        (b'{"jsonrpc":"1.0","id":3,"method":"x"}', INVALID_REQUEST, 3, "jsonrpc must be '2.0'"),
        (b'{"jsonrpc":"2.0","id":"a","method":""}', INVALID_REQUEST, "a", "method must be"),
        (b'{"jsonrpc":"2.0","id":4,"method":"x","params":[1]}', INVALID_PARAMS, 4, "object"),
        (b'{"jsonrpc":"2.0","id":5,"method":"x","extra":1}', INVALID_REQUEST, 5, "'extra'"),
    ],
)
def test_refused_requests_name_the_standard_code_and_their_id(
    line: bytes, code: int, request_id: object, text: str
) -> None:
    with pytest.raises(RequestError) as info:
        parse_request(line)
    assert (info.value.code, info.value.request_id) == (code, request_id)
    assert text in info.value.message


def test_a_request_round_trips() -> None:
    frame = encode_request(7, "listUnresolved", {"limit": 3})
    assert frame.endswith(b"\n") and frame.count(b"\n") == 1
    assert parse_request(frame[:-1]) == Request(7, "listUnresolved", {"limit": 3})
    # absent and null params are an empty object
    assert parse_request(b'{"jsonrpc":"2.0","id":"x","method":"m","params":null}').params == {}
    assert parse_request(encode_request("y", "m")[:-1]) == Request("y", "m", {})


def test_encoding_is_ascii_and_refuses_what_json_cannot_carry() -> None:
    frame = encode_result(1, {"text": "caf\u00e9 \ud800 \U0001f600"})
    assert frame.isascii() and frame.count(b"\n") == 1
    assert json.loads(frame)["result"]["text"] == "caf\u00e9 \ud800 \U0001f600"
    with pytest.raises(ValueError):
        encode({"x": float("nan")})
    error = json.loads(encode_error(None, -32001, "permission denied", {"uid": 5}))
    assert error == {
        "jsonrpc": "2.0",
        "id": None,
        "error": {"code": -32001, "message": "permission denied", "data": {"uid": 5}},
    }
    assert json.loads(encode_notification("receive", {"a": 1})) == {
        "jsonrpc": "2.0",
        "method": "receive",
        "params": {"a": 1},
    }


def test_messages_a_client_reads() -> None:
    assert parse_message(b'{"jsonrpc":"2.0","id":1,"result":null}') == Response(1, result=None)
    error = parse_message(b'{"jsonrpc":"2.0","id":2,"error":{"code":-5,"message":"rate"}}')
    assert isinstance(error, Response) and error.error is not None
    assert (error.id, error.error.code, error.error.message) == (2, -5, "rate")
    note = parse_message(b'{"jsonrpc":"2.0","method":"receive","params":{"envelope":{}}}')
    assert note == Incoming("receive", {"envelope": {}}, None)
    for bad in (b"", b"nope", b"[]", b'{"jsonrpc":"2.0","id":1}', b'{"id":[1],"result":1}'):
        with pytest.raises(FrameError):
            parse_message(bad)


def test_the_frame_buffer_splits_and_bounds_frames() -> None:
    frames = FrameBuffer(max_frame_bytes=10)
    frames.feed(b"one\ntw")
    assert frames.next_frame() == b"one"
    assert frames.next_frame() is None
    frames.feed(b"o\n\n")
    assert [frames.next_frame(), frames.next_frame(), frames.next_frame()] == [b"two", b"", None]
    frames.feed(b"x" * 10 + b"\n")
    assert frames.next_frame() == b"x" * 10  # exactly the bound is fine
    frames.feed(b"y" * 11 + b"\nz\n")
    with pytest.raises(FrameTooLargeError):
        frames.next_frame()
    assert len(frames) == 0  # cleared: no resynchronising on an untrusted stream
    frames.feed(b"w" * 11)  # an unterminated tail over the bound is refused too
    with pytest.raises(FrameTooLargeError):
        frames.next_frame()
    with pytest.raises(ValueError):
        FrameBuffer(0)


def test_the_framing_imports_the_standard_library_alone() -> None:
    """prismctl runs as any operator, on a Python that may not see the daemon's packages."""
    code = (
        "import sys, prismd.jsonrpc, prismd.cli.prismctl\n"
        "third = {m.split('.')[0] for m in sys.modules} & "
        "{'trio', 'attrs', 'h11', 'httpx', 'stores', 'adapters'}\n"
        "print(sorted(third))\n"
    )
    result = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(REPO)!r})\n" + code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert result.stdout == "[]\n"
