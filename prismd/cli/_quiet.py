"""A command line tool's manners: Ctrl-C and a closed pipe end it quietly.

:func:`run_quietly` runs a ``main`` and turns a ``KeyboardInterrupt`` (also one a Trio run
wraps in an exception group) into exit 130 with no traceback, and a ``BrokenPipeError``
on stdout (``prismctl health | head -1``) into exit 141 (128 + SIGPIPE), as a tool
killed by SIGPIPE would end, without Python's "Exception ignored … BrokenPipeError" at
exit. Standard library only: ``prismctl`` uses it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


def _only(kind: type[BaseException], exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return all(_only(kind, inner) for inner in exc.exceptions)
    return isinstance(exc, kind)


def only_interrupts(exc: BaseException) -> bool:
    """``exc`` is a ``KeyboardInterrupt``, or a group of nothing else."""
    return _only(KeyboardInterrupt, exc)


def _silence_stdout() -> None:
    """Point stdout at /dev/null: the interpreter's final flush then has nowhere to fail."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass


def run_quietly(main: Callable[[], int]) -> int:
    """``main()``'s exit code; 130 on Ctrl-C, 141 when stdout's reader went away."""
    try:
        code = main()
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except BaseException as exc:
        if only_interrupts(exc):
            return EXIT_INTERRUPTED
        if _only(BrokenPipeError, exc):
            _silence_stdout()
            return EXIT_BROKEN_PIPE
        raise
