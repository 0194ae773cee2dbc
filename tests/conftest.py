"""Shared fixtures for the whole suite."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("PRISMD_SHARED", REPO.parent / "shared"))
FIXTURES = SHARED / "fixtures"

if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
