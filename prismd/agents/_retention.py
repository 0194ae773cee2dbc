"""Which agent records ``prune`` may delete: the runtime's one hook into agent storage.

The built-in agents keep text (transcripts, run state with tool results) in the journal's
checkpoint store; :data:`AGENT_NAMESPACES` are pruned with the journal under the same
retention. A run still in flight (suspended on a decision, or interrupted mid-tool) is
kept, like the suspended binding that points at it.
"""

from __future__ import annotations

from collections.abc import Mapping

from ._session import NS_RUN, NS_SESSION

NS_A2A_TASK = "prismd.v1.a2a-task"
NS_A2A_INDEX = "prismd.v1.a2a-index"
AGENT_NAMESPACES = (NS_SESSION, NS_RUN, NS_A2A_TASK, NS_A2A_INDEX)
_IN_FLIGHT = frozenset({"suspended", "dispatching", "running"})
_A2A_OPEN = frozenset({"sending", "unknown", "following"})


def agent_record_kept(namespace: str, value: object) -> bool:
    """True when an agent record must outlive retention (a run not yet ended)."""
    if namespace == NS_RUN and isinstance(value, Mapping):
        return value.get("status") in _IN_FLIGHT
    if namespace == NS_A2A_TASK and isinstance(value, Mapping):
        # A remote task still followed (or whose send is unresolved) is kept.
        return value.get("phase") in _A2A_OPEN
    return False
