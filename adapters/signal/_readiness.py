"""The readiness record (contract §5.7): the probe written before every ``subscribeReceive``.

Namespace ``prism.channels.v1.signal.receiver``, key ``r1:<connection>``, the adapter's
service scope (the receiver lease's: same namespace and key, in the lease table),
category ``channel-signal-receiver``, value ``{"schema": 1, "updatedAt": <ISO time>}``,
rewritten at version + 1 by compare-and-swap and fenced by the receiver lease. A write the
store takes proves, just before signal-cli is asked for messages, that this holder can
still journal; a newer holder's fence refuses it.
"""

from __future__ import annotations

from stores import CheckpointStore, Clock, OwnershipScope, Replace, ms_to_iso, update_checkpoint

__all__ = ["READINESS_CATEGORY", "RECEIVER_NAMESPACE", "write_readiness"]

RECEIVER_NAMESPACE = "prism.channels.v1.signal.receiver"
READINESS_CATEGORY = "channel-signal-receiver"


async def write_readiness(
    checkpoints: CheckpointStore,
    *,
    connection_id: str,
    scope: OwnershipScope,
    fencing_token: int | None,
    clock: Clock,
) -> None:
    """Rewrite the record once. Raises :class:`~stores.CheckpointConflictError` when it was
    rewritten by someone else twice in a row (a newer fence), and the store's errors."""
    await update_checkpoint(
        checkpoints,
        namespace=RECEIVER_NAMESPACE,
        key=f"r1:{connection_id}",
        scope=scope,
        # Rewritten meanwhile: look again (a newer fence refuses twice).
        change=lambda _stored: Replace({"schema": 1, "updatedAt": ms_to_iso(clock.now_ms())}, None),
        what="the readiness record",
        category=READINESS_CATEGORY,
        fencing_token=fencing_token,
        attempts=2,
    )
