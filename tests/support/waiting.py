"""Waiting for a condition, and expecting an exception through nursery groups."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import trio


async def wait_until(predicate: Callable[[], bool], step: float = 0.05) -> None:
    """Poll a condition on Trio's (possibly virtual) clock; the caller bounds it with its
    own deadline (``trio.fail_after``)."""
    while True:
        if predicate():
            return
        await trio.sleep(step)


async def wait_until_async(predicate: Callable[[], Awaitable[object]], step: float = 0.1) -> None:
    """:func:`wait_until` for a condition that must be awaited (a store read)."""
    while True:
        if await predicate():
            return
        await trio.sleep(step)


def raises_flat(exc: type[BaseException], match: str | None = None) -> Any:
    """Expect ``exc`` raised bare or inside (nested) nursery exception groups."""
    return pytest.RaisesGroup(
        pytest.RaisesExc(exc, match=match), flatten_subgroups=True, allow_unwrapped=True
    )
