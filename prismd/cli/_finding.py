"""A finding of ``prismd doctor``: one line, ``<component>: <verdict> — <text>``."""

from __future__ import annotations

from typing import Literal

import attrs

Verdict = Literal["ok", "warning", "FAILED"]


@attrs.frozen
class Finding:
    """One line of the report: ``<component>: <verdict> — <text>``."""

    component: str
    verdict: Verdict
    text: str = ""

    @property
    def failed(self) -> bool:
        return self.verdict == "FAILED"

    def line(self) -> str:
        return f"{self.component}: {self.verdict}" + (f" — {self.text}" if self.text else "")


def ok(component: str, text: str = "") -> Finding:
    return Finding(component, "ok", text)


def failed(component: str, text: str) -> Finding:
    return Finding(component, "FAILED", text)
