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
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from stores import (
    CheckpointConflictError,
    CheckpointRecord,
    InvalidCheckpointError,
    Keep,
    OwnershipScope,
    Replace,
    update_checkpoint,
)

from ._journal import (
    CATEGORY,
    NS_OPERATION,
    NS_REPLY,
    ChannelJournal,
    CorruptRecordError,
    OperationRecord,
    ReplyRecord,
    Write,
    category_of,
)

NS_META = "prism.channels.v1.meta"
META_KEY = "journal"
META_SCOPE = OwnershipScope()
META_CATEGORY = "channel-meta"
FORMAT = 2
_PAGE = 500


@attrs.frozen
class JournalInfo:
    """What :func:`ensure_format` found or made."""

    journal_id: str
    created: bool
    """The id was written just now: a new journal, or one from before identities."""
    refiled: int = 0
    """Records re-filed by the format-2 upgrade."""


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
    refiled = 0 if version >= FORMAT else await _refile(journal)

    def change(stored: CheckpointRecord | None) -> Replace[JournalInfo] | Keep[JournalInfo]:
        journal_id, version = _id_of(stored)
        if journal_id is not None and version >= FORMAT:
            return Keep(JournalInfo(journal_id, created=False, refiled=refiled))
        # Written first by another process meanwhile: its id is taken (Keep above).
        new_id = journal_id or os.urandom(16).hex()
        info = JournalInfo(new_id, created=journal_id is None, refiled=refiled)
        return Replace({"journalId": new_id, "format": FORMAT}, info)

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
