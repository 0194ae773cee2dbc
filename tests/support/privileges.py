"""What in the suite needs root, in one place.

As root (CI) every test runs, and ``tests/conftest.py`` fails a root run that skipped
anything. A non-root user skips exactly the tests marked with :func:`needs_root`; ``-ra``
(in ``pyproject.toml``) prints each one with its reason.
"""

from __future__ import annotations

import os

import pytest

IS_ROOT = os.geteuid() == 0


def needs_root(why: str) -> pytest.MarkDecorator:
    """Skip the test for a non-root user, saying why it cannot run without root."""
    return pytest.mark.skipif(not IS_ROOT, reason=f"needs root: {why}")


def chown_group() -> int:
    """A gid this process may give its files: nogroup as root (not ours, so the chown is
    visible), else one of our own groups (a non-root user may only chown to those)."""
    if IS_ROOT:
        return 65534
    others = [gid for gid in os.getgroups() if gid != os.getegid()]
    return others[0] if others else os.getegid()
