"""The registry of connection kinds: every ``[[connections]] kind`` the config format knows,
each declared by its adapter package (``adapters.telegram.KIND`` …) as a
:class:`prismd.channel.ConnectionKind`: its config parser, secrets, builder and what the
daemon shows of it. The daemon's config and wiring read :data:`CONNECTION_KINDS`; a kind
not built yet (``build`` is ``None``) still parses, and ``check-config``/``run`` refuse it.

A new kind is one entry here and one package; nothing else names a kind.
"""

from __future__ import annotations

import types
from collections.abc import Mapping

from prismd.channel import ConnectionKind

from . import discord, signal, telegram, webchat

__all__ = ["CONNECTION_KINDS", "connection_kind"]

CONNECTION_KINDS: Mapping[str, ConnectionKind] = types.MappingProxyType(
    {kind.name: kind for kind in (telegram.KIND, signal.KIND, webchat.KIND, discord.KIND)}
)
"""By name, in the order the config's error messages list them."""


def connection_kind(name: str) -> ConnectionKind | None:
    """The registered kind ``name`` (read at call time, so a test may swap the table)."""
    return CONNECTION_KINDS.get(name)
