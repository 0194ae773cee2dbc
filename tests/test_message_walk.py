"""The path of one Telegram message, measured (issue 36): which code files of ``prismd/``,
``adapters/`` and ``stores/`` it enters from the poller to the delivered reply.

The daemon runs in this process as ``prismd run`` wires it (an SQLite journal, the ``echo``
agent, a Telegram connection polling the fake Bot API on loopback). A profile hook records
the file of every Python function entered on the event loop's thread while one message goes
through: pushed to the fake, polled, admitted, run, its reply sent and marked delivered. The
test's own task is not counted (it only waits), nor is anything before or after that window.

The bounds are the targets issue 36 set; the walk is printed (``pytest -s``) so a change that
lengthens it shows where.
"""

from __future__ import annotations

import dis
import io
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import trio

from prismd.daemon import _serving
from prismd.daemon._config import parse_config
from prismd.daemon._daemon import Daemon
from tests.conftest import REPO
from tests.fakes.telegram_api import FakeBotApi, start_fake
from tests.support.waiting import wait_until

pytestmark = pytest.mark.slow

# Issue 36's targets: 24 files, at most 7 of them in prismd/runtime/, none in prismd/daemon/.
# Measured before it: 44, 13 and 1; then 37, 7 and 0 (the rest of the walk is the Telegram
# adapter's 10 modules and the toolkit's 4, the SQLite store's 7, the journal's 3); 39 once
# the stores' shared bases (then stores/_checkpointing, _leasing) and the toolkit's Interrupts
# replaced their copies; 40 once the Bot API client moved from httpx onto the toolkit's own
# HTTP/1.1 client (adapters/toolkit/_http_client.py: a file of ours on the path instead of
# a library's); 34 once modules that served one step went into the module of that step: the
# Telegram adapter's _status into _api (what its callers make of a failure), _media into
# _parse (an event's files); the toolkit's _backoff, _interrupts and _activity with the
# lease in _receiver (what every receiver needs), its _text into prismd/redact.py
# (chunk_text, utf16_units; since in channel.py) and prismd/channel.py (button_lines); 33
# once the stores' shared bases became one module (stores/_bases.py); 32 with the Telegram adapter's
# Markdown → HTML in _send (the one step that uses it); 28 once the SQLite statement helpers
# went into _engine (stores/sqlite/_schema is read when the store opens), the Telegram
# update's parse and admission became one module (_updates), the connection kind went into
# _adapter with the adapter it builds, and the stores' shared modules on the way became two
# (_types: records and value encodings; _bases: the calls and their checks; the Protocols in
# _contracts, never entered); 27 with contract §2 in one module, prismd/grants.py (identities,
# authorize's question and answer, the grants: prismd/identity.py and channel's Grant and
# AuthorizeInput went there); 26 with prismd/redact.py in prismd/channel.py (the text that
# crosses the runtime boundary with its measures, cuts and redaction: every reply's text is
# redacted and cut, every inbound one measured); 24 (6 runtime) once the pass-throughs went:
# the runtime's ``admit`` is written in _admit (``Entrance``, beside the step it enters:
# _runtime is the facade, not a step), and the Telegram adapter's ``send`` is its sender's,
# its features built when what they are made of is set rather than on every read, its token
# source made in _api (adapters/telegram/_adapter only wires). The bounds only go down from
# here.
MAX_FILES = 24
MAX_RUNTIME_FILES = 6
MAX_DAEMON_FILES = 0
COUNTED = ("prismd/", "adapters/", "stores/")
RESUME = dis.opmap["RESUME"]
"""Where a frame starts (argument 0) or is resumed after a yield or an await (1–3): the
profile hook sees both as ``call``, and only the first enters the function."""


def _private(text: str, chat_id: int, message_id: int) -> dict[str, Any]:
    return {
        "message": {
            "message_id": message_id,
            "from": {"id": chat_id, "is_bot": False, "first_name": "Ada"},
            "chat": {"id": chat_id, "type": "private", "first_name": "Ada"},
            "date": 1_700_000_000,
            "text": text,
        }
    }


@contextmanager
def files_entered(skip: trio.lowlevel.Task) -> Iterator[set[str]]:
    """The repository files (relative paths under :data:`COUNTED`) whose functions are
    entered on this thread inside the block, by any task but ``skip``."""
    entered: set[str] = set()
    seen_codes: dict[types.CodeType, str | None] = {}
    root = str(REPO) + "/"

    def profile(frame: types.FrameType, event: str, _arg: object) -> None:
        if event != "call":
            return
        code = frame.f_code
        at = frame.f_lasti
        if code.co_code[at] == RESUME and code.co_code[at + 1] != 0:
            return  # a coroutine resumed where it awaited: not a call
        if code not in seen_codes:
            name = code.co_filename
            relative = name[len(root) :] if name.startswith(root) else None
            seen_codes[code] = relative if relative and relative.startswith(COUNTED) else None
        relative = seen_codes[code]
        if relative is None or relative in entered:
            return
        try:
            task = trio.lowlevel.current_task()
        except RuntimeError:
            return
        if task is not skip:
            entered.add(relative)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        yield entered
    finally:
        sys.setprofile(previous)


def _config(tmp_path: Path, origin: str) -> Any:
    return parse_config(
        {
            "daemon": {"state_dir": str(tmp_path / "state")},
            "store": {"url": "sqlite:///" + str(tmp_path / "journal.sqlite")},
            "control": {"socket": str(tmp_path / "run" / "control.sock")},
            "limits": {"stop_deadline_ms": 2000},
            "connections": [
                {
                    "id": "tg",
                    "kind": "telegram",
                    "token_env": "TG_TOKEN",
                    "api_origin": origin,
                    "poll_timeout_s": 30,
                }
            ],
            "agents": {"echo": {"kind": "echo"}},
            "grants": [{"connection": "tg", "actors": ["*"], "aliases": ["echo"]}],
        }
    )


async def _answered(fake: FakeBotApi, text: str) -> None:
    with trio.fail_after(30):
        await wait_until(lambda: any(sent.get("text") == text for sent in fake.sent), 0.01)


async def test_one_telegram_message_enters_few_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No periodic refresh of the daemon's status line inside the window.
    monkeypatch.setattr(_serving, "STATUS_REFRESH_S", 3600.0)
    async with trio.open_nursery() as nursery:
        fake = await start_fake(nursery)
        daemon = Daemon(
            _config(tmp_path, fake.origin),
            env={"TG_TOKEN": fake.token},
            install_signals=False,
            notify=lambda _state: None,
            out=io.StringIO(),
        )
        nursery.start_soon(daemon.run)
        with trio.fail_after(30):
            await daemon.ready.wait()
        # A first message from another chat: what runs once per process (the first use of
        # a client, the typing timer, imports) is not the path of a message.
        fake.push_update(_private("warm up", 301, 1))
        await _answered(fake, "warm up")
        runtime = daemon.runtime
        assert runtime is not None
        with trio.fail_after(30):
            assert (await runtime.drain(deadline_ms=20_000)).settled

        me = trio.lowlevel.current_task()
        with files_entered(skip=me) as entered:
            fake.push_update(_private("hello walk", 202, 2))
            await _answered(fake, "hello walk")
            # The reply is marked delivered (the runtime's last write for this message).
            with trio.fail_after(30):
                assert (await runtime.drain(deadline_ms=20_000)).settled
        daemon.request_stop()
        with trio.fail_after(30):
            await daemon.stopped.wait()
        nursery.cancel_scope.cancel()
    walk = sorted(entered)
    runtime_files = [f for f in walk if f.startswith("prismd/runtime/")]
    daemon_files = [f for f in walk if f.startswith("prismd/daemon/")]
    print(
        f"\none Telegram message entered {len(walk)} files"
        f" ({len(runtime_files)} in prismd/runtime/, {len(daemon_files)} in prismd/daemon/):"
    )
    for name in walk:
        print(f"  {name}")
    assert [s["text"] for s in fake.sent] == ["warm up", "hello walk"]
    assert any(f.startswith("adapters/telegram/") for f in walk)  # the hook sees the walk
    assert any(f.startswith("stores/sqlite/") for f in walk)
    assert len(daemon_files) <= MAX_DAEMON_FILES, daemon_files
    assert len(runtime_files) <= MAX_RUNTIME_FILES, runtime_files
    assert len(walk) <= MAX_FILES, walk
