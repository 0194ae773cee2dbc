"""``auth-required``: the remote task waits for a credential given out of band, and may go
on by itself afterwards (``reference/a2a-protocol.md`` §3). Its status message is relayed
to the chat — through :meth:`~prismd.agents.RunHooks.relay`, journaled and sent once — and
the task is followed on.

The relay's key is derived from the observation itself (the state and the message's
text), so the same remote status seen again — by the next poll, after a restart, by
another instance — is never relayed twice, while a new message is relayed once. The status
timestamp is not part of it: a peer may stamp the status when it answers rather than when
the status was recorded, and every read would then look like a new episode (the chat
spammed at each poll). So an episode whose message is one the operation relayed already
is not relayed again; a peer that gives no message gets one relay per operation.
"""

from __future__ import annotations

import hashlib

from .. import RunHooks
from ._wire import Task

AUTH_REQUIRED = "The remote agent needs an authorization to go on; it continues once it has it."
"""Relayed when the task gives no status message of its own."""


def relay_key(task: Task) -> str:
    """The relay key of one observed ``auth-required`` status (no text in it: a digest)."""
    seen = f"{task.state}\0{task.status_text or ''}"
    return "auth-" + hashlib.sha256(seen.encode("utf-8", "replace")).hexdigest()[:24]


async def relay_interrupt(hooks: RunHooks | None, task: Task, shown: list[str | None]) -> bool:
    """Relay an ``auth-required`` task's status message (once per observation; see the
    module); ``shown`` (the previews' last text) then holds it, so no preview repeats it.
    Whether a relay was sent now."""
    if hooks is None or task.state != "auth-required":
        return False
    text = task.status_text or AUTH_REQUIRED
    sent = await hooks.relay(relay_key(task), text)
    shown[0] = task.status_text
    return sent


def prompt_key(task: Task) -> str | None:
    """The key of an ``input-required`` status as it asked (state, timestamp, question); a
    status without a timestamp has none (a question asked again could not be told apart)."""
    if task.timestamp is None:
        return None
    seen = f"{task.state}\0{task.timestamp}\0{task.status_text or ''}"
    return "ask-" + hashlib.sha256(seen.encode("utf-8", "replace")).hexdigest()[:24]


def ends_turn(task: Task, prompt: str | None) -> bool:
    """The task's answer is due: it ended, or it asks for input — unless that is the very
    question the message being followed answers. A peer may answer the continuation with
    the task as it was (a2a-js 1.3.0: still ``input-required``, the same status), before its
    agent read the answer: that is not news."""
    if task.terminal:
        return True
    return task.state == "input-required" and (prompt is None or prompt_key(task) != prompt)
