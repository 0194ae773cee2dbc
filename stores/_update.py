"""Read-modify-write of one record by compare-and-swap: the one retry loop for it.

:func:`update_checkpoint` reads a checkpoint, asks ``change`` what to do with it (write a
new value, or keep it and answer), and writes at ``version + 1`` expecting the version it
read (``0``: create-only, when there was none). A write another writer beat is not an
error: the record is read again and ``change`` decides again, at most ``attempts`` times;
then :class:`~stores.CheckpointConflictError` names what kept losing. A caller whose read
or write is not one checkpoint (a cache in front, two rows in one atomic batch) gives its
own attempt to :func:`retry_compare_and_swap`, the same loop.

>>> async def touch(checkpoints):  # doctest: +SKIP
...     return await update_checkpoint(
...         checkpoints,
...         namespace="prism.channels.v1.signal.receiver",
...         key="r1:sig",
...         scope=scope,
...         change=lambda stored: Replace({"schema": 1}, result=None),
...         what="the readiness record",
...     )
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Final, Generic, TypeVar

import attrs

from ._contracts import (
    CheckpointStore,
)
from ._types import (
    CheckpointConflictError,
    CheckpointRecord,
    InvalidCheckpointError,
    JSONValue,
    OwnershipScope,
)

__all__ = ["LOST", "Keep", "Lost", "Replace", "retry_compare_and_swap", "update_checkpoint"]

R = TypeVar("R")

DEFAULT_ATTEMPTS = 3


@attrs.frozen
class Replace(Generic[R]):
    """Write ``value`` (with ``metadata``) over what was read; answer ``result`` once written."""

    value: JSONValue
    result: R
    metadata: Mapping[str, JSONValue] | None = None


@attrs.frozen
class Keep(Generic[R]):
    """Write nothing (what is stored is already right) and answer ``result``."""

    result: R


class Lost:
    """An attempt's answer when its compare-and-swap lost (see :data:`LOST`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "LOST"


LOST: Final = Lost()


async def retry_compare_and_swap(
    attempt: Callable[[], Awaitable[R | Lost]], *, what: str, attempts: int = DEFAULT_ATTEMPTS
) -> R:
    """Run ``attempt`` (read, change, conditional write) until it answers anything but
    :data:`LOST`, at most ``attempts`` times.

    Raises :class:`~stores.CheckpointConflictError` naming ``what`` when every attempt
    lost, and whatever ``attempt`` raises (the store's errors, the caller's refusals)."""
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    for _attempt in range(attempts):
        outcome = await attempt()
        if not isinstance(outcome, Lost):
            return outcome
    raise CheckpointConflictError(f"{what} kept losing its compare-and-swap ({attempts} attempts)")


async def update_checkpoint(
    checkpoints: CheckpointStore,
    *,
    namespace: str,
    key: str,
    scope: OwnershipScope,
    change: Callable[[CheckpointRecord | None], Replace[R] | Keep[R]],
    what: str,
    category: str | None = None,
    fencing_token: int | None = None,
    attempts: int = DEFAULT_ATTEMPTS,
) -> R:
    """Read the checkpoint at (``namespace``, ``key``, ``scope``), pass it (or ``None``) to
    ``change`` and do what that answers: :class:`Replace` saves at ``version + 1``
    expecting the version read (create-only when nothing was), fenced by
    ``fencing_token``; :class:`Keep` writes nothing. A save that lost its check starts over
    from a fresh read.

    ``change`` may be called once per attempt and should have no effect of its own; it may
    raise to refuse (the error reaches the caller, nothing written). Raises
    :class:`~stores.CheckpointConflictError` after ``attempts`` lost saves (a newer fence
    keeps refusing, say), :class:`~stores.InvalidCheckpointError` at once for a value the
    store refuses, and the store's errors."""

    async def attempt() -> R | Lost:
        stored = await checkpoints.load_checkpoint(namespace=namespace, key=key, scope=scope)
        decision = change(stored)
        if isinstance(decision, Keep):
            return decision.result
        version = 0 if stored is None else stored.version
        try:
            await checkpoints.save_checkpoint(
                namespace=namespace,
                key=key,
                scope=scope,
                version=version + 1,
                value=decision.value,
                expected_version=version,
                fencing_token=fencing_token,
                category=category,
                metadata=decision.metadata,
            )
        except InvalidCheckpointError:
            raise  # the value itself is refused: another attempt would be refused too
        except CheckpointConflictError:
            return LOST
        return decision.result

    return await retry_compare_and_swap(attempt, what=what, attempts=attempts)
