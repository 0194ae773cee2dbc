"""The daemon's state directory: a stable instance id and an exclusive lock.

``open_state_dir(path)`` creates the directory (mode 0750) when missing, reads or creates
``instance-id`` (a uuid4, written once and stable across restarts) and holds ``lock`` with
``flock(LOCK_EX | LOCK_NB)`` until :meth:`StateDir.close`. Because at most one live process
holds the lock, lease owner ids derived from the instance id are unique per live daemon,
which is what lets a restarted daemon adopt its own predecessor's leases at once
(deliberate difference 8).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import attrs

INSTANCE_FILE = "instance-id"
LOCK_FILE = "lock"
JOURNAL_FILE = "journal-id"


class StateDirError(Exception):
    """The state directory cannot be used (locked by another daemon, unreadable, …)."""


@attrs.define(eq=False)
class StateDir:
    """An opened, locked state directory. Close it to release the lock."""

    path: Path
    instance_id: str
    _lock_fd: int | None

    @property
    def owner_prefix(self) -> str:
        """``prismd-<instance id>``: the prefix of every lease owner id of this daemon."""
        return f"prismd-{self.instance_id}"

    def owner_id(self, *parts: str) -> str:
        """A lease owner id such as ``prismd-<id>:runtime`` or ``prismd-<id>:telegram:tg``."""
        return ":".join((self.owner_prefix, *parts))

    def remembered_journal(self) -> str | None:
        """The id of the journal this daemon ran on before (``None``: it never ran)."""
        target = self.path / JOURNAL_FILE
        try:
            text = target.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeError):
            raise StateDirError(f"cannot read {target}") from None
        return text or None

    def remember_journal(self, journal_id: str) -> None:
        """Remember the journal's id (atomically: a crash leaves the old one or the new)."""
        _write_atomically(self.path / JOURNAL_FILE, journal_id)

    def close(self) -> None:
        """Release the lock (idempotent). The kernel also drops it when the process dies."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            os.close(fd)


def _read_or_create_instance_id(directory: Path) -> str:
    target = directory / INSTANCE_FILE
    try:
        text = target.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        text = ""
    except OSError as exc:
        raise StateDirError(f"cannot read {target}: {exc.strerror}") from None
    except UnicodeError:
        raise StateDirError(f"{target} does not hold a UUID") from None
    if text:
        try:
            return str(uuid.UUID(text))
        except ValueError:
            raise StateDirError(f"{target} does not hold a UUID") from None
    value = str(uuid.uuid4())
    _write_atomically(target, value)
    return value


def _write_atomically(target: Path, value: str) -> None:
    # Written to a temp file and renamed, so a crash never leaves a half-written id.
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="ascii") as handle:
            handle.write(value + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except OSError as exc:
        raise StateDirError(f"cannot write {target}: {exc.strerror}") from None


def open_state_dir(path: str | os.PathLike[str]) -> StateDir:
    """Create/lock the state directory; raise :class:`StateDirError` when another daemon holds it.

    The lock is taken before the instance id is read or created, so two daemons racing
    on a fresh directory never end up with different ids.
    """
    directory = Path(path)
    try:
        directory.mkdir(mode=0o750, parents=True, exist_ok=True)
    except FileExistsError:
        raise StateDirError(
            f"cannot create state directory {directory}: it exists and is not a directory;"
            " move it away or change [daemon].state_dir"
        ) from None
    except OSError as exc:
        raise StateDirError(f"cannot create state directory {directory}: {exc.strerror}") from None
    lock_path = directory / LOCK_FILE
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
    except OSError as exc:
        raise StateDirError(f"cannot open {lock_path}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StateDirError(
            f"another prismd is already running with state directory {directory} "
            f"(lock file {lock_path} is held)"
        ) from None
    except OSError as exc:
        os.close(fd)
        raise StateDirError(f"cannot lock {lock_path}: {exc.strerror}") from None
    try:
        instance_id = _read_or_create_instance_id(directory)
        # The pid in the lock file is only a hint for humans; the flock is the lock.
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return StateDir(path=directory, instance_id=instance_id, lock_fd=fd)


@contextlib.contextmanager
def locked_state_dir(path: str | os.PathLike[str]) -> Iterator[StateDir]:
    """``open_state_dir`` as a context manager that always releases the lock."""
    state = open_state_dir(path)
    try:
        yield state
    finally:
        state.close()
