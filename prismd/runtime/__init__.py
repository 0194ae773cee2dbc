"""The messaging runtime (contract §2–§10, §13): ``open_messaging_runtime``.

Read it top to bottom: ``_admit`` (what happens when an event arrives), ``_turn`` (how a
message runs: the route queue, the claim, the run, its end), ``_replies`` (what a run's
result means, and the one reply path: staged with the settlement, delivered, marked),
``_commands``, ``_approvals``, ``_notify``, ``_resume`` (messages acknowledged before a
restart), ``_recovery`` (operator tools), ``_delivery`` (resends, held replies, history).
``_core`` holds the shared state and the answers every entry point gives; ``_routes`` the
route table (routes, their turns, bindings, ``/agent`` choices); ``_leases`` the binding
leases. Every journal write goes through :mod:`prismd.journal` (its write protocol
is :mod:`prismd.journal._protocol`).
"""

from __future__ import annotations

from ._notify import PairingUnavailableError as PairingUnavailableError
from ._runtime import Runtime as Runtime
from ._runtime import open_messaging_runtime as open_messaging_runtime
from .api import BindingInput as BindingInput
from .api import BindingResolution as BindingResolution
from .api import Diagnostics as Diagnostics
from .api import MessagingRuntime as MessagingRuntime
from .api import ReconcileResult as ReconcileResult
from .api import ResolveAgentInput as ResolveAgentInput
from .api import UnresolvedEntry as UnresolvedEntry
from .api import UnresolvedPage as UnresolvedPage

__all__ = [
    "BindingInput",
    "BindingResolution",
    "Diagnostics",
    "MessagingRuntime",
    "PairingUnavailableError",
    "ReconcileResult",
    "ResolveAgentInput",
    "Runtime",
    "UnresolvedEntry",
    "UnresolvedPage",
    "open_messaging_runtime",
]
