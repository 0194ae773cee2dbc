"""The agent seam: what the runtime needs from an agent (contract §2.5), Trio-native.

Cancellation is Trio cancellation: the runtime runs ``agent.run``/``agent.resume`` inside
a cancel scope and cancels it for ``/cancel`` and ``stop()``. An agent lets
``trio.Cancelled`` propagate (it may save state under a bounded shielded scope first);
the runtime then settles the turn ``aborted``.

Durable approvals: an agent whose ``supports_approvals`` is true keeps its run state in
the checkpoint store it was built with (``AgentContext.checkpoints``), so a second
runtime on the same store can ask ``status`` and ``resume`` a suspended run after a
restart.
"""

from __future__ import annotations

import abc
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable

import attrs

from stores import SYSTEM_CLOCK, CheckpointStore, Clock, OwnershipScope, PollStore

from ..channel import ApprovalOutcome, OutboundFile, ReplyFile
from ..grants import AgentIdentity


@attrs.frozen
class TextBlock:
    text: str


@attrs.frozen
class ImageBlock:
    data: bytes
    mime_type: str | None = None


AgentInput: TypeAlias = str | tuple[TextBlock | ImageBlock, ...]

RunStatusName: TypeAlias = Literal[
    "succeeded", "aborted", "suspended", "failed", "denied", "following"
]
"""``following``: the run parked its turn (:meth:`RunHooks.park`) and will be run again."""


class RunHooks(Protocol):
    """What a run that hands its work to a remote peer (``a2a``) tells the runtime, and asks."""

    async def following(self) -> bool:
        """The remote task is known and journaled by the agent: the operation is now
        *followed* (not interrupted work: a restart follows it again, SPEC difference 9),
        the typing indicator stops and the run's concurrency slot is given back. ``False``
        when the operation is no longer the run's (an operator settled it meanwhile)."""
        ...

    def stopping(self) -> bool:
        """The cancellation under way is the runtime stopping (leave the remote task
        running, it is followed again after the restart), not ``/cancel``."""
        ...

    @property
    def owner(self) -> str | None:
        """Who follows the task (the runtime's lease owner id: its instance), for operators."""
        ...

    def waiting(self) -> None:
        """The run waits on a remote peer that refused for now (a backoff): its concurrency
        slot is given back (the turn keeps its route)."""
        ...

    async def relay(self, key: str, text: str) -> bool:
        """Tell the chat ``text`` now, while the run goes on (an ``auth-required`` remote
        task's status message): journaled and sent once per ``key`` for this operation —
        never again for the same key, across restarts and instances — and only while the
        operation is followed. Whether it was sent now."""
        ...

    def park(self) -> Callable[[], None]:
        """The run returns ``status="following"`` next: its turn is *parked* — the
        operation stays ``following``, the route stays held (later messages wait), but
        nothing runs for it. Returns the *wake*: called (from any task of the runtime, at
        most once) when the turn should run again — the agent is then run for the same
        operation, and answers or parks again."""
        ...

    @property
    def cancelling(self) -> bool:
        """``/cancel`` woke this parked turn: cancel the remote task and end the run."""
        ...

    @property
    def runtime(self) -> object:
        """The runtime running this turn (a key: one follower of parked turns per runtime)."""
        ...

    def spawn(self, fn: Callable[[], Awaitable[None]]) -> None:
        """Run ``fn`` as a background task of the runtime, cancelled when it closes."""
        ...


@attrs.frozen
class RunRequest:
    session_id: str
    input: AgentInput
    identity: AgentIdentity
    idempotency_key: str
    leaf_id: str | None = None
    hooks: RunHooks | None = attrs.field(default=None, eq=False, repr=False)


@attrs.frozen
class RunError:
    code: str | None = None
    message: str | None = None


@attrs.frozen
class RunResult:
    status: RunStatusName
    text: str
    run_id: str
    session_id: str
    leaf_id: str | None = None
    error: RunError | None = None
    files: tuple[ReplyFile, ...] = ()
    """Files that go with a ``succeeded`` answer, by reference (journaled with the reply,
    fetched from the agent — a :class:`FileSource` — when the reply is delivered)."""


FileProblem: TypeAlias = Literal["too_large", "unavailable"]
"""Why a reply's file could not be fetched: over the channel's cap (known from its size
before or while reading), or not fetchable (gone, refused, not an allowed URL)."""


@runtime_checkable
class FileSource(Protocol):
    """An agent whose answers carry files by reference (:attr:`RunResult.files`)."""

    async def open_file(self, file: ReplyFile, max_bytes: int) -> OutboundFile | FileProblem:
        """The bytes of ``file`` — at most ``max_bytes``, else ``"too_large"`` (read no
        further) — or ``"unavailable"``. Never raises for the peer's failures."""
        ...


class RunFailedError(Exception):
    """A run error that carries a result; the runtime treats it as that result."""

    def __init__(self, result: RunResult) -> None:
        super().__init__("agent run failed")
        self.result = result


def run_failed(run_id: str, session_id: str, code: str, message: str) -> RunFailedError:
    """The error of a run that failed with ``code``: no text, ``RunError(code, message)``."""
    return RunFailedError(
        RunResult("failed", "", run_id, session_id, error=RunError(code, message))
    )


@attrs.frozen
class StreamEvent:
    """Run events for previews: a new assistant message, a text delta, its end."""

    kind: Literal["message_started", "message_delta", "message_finished"]
    run_id: str
    text: str = ""


EventSink: TypeAlias = Callable[[StreamEvent], None]


@attrs.frozen
class PendingDecision:
    approval_id: str
    kind: str = "tool_approval"
    reason: str = ""
    tool_name: str | None = None


@attrs.frozen
class RunState:
    """Durable run lifecycle state as reported by ``Agent.status``."""

    status: str
    version: int
    pending: tuple[PendingDecision, ...] = ()


@attrs.frozen
class Decision:
    approval_id: str
    outcome: ApprovalOutcome


@attrs.frozen
class ResumeRequest:
    """The arguments of one :meth:`Agent.resume` call, as a built-in kind's ``_resume``
    takes them."""

    run_id: str
    session_id: str
    scope: OwnershipScope
    identity: AgentIdentity
    expected_version: int
    decisions: tuple[Decision, ...] = ()
    deny: bool = False
    on_event: EventSink | None = attrs.field(default=None, eq=False, repr=False)


class Agent(Protocol):
    @property
    def agent_id(self) -> str: ...

    @property
    def definition_revision(self) -> str: ...

    @property
    def input_capabilities(self) -> frozenset[str]:
        """``{"text"}`` or ``{"text", "image"}``."""
        ...

    @property
    def supports_approvals(self) -> bool: ...

    async def run(self, request: RunRequest, *, on_event: EventSink | None = None) -> RunResult: ...

    async def status(
        self, *, run_id: str, session_id: str, scope: OwnershipScope
    ) -> RunState | None: ...

    async def resume(
        self,
        *,
        run_id: str,
        session_id: str,
        scope: OwnershipScope,
        identity: AgentIdentity,
        expected_version: int,
        decisions: tuple[Decision, ...] = (),
        deny: bool = False,
        on_event: EventSink | None = None,
    ) -> RunResult:
        """Continue a suspended run with ``decisions`` or, with ``deny``, a terminal denial."""
        ...


class AgentBase(abc.ABC):
    """What the built-in kinds share: text input only, no approvals and no suspended run
    (``status`` is ``None``) unless the kind says otherwise, and :meth:`resume`'s keywords
    gathered into one :class:`ResumeRequest` for the kind's ``_resume``."""

    @property
    def input_capabilities(self) -> frozenset[str]:
        """Text only, unless the kind says otherwise."""
        return frozenset({"text"})

    @property
    def supports_approvals(self) -> bool:
        """A kind that can suspend a run says so."""
        return False

    async def status(
        self, *, run_id: str, session_id: str, scope: OwnershipScope
    ) -> RunState | None:
        """A kind that can suspend a run reports its durable state."""
        return None

    async def resume(
        self,
        *,
        run_id: str,
        session_id: str,
        scope: OwnershipScope,
        identity: AgentIdentity,
        expected_version: int,
        decisions: tuple[Decision, ...] = (),
        deny: bool = False,
        on_event: EventSink | None = None,
    ) -> RunResult:
        """Continue a suspended run (see :meth:`Agent.resume`); the kind's ``_resume`` decides."""
        request = ResumeRequest(
            run_id, session_id, scope, identity, expected_version, decisions, deny, on_event
        )
        return await self._resume(request)

    @abc.abstractmethod
    async def _resume(self, request: ResumeRequest) -> RunResult:
        """The kind's own continuation of a suspended run (see :meth:`Agent.resume`)."""

    async def release_operation(self, scope: OwnershipScope, operation_id: str) -> None:
        """The runtime settled ``operation_id`` while it was ``following`` without running
        the agent again (its sender's grant refused): a kind that keeps work for such an
        operation (``a2a``: the remote task it follows) closes it. Nothing by default."""
        return None


SecretReader: TypeAlias = Callable[[str | None, str | None, str], str]
"""``read_secret(env_name, file_name, key)``: the secret from the environment variable or
the file (``$CREDENTIALS_DIRECTORY`` first), stripped; raises ``ValueError`` naming ``key``
(never the value) when it is missing or empty."""


@attrs.frozen
class AgentContext:
    """What a factory gets to build an agent for one alias.

    ``read_secret`` is the host's: under ``prismd run`` every secret read through it is
    registered with the daemon's redactor and log filter, so it never reaches a reply, a
    notice or a log line. ``None`` where the host reads no secrets (a bare test).
    """

    alias: str
    options: Mapping[str, Any]
    checkpoints: CheckpointStore
    clock: Clock = SYSTEM_CLOCK
    read_secret: SecretReader | None = None
    push_base_url: str | None = None
    """Where this daemon receives A2A push notifications (``[a2a]``), without the path;
    ``None`` when it receives none. Only the ``a2a`` kind reads it."""
    max_remote_tasks_per_tenant: int = 100
    """``[limits] max_remote_tasks_per_tenant``: remote tasks followed at once per tenant."""
    polls: PollStore | None = None
    """The store's due polls shared by instances (PostgreSQL; ``None`` elsewhere): the
    ``a2a`` kind polls each followed task from one instance at a time."""


AgentFactory: TypeAlias = Callable[[AgentContext], Agent]
