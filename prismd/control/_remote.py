"""The control methods of remote A2A tasks: ``listRemoteTasks`` and ``reconcile …
cancelRemote``, over the a2a agents' task records and the journal's operations."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs

from stores import OwnershipScope, Store, ms_to_iso

__all__ = ["NextPoll", "RemoteTasks", "cancel_remote", "list_remote_tasks"]

REMOTE_SCAN_PAGES = 20
"""``listRemoteTasks`` reads at most this many pages of open operations for their versions."""

CancelRemote = Callable[[OwnershipScope, str], Awaitable[Mapping[str, Any]]]


async def cancel_remote(
    store: Store,
    cancel: CancelRemote,
    scope: OwnershipScope,
    connection_id: str,
    operation_id: str,
    expected: int,
) -> Any:
    """CancelTask for the remote task ``operation_id`` follows (its follower then settles
    the operation and tells the user), once its version is still ``expected``."""
    from ..agents.a2a import Book
    from ..journal import ChannelJournal

    task = await Book(store.checkpoints).find_operation(scope, operation_id)
    if task is None:
        return {"status": "not_found"}
    # The operator decided on the version listed: a CAS-like check before acting.
    loaded = await ChannelJournal(store.checkpoints).load_operation(
        task.scope, connection_id, operation_id
    )
    if loaded is None:
        return {"status": "not_found"}
    if loaded.version != expected:
        return {
            "status": "conflict",
            "state": loaded.record.state,
            "currentVersion": loaded.version,
        }
    return await cancel(scope, operation_id)


NextPoll = Callable[[str, str], int | None]
"""(alias, remote task id) → when this daemon's follower reads the task next (Unix ms), or
``None`` when it does not follow it."""


@attrs.frozen
class RemoteTasks:
    """What the control methods of remote tasks ask of the daemon's a2a agents."""

    cancel: CancelRemote
    next_poll: NextPoll


async def list_remote_tasks(
    store: Store,
    scope: OwnershipScope,
    remote: RemoteTasks | None = None,
    *,
    limit: int,
    after: str | None,
) -> dict[str, Any]:
    """The remote A2A tasks being followed in ``scope`` (a page): alias, operation, remote
    task id, phase, state, last observation, next poll (known to the instance following
    the task: this daemon's own, from its follower's schedule; never journaled), owner, and
    what ``reconcile … --cancel-remote`` needs (the operation's connection and version).
    Raises :class:`~stores.InvalidCheckpointError` for a bad ``after``."""
    from ..agents.a2a import list_remote_tasks as listed

    entries, cursor = await listed(store.checkpoints, scope, limit=limit, after=after)
    if remote is not None:
        for entry in entries:
            task_id = entry.get("remoteTaskId")
            if entry.get("nextPoll") is None and isinstance(task_id, str):
                due = remote.next_poll(str(entry["alias"]), task_id)
                entry["nextPoll"] = None if due is None else ms_to_iso(due)
    if entries:
        operations = await _open_operations(store, scope)
        for entry in entries:
            found = operations.get(entry["operationId"])
            entry["connectionId"], entry["version"] = found or (None, None)
    return {"tasks": entries, "nextCursor": cursor}


async def _open_operations(store: Store, scope: OwnershipScope) -> dict[str, tuple[str, int]]:
    """The open operations in ``scope`` (following ones among them): id → (connection,
    version), bounded to :data:`REMOTE_SCAN_PAGES` pages."""
    from ..journal import NS_OPERATION, ChannelJournal

    journal = ChannelJournal(store.checkpoints)
    out: dict[str, tuple[str, int]] = {}
    cursor: str | None = None
    for _page in range(REMOTE_SCAN_PAGES):
        rows, cursor = await journal.list(scope, NS_OPERATION, 500, cursor=cursor, open_only=True)
        for row in rows:
            value = row.value
            if isinstance(value, dict) and isinstance(value.get("operationId"), str):
                out[value["operationId"]] = (str(value.get("connectionId")), row.version)
        if cursor is None:
            break
    return out
