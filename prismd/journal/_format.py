"""The journal's own record: its identity and its format, and the one upgrade so far.

**Identity.** Every journal holds a random id, written once when the journal first meets
this code. The daemon remembers it in its state directory, so a journal that is not the
one it had — a zero-length or replaced file, a database recreated empty — is noticed
instead of silently starting afresh (every dedup record gone, and with them the
at-most-once guarantee). See :func:`ensure_format`.

**Format 2** stores an operation or reply an operator may have to settle under the *open*
category (:data:`~._journal.OPEN_CATEGORY`), so listing them reads the store's category
index instead of the whole journal. A journal written before carries every record under
its namespace's plain category: the first start re-files the open ones (each by
compare-and-swap at its stored version and fence, the value unchanged), then records the
format, so later starts only read this record.

**Format 3** keeps prismd's own records under one scheme of namespaces,
``prismd.v1.<name>``: the agents' transcripts and run records, written before under
``prismd.agents.v1.*`` (:data:`prismd.agents.MOVED_NAMESPACES`), are moved, each with its
key, scope, version, fence, category and metadata, in one atomic batch that also checks the
old row is still as read: a record changed meanwhile is moved at its newer version in a
later pass (or, if it keeps changing, at the next start: the format is recorded as 3 only
once nothing is left). The version stays: a run's ``expected_version`` still holds.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from stores import (
    CheckpointConflictError,
    CheckpointRecord,
    DeleteCheckpoint,
    InvalidCheckpointError,
    Keep,
    OwnershipScope,
    Replace,
    SaveCheckpoint,
    update_checkpoint,
)

from ..agents import MOVED_NAMESPACES
from ._journal import (
    CATEGORY,
    NS_OPERATION,
    NS_REPLY,
    ChannelJournal,
    Write,
    category_of,
)
from ._records import CorruptRecordError, OperationRecord, ReplyRecord

NS_META = "prism.channels.v1.meta"
META_KEY = "journal"
META_SCOPE = OwnershipScope()
META_CATEGORY = "channel-meta"
FORMAT = 3
_PAGE = 500


@attrs.frozen
class JournalInfo:
    """What :func:`ensure_format` found or made."""

    journal_id: str
    created: bool
    """The id was written just now: a new journal, or one from before identities."""
    refiled: int = 0
    """Records re-filed by the format-2 upgrade."""
    moved: int = 0
    """Records moved to their namespace by the format-3 upgrade."""


def _id_of(stored: CheckpointRecord | None) -> tuple[str | None, int]:
    if stored is None or not isinstance(stored.value, dict):
        return None, 0
    journal_id = stored.value.get("journalId")
    version = stored.value.get("format")
    return (
        journal_id if isinstance(journal_id, str) and journal_id else None,
        version if isinstance(version, int) else 0,
    )


async def _load(journal: ChannelJournal) -> CheckpointRecord | None:
    return await journal.checkpoints.load_checkpoint(
        namespace=NS_META, key=META_KEY, scope=META_SCOPE
    )


async def ensure_format(journal: ChannelJournal) -> JournalInfo:
    """The journal's identity, after bringing it to :data:`FORMAT`.

    Safe to run from several processes at once (several instances on one database): a
    record someone else rewrote meanwhile is skipped (its writer filed it by the current
    rules), and the record holding the id is written by compare-and-swap, so every
    process ends up with the same id. Raises the store's errors.
    """
    stored = await _load(journal)
    journal_id, version = _id_of(stored)
    if journal_id is not None and version >= FORMAT:
        return JournalInfo(journal_id, created=False)
    refiled = 0 if version >= 2 else await _refile(journal)
    moved, complete = (0, True) if version >= 3 else await _move_namespaces(journal)
    reached = FORMAT if complete else 2

    def change(stored: CheckpointRecord | None) -> Replace[JournalInfo] | Keep[JournalInfo]:
        journal_id, version = _id_of(stored)
        if journal_id is not None and version >= FORMAT:
            return Keep(JournalInfo(journal_id, created=False, refiled=refiled, moved=moved))
        # Written first by another process meanwhile: its id is taken (Keep above).
        new_id = journal_id or os.urandom(16).hex()
        info = JournalInfo(new_id, created=journal_id is None, refiled=refiled, moved=moved)
        return Replace({"journalId": new_id, "format": reached}, info)

    try:
        return await update_checkpoint(
            journal.checkpoints,
            namespace=NS_META,
            key=META_KEY,
            scope=META_SCOPE,
            change=change,
            what="the journal's identity record",
            category=META_CATEGORY,
        )
    except InvalidCheckpointError:
        raise
    except CheckpointConflictError:
        raise RuntimeError("the journal's identity record kept changing") from None


async def _refile(journal: ChannelJournal) -> int:
    moved = 0
    parsers: tuple[tuple[str, Any], ...] = (
        (NS_OPERATION, OperationRecord.from_json),
        (NS_REPLY, ReplyRecord.from_json),
    )
    for namespace, parse in parsers:
        cursor: str | None = None
        while True:
            page = await journal.checkpoints.list_checkpoints(
                namespace=namespace, category=CATEGORY[namespace], cursor=cursor, limit=_PAGE
            )
            writes = []
            for row in page.items:
                try:
                    record = parse(row.value)
                except (CorruptRecordError, ValueError):
                    continue
                if category_of(namespace, record) != CATEGORY[namespace]:
                    write = Write(
                        namespace, row.scope, record, row.version, row.fencing_token, key=row.key
                    )
                    writes.append(write)
            if writes:
                committed = await journal.commit(writes)
                moved += sum(1 for status in committed.statuses if status == "ok")
            cursor = page.next_cursor
            if cursor is None:
                break
    return moved


_MOVE_BATCH = 100
"""Records moved in one atomic batch (three writes each)."""
_MOVE_PASSES = 3


async def _move_namespaces(journal: ChannelJournal) -> tuple[int, bool]:
    """Move every record of :data:`MOVED_NAMESPACES`: how many, and whether all were (a
    record that kept changing while this ran stays, and the format stays 2 for the next
    start to finish)."""
    moved = 0
    for _pass in range(_MOVE_PASSES):
        stayed = 0
        for old, new in MOVED_NAMESPACES.items():
            cursor: str | None = None
            while True:
                page = await journal.checkpoints.list_checkpoints(
                    namespace=old, cursor=cursor, limit=_PAGE
                )
                rows = list(page.items)
                for start in range(0, len(rows), _MOVE_BATCH):
                    chunk = rows[start : start + _MOVE_BATCH]
                    if await _move(journal, new, chunk):
                        moved += len(chunk)
                        continue
                    for row in chunk:  # one of them changed meanwhile: each on its own
                        if await _move(journal, new, [row]):
                            moved += 1
                        else:
                            stayed += 1
                cursor = page.next_cursor
                if cursor is None:
                    break
        if not stayed:
            return moved, True
    return moved, False


async def _move(journal: ChannelJournal, namespace: str, rows: list[CheckpointRecord]) -> bool:
    """Move ``rows`` to ``namespace`` together, or none of them (one changed meanwhile, or
    is there already)."""
    writes: list[SaveCheckpoint | DeleteCheckpoint] = []
    for row in rows:
        fields = {
            "key": row.key,
            "scope": row.scope,
            "value": row.value,
            "fencing_token": row.fencing_token,
            "category": row.category,
            "metadata": row.metadata,
        }
        writes += [
            # Still as read (a compare-and-swap that changes nothing but the version) ...
            SaveCheckpoint(
                namespace=row.namespace,
                version=row.version + 1,
                expected_version=row.version,
                **fields,
            ),
            DeleteCheckpoint(namespace=row.namespace, key=row.key, scope=row.scope),
            # ... and created where it belongs, at the version it had.
            SaveCheckpoint(namespace=namespace, version=row.version, expected_version=0, **fields),
        ]
    results = await journal.checkpoints.write_checkpoints(writes, atomic=True)
    return all(result.ok for result in results)
