"""The command-line tools: ``prismd`` (init, run, check-config, doctor, migrate, soak, bench,
telegram) and, in the public module :mod:`prismd.cli.prismctl`, ``prismctl`` (the operator
client of the control socket; ``python -m prismd.cli.prismctl``).

This face imports nothing at import time: ``prismctl`` must start with the standard library
alone (it runs as any operator, whose Python may not see the daemon's dependencies)."""

from __future__ import annotations

from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """The ``prismd`` console script (see :mod:`prismd.cli._prismd`).

    A Ctrl-C before the daemon's own signal handling is in place (while the modules load,
    the config is read or the store opens) ends it quietly with exit 130, as ``prismctl``
    does, instead of a ``KeyboardInterrupt`` traceback; a closed stdout is exit 141.
    """
    try:
        from ._prismd import main as prismd_main
        from ._quiet import run_quietly
    except KeyboardInterrupt:
        return 130
    return run_quietly(lambda: prismd_main(argv))


__all__ = ["main"]
