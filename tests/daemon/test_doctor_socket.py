"""``prismd doctor`` says when the control socket's directory is one the daemon will refuse
at start (the state directory, a directory of other files open to other users), instead of
"free" followed by ``control failed to start`` under ``prismd run``; and a SQLite file
that is no journal is not blamed on "the server and the password"."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from prismd.cli._doctor import diagnose
from prismd.control import ControlSocketError
from prismd.control._server import _prepare_directory

from .helpers import free_port


def _config(tmp_path: Path, socket_path: Path) -> Path:
    path = tmp_path / "prismd.toml"
    path.write_text(
        f"""
[daemon]
state_dir = "{tmp_path / "state"}"

[store]
url = "sqlite:///{tmp_path / "journal.sqlite"}"

[control]
socket = "{socket_path}"

[[connections]]
id = "web"
kind = "webchat"
listen = "127.0.0.1:{free_port()}"

[agents.echo]
kind = "echo"

[[grants]]
connection = "web"
actors = ["*"]
aliases = ["echo"]
"""
    )
    return path


async def _socket_finding(tmp_path: Path, socket_path: Path) -> tuple[str, str]:
    with trio.fail_after(30):
        findings = await diagnose(str(_config(tmp_path, socket_path)), {})
    (found,) = [f for f in findings if f.component == f"control socket {socket_path}"]
    return found.verdict, found.text


async def test_a_socket_in_the_state_directory_to_be_made_is_named(tmp_path: Path) -> None:
    verdict, text = await _socket_finding(tmp_path, tmp_path / "state" / "control.sock")
    assert verdict == "FAILED"
    assert text == (
        f"{tmp_path / 'state'} is the state directory, which will hold other files and be"
        " open to its group (mode 750); put the control socket in its own directory, such as"
        f" {tmp_path / 'state' / 'run' / 'control.sock'}; change [control].socket"
    )
    assert not (tmp_path / "state").exists()  # doctor changes nothing


async def test_a_directory_the_server_refuses_is_refused_by_doctor_too(tmp_path: Path) -> None:
    shared = tmp_path / "project"
    shared.mkdir(mode=0o750)
    shared.chmod(0o750)
    (shared / "notes.txt").write_text("x")
    socket_path = shared / "control.sock"
    verdict, text = await _socket_finding(tmp_path, socket_path)
    with pytest.raises(ControlSocketError) as refused:
        _prepare_directory(shared, None, socket_path.name)
    assert (verdict, text) == ("FAILED", f"{refused.value}; change [control].socket")
    assert "holds other files and is open to other users (mode 750)" in text


async def test_a_directory_of_its_own_is_free(tmp_path: Path) -> None:
    assert await _socket_finding(tmp_path, tmp_path / "state" / "run" / "control.sock") == (
        "ok",
        "free",
    )


async def test_a_file_that_is_no_journal_names_the_file_not_a_server(tmp_path: Path) -> None:
    # A SQLite journal has no server and no password to check.
    (tmp_path / "journal.sqlite").write_text("not a database\n")
    with trio.fail_after(30):
        findings = await diagnose(str(_config(tmp_path, tmp_path / "run" / "c.sock")), {})
    (found,) = [f for f in findings if f.component.startswith("SQLite ")]
    assert found.verdict == "FAILED"
    assert found.text.endswith("(NotADBError); check [store] url and the file"), found.text


async def test_a_journal_that_cannot_be_created_is_named(tmp_path: Path) -> None:
    # "ok — no schema yet: prismd run creates it", then run could not create it.
    path = _config(tmp_path, tmp_path / "run" / "c.sock")
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    path.write_text(
        path.read_text().replace(
            f"sqlite:///{tmp_path / 'journal.sqlite'}", f"sqlite:///{blocker / 'j.sqlite'}"
        )
    )
    with trio.fail_after(30):
        findings = await diagnose(str(path), {})
    (found,) = [f for f in findings if f.component.startswith("SQLite ")]
    assert (found.verdict, found.text) == (
        "FAILED",
        f"the file cannot be created: {blocker} is not a directory; change [store] url",
    )
