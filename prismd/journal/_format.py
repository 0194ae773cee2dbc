"""The journal's format marker and the one upgrade it has needed so far.

Format 2 stores an operation or reply an operator may have to settle under the *open*
category (:data:`~._journal.OPEN_CATEGORY`), so listing them reads the store's category
index instead of the whole journal. A journal written before carries every record under
its namespace's plain category; :func:`ensure_format` re-files the open ones once (each by
compare-and-swap at its stored version and fence, the value unchanged) and then records
the format, so later starts only read the marker.
"""

from __future__ import annotations

from typing import Any

import attrs

from stores import OwnershipScope, SaveCheckpoint

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
FORMAT = 2
_PAGE = 500


@attrs.frozen
class JournalMeta:
    """The journal's own record: its format (and, in time, its identity)."""

    format: int = FORMAT

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format}


async def ensure_format(journal: ChannelJournal) -> int:
    """Bring the journal to :data:`FORMAT`; returns how many records were re-filed.

    Safe to run from several processes at once: a record someone else rewrote meanwhile is
    skipped (its writer filed it by the current rules), and the marker is create-only.
    Raises the store's errors.
    """
    stored = await journal.checkpoints.load_checkpoint(
        namespace=NS_META, key=META_KEY, scope=META_SCOPE
    )
    if stored is not None and isinstance(stored.value, dict):
        current = stored.value.get("format")
        if isinstance(current, int) and current >= FORMAT:
            return 0
    moved = 0
    for namespace, parse in (
        (NS_OPERATION, OperationRecord.from_json),
        (NS_REPLY, ReplyRecord.from_json),
    ):
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
                    writes.append(
                        Write(
                            namespace,
                            row.scope,
                            record,
                            row.version,
                            row.fencing_token,
                            key=row.key,
                        )
                    )
            if writes:
                committed = await journal.commit(writes)
                moved += sum(1 for status in committed.statuses if status == "ok")
            cursor = page.next_cursor
            if cursor is None:
                break
    await journal.checkpoints.write_checkpoints(
        [_marker()]  # create-only: a concurrent upgrader's marker is as good as ours
    )
    return moved


def _marker() -> SaveCheckpoint:
    return SaveCheckpoint(
        namespace=NS_META,
        key=META_KEY,
        scope=META_SCOPE,
        version=1,
        value=JournalMeta().to_json(),
        expected_version=0,
        category="channel-meta",
    )
