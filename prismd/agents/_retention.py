"""Which agent records ``prune`` may delete: the runtime's one hook into agent storage.

The built-in agents keep text (transcripts, run state with tool results) in the journal's
checkpoint store; :data:`AGENT_NAMESPACES` are pruned with the journal under the same
retention. A run still in flight (suspended on a decision, or interrupted mid-tool) is
kept, like the suspended binding that points at it.
"""

from __future__ import annotations

from collections.abc import Mapping

from ._session import NS_RUN, NS_SESSION

AGENT_NAMESPACES = (NS_SESSION, NS_RUN)
_IN_FLIGHT = frozenset({"suspended", "dispatching", "running"})


def agent_record_kept(namespace: str, value: object) -> bool:
    """True when an agent record must outlive retention (a run not yet ended)."""
    if namespace == NS_RUN and isinstance(value, Mapping):
        return value.get("status") in _IN_FLIGHT
    return False
