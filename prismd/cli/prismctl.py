"""``prismctl``: the operator's client for the daemon's control socket.

Every control method is a subcommand; output is a readable table, or the raw JSON-RPC
result with ``--json``. Exit codes: 0 success, 1 an error (an error result, a reconcile
whose status is not ``resolved``, a notify that was not accepted, a settle-inbox that
settled nothing, no daemon, permission denied), 2 a usage error (``pair --ttl-ms``
outside 1000..300000 included). A refusal the operator can act on is followed, on
stderr, by what to do: the exact ``reconcile`` command to retry with (``--version`` N,
``--acknowledge-duplicate-risk``), or the daemon's hint (e.g. the ``[[grants]]`` entry a
``notify`` needs).

The socket is ``--socket``, else ``$PRISMD_CONTROL_SOCKET``, else (with ``--config FILE``)
that config's ``[control].socket``, else ``./var/run/control.sock`` when it exists (the
``make run`` default), else ``/run/prismd/control.sock`` (:mod:`._ctlsocket`); a failed
search lists the paths tried. Ctrl-C ends any command quietly with exit 130, a closed
stdout (``| head``) with 141 (:mod:`._quiet`).

Plain blocking sockets on purpose: one request, one answer (or a stream of pages for
``events --follow``), nothing to schedule. The framing is :mod:`prismd.jsonrpc`'s, which,
like this module, imports the standard library alone.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import shlex
import socket
import stat
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TextIO

from ..jsonrpc import FrameBuffer, FrameError, Incoming, encode_request, parse_message
from ._ctlsocket import (
    LOCAL_SOCKET,
    SYSTEM_SOCKET,
    SocketSearchError,
    chat_target,
    find_socket,
)
from ._ctltable import (
    INBOX_COLUMNS,
    REMOTE_TASK_COLUMNS,
    UNRESOLVED_COLUMNS,
    cell,
    print_events,
    print_health,
    print_pairs,
    print_table,
)
from ._quiet import EXIT_INTERRUPTED, run_quietly
from ._suggest import SuggestingParser
from ._version import version_text

__all__ = ["ControlClient", "ControlClientError", "default_socket_path", "main"]

CALL_TIMEOUT_S = 60.0
MAX_ANSWER_BYTES = 64 * 1024 * 1024
"""Far above any answer the daemon sends (an events page is at most 500 bounded records)."""
PERMISSION_DENIED = -32001
PAIRING_UNAVAILABLE = -32002
# prismd.journal's pairing TTL bounds (contract: at most 5 minutes), repeated because
# prismctl imports only the standard library; a test keeps the two equal.
PAIRING_TTL_MIN_MS = 1000
PAIRING_TTL_MAX_MS = 5 * 60 * 1000


class ControlClientError(Exception):
    """A failure to talk to the daemon (not an error *result*)."""


class RpcErrorResult(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def default_socket_path(env: Mapping[str, str] = os.environ) -> str:
    explicit = env.get("PRISMD_CONTROL_SOCKET")
    if explicit:
        return explicit
    if os.path.exists(LOCAL_SOCKET):
        return LOCAL_SOCKET
    return SYSTEM_SOCKET


def _refuse_a_non_socket(path: str) -> None:
    """A path that is there but is no socket (a config file, a directory) is named as such,
    instead of the kernel's "connection refused"."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # connect() says what is wrong
    if not stat.S_ISSOCK(mode):
        what = "a directory" if stat.S_ISDIR(mode) else "a file"
        raise ControlClientError(
            f"{path} is {what}, not a socket: name prismd's control socket ([control].socket"
            " of its config) with --socket PATH, or use --config FILE"
        )


class ControlClient:
    """One connection to the control socket; ``call`` sends a request and reads its answer."""

    def __init__(self, path: str, *, timeout: float | None = CALL_TIMEOUT_S) -> None:
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self._frames = FrameBuffer(MAX_ANSWER_BYTES)
        self._next_id = 0
        try:
            _refuse_a_non_socket(path)
            self._sock.connect(path)
        except ControlClientError:
            self._sock.close()
            raise
        except FileNotFoundError:
            self._sock.close()
            raise ControlClientError(f"daemon not running (no socket at {path})") from None
        except ConnectionRefusedError:
            self._sock.close()
            raise ControlClientError(
                f"connection refused at {path} — is prismd running? (nothing listens on"
                " that socket file)"
            ) from None
        except PermissionError:
            self._sock.close()
            raise ControlClientError(
                f"permission denied: cannot open {path} as uid {os.getuid()}; the control"
                " socket is open to the daemon's own user (and to its [control].group when"
                " set): run prismctl as that user, or see docs/install.md#operators"
            ) from None
        except OSError as exc:
            self._sock.close()
            # strerror is None for errors raised by Python itself ("AF_UNIX path too long").
            reason = exc.strerror or str(exc)
            raise ControlClientError(f"cannot connect to {path}: {reason}") from None

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def send(self, method: str, params: Mapping[str, Any]) -> int:
        self._next_id += 1
        try:
            self._sock.sendall(encode_request(self._next_id, method, dict(params)))
        except OSError:
            # The daemon may have refused us and closed; its error line is still readable.
            pass
        return self._next_id

    def read(self) -> Any:
        """The next result; raises :class:`RpcErrorResult` or :class:`ControlClientError`."""
        try:
            line = self._frames.next_frame()
            while line is None:
                try:
                    data = self._sock.recv(65536)
                except TimeoutError:
                    raise ControlClientError("the daemon did not answer in time") from None
                except OSError as exc:
                    raise ControlClientError(f"connection lost: {exc.strerror or exc}") from None
                if not data:
                    raise ControlClientError("the daemon closed the connection")
                self._frames.feed(data)
                line = self._frames.next_frame()
            message = parse_message(line)
        except FrameError:
            raise ControlClientError("the daemon sent an unreadable answer") from None
        if isinstance(message, Incoming):
            raise ControlClientError("the daemon sent an unreadable answer")
        if message.error is not None:
            raise RpcErrorResult(message.error.code, message.error.message)
        return message.result

    def call(self, method: str, params: Mapping[str, Any]) -> Any:
        self.send(method, params)
        return self.read()

    def stream(self, method: str, params: Mapping[str, Any]) -> Iterator[Any]:
        self._sock.settimeout(None)
        self.send(method, params)
        while True:
            yield self.read()


# --------------------------------------------------------------------------- commands


def _ttl_ms(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not PAIRING_TTL_MIN_MS <= value <= PAIRING_TTL_MAX_MS:
        raise argparse.ArgumentTypeError(
            f"{value} is outside {PAIRING_TTL_MIN_MS}..{PAIRING_TTL_MAX_MS} "
            "(milliseconds; a pairing token lives at most 5 minutes)"
        )
    return value


def _socket_help(env: Mapping[str, str]) -> str:
    chosen = default_socket_path(env)
    text = (
        "control socket path (default: $PRISMD_CONTROL_SOCKET, else "
        f"./{LOCAL_SOCKET} when it exists, else {SYSTEM_SOCKET}; here: {chosen})"
    )
    return text.replace("%", "%%")  # argparse formats help strings with %


def build_parser(env: Mapping[str, str] = os.environ) -> argparse.ArgumentParser:
    parser = SuggestingParser(
        prog="prismctl", description="Operate a running prismd through its control socket."
    )
    parser.add_argument("--socket", metavar="PATH", help=_socket_help(env))
    parser.add_argument(
        "--config",
        metavar="FILE",
        help="use this prismd config's [control].socket (when --socket and"
        " $PRISMD_CONTROL_SOCKET are not given), and for chat its web chat",
    )
    parser.add_argument("--json", action="store_true", help="print the raw JSON result")
    parser.add_argument("--version", action="version", version=version_text("prismctl"))
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # The global options are accepted after the command too (`prismctl events --json`);
    # SUPPRESS keeps the top-level value when the command does not repeat them.
    common = SuggestingParser(add_help=False)
    common.add_argument(
        "--socket", metavar="PATH", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    common.add_argument(
        "--config", metavar="FILE", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS
    )
    add = functools.partial(sub.add_parser, parents=[common])

    cmd = add("list-unresolved", help="operations the daemon cannot prove settled")
    cmd.add_argument(
        "--limit", type=int, help="entries per page (capped at the daemon's max_journal_page)"
    )
    pages = cmd.add_mutually_exclusive_group()
    pages.add_argument("--after", metavar="CURSOR", help="the page after this cursor")
    pages.add_argument("--all", action="store_true", help="every page")

    cmd = add("reconcile", help="settle one unresolved operation")
    cmd.add_argument("operation", metavar="OP", help="operation id")
    cmd.add_argument("--connection", required=True, help="connection id")
    cmd.add_argument("--version", required=True, type=int, help="expected version (CAS)")
    cmd.add_argument(
        "--acknowledge-duplicate-risk",
        action="store_true",
        help="settle a possibly executed turn as execution_unknown",
    )
    cmd.add_argument(
        "--cancel-remote",
        action="store_true",
        help="cancel the remote A2A task the operation follows (its follower then settles it)",
    )

    cmd = add("prune", help="delete settled records past retention")
    cmd.add_argument("--now", metavar="ISO", help="prune as if it were this time (ISO 8601)")

    add("diagnostics", help="runtime counters")
    add("health", help="the supervisor's health snapshot")

    cmd = add("notify", help="send a durable notice to a conversation")
    cmd.add_argument("--connection", required=True)
    cmd.add_argument("--conversation", required=True, help="external conversation id")
    cmd.add_argument("--thread", help="thread id")
    cmd.add_argument("--id", dest="notify_id", required=True, metavar="NOTIFY_ID")
    cmd.add_argument("--text", required=True)

    cmd = add("pair", help="issue a one-time pairing token")
    cmd.add_argument("--connection", required=True)
    cmd.add_argument("--alias", action="append", dest="aliases", metavar="A")
    cmd.add_argument(
        "--ttl-ms",
        type=_ttl_ms,
        metavar="MS",
        help=f"token lifetime in ms, {PAIRING_TTL_MIN_MS}..{PAIRING_TTL_MAX_MS} "
        "(default and maximum: 5 minutes)",
    )

    cmd = add("events", help="the journal event stream (every instance's, from the store)")
    start = cmd.add_mutually_exclusive_group()
    start.add_argument("--after", type=int, metavar="N", help="cursor to start after")
    start.add_argument(
        "--from-now", action="store_true", help="start at the end (with --follow: only new)"
    )
    cmd.add_argument("--follow", action="store_true", help="keep printing new events")

    cmd = add("list-inbox", help="the webhook inbox's dead letters (or rows in --state)")
    cmd.add_argument("--connection", help="connection id (default: every inbox connection)")
    cmd.add_argument(
        "--state",
        choices=("pending", "claimed", "done", "dead", "discarded", "all"),
        default="dead",
        help="rows in this state (default: dead)",
    )
    cmd.add_argument("--limit", type=int, help="rows per page (per connection)")
    cmd.add_argument("--after", metavar="CURSOR", help="the page after this cursor")

    cmd = add("settle-inbox", help="retry or discard one dead letter of the inbox")
    cmd.add_argument("update", metavar="UPDATE_ID", help="the update id (see list-inbox)")
    cmd.add_argument("--connection", required=True, help="connection id")
    settle = cmd.add_mutually_exclusive_group(required=True)
    settle.add_argument("--retry", action="store_true", help="hand it to the workers again")
    settle.add_argument("--discard", action="store_true", help="never admit it")

    cmd = add("list-remote-tasks", help="remote A2A tasks being followed")
    cmd.add_argument("--limit", type=int, help="entries per page (1..500)")
    cmd.add_argument("--after", metavar="CURSOR", help="the page after this cursor")

    cmd = add("chat", help="chat with an agent through the web chat channel")
    cmd.add_argument(
        "--url",
        help="web chat address (default: the web chat of --config FILE, else of"
        " ./prismd.toml, else http://127.0.0.1:8787/)",
    )
    cmd.add_argument(
        "--actor",
        help="actor id (default: the one kept for this server under $XDG_STATE_HOME/prismd/, "
        "else a new random one)",
    )
    cmd.add_argument(
        "--token-env", metavar="NAME", help="environment variable holding the access token"
    )
    return parser


def _given(params: dict[str, Any], **optional: Any) -> dict[str, Any]:
    """``params`` with those of ``optional`` that were given (not ``None``), in order."""
    params.update((name, value) for name, value in optional.items() if value is not None)
    return params


def _request(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    command = args.command
    if command == "list-unresolved":
        return "listUnresolved", _given({"paged": True}, limit=args.limit, after=args.after)
    if command == "reconcile":
        params: dict[str, Any] = {
            "connectionId": args.connection,
            "operationId": args.operation,
            "expectedVersion": args.version,
        }
        if args.acknowledge_duplicate_risk:
            params["acknowledgeDuplicateRisk"] = True
        if args.cancel_remote:
            params["cancelRemote"] = True
        return "reconcile", params
    if command == "prune":
        return "prune", {} if args.now is None else {"now": args.now}
    if command in ("diagnostics", "health"):
        return command, {}
    if command == "notify":
        params = {
            "connectionId": args.connection,
            "externalConversationId": args.conversation,
            "notifyId": args.notify_id,
            "text": args.text,
        }
        return "notify", _given(params, threadId=args.thread)
    if command == "pair":
        params = {"connectionId": args.connection}
        if args.aliases:
            params["aliases"] = args.aliases
        return "pair", _given(params, ttlMs=args.ttl_ms)
    if command == "events":
        params = {"fromNow": True} if args.from_now else {"after": args.after or 0}
        if args.follow:
            params["follow"] = True
        return "events", params
    if command == "list-inbox":
        params = {"state": args.state}
        return "listInbox", _given(
            params, connectionId=args.connection, limit=args.limit, after=args.after
        )
    if command == "list-remote-tasks":
        return "listRemoteTasks", _given({}, limit=args.limit, after=args.after)
    if command == "settle-inbox":
        action = "retry" if args.retry else "discard"
        return "settleInbox", {
            "connectionId": args.connection,
            "updateId": args.update,
            "action": action,
        }
    raise AssertionError(command)


def _every_page(client: ControlClient, params: dict[str, Any], first: Any) -> Any:
    """``first`` and every page after it, as one page without a next cursor."""
    entries = list(first.get("entries") or [])
    result = first
    while result.get("nextCursor"):
        result = client.call("listUnresolved", {**params, "after": result["nextCursor"]})
        entries += result.get("entries") or []
    return {**first, "entries": entries, "nextCursor": None}


def _paging_notes(args: argparse.Namespace, result: Any) -> list[str]:
    """What a list-unresolved (or list-inbox) page says about the rest: the cap, the next
    cursor."""
    if not isinstance(result, Mapping):
        return []
    if args.command == "list-inbox":
        after = result.get("nextCursor")
        if not after:
            return []
        again = ["prismctl", "list-inbox", "--state", args.state]
        if args.connection is not None:
            again += ["--connection", args.connection]
        if args.limit is not None:
            again += ["--limit", str(args.limit)]
        return [f"more: {shlex.join([*again, '--after', after])}"]
    if args.command != "list-unresolved":
        return []
    notes = []
    if result.get("capped"):
        notes.append(
            f"--limit {args.limit} is above the daemon's page cap: {result.get('limit')}"
            " entries per page"
        )
    cursor = result.get("nextCursor")
    if cursor:
        notes.append(f"more: prismctl list-unresolved --after {cursor} (or --all for every page)")
    return notes


_LISTINGS: dict[str, tuple[str, Sequence[tuple[str, str]], str]] = {
    "list-unresolved": ("entries", UNRESOLVED_COLUMNS, "no unresolved operations"),
    "list-inbox": ("items", INBOX_COLUMNS, "no inbox rows in that state"),
    "list-remote-tasks": ("tasks", REMOTE_TASK_COLUMNS, "no remote tasks being followed"),
}
"""The commands that print a table: the result's key of the rows, the columns, and what is
said when there are none."""


def _render(command: str, result: Any, out: TextIO) -> int:
    """Print ``result`` for people; the exit code for it."""
    listing = _LISTINGS.get(command)
    if listing is not None:
        key, columns, none = listing
        rows = result.get(key) if isinstance(result, Mapping) else result
        if not rows:
            out.write(f"{none}\n")
        else:
            print_table(rows, columns, out)
        if command == "list-remote-tasks" and result.get("nextCursor"):
            out.write(f"more: prismctl list-remote-tasks --after {result['nextCursor']}\n")
        return 0
    if command == "pair":
        out.write(f"token       {result.get('token')}\n")
        out.write(f"connection  {result.get('connectionId')}\n")
        out.write(f"expires     {result.get('expiresAt')}\n")
        out.write(f"send '/pair {result.get('token')}' from the account to pair (once)\n")
        return 0
    if command == "events":
        if result.get("events"):
            print_events(result["events"], out, heading=True)
        out.write(f"cursor {result.get('cursor')}\n")
        return 0
    if command == "settle-inbox":
        out.write(f"{result.get('status')}\n")
        return 0 if result.get("status") == "settled" else 1
    if command == "health" and isinstance(result, Mapping):
        print_health(result, out)
        return 0
    if isinstance(result, Mapping):
        # The hint is printed as advice (stderr), in prismctl's own terms where it can.
        print_pairs({k: v for k, v in result.items() if k != "hint"}, out)
    else:
        out.write(f"{cell(result)}\n")
    return _exit_code_of(command, result)


def _advice(args: argparse.Namespace, result: Any) -> list[str]:
    """What the operator can do about a refused result (empty when there is nothing)."""
    if not isinstance(result, Mapping):
        return []
    if args.command == "reconcile":
        advice = _reconcile_advice(args, result)
        if advice:
            return advice
    hint = result.get("hint")
    return [hint] if isinstance(hint, str) and hint else []


def _reconcile_advice(args: argparse.Namespace, result: Mapping[str, Any]) -> list[str]:
    """The exact command to retry with, for the refusals prismctl can phrase in its flags."""
    if result.get("status") == "not_found":
        return [
            f"no operation {args.operation} on connection {args.connection} in your scope; "
            "'prismctl list-unresolved' shows the open ones"
        ]
    if result.get("status") != "conflict":
        return []
    current = result.get("currentVersion")
    known = isinstance(current, int) and not isinstance(current, bool)
    words = ["prismctl"]
    if args.socket:
        words += ["--socket", args.socket]
    words += ["reconcile", args.operation, "--connection", args.connection]
    words += ["--version", str(current if known else args.version)]
    if result.get("detail") == "duplicate_risk":
        if result.get("state") == "executing":
            why = f"{args.operation} is executing: the agent may have run already"
            what = "to settle it as execution_unknown (it is never re-run)"
        else:
            why = f"the reply of {args.operation} may have been delivered already"
            what = "to resend the stored reply (the user may get it twice)"
        command = shlex.join([*words, "--acknowledge-duplicate-risk"])
        return [f"{why}; {what}, add --acknowledge-duplicate-risk:", f"  {command}"]
    if known and current != args.version:
        return [
            f"version {args.version} is stale: {args.operation} is at version {current} now "
            f"(state {result.get('state')}); check it with 'prismctl list-unresolved', "
            "then retry:",
            f"  {shlex.join(words)}",
        ]
    return []


def _exit_code_of(command: str, result: Any) -> int:
    if command == "reconcile" and isinstance(result, Mapping):
        return 0 if result.get("status") == "resolved" else 1
    if command == "notify" and isinstance(result, Mapping):
        return 0 if result.get("status") == "accepted" else 1
    if command == "settle-inbox" and isinstance(result, Mapping):
        return 0 if result.get("status") == "settled" else 1
    return 0


def _follow(client: ControlClient, args: argparse.Namespace, out: TextIO) -> int:
    method, params = _request(args)
    header = True
    widths = None
    for page in client.stream(method, params):
        if args.json:
            out.write(json.dumps(page, separators=(",", ":")) + "\n")
        elif page.get("events"):
            if widths is None:
                widths = print_events(page["events"], out, heading=header)
            else:
                widths = print_events(page["events"], out, heading=header, widths=widths)
            header = False
        out.flush()
    return 0  # the daemon never ends the stream; Ctrl-C does (exit 130)


def _dead_letters(client: ControlClient) -> int:
    """The inbox's dead letters (``health``), which ``list-unresolved`` mentions: they wait
    for an operator too. 0 when the daemon has no inbox or does not say."""
    try:
        health = client.call("health", {})
    except RpcErrorResult:
        return 0
    inbox = health.get("inbox") if isinstance(health, Mapping) else None
    dead = inbox.get("dead") if isinstance(inbox, Mapping) else None
    return dead if isinstance(dead, int) and not isinstance(dead, bool) else 0


def _chat(args: argparse.Namespace, err: TextIO) -> int:
    token = None
    if args.token_env:
        token = os.environ.get(args.token_env) or None
        if token is None:
            err.write(f"prismctl: environment variable {args.token_env} is not set\n")
            return 1
    try:
        # Imported on demand: the chat client pulls in trio and trio-websocket, which the
        # other subcommands do not need.
        chatclient = importlib.import_module("prismd.cli._chat")
    except ModuleNotFoundError as exc:
        if exc.name != "prismd.cli._chat":
            raise
        err.write("prismctl: the chat client is not available in this installation\n")
        return 1
    try:
        target = chat_target(args.url, getattr(args, "config", None))
    except SocketSearchError as exc:
        err.write(f"prismctl: {exc}\n")
        return 1
    if token is None and target.token_env:
        token = os.environ.get(target.token_env) or None
        if token is None:
            err.write(f"prismctl: {target.source} needs its access token: set {target.token_env}\n")
            return 1
    code = chatclient.run_chat_cli(target.url, actor=args.actor, token=token)
    return int(code)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``prismctl``; returns the exit code (argparse exits 2 on usage errors, Ctrl-C
    130, a closed stdout 141)."""
    return run_quietly(lambda: _main(argv))


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    out, err = sys.stdout, sys.stderr
    if args.command == "chat":
        return _chat(args, err)
    try:
        path = find_socket(args.socket, args.config)
    except SocketSearchError as exc:
        err.write(f"prismctl: {exc}\n")
        return 1
    try:
        with ControlClient(path) as client:
            if args.command == "events" and args.follow:
                return _follow(client, args, out)
            method, params = _request(args)
            result = client.call(method, params)
            if args.command == "list-unresolved" and args.all:
                result = _every_page(client, params, result)
            dead = _dead_letters(client) if args.command == "list-unresolved" else 0
    except ControlClientError as exc:
        err.write(f"prismctl: {exc}\n")
        return 1
    except RpcErrorResult as exc:
        if exc.code == PERMISSION_DENIED:
            uid = os.getuid()
            err.write(
                f"prismctl: permission denied: uid {uid} is not an operator of this daemon;"
                f" list it in the daemon's config ([[control.operators]] uid = {uid}, tenant ="
                ' "default") and restart it, or run prismctl as the daemon\'s user\n'
            )
        elif exc.code == PAIRING_UNAVAILABLE:
            err.write(f"prismctl: {exc.message}\n")  # "pairing unavailable: <why>"
        else:
            err.write(f"prismctl: error {exc.code}: {exc.message}\n")
        return 1
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    notes = _paging_notes(args, result)
    if dead:
        notes.append(f"and {dead} dead letter(s) in the webhook inbox: prismctl list-inbox")
    if args.json:
        shown = result
        if args.command == "list-unresolved" and isinstance(result, Mapping):
            shown = result.get("entries", [])  # the list scripts read; paging goes to stderr
        out.write(json.dumps(shown, indent=2, ensure_ascii=False) + "\n")
        for line in notes:
            err.write(f"prismctl: {line}\n")
        return _exit_code_of(args.command, shown)
    code = _render(args.command, result, out)
    advice = notes + _advice(args, result)
    if advice:
        err.write("prismctl: " + "\n".join(advice) + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
