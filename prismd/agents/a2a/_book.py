"""What the ``a2a`` agent keeps durably, in the journal's checkpoint store.

* A **task record** per operation (:data:`NS_TASK`, key = the run's idempotency key, the
  operation id): the send intent is written *before* the request (``phase = "sending"``,
  the deterministic ``messageId``, the push secrets' hashes), the remote task id and
  ``contextId`` the moment the peer answers (``"following"``), the last state observed, and
  ``"done"`` once the run has its answer. It is stored under the open category
  :data:`FOLLOWING_CATEGORY` until done, which is how remote tasks being followed are listed
  (``listRemoteTasks``) and kept by prune.
* An **index record** per remote task (:data:`NS_INDEX`, key ``<alias>/<task id>``): the
  way back from a push (which names only the task) to the task record, with the push
  secrets' hashes to check the sender against.
* A **context record** per (conversation session, alias) (:data:`NS_CONTEXT`): the
  ``contextId`` to continue, and the task id while that task waits for input. ``/new``
  starts a new session id, hence a new context.

A task record also keeps the ids of the artifacts seen built by ``append`` chunks (an
artifact-update with ``append: true`` observed on the task's stream or in a push: at most
:data:`MAX_APPENDED`, each at most :data:`MAX_APPENDED_ID_CHARS` long or else its hash),
so that the answer joins their parts as they were sent (:func:`._steps.reply_text`), after
a restart too. Never the chunks' text.

Nothing here holds message text; the push secrets are stored only as SHA-256 hashes.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any, Literal

import attrs

from stores import (
    ANY_SCOPE,
    LOST,
    CheckpointConflictError,
    CheckpointStore,
    Lost,
    OwnershipScope,
    Replace,
    ms_to_iso,
    retry_compare_and_swap,
    update_checkpoint,
)

from .. import NS_A2A_INDEX, NS_A2A_TASK

NS_TASK = NS_A2A_TASK
NS_INDEX = NS_A2A_INDEX
NS_CONTEXT = "prismd.v1.a2a-context"
FOLLOWING_CATEGORY = "a2a-following"
DONE_CATEGORY = "a2a-done"

Phase = Literal["sending", "unknown", "following", "done"]
MAX_APPENDED = 32
"""Artifacts seen built by ``append`` chunks, journaled per task (more are not noted:
their parts are joined as paragraphs)."""
MAX_APPENDED_ID_CHARS = 64
"""A longer artifact id is noted by its hash (:func:`appended_key`)."""


def secret_hash(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


def appended_key(artifact_id: str) -> str:
    """How an artifact id is noted among a task's appended ones: as it is, or a longer one
    by its SHA-256 (``#`` and 32 hex digits). ``""`` (no id) is never noted."""
    if len(artifact_id) <= MAX_APPENDED_ID_CHARS:
        return artifact_id
    return "#" + hashlib.sha256(artifact_id.encode()).hexdigest()[:32]


def with_appended(noted: tuple[str, ...], artifact_id: str) -> tuple[str, ...] | None:
    """``noted`` with ``artifact_id`` (:func:`appended_key`) added; ``None`` when nothing
    changes (no id, noted already, or :data:`MAX_APPENDED` noted)."""
    key = appended_key(artifact_id)
    if not key or key in noted or len(noted) >= MAX_APPENDED:
        return None
    return (*noted, key)


def _appended_of(value: object) -> tuple[str, ...]:
    """The appended ids of a stored record, bounded again (absent in older records)."""
    if not isinstance(value, list):
        return ()
    out: tuple[str, ...] = ()
    for item in value:
        if isinstance(item, str):
            out = with_appended(out, item) or out
    return out


def secret_matches(value: str, stored_hash: str | None) -> bool:
    """Constant-time comparison of ``value``'s hash with ``stored_hash``."""
    if not stored_hash:
        return False
    return hmac.compare_digest(secret_hash(value), stored_hash)


@attrs.frozen
class TaskRecord:
    alias: str
    message_id: str
    phase: Phase
    session_id: str
    created_ms: int
    task_id: str | None = None
    context_id: str | None = None
    state: str | None = None
    continues_task: bool = False
    token_hash: str | None = None
    credentials_hash: str | None = None
    observed_ms: int | None = None
    next_poll_ms: int | None = None
    owner: str | None = None
    prompt: str | None = None
    """A continuation: the key of the status that asked (:func:`._relay.prompt_key`)."""
    appended: tuple[str, ...] = ()
    """The artifacts seen built by ``append`` chunks (:func:`appended_key`)."""

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "alias": self.alias,
            "messageId": self.message_id,
            "phase": self.phase,
            "sessionId": self.session_id,
            "createdMs": self.created_ms,
            "taskId": self.task_id,
            "contextId": self.context_id,
            "state": self.state,
            "continuesTask": self.continues_task,
            "tokenHash": self.token_hash,
            "credentialsHash": self.credentials_hash,
            "observedMs": self.observed_ms,
            "nextPollMs": self.next_poll_ms,
            "owner": self.owner,
            "prompt": self.prompt,
        }
        if self.appended:
            out["appended"] = list(self.appended)
        return out

    @classmethod
    def from_json(cls, value: object) -> TaskRecord:
        if not isinstance(value, dict):
            raise ValueError("not an a2a task record")
        phase = value.get("phase")
        if phase not in ("sending", "unknown", "following", "done"):
            raise ValueError("not an a2a task record")
        return cls(
            alias=str(value.get("alias", "")),
            message_id=str(value.get("messageId", "")),
            phase=phase,
            session_id=str(value.get("sessionId", "")),
            created_ms=int(value.get("createdMs", 0)),
            task_id=value.get("taskId"),
            context_id=value.get("contextId"),
            state=value.get("state"),
            continues_task=bool(value.get("continuesTask", False)),
            token_hash=value.get("tokenHash"),
            credentials_hash=value.get("credentialsHash"),
            observed_ms=value.get("observedMs"),
            next_poll_ms=value.get("nextPollMs"),
            owner=value.get("owner"),
            prompt=value.get("prompt"),
            appended=_appended_of(value.get("appended")),
        )


@attrs.frozen
class Stored:
    record: TaskRecord
    version: int
    scope: OwnershipScope
    key: str


@attrs.frozen
class ContextRecord:
    context_id: str | None = None
    task_id: str | None = None
    """The task waiting for input (``input-required``): the next message continues it."""
    prompt: str | None = None
    """The key of the status that asked (:func:`._relay.prompt_key`)."""


@attrs.define(eq=False)
class Book:
    """The agent's durable records over one checkpoint store."""

    checkpoints: CheckpointStore

    async def load(self, scope: OwnershipScope, key: str) -> Stored | None:
        row = await self.checkpoints.load_checkpoint(namespace=NS_TASK, key=key, scope=scope)
        if row is None:
            return None
        return Stored(TaskRecord.from_json(row.value), row.version, scope, key)

    async def save(
        self, scope: OwnershipScope, key: str, record: TaskRecord, expected: int
    ) -> Stored | None:
        """Create (``expected=0``) or replace at version ``expected``; ``None`` on a lost
        compare-and-swap (someone else wrote it)."""
        category = DONE_CATEGORY if record.phase == "done" else FOLLOWING_CATEGORY
        try:
            row = await self.checkpoints.save_checkpoint(
                namespace=NS_TASK,
                key=key,
                scope=scope,
                version=expected + 1,
                value=record.to_json(),
                expected_version=expected,
                category=category,
            )
        except CheckpointConflictError:
            return None
        return Stored(record, row.version, scope, key)

    async def update(self, stored: Stored, **changes: Any) -> Stored:
        """Write ``changes`` at the version read; on a lost CAS re-read and apply again
        (the record's writer is this run alone; an observation raced it at most)."""
        current = stored

        async def attempt() -> Stored | Lost:
            nonlocal current
            changed = attrs.evolve(current.record, **changes)
            saved = await self.save(current.scope, current.key, changed, current.version)
            if saved is not None:
                return saved
            again = await self.load(current.scope, current.key)
            if again is None:
                raise CheckpointConflictError("a2a task record is gone")
            current = again
            return LOST

        return await retry_compare_and_swap(attempt, what="an a2a task record")

    async def note_appended(self, stored: Stored | None, artifact_id: str) -> None:
        """A chunk appended to ``artifact_id`` was seen for ``stored``'s task: noted in its
        record unless the task is answered (or the record full); a lost compare-and-swap
        reads the record again (a push and a stream may note at once)."""
        for _attempt in range(8):  # a lost compare-and-swap: read again
            if stored is None or stored.record.phase == "done":
                return
            appended = with_appended(stored.record.appended, artifact_id)
            if appended is None:
                return
            changed = attrs.evolve(stored.record, appended=appended)
            if await self.save(stored.scope, stored.key, changed, stored.version) is not None:
                return
            stored = await self.load(stored.scope, stored.key)

    async def index(self, stored: Stored, task_id: str) -> None:
        """Point ``<alias>/<task id>`` back at the task record (create or refresh)."""
        record = stored.record
        key = f"{record.alias}/{task_id}"
        value = {
            "taskKey": stored.key,
            "tokenHash": record.token_hash,
            "credentialsHash": record.credentials_hash,
        }
        existing = await self.checkpoints.load_checkpoint(
            namespace=NS_INDEX, key=key, scope=stored.scope
        )
        try:
            await self.checkpoints.save_checkpoint(
                namespace=NS_INDEX,
                key=key,
                scope=stored.scope,
                version=(existing.version if existing else 0) + 1,
                value=value,
                expected_version=existing.version if existing else 0,
            )
        except CheckpointConflictError:
            pass  # written meanwhile by the same run's retry: the same value

    async def find_operation(self, scope: OwnershipScope, operation_id: str) -> Stored | None:
        """The task record of ``operation_id`` inside ``scope`` (a partial scope: an
        operator's), or ``None``."""
        page = await self.checkpoints.list_checkpoints(
            namespace=NS_TASK, key_prefix=operation_id, scope=scope, limit=2
        )
        for row in page.items:
            if row.key == operation_id:
                return Stored(TaskRecord.from_json(row.value), row.version, row.scope, row.key)
        return None

    async def index_secrets(self, stored: Stored) -> None:
        """Point each push secret's hash (``secret/<alias>/<hash>``) at the task record,
        written with the send intent: a push that arrives before the task id is journaled
        (or after a crash in between) is still recognised by the credential it carries."""
        record = stored.record
        value = {
            "taskKey": stored.key,
            "tokenHash": record.token_hash,
            "credentialsHash": record.credentials_hash,
        }
        for digest in (record.token_hash, record.credentials_hash):
            if digest is None:
                continue
            try:
                await self.checkpoints.save_checkpoint(
                    namespace=NS_INDEX,
                    key=f"secret/{record.alias}/{digest}",
                    scope=stored.scope,
                    version=1,
                    value=value,
                    expected_version=0,
                )
            except CheckpointConflictError:
                pass  # written before by this send intent

    async def find_task(self, alias: str, task_id: str) -> tuple[Stored, dict[str, Any]] | None:
        """The task record a push for ``alias``'s ``task_id`` belongs to, with its index
        value (the secrets' hashes); ``None`` for a task we do not follow."""
        return await self._find(f"{alias}/{task_id}")

    async def find_index(self, alias: str, task_id: str) -> dict[str, Any] | None:
        """The index value of ``alias``'s ``task_id`` (the secrets' hashes, the task record's
        key) without loading the task record: one read, what a push needs to be checked."""
        key = f"{alias}/{task_id}"
        page = await self.checkpoints.list_checkpoints(
            namespace=NS_INDEX, key_prefix=key, scope=ANY_SCOPE, limit=2
        )
        for row in page.items:
            if row.key == key and isinstance(row.value, dict):
                return row.value
        return None

    async def find_by_secret(self, alias: str, digest: str) -> tuple[Stored, dict[str, Any]] | None:
        """The task record whose push secret hashes to ``digest`` (see :meth:`index_secrets`)."""
        return await self._find(f"secret/{alias}/{digest}")

    async def _find(self, key: str) -> tuple[Stored, dict[str, Any]] | None:
        page = await self.checkpoints.list_checkpoints(
            namespace=NS_INDEX, key_prefix=key, scope=ANY_SCOPE, limit=2
        )
        for row in page.items:
            if row.key != key or not isinstance(row.value, dict):
                continue
            stored = await self.load(row.scope, str(row.value.get("taskKey")))
            if stored is not None:
                return stored, row.value
        return None

    async def following(
        self, *, scope: OwnershipScope = ANY_SCOPE, limit: int = 100, cursor: str | None = None
    ) -> tuple[list[Stored], str | None]:
        """Task records not yet done, newest first (a page)."""
        page = await self.checkpoints.list_checkpoints(
            namespace=NS_TASK,
            category=FOLLOWING_CATEGORY,
            scope=scope,
            limit=limit,
            cursor=cursor,
        )
        out = []
        for row in page.items:
            try:
                out.append(Stored(TaskRecord.from_json(row.value), row.version, row.scope, row.key))
            except ValueError:
                continue
        return out, page.next_cursor

    async def count_following(self, scope: OwnershipScope, limit: int) -> int:
        """How many task records of ``scope`` (partial) are not yet done, counted up to
        ``limit``: the rows are counted through the listing index, none is read."""
        return await self.checkpoints.count_checkpoints(
            namespace=NS_TASK, category=FOLLOWING_CATEGORY, scope=scope, limit=limit
        )

    # ------------------------------------------------------------------ contexts

    async def context(self, scope: OwnershipScope, alias: str, session_id: str) -> ContextRecord:
        row = await self.checkpoints.load_checkpoint(
            namespace=NS_CONTEXT, key=f"{alias}/{session_id}", scope=scope
        )
        if row is None or not isinstance(row.value, dict):
            return ContextRecord()
        value = row.value
        return ContextRecord(value.get("contextId"), value.get("taskId"), value.get("prompt"))

    async def set_context(
        self, scope: OwnershipScope, alias: str, session_id: str, context: ContextRecord
    ) -> None:
        key = f"{alias}/{session_id}"
        value = {
            "contextId": context.context_id,
            "taskId": context.task_id,
            "prompt": context.prompt,
        }
        await update_checkpoint(
            self.checkpoints,
            namespace=NS_CONTEXT,
            key=key,
            scope=scope,
            change=lambda _stored: Replace(value, None),
            what="an a2a context record",
        )


def remote_task_entry(stored: Stored) -> dict[str, Any]:
    """One ``listRemoteTasks`` entry (camelCase on the wire); no text, no secret."""
    record = stored.record
    return {
        "alias": record.alias,
        "operationId": stored.key,
        "remoteTaskId": record.task_id,
        "contextId": record.context_id,
        "phase": record.phase,
        "state": record.state,
        "createdAt": ms_to_iso(record.created_ms),
        "lastObservation": None if record.observed_ms is None else ms_to_iso(record.observed_ms),
        "nextPoll": None if record.next_poll_ms is None else ms_to_iso(record.next_poll_ms),
        "owner": record.owner,
    }


async def list_remote_tasks(
    checkpoints: CheckpointStore,
    scope: OwnershipScope,
    *,
    limit: int = 100,
    after: str | None = None,
) -> tuple[list[dict[str, Any]], str | None]:
    """The remote tasks being followed (or whose send is unresolved) inside ``scope``, a
    page at a time: the entries and the cursor of the next page (``None`` on the last)."""
    found, cursor = await Book(checkpoints).following(scope=scope, limit=limit, cursor=after)
    return [remote_task_entry(s) for s in found], cursor
