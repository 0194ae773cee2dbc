"""Every web chat test (and each subprocess it starts) keeps ``prismctl chat`` state in its
own temporary directory, never in the real ``~/.local/state``."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def _private_state_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    state_home = tmp_path / "xdg-state"
    monkeypatch.setenv("XDG_STATE_HOME", str(state_home))
    return state_home
