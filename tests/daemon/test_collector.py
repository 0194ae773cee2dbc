"""The collector settings of prismd's long-running commands (``prismd.cli._collector``)."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from prismd.cli._collector import YOUNG_THRESHOLD, tune_collector
from tests.daemon.helpers import child_env


@pytest.fixture
def restored_collector() -> Iterator[None]:
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_what_is_alive_is_frozen_and_the_young_are_collected_less_often(
    restored_collector: None,
) -> None:
    older = gc.get_threshold()[1:]
    alive = object()
    tune_collector()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, *older)
    assert gc.get_freeze_count() > 0
    # A cycle made afterwards is still the collector's: freezing is not disabling.
    box: list[object] = [alive]
    box.append(box)
    del box
    assert gc.collect() >= 1


def test_the_commands_tune_it_before_their_run(tmp_path: Path) -> None:
    """``prismd bench`` (one short scenario, in a child process: the settings are the
    process's) runs with the tuned collector."""
    probe = (
        "import gc, trio\n"
        "from prismd.cli import main\n"
        "seen = []\n"
        "real = trio.run\n"
        "def run(*a, **k):\n"
        "    seen.append((gc.get_threshold()[0], gc.get_freeze_count() > 0))\n"
        "    return real(*a, **k)\n"
        "trio.run = run\n"
        "code = main(['bench', '--scenario', 'duplicate', '--duration-s', '0.1', '--json'])\n"
        "print(code, seen)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        cwd=tmp_path,
        env=child_env(),
    )
    assert out.stdout.strip().splitlines()[-1] == f"0 [({YOUNG_THRESHOLD}, True)]"
