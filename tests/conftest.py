"""Shared fixtures for the whole suite.

The suite reads nothing outside the clone: samples live in ``tests/fixtures`` (provenance in
``SOURCES.md``), and an audit hook turns any open or directory listing of a path beside the
repository (the shared samples folder and the like) into an error, so a test that would
fail on a user's fresh clone fails here too.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import trio.testing

from tests.support.privileges import IS_ROOT

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
"""Real Telegram and signal-cli samples, copied into the repository."""

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

_BESIDE = str(REPO.parent).rstrip(os.sep) + os.sep
_INSIDE = str(REPO) + os.sep
_WATCHED = frozenset({"open", "os.listdir", "os.scandir"})
_IN_TEMP = os.path.realpath(REPO.parent) == os.path.realpath(tempfile.gettempdir())
_SCRATCH = ("pytest-of-", "tmp", "prismd-")
_BEFORE = frozenset(os.listdir(REPO.parent)) if _IN_TEMP else frozenset()
"""With the clone in the temporary directory: the names beside it before the run."""


class OutsideRepositoryError(RuntimeError):
    """A test touched a path beside the clone, which a user's fresh clone does not have."""


def outside_repository(path: object) -> str | None:
    """The absolute path when ``path`` lies beside the repository (not inside it), else None."""
    if not isinstance(path, str | bytes | os.PathLike):
        return None
    try:
        raw = os.fsdecode(os.fspath(path))
    except TypeError:
        return None
    full = os.path.normpath(os.path.abspath(raw))
    if (full + os.sep).startswith(_INSIDE) or not (full + os.sep).startswith(_BESIDE):
        return None
    # A clone in a home directory sits beside the user's dot-directories (~/.config,
    # ~/.cache): tools read those legitimately. A sibling checkout or sample folder is
    # what a fresh clone lacks.
    beside = full[len(_BESIDE) :]
    if beside.startswith("."):
        return None
    # A clone made directly in the temporary directory sits beside the scratch space of the
    # tests and the harness — whatever appeared there during the run, and the names of
    # pytest's, tempfile's and our own (the PostgreSQL server of tests/with-services.sh) —
    # not beside samples.
    if _IN_TEMP and is_scratch(beside.split(os.sep, 1)[0], _BEFORE, os.path.lexists):
        return None
    return full


def is_scratch(name: str, before: frozenset[str], exists: Callable[[str], bool]) -> bool:
    """``name`` (beside a clone in the temporary directory) is scratch: one of the scratch
    prefixes, or made since the run began (it exists now and did not then)."""
    if not name:
        return False
    return name.startswith(_SCRATCH) or (name not in before and exists(_BESIDE + name))


def _audit(event: str, args: tuple[object, ...]) -> None:
    if event in _WATCHED and args:
        full = outside_repository(args[0])
        if full is not None:
            raise OutsideRepositoryError(
                f"a test read {full}, outside the repository: copy what it needs into tests/"
            )


if os.sep != _BESIDE:
    sys.addaudithook(_audit)


_skipped: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if IS_ROOT and _skipped:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if IS_ROOT and _skipped:
        terminalreporter.section("skipped in a root run, where nothing may be skipped", red=True)
        for nodeid in _skipped:
            terminalreporter.write_line(nodeid)


AUTOJUMP_THRESHOLD_S = 0.0002
"""Real seconds the run loop stays idle before virtual time jumps.

pytest-trio's own ``autojump_clock`` uses 0, which makes an idle run loop with no timer
pending spin (``epoll_wait`` with a zero timeout, again and again) while a worker thread
runs — the SQLite store's — and the thread then waits for the GIL after every SQLite call
(the 5 ms switch interval): opening a store took 1.4–2.7 s instead of 6 ms. A small positive
threshold lets the loop sleep, costing that much real time per jump."""


@pytest.fixture
def autojump_clock() -> trio.testing.MockClock:
    """Virtual time that jumps whenever every task is blocked (see
    :data:`AUTOJUMP_THRESHOLD_S`)."""
    return trio.testing.MockClock(autojump_threshold=AUTOJUMP_THRESHOLD_S)
