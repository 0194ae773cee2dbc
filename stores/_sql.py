"""What the two SQL backends' reads share: a ``WHERE`` clause built from optional filters
(:class:`Where`, in ``?`` parameters), the checkpoint listing and the events read, and
:func:`numbered`, which turns those ``?`` parameters into PostgreSQL's ``$1``, ``$2``, …"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeAlias

import attrs

from ._bases import CheckpointQuery, prefix_bounds
from ._types import OwnershipScope, scope_args

SCOPE_COLUMNS = ("tenant_id", "account_id", "user_id")

_PARAM = re.compile(r"\?")

Condition: TypeAlias = tuple[str, tuple[Any, ...]]
"""A condition in ``?`` parameters and its arguments."""


def numbered(sql: str) -> str:
    """``sql`` with its ``?`` parameters numbered ``$1``, ``$2``, …"""
    n = iter(range(1, sql.count("?") + 1))
    return _PARAM.sub(lambda _: f"${next(n)}", sql)


@attrs.define
class Where:
    """The conditions of a ``WHERE`` clause (all must hold) and their arguments, in order."""

    conditions: list[str] = attrs.field(factory=list)
    args: list[Any] = attrs.field(factory=list)

    def add(self, condition: str, *args: Any) -> None:
        self.conditions.append(condition)
        self.args.extend(args)

    def equals(self, column: str, value: object) -> None:
        """``column = value``; no condition when ``value`` is ``None``."""
        if value is not None:
            self.add(f"{column} = ?", value)

    def scope(self, scope: OwnershipScope) -> None:
        """The partial-scope filter: each field that is set must match exactly."""
        for column, value in zip(SCOPE_COLUMNS, scope_args(scope)):
            self.equals(column, value)

    def sql(self) -> str:
        """`` WHERE …`` (with its leading space), or ``""`` when there is no condition."""
        return " WHERE " + " AND ".join(self.conditions) if self.conditions else ""


def events_query(
    table: str, columns: str, after: int, limit: int, scope: OwnershipScope
) -> tuple[str, list[Any]]:
    """The statement and arguments that read up to ``limit`` events of ``table`` after
    ``after`` in ``scope``, in ``seq`` order (commit order)."""
    where = Where()
    where.add("seq > ?", after)
    where.scope(scope)
    return f"SELECT {columns} FROM {table}{where.sql()} ORDER BY seq LIMIT ?", [
        *where.args,
        limit,
    ]


def listing_query(
    table: str,
    columns: str,
    query: CheckpointQuery,
    *,
    starts_with: Callable[[str], Condition],
    one_of: Callable[[tuple[str, ...]], Condition],
) -> tuple[str, list[Any]]:
    """The statement and arguments of a checkpoint listing of ``table``. The backend says
    how its SQL checks that ``key`` starts with a prefix (besides the key range, which an
    index serves) and that ``category`` is one of some names."""
    where = Where()
    where.equals("namespace", query.namespace)
    if query.key_prefix:
        low, high = prefix_bounds(query.key_prefix)
        where.add("key >= ?", low)
        if high is not None:
            where.add("key < ?", high)
        condition, args = starts_with(query.key_prefix)
        where.add(condition, *args)
    if query.categories is not None:
        condition, args = one_of(query.categories)
        where.add(condition, *args)
    where.scope(query.scope)
    if query.after is not None:
        at, last_key, last_ns = query.after
        where.add(
            "(updated_at < ? OR (updated_at = ? AND (key > ? OR (key = ? AND namespace > ?))))",
            at,
            at,
            last_key,
            last_key,
            last_ns,
        )
    sql = (
        f"SELECT {columns} FROM {table}{where.sql()}"
        " ORDER BY updated_at DESC, key ASC, namespace ASC LIMIT ?"
    )
    return sql, [*where.args, query.limit]
