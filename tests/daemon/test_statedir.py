"""State directory: stable instance id, exclusive flock across processes."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from prismd.daemon._statedir import StateDirError, locked_state_dir, open_state_dir

pytestmark = pytest.mark.slow  # real subprocesses, servers or a browser


def test_creates_directory_with_0750_and_a_uuid_instance_id(tmp_path: Path) -> None:
    target = tmp_path / "state" / "nested"
    old = os.umask(0o022)
    try:
        with locked_state_dir(target) as state:
            assert stat.S_IMODE(target.stat().st_mode) == 0o750
            assert uuid.UUID(state.instance_id).version == 4
            assert (target / "instance-id").read_text().strip() == state.instance_id
            assert state.owner_id("runtime") == f"prismd-{state.instance_id}:runtime"
            assert state.owner_id("telegram", "tg") == f"prismd-{state.instance_id}:telegram:tg"
    finally:
        os.umask(old)


def test_instance_id_is_stable_across_restarts(tmp_path: Path) -> None:
    with locked_state_dir(tmp_path) as first:
        first_id = first.instance_id
    with locked_state_dir(tmp_path) as second:
        assert second.instance_id == first_id


def test_second_open_in_same_process_is_refused_until_closed(tmp_path: Path) -> None:
    state = open_state_dir(tmp_path)
    try:
        with pytest.raises(StateDirError, match="another prismd is already running"):
            open_state_dir(tmp_path)
    finally:
        state.close()
    state.close()  # idempotent
    with locked_state_dir(tmp_path):
        pass


def test_lock_is_refused_for_another_process_and_freed_when_it_dies(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from prismd.daemon._statedir import open_state_dir, StateDirError\n"
        "try:\n"
        "    open_state_dir(sys.argv[1])\n"
        "except StateDirError as exc:\n"
        "    print(exc); sys.exit(3)\n"
        "print('locked')\n"
    )
    repo = Path(__file__).resolve().parents[2]
    with locked_state_dir(tmp_path):
        refused = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=30,
            cwd=repo,
        )
        assert refused.returncode == 3
        assert "already running" in refused.stdout
    # Lock released: the other process gets it now (the lock dies with its holder).
    ok = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=repo,
    )
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.strip() == "locked"


def test_corrupt_instance_id_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "instance-id").write_text("not-a-uuid\n")
    with pytest.raises(StateDirError, match="does not hold a UUID"):
        open_state_dir(tmp_path)
    # The failed open released the lock.
    (tmp_path / "instance-id").write_text(str(uuid.uuid4()))
    with locked_state_dir(tmp_path):
        pass


def test_unusable_location_is_a_clear_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(StateDirError, match="cannot create state directory"):
        open_state_dir(blocker / "sub")
    # A file where the directory should be: "File exists" said nothing about what to do.
    with pytest.raises(StateDirError) as info:
        open_state_dir(blocker)
    assert str(info.value) == (
        f"cannot create state directory {blocker}: it exists and is not a directory;"
        " move it away or change [daemon].state_dir"
    )
