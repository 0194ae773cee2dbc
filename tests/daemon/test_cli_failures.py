"""`prismd run` failing: a bug names what failed, never its text; a store that cannot be
opened is named with the store's own reason, once."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import apsw
import pytest

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser

REPO = Path(__file__).resolve().parents[2]
SECRET_TEXT = "private words from a user 7f3a"

CRASH = f"""
import sys
import prismd.daemon as daemon

async def boom(config, **kwargs):
    try:
        raise KeyError({SECRET_TEXT!r})
    except KeyError:
        raise RuntimeError("while handling " + {SECRET_TEXT!r})

daemon.run_daemon = boom
from prismd.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_uncaught_daemon_error_exits_1_with_a_traceback_but_no_exception_text(
    tmp_path: Path,
) -> None:
    config = tmp_path / "prismd.toml"
    config.write_text(f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n')
    done = subprocess.run(
        [sys.executable, "-c", CRASH, "run", "--config", str(config), "--log-level", "debug"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=str(tmp_path),
    )
    assert done.returncode == 1
    assert "RuntimeError" in done.stderr and "KeyError" in done.stderr
    assert "boom" in done.stderr  # the frames are there for the bug report
    assert SECRET_TEXT not in done.stderr


def _integrity_failure(path: Path) -> None:
    """A real SQLite file whose header claims free pages it does not have (quick_check
    reports it; the file opens fine otherwise)."""
    db = apsw.Connection(str(path))
    db.execute("CREATE TABLE notes(x TEXT)")
    db.execute("INSERT INTO notes VALUES ('the operator''s own data')")
    db.close()
    data = bytearray(path.read_bytes())
    data[36:40] = struct.pack(">I", 3)  # the header's free-list page count
    path.write_bytes(bytes(data))


def _not_a_database(path: Path) -> None:
    path.write_bytes(b"these are the operator's notes, not a database\n" * 100)


def _a_directory(path: Path) -> None:
    path.mkdir()


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (_integrity_failure, "integrity check failed"),
        (_not_a_database, "not a usable SQLite database (NotADBError)"),
        (_a_directory, "path is a directory"),
    ],
    ids=["integrity", "not-sqlite", "directory"],
)
def test_run_prints_the_stores_reason_once_and_leaves_the_file_alone(
    tmp_path: Path, make: Callable[[Path], None], reason: str
) -> None:
    journal = tmp_path / "journal.sqlite"
    make(journal)
    before = None if journal.is_dir() else journal.read_bytes()
    config = tmp_path / "prismd.toml"
    config.write_text(
        f'[daemon]\nstate_dir = "{tmp_path / "state"}"\n'
        f'[store]\nurl = "sqlite:///{journal}"\n'
        f'[control]\nsocket = "{tmp_path / "run" / "c.sock"}"\n'
        # (a connection: a config without one is refused before the store is opened)
        '[[connections]]\nid = "web"\nkind = "webchat"\nlisten = "127.0.0.1:0"\n'
    )
    done = subprocess.run(
        [sys.executable, "-m", "prismd", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        cwd=str(tmp_path),
    )
    err = done.stderr
    assert done.returncode == 1, err
    line = f"prismd: cannot open the store: SQLite store {journal}: {reason}"
    assert line + "\n" in err, err
    # Once: not also as a log record, and never as a bare exception type.
    assert err.count("cannot open the store") == 1, err
    assert "StoreUnavailableError" not in err
    assert before is None or journal.read_bytes() == before
    assert not (tmp_path / "run").exists()
