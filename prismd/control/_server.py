"""The operator control socket: newline-delimited JSON-RPC 2.0 over a Unix socket.

:func:`serve_control` owns the socket file and its connections; the methods and their
results are :mod:`prismd.control._methods` (:class:`ControlHandler`). Guarantees:

* The socket is created under a restrictive umask (socket 0600, or 0660 with ``group``) inside a
  directory that is 0700 (0750 and owned by ``group`` when set), so there is never a
  moment where another user could connect. A stale socket file is replaced; a socket a
  live daemon still answers on is not (:class:`ControlSocketInUseError`). The file is
  removed when the server stops.
* The peer's uid (``SO_PEERCRED``) must map to an :class:`~prismd.control.Operator`, checked
  at accept before anything else; anyone else gets one error (``-32001 permission
  denied``) and the connection is closed. Refused connections cost operators nothing: they
  have their own small budget (:data:`MAX_REFUSED_CONNECTIONS` being answered at once, for
  at most :data:`REFUSED_DRAIN_S`; beyond it they are closed unanswered), and they are
  logged at most once per minute per uid, with a count.
* At most :data:`MAX_OPERATOR_CONNECTIONS` operator connections are open at once (further
  ones are closed at accept); out of file descriptors, accept backs off and logs once a
  minute (:func:`adapters.toolkit.serve_limited`).
* Every input gets a JSON-RPC answer or a closed connection, never a crash: bad UTF-8 or
  JSON → ``-32700``; not a request object (or no ``id``; notifications are not
  supported) → ``-32600``; a line longer than ``max_request_bytes`` → ``-32600`` and close;
  unknown method → ``-32601``; bad params → ``-32602`` naming the param (and the allowed
  range, e.g. ``ttlMs`` at most 5 minutes); pairing refused → ``-32002 pairing
  unavailable: <reason>`` (a connection without a pairing grant is named: ``no [[grants]]
  entry for connection 'tg' with pairing = true``); anything else the handler raises →
  ``-32603 internal error`` (only the exception type is logged).
* Each request line must arrive whole within ``idle_timeout_ms`` of the connection's
  start or of the previous answer, counted for the whole line and not per read, so a
  client dripping a byte a second is closed at that deadline like a silent one.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import grp
import logging
import os
import socket as _socket
import stat
import struct
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import trio

from adapters.toolkit import (
    Budget,
    ConnectionLimiter,
    LogThrottle,
    Slot,
    close_gracefully,
    quiet_note,
    serve_limited,
)

from ..jsonrpc import (
    INTERNAL_ERROR,
    INVALID_REQUEST,
    FrameBuffer,
    FrameTooLargeError,
    Request,
    RequestError,
    RpcError,
    encode_error,
    encode_result,
    parse_request,
)
from ._config import ControlConfig, Operator
from ._methods import (
    PERMISSION_DENIED,
    ControlHandler,
)

__all__ = ["ControlSocketError", "ControlSocketInUseError", "serve_control"]


log = logging.getLogger("prismd.control")

_RECEIVE_CHUNK = 65536
_CLOSE_BUDGET_S = 1.0
MAX_OPERATOR_CONNECTIONS = 32
"""Operator connections at once (an ``events --follow`` holds one for as long as it runs)."""
MAX_REFUSED_CONNECTIONS = 8
"""Refused connections being answered at once; further ones are closed unanswered."""
REFUSED_DRAIN_S = 0.25
OPERATORS, REFUSED = "operators", "refused"


class ControlSocketError(Exception):
    """The control socket cannot be set up (its path is not ours to use)."""


class ControlSocketInUseError(ControlSocketError):
    """A live process already answers on the control socket path."""


# --------------------------------------------------------------------------- server


def _peer_uid(sock: trio.socket.SocketType) -> int | None:
    try:
        raw = sock.getsockopt(_socket.SOL_SOCKET, _socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    _pid, uid, _gid = struct.unpack("3i", raw)
    return int(uid)


@attrs.define(eq=False)
class _Connection:
    stream: trio.SocketStream
    operator: Operator
    handler: ControlHandler
    max_request_bytes: int
    idle_timeout_s: float
    frames: FrameBuffer = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.frames = FrameBuffer(self.max_request_bytes)

    async def run(self) -> None:
        while True:
            try:
                line = await self._next_line()
            except FrameTooLargeError:
                # Do not keep reading an oversize line: answer once and close.
                await self.stream.send_all(
                    encode_error(None, INVALID_REQUEST, "invalid request: request too large")
                )
                await close_gracefully(self.stream)
                return
            if line is None:
                return
            if not line.strip():
                continue
            try:
                request = parse_request(line)
            except RequestError as refused:
                await self.stream.send_all(
                    encode_error(refused.request_id, refused.code, refused.message)
                )
                continue
            outcome = await self._dispatch(request)
            if isinstance(outcome, bytes):
                await self.stream.send_all(outcome)
                continue
            await self._stream_results(request.id, outcome)
            return

    async def _next_line(self) -> bytes | None:
        """The next line without its newline; ``None`` on EOF or when the whole line did not
        arrive within ``idle_timeout_s``. :class:`~prismd.jsonrpc.FrameTooLargeError` for a
        line over ``max_request_bytes``."""
        deadline = trio.current_time() + self.idle_timeout_s
        while True:
            line = self.frames.next_frame()
            if line is not None:
                return line
            with trio.move_on_at(deadline):
                data = await self.stream.receive_some(_RECEIVE_CHUNK)
                if not data:
                    return None
                self.frames.feed(data)
                continue
            return None

    async def _dispatch(self, request: Request) -> bytes | AsyncIterator[Any]:
        try:
            result = await self.handler.call(self.operator, request.method, request.params)
            if isinstance(result, AsyncIterator):
                return result
            # Encoding is inside the guard: a result that is not JSON is an internal error.
            return encode_result(request.id, result)
        except RpcError as exc:
            return encode_error(request.id, exc.code, exc.message)
        except Exception as exc:
            # The type only: exception text may carry ids or user content.
            log.warning("control method %s failed: %s", request.method, type(exc).__name__)
            return encode_error(request.id, INTERNAL_ERROR, "internal error")

    async def _stream_results(self, request_id: Any, pages: AsyncIterator[Any]) -> None:
        """Send every page until the client closes (EOF) or a send fails."""

        async def watch_for_close(cancel_scope: trio.CancelScope) -> None:
            try:
                while await self.stream.receive_some(_RECEIVE_CHUNK):
                    pass
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            cancel_scope.cancel()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_for_close, nursery.cancel_scope)
            try:
                async for page in pages:
                    await self.stream.send_all(encode_result(request_id, page))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
            except Exception as exc:
                log.warning("control event stream failed: %s", type(exc).__name__)
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await self.stream.send_all(
                        encode_error(request_id, INTERNAL_ERROR, "internal error")
                    )
            finally:
                aclose = getattr(pages, "aclose", None)
                if aclose is not None:
                    # An async generator's aclose only runs its finally blocks; bounded all
                    # the same, so a stuck one cannot hold the server's shutdown.
                    with trio.move_on_after(_CLOSE_BUDGET_S, shield=True):
                        await aclose()
            nursery.cancel_scope.cancel()


def socket_directory_problem(directory: Path, gid: int | None, socket_name: str) -> str | None:
    """Why the control socket cannot be made in ``directory`` as it is now, or ``None``
    (``None`` too when it does not exist yet: it is then created 0700 / 0750+group).

    A shared directory (world-writable or sticky, like /tmp) is refused, and so is a
    directory with other files in it that other users can reach (``socket =
    "prismd.sock"`` in a project or home directory, or in the state directory): its mode
    is never changed for us. Read only: ``prismd doctor`` asks it too.
    """
    try:
        mode = directory.stat().st_mode
    except FileNotFoundError:
        return None
    if not stat.S_ISDIR(mode):
        return f"{directory} is not a directory"
    if mode & (stat.S_ISVTX | stat.S_IWOTH):
        return f"{directory} is a shared directory; put the control socket in its own directory"
    others = [entry for entry in os.listdir(directory) if entry != socket_name]
    allowed = 0o750 if gid is not None else 0o700
    if others and stat.S_IMODE(mode) & ~allowed:
        return (
            f"{directory} holds other files and is open to other users "
            f"(mode {stat.S_IMODE(mode):o}); put the control socket in its own directory"
        )
    return None


def _prepare_directory(directory: Path, gid: int | None, socket_name: str) -> None:
    """Create the socket's directory, or tighten an existing one of its own to 0700 /
    0750+group; refuse what :func:`socket_directory_problem` refuses.

    Only a directory that holds nothing but (a stale copy of) our socket is tightened.
    """
    problem = socket_directory_problem(directory, gid, socket_name)
    if problem is not None:
        raise ControlSocketError(problem)
    try:
        directory.stat()
    except FileNotFoundError:
        directory.mkdir(parents=True, mode=0o700)
    else:
        if any(entry != socket_name for entry in os.listdir(directory)):
            return
    if gid is not None:
        os.chown(directory, -1, gid)
        os.chmod(directory, 0o750)
    else:
        os.chmod(directory, 0o700)


def _remove_stale_socket(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ControlSocketError(f"{path} exists and is not a socket")
    probe = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)
        return
    except OSError as exc:
        if exc.errno in (errno.ECONNREFUSED, errno.ENOENT):
            path.unlink(missing_ok=True)
            return
        raise ControlSocketError(f"cannot probe existing socket {path}") from None
    finally:
        probe.close()
    raise ControlSocketInUseError(f"another daemon is serving on {path}")


def _bind_socket(path: Path, *, group: bool) -> _socket.socket:
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        # The umask is process-wide: set it, bind (synchronously, no checkpoint in
        # between, so no other task of ours runs), restore at once.
        previous = os.umask(0o117 if group else 0o177)
        try:
            sock.bind(str(path))
        finally:
            os.umask(previous)
        sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return sock


async def serve_control(
    config: ControlConfig,
    *,
    handler: ControlHandler,
    daemon_uid: int | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the control socket at ``config.socket`` until cancelled.

    Calls ``task_status.started()`` once the socket accepts connections. Raises
    :class:`ControlSocketInUseError` when a live process answers on the path,
    :class:`ControlSocketError` when the path is something other than a socket, and
    ``KeyError`` for an unknown ``group``. The socket file is removed on exit.
    """
    path = Path(config.socket)
    gid = grp.getgrnam(config.group).gr_gid if config.group is not None else None
    _prepare_directory(path.parent, gid, path.name)
    _remove_stale_socket(path)
    raw = _bind_socket(path, group=gid is not None)
    identity = os.stat(path)
    try:
        if gid is not None:
            os.chown(path, -1, gid)
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(raw))
        limiter = ConnectionLimiter(
            "control socket",
            {
                OPERATORS: Budget(MAX_OPERATOR_CONNECTIONS, "refuse", "operator connections"),
                REFUSED: Budget(MAX_REFUSED_CONNECTIONS, "refuse", "refused connections"),
            },
            logger=log,
        )
        refusals = LogThrottle()

        def budget_for(stream: trio.SocketStream) -> str:
            uid = _peer_uid(stream.socket)
            if _operator(config, uid, daemon_uid) is not None:
                return OPERATORS
            quiet = refusals.passes(uid)
            if quiet is not None:
                log.info("control connection refused for uid %s%s", uid, quiet_note(quiet))
            return REFUSED

        async def serve_one(stream: trio.SocketStream, slot: Slot) -> None:
            await _serve_one(stream, slot, config, handler, daemon_uid)

        async with trio.open_nursery() as nursery:
            await nursery.start(
                functools.partial(serve_limited, budget=budget_for),
                serve_one,
                [listener],
                limiter,
            )
            task_status.started()
    finally:
        raw.close()
        _remove_if_ours(path, identity)


def _remove_if_ours(path: Path, identity: os.stat_result) -> None:
    try:
        now = os.stat(path)
        # Only remove the file we created, not one a successor put there.
        if (now.st_ino, now.st_dev) == (identity.st_ino, identity.st_dev):
            os.unlink(path)
    except OSError:
        pass


def _operator(config: ControlConfig, uid: int | None, daemon_uid: int | None) -> Operator | None:
    return config.operator_for(uid, daemon_uid=daemon_uid) if uid is not None else None


async def _serve_one(
    stream: trio.SocketStream,
    slot: Slot,
    config: ControlConfig,
    handler: ControlHandler,
    daemon_uid: int | None,
) -> None:
    async with stream:
        try:
            operator = _operator(config, _peer_uid(stream.socket), daemon_uid)
            if slot.budget == REFUSED or operator is None:
                with trio.move_on_after(REFUSED_DRAIN_S):
                    await stream.send_all(
                        encode_error(None, PERMISSION_DENIED, "permission denied")
                    )
                await close_gracefully(stream, drain_s=REFUSED_DRAIN_S)
                return
            connection = _Connection(
                stream,
                operator,
                handler,
                config.max_request_bytes,
                config.idle_timeout_ms / 1000,
            )
            await connection.run()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        except Exception as exc:
            log.warning("control connection failed: %s", type(exc).__name__)
