"""The messaging runtime (contract §2–§10, §13): ``open_messaging_runtime``.

Read it top to bottom: ``_admit`` (what happens when an event arrives), ``_turn`` (how a
message runs), ``_commands``, ``_approvals``, ``_notify``, ``_recovery`` (operator
tools), ``_delivery`` (sending a staged reply, resends, held replies re-driven when a
conversation reconnects); ``_core`` holds the shared state, leases and reply staging.
"""

from __future__ import annotations

from ._notify import PairingUnavailableError as PairingUnavailableError
from ._runtime import Runtime as Runtime
from ._runtime import open_messaging_runtime as open_messaging_runtime
from ._types import BindingInput as BindingInput
from ._types import BindingResolution as BindingResolution
from ._types import ResolveAgentInput as ResolveAgentInput

__all__ = [
    "BindingInput",
    "BindingResolution",
    "PairingUnavailableError",
    "ResolveAgentInput",
    "Runtime",
    "open_messaging_runtime",
]

from .api import Diagnostics as Diagnostics
from .api import MessagingRuntime as MessagingRuntime
from .api import ReconcileResult as ReconcileResult
