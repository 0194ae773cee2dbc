"""The version ``prismd --version`` and ``prismctl --version`` print.

One source of truth: the installed distribution's metadata, i.e. ``version`` in
pyproject.toml (kept light: ``prismctl`` imports it without the daemon's modules).
"""

from __future__ import annotations

import importlib.metadata

DISTRIBUTION = "prismd"


def version_text(prog: str) -> str:
    """``"<prog> <version>"``, or says so when the distribution is not installed."""
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = f"(version unknown: the {DISTRIBUTION} distribution is not installed)"
    return f"{prog} {version}"
