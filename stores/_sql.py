"""The SQL backends' events read (its statement and rows), and :func:`numbered`, which
turns the ``?`` parameters both backends write (:class:`~stores._types.Where`) into
PostgreSQL's ``$1``, ``$2``, …"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from ._types import JournalEvent, OwnershipScope, Where, decode_json

_PARAM = re.compile(r"\?")


def numbered(sql: str) -> str:
    """``sql`` with its ``?`` parameters numbered ``$1``, ``$2``, …"""
    n = iter(range(1, sql.count("?") + 1))
    return _PARAM.sub(lambda _: f"${next(n)}", sql)


def events_query(
    table: str, columns: str, after: int, limit: int, scope: OwnershipScope
) -> tuple[str, list[Any]]:
    """The statement and arguments that read up to ``limit`` events of ``table`` after
    ``after`` in ``scope``, in ``seq`` order (commit order); rows per :func:`event_from_row`."""
    where = Where()
    where.add("seq > ?", after)
    where.scope(scope)
    return f"SELECT {columns} FROM {table}{where.sql()} ORDER BY seq LIMIT ?", [
        *where.args,
        limit,
    ]


def event_from_row(row: Sequence[Any]) -> JournalEvent:
    """A journal event row of the SQL backends as an event."""
    (seq, at, action, ns, key, tenant, account, user, version, category, meta) = row
    return JournalEvent(
        seq=seq,
        at_ms=at,
        action=action,
        namespace=ns,
        key=key,
        scope=OwnershipScope(tenant, account, user),
        version=version,
        category=category,
        metadata=None if meta is None else decode_json(meta),
    )
