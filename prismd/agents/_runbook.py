"""The durable run records of an agent kind that suspends (``prismd.v1.agent-run``, one row
per run under :func:`~prismd.agents._session.run_key`): loaded, created and changed by
compare-and-swap. The ``openai`` and ``mock`` kinds keep theirs here, each with its own
record type (its JSON, its statuses)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any, Generic, Protocol, TypeVar

import attrs

from stores import (
    CheckpointConflictError,
    CheckpointRecord,
    CheckpointStore,
    Keep,
    OwnershipScope,
    Replace,
)
from stores import update_checkpoint as _update_checkpoint

from ._base import run_failed
from ._session import CATEGORY_RUN, NS_RUN, run_key

__all__ = ["RunBook", "RunJson", "VersionedRun"]


class RunJson(Protocol):
    """What a run record offers the book: its status and session, and its JSON."""

    @property
    def status(self) -> str: ...
    @property
    def session_id(self) -> str: ...
    def to_json(self) -> dict[str, Any]: ...


Run = TypeVar("Run", bound=RunJson)
T = TypeVar("T")


@attrs.define
class VersionedRun(Generic[Run]):
    """A run record and the version it was loaded or saved at (0: not stored yet)."""

    run: Run
    version: int = 0


@attrs.frozen
class RunBook(Generic[Run]):
    """The run records of one alias. ``parse`` reads a record's JSON object (raising
    ``ValueError``, ``KeyError`` or ``TypeError`` for one it cannot read: such a row, or one
    that is not a JSON object, loads as no run);
    ``max_bytes`` bounds a record's JSON (``run_state_too_large`` beyond it)."""

    checkpoints: CheckpointStore
    alias: str
    parse: Callable[[Mapping[str, Any]], Run]
    max_bytes: int | None = None

    async def load(
        self, run_id: str, scope: OwnershipScope, *, session_id: str | None = None
    ) -> VersionedRun[Run] | None:
        """The run's record, or ``None`` (none, unreadable, or — with ``session_id`` — a
        run of another session)."""
        stored = await self.checkpoints.load_checkpoint(
            namespace=NS_RUN, key=run_key(self.alias, run_id), scope=scope
        )
        return self._versioned(stored, session_id)

    async def save(
        self, run_id: str, scope: OwnershipScope, versioned: VersionedRun[Run], run: Run
    ) -> bool:
        """CAS ``run`` over ``versioned`` (a create when its version is 0); False on a lost
        CAS, else ``versioned`` holds ``run`` at its new version."""
        value = self._json(run_id, run)
        try:
            saved = await self.checkpoints.save_checkpoint(
                namespace=NS_RUN,
                key=run_key(self.alias, run_id),
                scope=scope,
                version=versioned.version + 1,
                value=value,
                expected_version=versioned.version,
                category=CATEGORY_RUN,
                metadata={"status": run.status},
            )
        except CheckpointConflictError:
            return False
        versioned.run, versioned.version = run, saved.version
        return True

    async def advance(
        self, run_id: str, scope: OwnershipScope, versioned: VersionedRun[Run], run: Run
    ) -> None:
        """Save or fail the run: losing a CAS here means another resume took the run over."""
        if not await self.save(run_id, scope, versioned, run):
            raise run_failed(run_id, run.session_id, "run_state_conflict", "run state changed")

    async def update(
        self,
        run_id: str,
        session_id: str,
        scope: OwnershipScope,
        change: Callable[[VersionedRun[Run] | None], Replace[T] | Keep[T]],
        *,
        attempts: int,
    ) -> T:
        """Read-modify-write of the record of ``session_id``'s run (``change`` gets what
        :meth:`load` would; :meth:`replace` makes its answer; see
        :func:`stores.update_checkpoint`); ``run_state_conflict`` when it kept changing
        under us."""

        def decide(stored: CheckpointRecord | None) -> Replace[T] | Keep[T]:
            return change(self._versioned(stored, session_id))

        try:
            return await _update_checkpoint(
                self.checkpoints,
                namespace=NS_RUN,
                key=run_key(self.alias, run_id),
                scope=scope,
                change=decide,
                what="an agent run's record",
                category=CATEGORY_RUN,
                attempts=attempts,
            )
        except CheckpointConflictError:
            raise run_failed(
                run_id, session_id, "run_state_conflict", "run state kept changing"
            ) from None

    def replace(self, run_id: str, run: Run, result: T) -> Replace[T]:
        """:meth:`update`'s answer that stores ``run`` and returns ``result``."""
        return Replace(self._json(run_id, run), result, metadata={"status": run.status})

    def _versioned(
        self, stored: CheckpointRecord | None, session_id: str | None
    ) -> VersionedRun[Run] | None:
        if stored is None or not isinstance(stored.value, Mapping):
            return None
        try:
            run = self.parse(stored.value)
        except (ValueError, KeyError, TypeError):
            return None
        if session_id is not None and run.session_id != session_id:
            return None
        return VersionedRun(run, stored.version)

    def _json(self, run_id: str, run: Run) -> dict[str, Any]:
        value = run.to_json()
        if self.max_bytes is not None and len(json.dumps(value)) > self.max_bytes:
            raise run_failed(
                run_id, run.session_id, "run_state_too_large", "the tool results are too large"
            )
        return value
