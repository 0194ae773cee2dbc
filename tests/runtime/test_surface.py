"""The public surface of ``prismd.runtime`` is exactly what the daemon codes against."""

from __future__ import annotations

import inspect

import prismd.runtime as runtime_pkg
from prismd.runtime import Runtime, open_messaging_runtime
from prismd.runtime.api import MessagingRuntime

PINNED_PARAMETERS = [
    "authorize",
    "resolve_agent",
    "deliver",
    "adapters",
    "agents",
    "runtime",
    "store",
    "use_leases",
    "limits",
    "redactor",
    "clock",
    "owner_id",
    "adopt_own_leases",
    "fetch_attachment",
    "tells_unanswered",
    "on_preview",
    "resolve_binding",
    "pairing_scope",
    "on_paired",
    "on_typing",
    "typing_delay_ms",
    "idempotent_send",
    "resume_accepted",
    "lease_idle_ms",
]


def test_public_names() -> None:
    assert sorted(runtime_pkg.__all__) == [
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


def test_open_messaging_runtime_signature_is_pinned() -> None:
    params = inspect.signature(open_messaging_runtime).parameters
    assert list(params) == PINNED_PARAMETERS
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())


def test_runtime_has_every_protocol_method() -> None:
    wanted = [n for n in dir(MessagingRuntime) if not n.startswith("_")]
    assert wanted
    for name in wanted:
        ours = inspect.signature(getattr(Runtime, name))
        theirs = inspect.signature(getattr(MessagingRuntime, name))
        assert list(ours.parameters) == list(theirs.parameters), name
