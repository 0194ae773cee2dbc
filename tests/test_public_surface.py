"""Every package's public surface is what we mean it to be (as Trio pins its own): the names
its face (``__init__``) re-exports with ``name as name``, defines, or lists in ``__all__``.
A change here is a change of what other packages (and users) may rely on: update the pin
deliberately. Every pinned name resolves."""

from __future__ import annotations

import ast
import importlib

from tests.conftest import REPO

PINNED: dict[str, list[str]] = {
    "adapters": [],
    "adapters.discord": [
        "DiscordAdapter",
        "DiscordConnectionConfig",
        "KIND",
        "chunk_markdown",
        "default_intents",
    ],
    "adapters.signal": [
        "ACCOUNT_RE",
        "Endpoint",
        "IGNORE_REASONS",
        "INBOX_NAMESPACE",
        "KIND",
        "MAX_CHUNK_UNITS",
        "RECEIVER_NAMESPACE",
        "SignalAdapter",
        "SignalConnectionConfig",
        "SignalStatistics",
        "event_id_for",
    ],
    "adapters.telegram": [
        "ALLOWED_UPDATES",
        "KIND",
        "ReceiverLeaseLostError",
        "TelegramAdapter",
        "TelegramApi",
        "TelegramApiError",
        "TelegramConnectionConfig",
        "TelegramCredentialError",
        "TelegramError",
        "chunk_text",
    ],
    "adapters.toolkit": [
        "Backoff",
        "Budget",
        "BudgetStatistics",
        "ConnectionLimiter",
        "FrameTooLargeError",
        "HttpError",
        "Incoming",
        "JsonRpcClient",
        "JsonRpcConnectionError",
        "JsonRpcTimeoutError",
        "LOG_INTERVAL_S",
        "LeaseLostError",
        "LogThrottle",
        "ReceiverLease",
        "RequestHead",
        "RpcError",
        "Slot",
        "chunk_text",
        "close_gracefully",
        "is_loopback_host",
        "open_jsonrpc_client",
        "parse_host_port",
        "quiet_note",
        "read_body",
        "read_request_head",
        "respond",
        "serve_limited",
        "server_connection",
        "utf16_units",
    ],
    "adapters.webchat": [
        "Conversations",
        "KIND",
        "WebchatAdapter",
        "WebchatConnectionConfig",
        "WebchatStatistics",
        "parse_listen",
    ],
    "prismd": [],
    "prismd.agents": [
        "AGENT_KINDS",
        "AGENT_NAMESPACES",
        "Agent",
        "AgentContext",
        "AgentFactory",
        "AgentInput",
        "AgentOptionError",
        "Decision",
        "EchoAgent",
        "EventSink",
        "ImageBlock",
        "MockAgent",
        "MockOptions",
        "NS_RUN",
        "NS_SESSION",
        "OpenAIAgent",
        "OpenAIOptions",
        "PendingDecision",
        "RunError",
        "RunFailedError",
        "RunRequest",
        "RunResult",
        "RunState",
        "RunStatusName",
        "SecretReader",
        "SessionEntry",
        "StreamEvent",
        "TextBlock",
        "Tool",
        "agent_record_kept",
        "build_agent",
        "resolve_factory",
        "validate_agent_options",
    ],
    "prismd.cli": [
        "main",
    ],
    "prismd.control": [
        "ControlHandler",
        "ControlSocketError",
        "pairing_aliases_from_grants",
        "serve_control",
    ],
    "prismd.daemon": [
        "Config",
        "ConfigError",
        "ControlConfig",
        "GrantConfig",
        "Operator",
        "TelegramConnectionConfig",
        "check_runnable",
        "configure_logging",
        "describe_exception",
        "install_early_signal_handlers",
        "is_loopback_host",
        "load_config",
        "parse_host_port",
        "read_secret",
        "run_daemon",
        "take_early_signal",
    ],
    "prismd.journal": [
        "Admitted",
        "ApprovalRecord",
        "ApprovalStore",
        "ApprovalTarget",
        "BindingRecord",
        "Change",
        "ChannelJournal",
        "Committed",
        "CursorRecord",
        "FORMAT",
        "Finished",
        "GrantRecord",
        "GrantStore",
        "InputAttachment",
        "JournalRecordTooLargeError",
        "Loaded",
        "LoadedApproval",
        "NS_BINDING",
        "NS_CONTROL",
        "NS_CURSOR",
        "NS_META",
        "NS_OPERATION",
        "NS_REPLY",
        "OPEN_CATEGORY",
        "OPERATION_FLOW",
        "OperationInput",
        "OperationRecord",
        "OperationRef",
        "PAIRING_TTL_MAX_MS",
        "PAIRING_TTL_MIN_MS",
        "PairingStore",
        "REPLY_FLOW",
        "ReplyRecord",
        "StoredControl",
        "SuspendedRun",
        "UNRESOLVED",
        "UNRESOLVED_OPERATION_STATES",
        "UNRESOLVED_REPLY_STATES",
        "UNSETTLED_REPLY_STATES",
        "Write",
        "admit",
        "binding_actor_prefix",
        "binding_key",
        "bounded_claims",
        "categories",
        "category_of",
        "cursor_key",
        "ensure_format",
        "finish",
        "mark",
        "may_move",
        "maybe_answerless",
        "new_token",
        "operation_key",
        "reclaim",
        "reply_key",
        "token_hash",
        "transition",
    ],
    "prismd.runtime": [
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
    ],
    "stores": [
        "ANY_SCOPE",
        "CheckpointConflictError",
        "CheckpointPage",
        "CheckpointRecord",
        "CheckpointStore",
        "CheckpointWrite",
        "Clock",
        "DEFAULT_CONNECT_TIMEOUT_MS",
        "DEFAULT_MAX_VALUE_BYTES",
        "DEFAULT_STATEMENT_TIMEOUT_MS",
        "DeleteCheckpoint",
        "EncodedSave",
        "EventPage",
        "INBOX_STATES",
        "InboxClaim",
        "InboxDepth",
        "InboxItem",
        "InboxPage",
        "InboxState",
        "InboxStore",
        "InvalidCheckpointError",
        "InvalidInboxError",
        "InvalidLeaseError",
        "InvalidStoreURLError",
        "JSONValue",
        "JournalEvent",
        "LeaseConflictError",
        "LeaseRecord",
        "LeaseStore",
        "MAX_POOL_SIZE",
        "OwnershipScope",
        "PostgresOptions",
        "PostgresURL",
        "RecordTooLargeError",
        "SYSTEM_CLOCK",
        "SaveCheckpoint",
        "SchemaStatus",
        "Store",
        "StoreError",
        "StoreUnavailableError",
        "StoreUnreachableError",
        "SystemClock",
        "WriteResult",
        "WriteStatus",
        "compact_json",
        "default_pool_size",
        "is_postgres_url",
        "migrate_store",
        "ms_to_iso",
        "open_store",
        "parse_postgres_url",
    ],
}


def _declared(package: str) -> list[str]:
    init = REPO.joinpath(*package.split("."), "__init__.py")
    tree = ast.parse(init.read_text(encoding="utf-8"))
    names: set[str] = set()
    body = list(tree.body)
    for node in tree.body:
        # Re-exports for type checkers whose modules the face imports when first named
        # (its ``__getattr__``): part of the face too.
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            body += node.body
    for node in body:
        if isinstance(node, ast.ImportFrom):
            names.update(a.name for a in node.names if a.asname is not None and a.asname == a.name)
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            if not node.name.startswith("_"):
                names.add(node.name)
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == "__all__":
                    assert isinstance(node.value, ast.List | ast.Tuple)
                    names.update(str(ast.literal_eval(e)) for e in node.value.elts)
    return sorted(names)


def _faces() -> list[str]:
    found = []
    for root in ("prismd", "adapters", "stores"):
        for init in sorted(REPO.joinpath(root).rglob("__init__.py")):
            parts = init.relative_to(REPO).parent.parts
            if not any(part.startswith("_") for part in parts):
                found.append(".".join(parts))
    return found


def test_every_package_face_is_pinned() -> None:
    assert sorted(_faces()) == sorted(PINNED)


def test_each_face_exports_exactly_the_pinned_names() -> None:
    for package, names in PINNED.items():
        assert _declared(package) == names, package
        module = importlib.import_module(package)
        assert [n for n in names if not hasattr(module, n)] == [], package


def test_every_pinned_name_resolves() -> None:
    for package, names in PINNED.items():
        module = importlib.import_module(package)
        missing = [name for name in names if not hasattr(module, name)]
        assert missing == [], package
