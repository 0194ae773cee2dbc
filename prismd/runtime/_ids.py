"""Identifier derivations (contract §4), exactly as the reference computes them.

``J(parts)`` joins the parts with NUL (an absent part is the empty string) and hashes the
UTF-8 bytes with SHA-256, rendered as lowercase hex.
"""

from __future__ import annotations

import hashlib

from ..journal import OwnershipScope


def _j(parts: tuple[str | None, ...]) -> str:
    return "\u0000".join("" if p is None else p for p in parts)


def _sha(parts: tuple[str | None, ...]) -> str:
    return hashlib.sha256(_j(parts).encode("utf-8", "surrogatepass")).hexdigest()


def operation_id_for(connection_id: str, event_id: str) -> str:
    """``chan-op-`` + 32 hex of SHA-256(J([conn, eventId])) (§4)."""
    return "chan-op-" + _sha((connection_id, event_id))[:32]


def notify_operation_id(
    connection_id: str, ownership: OwnershipScope, actor_id: str, alias: str, notify_id: str
) -> str:
    parts = (
        "notify",
        connection_id,
        ownership.tenant_id,
        ownership.account_id,
        ownership.user_id,
        actor_id,
        alias,
        notify_id,
    )
    return "chan-op-" + _sha(parts)[:32]


def default_session_id(
    connection_id: str,
    conversation_id: str,
    thread_id: str | None,
    actor_id: str,
    ownership: OwnershipScope,
    alias: str,
    generation: int,
) -> str:
    """``chan-`` + 40 hex of SHA-256(J([conn, conv, thread, actor, T, A, U, alias, gen]))."""
    parts = (
        connection_id,
        conversation_id,
        thread_id,
        actor_id,
        ownership.tenant_id,
        ownership.account_id,
        ownership.user_id,
        alias,
        str(generation),
    )
    return "chan-" + _sha(parts)[:40]


def control_kind(value: str) -> str:
    if value.startswith("p:a:"):
        return "allow_once"
    if value.startswith("p:d:"):
        return "reject_once"
    return "other"
