"""The suite is self-contained: what it reads lives in the repository."""

from __future__ import annotations

import json
import os

import pytest

from tests import conftest
from tests.conftest import (
    FIXTURES,
    REPO,
    OutsideRepositoryError,
    is_scratch,
    outside_repository,
)


def test_a_path_beside_the_clone_is_refused() -> None:
    beside = REPO.parent / "beside-the-clone" / "SOURCES.md"
    assert outside_repository(beside) == str(beside)
    with pytest.raises(OutsideRepositoryError, match="outside the repository"):
        beside.open()
    with pytest.raises(OutsideRepositoryError):
        os.listdir(REPO.parent / "beside-the-clone")


def test_paths_inside_the_clone_and_elsewhere_are_allowed() -> None:
    assert outside_repository(FIXTURES / "SOURCES.md") is None
    assert outside_repository(REPO) is None
    assert outside_repository("/proc/self/status") is None or str(REPO.parent) == "/proc"
    assert outside_repository(3) is None
    # The dot-directories of a home the clone may live in are not sibling checkouts.
    assert outside_repository(REPO.parent / ".cache" / "pip") is None


def test_a_clone_in_the_temporary_directory_may_use_the_scratch_beside_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Cloned straight into /tmp, the clone sits beside pytest's, tempfile's and the
    harness's scratch directories; a sample folder there is still refused."""
    before = frozenset({"samples", "tmpab12cd", "prismd-pg.Cja9q6", "sibling-checkout"})
    made_now = {"sg-abc123"}

    def exists(path: str) -> bool:
        return os.path.basename(path) in before | made_now

    for name in ("pytest-of-someone", "tmpab12cd", "prismd-pg.Cja9q6", "sg-abc123"):
        assert is_scratch(name, before, exists), name
    for name in ("samples", "sibling-checkout", "never-there", ""):
        assert not is_scratch(name, before, exists), name
    monkeypatch.setattr(conftest, "_IN_TEMP", True)
    monkeypatch.setattr(conftest, "_BEFORE", before)
    assert outside_repository(REPO.parent / "pytest-of-someone" / "test0") is None
    samples = REPO.parent / "samples" / "SOURCES.md"
    assert outside_repository(samples) == str(samples)
    monkeypatch.setattr(conftest, "_IN_TEMP", False)
    scratch = REPO.parent / "pytest-of-someone" / "test0"
    assert outside_repository(scratch) == str(scratch)


def test_samples_and_their_provenance_are_in_the_repository() -> None:
    sources = (FIXTURES / "SOURCES.md").read_text(encoding="utf-8")
    samples = sorted(p for p in FIXTURES.rglob("*.json"))
    assert len([p for p in samples if p.parent.name == "telegram"]) >= 8
    assert len([p for p in samples if p.parent.name == "signal-cli"]) >= 8
    for path in samples:
        json.loads(path.read_text(encoding="utf-8"))
        assert path.name in sources, f"{path.name} has no provenance line in SOURCES.md"
